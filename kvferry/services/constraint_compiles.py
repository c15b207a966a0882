"""Compiling requests' structured-output constraints off a worker's step loop.

A request whose constraint is not compiled yet waits here, not in the engine. One daemon thread compiles
(xgrammar lets go of the GIL meanwhile, so the running batch keeps stepping; a daemon, so that a compile under
way never holds up the process's exit), requests with the same constraint share one compile, and the loop, which
polls `wake_fd`, takes the finished ones with their compiled grammar, which the request keeps: the cache may
evict it before the request needs it.

A compile that runs past the timeout (counted from its own start: not from the queue, nor from the one-time set-up
before a worker's first compile, the tokenizer and xgrammar) fails the requests that wait on it with a 400, and its
constraint is refused at once from then on; it cannot be interrupted, so the thread stays busy until it ends. The
gateway's bounds on a schema keep compiles short; the queue of distinct constraints is capped, and past the cap a
request is refused with a 503 that another worker may take.
"""

import os
import queue
import threading
import time
from dataclasses import dataclass, field

from kvferry.common.constraint import Constraint
from kvferry.common.errors import InvalidRequest
from kvferry.common.structured.grammars import GrammarCache
from kvferry.services.wake_pipe import clear, pipe, signal

MAX_QUEUED_COMPILES = 64  # distinct constraints waiting for the thread: a bound on what a burst can queue
MAX_TIMED_OUT = 1024  # constraints remembered as too slow to compile


@dataclass
class Job:
    constraint: Constraint
    owners: dict = field(default_factory=dict)  # owner -> wall clock it started waiting, for its trace span
    started: float | None = None  # monotonic, set by the thread when it begins
    finished: bool = False
    grammar: object = None
    error: str = ""


@dataclass
class Compiled:
    """A finished wait: the grammar, or why there is none (retry: not the request's fault, another worker may)."""

    owner: object
    constraint: Constraint
    grammar: object
    error: str
    started_at: float
    ended_at: float
    retry: bool = False


class ConstraintCompiles:
    def __init__(self, grammars: GrammarCache, timeout_s: float):
        self.grammars, self.timeout_s = grammars, timeout_s
        self.wake_fd, self._wake_write = pipe()
        self._jobs: dict[tuple[str, str], Job] = {}  # by constraint key, queued or compiling
        self._owners: dict[object, Job] = {}
        self._refused: list[Compiled] = []  # refused without a compile: reported by the next take_finished
        self._timed_out: dict[tuple[str, str], None] = {}  # insertion-ordered: the oldest go past the cap
        self._todo: queue.SimpleQueue[Job | None] = queue.SimpleQueue()
        self._lock = threading.Lock()  # the thread's wake-up against close()
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="grammar-compile", daemon=True)
        self._thread.start()

    def ready(self, owner, constraint: Constraint):
        """The compiled grammar when it is cached (a hit). Else None: the owner waits for its compile, which it
        shares with any other owner of the same constraint, and take_finished() reports it once it ends."""
        grammar = self.grammars.cached(constraint)
        if grammar is not None:
            return grammar
        key, now = constraint.key, time.time()
        job = self._jobs.get(key)
        if job is None:
            if key in self._timed_out:
                return self._refuse(owner, constraint, self._too_slow(constraint))
            if len(self._jobs) >= MAX_QUEUED_COMPILES:
                busy = f"{constraint.field}: this worker has {MAX_QUEUED_COMPILES} constraints to compile already"
                return self._refuse(owner, constraint, busy, retry=True)
            job = self._jobs[key] = Job(constraint)
            self._todo.put(job)
        job.owners[owner] = now
        self._owners[owner] = job
        return None

    def waiting(self, owner) -> bool:
        """Whether the owner has a compile (or a refusal) still to be reported."""
        return owner in self._owners or any(done.owner == owner for done in self._refused)

    def forget(self, owner) -> None:
        """The owner ended while its constraint compiled: it is not reported, and a compile nobody waits for any
        more is dropped unless it has begun."""
        self._refused = [done for done in self._refused if done.owner != owner]
        job = self._owners.pop(owner, None)
        if job is not None:
            job.owners.pop(owner, None)
            if not job.owners and job.started is None:
                self._jobs.pop(job.constraint.key, None)  # the thread skips it

    def take_finished(self) -> list[Compiled]:
        """The owners whose compile ended, or ran past the timeout, since the last call."""
        clear(self.wake_fd)
        ended, self._refused = self._refused, []
        now, wall = time.monotonic(), time.time()
        for key, job in list(self._jobs.items()):
            if job.finished:
                error, retry = job.error, False
            elif job.started is not None and now - job.started > self.timeout_s:
                self._remember_too_slow(key)
                error, retry = self._too_slow(job.constraint), False
            else:
                continue
            del self._jobs[key]
            for owner, since in job.owners.items():
                self._owners.pop(owner, None)
                grammar = None if error else job.grammar
                ended.append(Compiled(owner, job.constraint, grammar, error, since, wall, retry))
        return ended

    def next_deadline_in(self) -> float | None:
        """Seconds until the compile under way times out; None when nothing compiles."""
        started = [job.started for job in self._jobs.values() if job.started is not None and not job.finished]
        if not started:
            return 0.0 if self._refused else None
        return max(0.0, min(started) + self.timeout_s - time.monotonic())

    def _refuse(self, owner, constraint: Constraint, error: str, retry: bool = False) -> None:
        now = time.time()
        self._refused.append(Compiled(owner, constraint, None, error, now, now, retry))
        self._wake()

    def _run(self) -> None:
        while (job := self._todo.get()) is not None:
            if not job.owners:
                continue  # everyone who waited for it ended
            try:
                self.grammars.compiler()  # the first time, the tokenizer and xgrammar: before the clock starts
                job.started = time.monotonic()
                self._wake()  # the loop's poll now waits no longer than this compile's deadline (next_deadline_in)
                job.grammar = self.grammars.compile(job.constraint)
            except InvalidRequest as exc:
                job.error = str(exc)
            except Exception as exc:  # a bug, or xgrammar failing otherwise: this constraint's requests fail
                job.error = f"{job.constraint.field}: {type(exc).__name__}: {exc}"
            job.finished = True
            self._wake()

    def _wake(self) -> None:
        with self._lock:
            if not self._closed:  # a compile that outlived the worker's loop has nobody to wake
                signal(self._wake_write)

    def _remember_too_slow(self, key) -> None:
        self._timed_out[key] = None
        while len(self._timed_out) > MAX_TIMED_OUT:
            del self._timed_out[next(iter(self._timed_out))]

    def _too_slow(self, constraint: Constraint) -> str:
        return f"{constraint.field}: compiling it took longer than the {self.timeout_s:g} s this server allows"

    def close(self) -> None:
        self._todo.put(None)
        with self._lock:
            self._closed = True
            for fd in (self.wake_fd, self._wake_write):
                os.close(fd)

"""Compiling requests' structured-output constraints off a worker's step loop.

One daemon thread compiles, in the grammar cache's child process (common/structured/compile_process.py); owners of
the same constraint share one compile, and the loop (which polls `wake_fd`) takes the finished ones with their
grammar, which the request keeps: the cache may evict it before the request needs it.

A constraint's clock starts when it is queued; only the one-time set-up stops it. Past its deadline it fails with a
400 when its own trial compile had most of the timeout (its child is killed, and it is refused at once from then on),
else with a 503 that another worker may take. A trial that passed is past the clock: its compile in the worker takes
about as long again, so a compile holds the path for about twice the timeout at most. The queue is capped by count and
by bytes of text; past either, or when the child dies under a compile, a request gets a 503.
"""

import os
import queue
import threading
import time
from dataclasses import dataclass, field

from kvferry.common.constraint import Constraint
from kvferry.common.errors import InvalidRequest
from kvferry.common.structured.compile_process import CompileProcessEnded, CompileTimedOut
from kvferry.common.structured.grammars import GrammarCache
from kvferry.services.wake_pipe import clear, pipe, signal

MAX_QUEUED_COMPILES = 64  # distinct constraints waiting for the thread: a bound on what a burst can queue
# Their text together: eight of the largest, more than could compile in one timeout; compiled, each may be 200x.
MAX_QUEUED_COMPILE_BYTES = 1 << 20
MAX_TIMED_OUT = 1024  # constraints remembered as too slow to compile


@dataclass
class Job:
    constraint: Constraint
    deadline: float  # on the queue clock (ConstraintCompiles.clock)
    num_bytes: int  # its text's, UTF-8
    owners: dict = field(default_factory=dict)  # owner -> wall clock it started waiting, for its trace span
    started: float | None = None  # queue clock, set by the thread when its compile begins
    trial_passed: bool = False  # its trial compile finished in time: no deadline applies to it any more
    finished: bool = False
    retry: bool = False  # its error is no fault of the constraint's: another worker may take it
    reported: bool = False  # failed by the loop at its deadline: the thread skips it
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
        self._num_todo = self._num_todo_bytes = 0  # jobs on _todo, forgotten ones too, and their text's bytes
        self._lock = threading.Lock()  # the thread's wake-up against close()
        self._closed = False
        self._set_up_s = 0.0  # the set-ups' time so far, which the queue clock leaves out
        self._set_up_since: float | None = None  # monotonic, while the thread sets up
        self._thread = threading.Thread(target=self._run, name="grammar-compile", daemon=True)
        self._thread.start()

    def clock(self) -> float:
        """Monotonic seconds, stopped while the thread sets up. Both threads read it without a lock: each float is
        written whole, and a read between the thread's two writes counts a
        set-up twice: a deadline later, never sooner)."""
        now, since = time.monotonic(), self._set_up_since
        return now - self._set_up_s - (now - since if since is not None else 0.0)

    def ready(self, owner, constraint: Constraint):
        """The compiled grammar when it is cached; else None, and take_finished() reports the compile once it ends."""
        grammar = self.grammars.cached(constraint)
        if grammar is not None:
            return grammar
        key, now = constraint.key, time.time()
        job = self._jobs.get(key)
        if job is None:
            if key in self._timed_out:
                return self._refuse(owner, constraint, self._too_slow(constraint))
            num_bytes = len(constraint.spec.encode("utf-8", "surrogatepass"))
            busy = self._queue_full(num_bytes)
            if busy:
                return self._refuse(owner, constraint, f"{constraint.field}: this worker has {busy}", retry=True)
            job = self._jobs[key] = Job(constraint, self.clock() + self.timeout_s, num_bytes)
            with self._lock:
                self._num_todo += 1
                self._num_todo_bytes += num_bytes
            self._todo.put(job)
        job.owners[owner] = now
        self._owners[owner] = job
        return None

    def waiting(self, owner) -> bool:
        """Whether the owner has a compile (or a refusal) still to be reported."""
        return owner in self._owners or any(done.owner == owner for done in self._refused)

    def forget(self, owner) -> None:
        """The owner ended: it is not reported, and a compile nobody waits for is dropped unless it has begun."""
        self._refused = [done for done in self._refused if done.owner != owner]
        job = self._owners.pop(owner, None)
        if job is not None:
            job.owners.pop(owner, None)
            if not job.owners and job.started is None:
                self._jobs.pop(job.constraint.key, None)  # the thread skips it

    def take_finished(self) -> list[Compiled]:
        """The owners whose compile ended, or whose deadline passed, since the last call."""
        clear(self.wake_fd)
        ended, self._refused = self._refused, []
        now, wall = self.clock(), time.time()
        for key, job in list(self._jobs.items()):
            if job.finished:
                error, retry = job.error, job.retry
            elif now > job.deadline and not job.trial_passed:
                error, retry = self._past_deadline(job)
            else:
                continue
            job.reported = True
            del self._jobs[key]
            for owner, since in job.owners.items():
                self._owners.pop(owner, None)
                grammar = None if error else job.grammar
                ended.append(Compiled(owner, job.constraint, grammar, error, since, wall, retry))
        return ended

    def next_deadline_in(self) -> float | None:
        """Seconds until the earliest deadline of a constraint queued or compiling; None when there is none."""
        deadlines = [job.deadline for job in self._jobs.values() if not (job.finished or job.trial_passed)]
        if not deadlines:
            return 0.0 if self._refused else None
        return max(0.0, min(deadlines) - self.clock())

    def _queue_full(self, num_bytes: int) -> str:
        """Why the queue has no room for a constraint of this many bytes, or "". Jobs nobody waits for count until
        the thread takes them off: their text is held until then."""
        if max(len(self._jobs), self._num_todo) >= MAX_QUEUED_COMPILES:
            return f"{MAX_QUEUED_COMPILES} constraints to compile already"
        queued = max(sum(job.num_bytes for job in self._jobs.values()), self._num_todo_bytes)
        if queued + num_bytes > MAX_QUEUED_COMPILE_BYTES:
            return f"{queued} bytes of constraints to compile already (at most {MAX_QUEUED_COMPILE_BYTES})"
        return ""

    def _past_deadline(self, job: Job) -> tuple[str, bool]:
        """Its error, and whether another worker may take it (as the module says)."""
        if job.started is not None and job.deadline - job.started >= self.timeout_s / 2:
            self._timed_out[job.constraint.key] = None
            while len(self._timed_out) > MAX_TIMED_OUT:
                del self._timed_out[next(iter(self._timed_out))]
            return self._too_slow(job.constraint), False
        busy = "this worker was busy compiling other constraints"
        return f"{job.constraint.field}: not compiled within the {self.timeout_s:g} s this server allows: {busy}", True

    def _refuse(self, owner, constraint: Constraint, error: str, retry: bool = False) -> None:
        now = time.time()
        self._refused.append(Compiled(owner, constraint, None, error, now, now, retry))
        self._wake()

    def _run(self) -> None:
        try:
            while (job := self._todo.get()) is not None and not self._closed:
                with self._lock:
                    self._num_todo -= 1
                    self._num_todo_bytes -= job.num_bytes
                if job.owners and not job.reported:  # else everyone who waited for it ended, or its time is up
                    self._compile(job)
        finally:
            self.grammars.close()

    def _compile(self, job: Job) -> None:
        try:
            self._set_up_since = time.monotonic()  # the queue clock stops while the grammar cache sets up
            try:
                self.grammars.set_up()
            finally:
                self._set_up_s += time.monotonic() - self._set_up_since
                self._set_up_since = None
            left = job.deadline - self.clock()
            if left <= 0:
                return  # the loop fails it at its deadline, uncompiled
            job.started = self.clock()  # from now on forget() leaves it be
            job.grammar = self.grammars.compile(job.constraint, left, lambda: setattr(job, "trial_passed", True))
        except CompileTimedOut:
            return  # the loop fails it at its deadline: the child that compiled it is killed, its core free
        except CompileProcessEnded as exc:
            job.error, job.retry = f"{job.constraint.field}: {exc}; another worker may compile it", True
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

    def _too_slow(self, constraint: Constraint) -> str:
        return f"{constraint.field}: compiling it took longer than the {self.timeout_s:g} s this server allows"

    def close(self) -> None:
        """Stop: a compile under way is killed with its child process, and the thread ends it."""
        self._todo.put(None)
        with self._lock:
            self._closed = True
            for fd in (self.wake_fd, self._wake_write):
                os.close(fd)
        self.grammars.kill_compile()

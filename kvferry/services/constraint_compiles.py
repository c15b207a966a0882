"""Compiling requests' structured-output constraints off a worker's step loop.

A request whose constraint is not compiled yet waits here, not in the engine: one thread compiles (xgrammar lets
go of the GIL meanwhile, so the running batch keeps stepping), requests with the same constraint share its
compile, and the loop, which polls `wake_fd`, takes the finished ones. A compile that runs past its timeout fails
its requests with a 400; it cannot be interrupted, so its constraint is refused at once from then on, unless the
compile finished into the cache after all.
"""

import os
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

from kvferry.common.constraint import Constraint
from kvferry.common.errors import InvalidRequest
from kvferry.common.structured.grammars import GrammarCache
from kvferry.services.wake_pipe import clear, pipe, signal

MAX_TIMED_OUT = 1024  # constraints remembered as too slow to compile


@dataclass
class Waiting:
    constraint: Constraint
    future: Future
    started_at: float  # wall clock, for its trace span
    deadline: float  # monotonic


@dataclass
class Compiled:
    """A finished wait: error is empty when the grammar is in the cache now."""

    owner: object
    constraint: Constraint
    error: str
    started_at: float
    ended_at: float


class ConstraintCompiles:
    def __init__(self, grammars: GrammarCache, timeout_s: float):
        self.grammars, self.timeout_s = grammars, timeout_s
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar-compile")
        self.wake_fd, self._wake_write = pipe()
        self._compiling: dict[tuple[str, str], Future] = {}
        self._waiting: dict[object, Waiting] = {}
        self._timed_out: dict[tuple[str, str], None] = {}  # insertion-ordered: the oldest go past the cap
        self._closed = False

    def ready(self, owner, constraint: Constraint) -> bool:
        """True when its grammar is compiled (a cache hit). Else its compile starts, or the one under way for the
        same constraint is joined, and take_finished() reports the owner once it ends."""
        if self.grammars.cached(constraint) is not None:
            return True
        key = constraint.key
        future = self._compiling.get(key)
        if future is None:
            if key in self._timed_out:
                future = Future()
                future.set_exception(InvalidRequest(self._too_slow(constraint)))
            else:
                future = self._compiling[key] = self._pool.submit(self.grammars.compile, constraint)
            future.add_done_callback(self._wake)
        self._waiting[owner] = Waiting(constraint, future, time.time(), time.monotonic() + self.timeout_s)
        return False

    def waiting(self, owner) -> bool:
        return owner in self._waiting

    def forget(self, owner) -> None:
        """The owner ended while its constraint compiled: the compile goes on (for the cache), unreported."""
        self._waiting.pop(owner, None)

    def take_finished(self) -> list[Compiled]:
        """The owners whose compile ended, or ran past the timeout, since the last call."""
        clear(self.wake_fd)
        now, ended = time.monotonic(), []
        for key, future in list(self._compiling.items()):
            if future.done():
                del self._compiling[key]
        for owner, wait in list(self._waiting.items()):
            if wait.future.done():
                exc = wait.future.exception()
                error = "" if exc is None else str(exc) if isinstance(exc, InvalidRequest) else repr(exc)
            elif now >= wait.deadline:
                self._remember_too_slow(wait.constraint.key)
                error = self._too_slow(wait.constraint)
            else:
                continue
            del self._waiting[owner]
            ended.append(Compiled(owner, wait.constraint, error, wait.started_at, time.time()))
        return ended

    def next_deadline_in(self) -> float | None:
        """Seconds until the earliest wait times out; None when nothing waits."""
        if not self._waiting:
            return None
        return max(0.0, min(w.deadline for w in self._waiting.values()) - time.monotonic())

    def _wake(self, _future) -> None:
        if not self._closed:  # a compile that outlived the worker's loop has nobody to wake
            signal(self._wake_write)

    def _remember_too_slow(self, key) -> None:
        self._timed_out[key] = None
        while len(self._timed_out) > MAX_TIMED_OUT:
            del self._timed_out[next(iter(self._timed_out))]

    def _too_slow(self, constraint: Constraint) -> str:
        return f"{constraint.field}: compiling it took longer than the {self.timeout_s:g} s this server allows"

    def close(self) -> None:
        self._closed = True
        self._pool.shutdown(wait=False, cancel_futures=True)
        for fd in (self.wake_fd, self._wake_write):
            os.close(fd)

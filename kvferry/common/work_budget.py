"""A bound on the work one check of a request's content may do, in steps (not seconds: a busy machine must not turn
a good request into a refusal), in proportion to the size of what it checks.

A check that runs out raises WorkBudgetExceeded, which the caller turns into a 400 naming the field. Every CHECK_EVERY
steps it also asks whether its request still wants the answer: a client that left, a passed deadline or a stopping
gateway ends it there (WorkCancelled), so no abandoned request holds a text thread. Standard library only.
"""

import contextvars
import threading
import time

CHECK_EVERY = 1024  # steps between looks at the clock and at the request's cancellation
# A check may take BASE_STEPS plus STEPS_PER_BYTE for each byte of its input: far more than a linear walk or a oneOf
# of 256 const branches needs. What it bounds is work that grows faster than the input (pairwise comparisons recursing
# into shared properties, $ref chains walked again and again).
BASE_STEPS = 200_000
STEPS_PER_BYTE = 8


class WorkBudgetExceeded(Exception):
    """The check needed more steps than its input's size allows."""


class WorkCancelled(Exception):
    """Nobody waits for the check's answer any more: the client left, the deadline passed, or the gateway stops."""


class RequestWork:
    """One request's stake in the checks run for it: whether it still wants them, until when, and the steps they may
    take together (each check has a budget of its own besides: a request of many schemas, 128 tools say, would
    otherwise get the base allowance 128 times)."""

    def __init__(self, deadline: float | None = None, num_steps: int | None = None):
        """deadline: time.monotonic() past which the checks stop (None: none); num_steps: the steps of all its
        checks together (None: no bound but each check's own)."""
        self.deadline, self.num_steps, self.num_steps_left = deadline, num_steps, num_steps
        self._cancelled = threading.Event()

    def cancel(self) -> None:
        self._cancelled.set()

    @property
    def wanted(self) -> bool:
        return not self._cancelled.is_set() and (self.deadline is None or time.monotonic() < self.deadline)


# The request whose checks run in this context: the gateway sets it per request, and a text thread runs in a copy of
# the request's context, so every budget made there is that request's.
current_request: contextvars.ContextVar[RequestWork | None] = contextvars.ContextVar("current_request", default=None)


class WorkBudget:
    def __init__(self, num_bytes: int, steps_per_byte: int = STEPS_PER_BYTE, base_steps: int = BASE_STEPS):
        self.num_steps = base_steps + steps_per_byte * max(num_bytes, 0)
        self.num_left = self.num_steps
        self._until_look = CHECK_EVERY
        self.request = current_request.get()

    @property
    def num_spent(self) -> int:
        return self.num_steps - self.num_left

    def spend(self, num_steps: int = 1) -> None:
        self.num_left -= num_steps
        if self.num_left < 0:
            raise WorkBudgetExceeded(f"more than the {self.num_steps} steps its size allows")
        request = self.request
        if request is not None and request.num_steps_left is not None:
            request.num_steps_left -= num_steps
            if request.num_steps_left < 0:
                raise WorkBudgetExceeded(
                    f"more than the {request.num_steps} steps a request's checks may take together"
                )
        self._until_look -= num_steps
        if self._until_look <= 0:
            self._until_look = CHECK_EVERY
            if self.request is not None and not self.request.wanted:
                raise WorkCancelled

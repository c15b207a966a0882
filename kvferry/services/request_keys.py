"""Typed keys for a request's attempts and choices, in place of ids joined into strings and parsed back.

A request moved off a failed worker comes back as a new attempt (possibly to the same worker), so a worker keys
its records by (request id, attempt); a decode worker runs each choice of an attempt as a sequence of its own.
"""

from typing import NamedTuple


class AttemptKey(NamedTuple):
    request_id: str
    attempt: int = 0

    def choice(self, choice: int) -> "ChoiceKey":
        return ChoiceKey(self.request_id, self.attempt, choice)


class ChoiceKey(NamedTuple):
    """The engine's id for one choice's sequence on a decode worker."""

    request_id: str
    attempt: int
    choice: int

    @property
    def attempt_key(self) -> AttemptKey:
        return AttemptKey(self.request_id, self.attempt)

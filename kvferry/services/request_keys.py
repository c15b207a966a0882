"""Typed keys for a request's attempts and choices. A request moved off a failed worker comes back as a new attempt
(possibly to the same worker), so records are keyed by (request id, attempt); each choice runs as its own sequence.
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

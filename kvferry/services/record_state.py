"""What every request record shares: an explicit state, and transitions that are checked, not assumed."""

import enum


class IllegalTransition(RuntimeError):
    """A record asked to move to a state its machine does not allow from where it is: a bug, never a request's
    fault. The worker fails that request and goes on."""


def move(record, allowed: dict[enum.Enum, tuple[enum.Enum, ...]], to: enum.Enum) -> None:
    """Set record.state to `to` if the machine `allowed` (state -> states it may go to) permits it."""
    if to not in allowed[record.state]:
        raise IllegalTransition(f"{type(record).__name__} {record.key}: {record.state.name} -> {to.name}")
    record.state = to

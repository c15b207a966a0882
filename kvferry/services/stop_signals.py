"""Telling a repeated stop signal from the echo of the first. A signal sent to a whole process group (Ctrl-C in a
terminal, `kill -- -PGID`, systemd's KillMode=control-group) reaches each child of `kvferry serve` or `kvferry gateway
--gateways N` twice: from the sender, and a few milliseconds later from the parent, which passes every stop on. Taken
as a second signal, the echo would turn a drain into a stop at once and cut the requests in flight. So a repeat of a
signal within SAME_STOP_S of its first is the same stop; a later repeat is a second one.
"""

import time

SAME_STOP_S = 1.0  # the parent's copy comes within milliseconds; a person who repeats a stop takes longer


class StopSignals:
    def __init__(self) -> None:
        self.first_at: dict[int, float] = {}  # signal number -> when it first came (time.monotonic)

    def is_echo(self, sig: int) -> bool:
        """True when sig came before, less than SAME_STOP_S ago: the same stop again. Else False, and a first one is
        remembered."""
        now = time.monotonic()
        if sig not in self.first_at:
            self.first_at[sig] = now
            return False
        return now - self.first_at[sig] < SAME_STOP_S

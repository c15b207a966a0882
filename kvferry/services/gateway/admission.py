"""What the gateway lets in at once: requests not answered yet, counted (--max-waiting) and by their bodies' bytes
(--max-waiting-bytes): parsed, a body takes many times its raw size, so a count alone would let gigabytes in.

Every route that parses a body is let in with its raw size (its Content-Length, which the Guards give a chunked body
too) before reading it, and gives both back once answered: a generation at its first event, a tokenizer route with its
reply. Past either bound it gets 429 with retry-after at once. The Guards read a chunked body under a reservation of
--max-body-size bytes (reserve_bytes). A lone request is always let in, whatever its size (--max-body-size bounds it),
so that a budget below that size refuses no request forever.
"""

import contextlib

from starlette.requests import Request

from kvferry.common import settings
from kvferry.services.gateway.api_error import ApiError

RETRY_AFTER = {"retry-after": "1"}


def body_bytes(request: Request) -> int:
    """The raw body's size as the Guards checked it (0 without a body)."""
    length = request.headers.get("content-length", "")
    return int(length) if length.isdigit() and len(length) <= 18 else 0


class Admission:
    """The one owner of both bounds (0: none) and of what they count."""

    def __init__(self, max_waiting: int = 0, max_waiting_bytes: int = 0):
        self.max_waiting, self.max_waiting_bytes = max_waiting, max_waiting_bytes
        # Counted from the moment a request is let in, so that a burst cannot pass the bounds while it is parsed.
        self.num_unanswered = 0
        self.num_unanswered_bytes = 0

    def refusal(self, num_bytes: int) -> ApiError | None:
        """The 429 for a request of num_bytes, or None when it may be let in (then: admit)."""
        max_waiting = self.max_waiting
        if max_waiting and self.num_unanswered >= max_waiting:
            # Refused at once, not queued until it times out: the client backs off and comes back.
            message = f"too many requests waiting ({max_waiting}); retry shortly"
            return ApiError(429, message, kind="rate_limit_error", headers=RETRY_AFTER)
        if not self.bytes_fit(num_bytes):
            return ApiError(
                429,
                f"too many request bytes waiting ({self.num_unanswered_bytes} let in, {num_bytes} more asked, at most "
                f"{self.max_waiting_bytes}: {settings.label('max_waiting_bytes')}); retry shortly",
                kind="rate_limit_error",
                headers=RETRY_AFTER,
            )
        return None

    @contextlib.contextmanager
    def let_in(self, num_bytes: int):
        """The request let in (admit) until the block ends, when it is answered; its 429 raised if it may not be."""
        refused = self.refusal(num_bytes)
        if refused is not None:
            raise refused
        self.admit(num_bytes)
        try:
            yield
        finally:
            self.release(num_bytes)

    def reserve_bytes(self, num_bytes: int) -> bool:
        """Hold num_bytes for a body being read, unless that passes the byte bound while other bytes are held (a lone
        body is always let in, as a lone request is); then False. Given back with release_bytes."""
        if not self.bytes_fit(num_bytes):
            return False
        self.num_unanswered_bytes += num_bytes
        return True

    def bytes_fit(self, num_bytes: int) -> bool:
        """Whether num_bytes more stay within --max-waiting-bytes; always, when nothing is held."""
        held = self.num_unanswered_bytes
        return not (self.max_waiting_bytes and held and held + num_bytes > self.max_waiting_bytes)

    def release_bytes(self, num_bytes: int) -> None:
        self.num_unanswered_bytes -= num_bytes
        assert self.num_unanswered_bytes >= 0

    def admit(self, num_bytes: int) -> None:
        self.num_unanswered += 1
        self.num_unanswered_bytes += num_bytes

    def release(self, num_bytes: int) -> None:
        """The request was answered: what admit took is given back (once)."""
        self.num_unanswered -= 1
        self.num_unanswered_bytes -= num_bytes
        assert self.num_unanswered >= 0 and self.num_unanswered_bytes >= 0

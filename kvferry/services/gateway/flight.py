"""One request on its way through the workers, as the gateway keeps it: pure state, no sockets.

Workers' messages can arrive twice, late, out of order (decode's tokens may overtake prefill's first token) or never.
Each token message says where its tokens start in their choice's output, so the flight delivers every token exactly
once and in order, holds back what comes early, and notices a gap; a new attempt resumes from what was delivered.
"""

import time
from dataclasses import dataclass, field

from kvferry.common import protocol as p
from kvferry.common.sampling import SamplingParams
from kvferry.common.sequence import FinishReason
from kvferry.services.gateway.inbox import Inbox

MAX_QUEUED_EVENTS = 4096  # token messages per choice waiting for a request's consumer; many seconds of stream


@dataclass
class Event:
    """What a request's loop consumes: new tokens of one choice, or an error (a RequestFailed's or the gateway's own).
    The fields are what the flight trims and renumbers; what only a FirstToken or a Tokens carries (prefill timings,
    the prompt's logprobs, the KV hop) is read from the message itself: `first_token`, `decode_tokens`."""

    token_ids: list[int] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    choice: int = 0
    start: int = 0  # where the tokens start in their choice's output
    attempt: int = 0  # which attempt sent them
    logprobs: list = field(default_factory=list)  # TokenLogprobs per token, when asked for
    message: p.FirstToken | p.Tokens | None = None  # the message the tokens came in
    error: str | None = None
    error_code: int = 500
    retry: bool = False  # an error that another attempt may get past

    @property
    def first_token(self) -> p.FirstToken | None:
        return self.message if isinstance(self.message, p.FirstToken) else None

    @property
    def decode_tokens(self) -> p.Tokens | None:
        return self.message if isinstance(self.message, p.Tokens) else None


@dataclass
class Lost:
    """Something went wrong on the workers' side; the request moves to other workers, or fails."""

    reason: str
    attempt: int


@dataclass
class Flight:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    trace: p.TraceContext
    n: int = 1
    attempt: int = 0
    prefill_identity: bytes = b""
    decode_identity: bytes = b""
    prefill_worker_id: str = ""
    routes: list[dict] = field(default_factory=list)  # per attempt: {"prefill": worker id, "decode": worker id}
    pending_prefill_tokens: int = 0  # prompt tokens this attempt added to its prefill worker's queue, until prefilled
    outputs: list[list[int]] = field(default_factory=list)  # delivered tokens, per choice
    finished: list[bool] = field(default_factory=list)
    early: dict[tuple[int, int], Event] = field(default_factory=dict)  # (choice, start) -> held back
    early_since: float = 0.0  # monotonic time the oldest held-back event arrived
    got_first_token: bool = False  # in this attempt
    decode_started: bool = False  # this attempt's KV landed: tokens came from the decode worker
    last_progress: float = field(default_factory=time.monotonic)
    num_moves: int = 0
    # The workers an attempt failed on: the next attempt goes elsewhere if it can.
    failed_on: set[bytes] = field(default_factory=set)
    inbox: Inbox = field(init=False)  # bounded: MAX_QUEUED_EVENTS per choice
    deadline: float = float("inf")  # monotonic: the request's end-to-end bound
    failure: Event | None = None  # set by the gateway's watchdog: the request ends with this error

    def __post_init__(self):
        self.outputs = [[] for _ in range(self.n)]
        self.finished = [False] * self.n
        self.inbox = Inbox(MAX_QUEUED_EVENTS * self.n)  # each step brings one message per choice

    def post(self, item: "Event | Lost") -> None:
        """Queue a worker's message for the consumer. A consumer that has fallen MAX_QUEUED_EVENTS behind (a client
        that does not read its stream) fails the request instead of holding ever more of it in memory."""
        if not self.inbox.put(item) and self.failure is None:
            self.fail(Event(error=f"the client fell {self.inbox.max_items} messages behind the stream", error_code=408))

    def fail(self, failure: Event) -> None:
        """End the request with this error: its consumer gets it next."""
        self.failure = failure
        self.inbox.wake()

    @property
    def done(self) -> bool:
        return all(self.finished)

    def involves(self, identity: bytes) -> bool:
        """Whether this attempt still depends on the worker: the decode worker until the end, the prefill worker
        until its KV has landed."""
        return identity == self.decode_identity or (identity == self.prefill_identity and not self.decode_started)

    def accept(self, event: Event) -> list[Event]:
        """A worker's tokens for this attempt -> the events to deliver now, in order, each token once."""
        now = time.monotonic()
        self.last_progress = now
        self.got_first_token = True
        self.decode_started = self.decode_started or event.decode_tokens is not None
        c = event.choice
        if self.finished[c]:
            return []
        output = self.outputs[c]
        if event.start == len(output) and not self.early:  # in order, nothing held back: most events
            if not event.token_ids and event.finish_reason is None:
                return []
            output.extend(event.token_ids)
            self.finished[c] = event.finish_reason is not None
            return [event]
        if event.start > len(self.outputs[c]):
            self.early_since = self.early_since or now
            self.early[(c, event.start)] = event
            return []
        ready = []
        while event is not None:
            skip = len(self.outputs[c]) - event.start
            # Else every token came already: a repeat. An end with no token (a constraint's dead end) comes alone.
            if skip < len(event.token_ids) or (skip == len(event.token_ids) and event.finish_reason is not None):
                event.token_ids, event.logprobs = event.token_ids[skip:], event.logprobs[skip:]
                event.start += skip
                self.outputs[c].extend(event.token_ids)
                self.finished[c] = event.finish_reason is not None
                ready.append(event)
            if self.finished[c]:
                break
            event = self.early.pop((c, len(self.outputs[c])), None)
        if self.early:
            self.early = {k: e for k, e in self.early.items() if not (k[0] == c and self.finished[c])}
        self.early_since = self.early_since if self.early else 0.0
        return ready

    def gap_age(self, now: float) -> float:
        """How long tokens have waited for a message that has not come (0: none waiting)."""
        return now - self.early_since if self.early else 0.0

    def can_resume(self) -> bool:
        """A single choice continues from its delivered tokens; several choices restart only if none has
        delivered anything (each would need its own prefill)."""
        return self.n == 1 or not any(self.outputs)

    def next_attempt(self) -> None:
        """Start a new attempt: forget what is held back; the request continues from what was delivered."""
        self.attempt += 1
        self.num_moves += 1
        self.early.clear()
        self.early_since = 0.0
        self.got_first_token = self.decode_started = False
        self.last_progress = time.monotonic()

    def resume_token_ids(self) -> list[int]:
        return list(self.outputs[0]) if self.n == 1 else []

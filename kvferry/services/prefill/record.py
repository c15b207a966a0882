"""One prefill worker's record of one request attempt, from arrival to the decode worker's acknowledgement.

    COMPILING ──compiled──▶ QUEUED ──start_computing──▶ COMPUTING ──start_shipping──▶ SHIPPING ──all_sent──▶ AWAITING_ACK
       │                           │                            ▲                      │
       │                           │                            └──────send_again──────┘
       └───────────────────────────┴──── end (done, refused, aborted, failed, given up) ──▶ DONE

COMPILING: its structured-output constraint compiles off the step loop (services/constraint_compiles.py); a
request without one, or whose constraint is cached, is made QUEUED.

COMPUTING may already ship layer groups (those stored while later layers compute); SHIPPING is a transfer
that is due, or waiting for its retry time or for the decode worker's KVHeld answer.
"""

import enum
import time
from dataclasses import dataclass, field

from kvferry.common import protocol as p
from kvferry.services.gateway_link import GatewayLink
from kvferry.services.record_state import move
from kvferry.services.request_keys import AttemptKey


class PrefillState(enum.Enum):
    COMPILING = "compiling"
    QUEUED = "queued"
    COMPUTING = "computing"
    SHIPPING = "shipping"
    AWAITING_ACK = "awaiting_ack"
    DONE = "done"


S = PrefillState
ALLOWED = {
    S.COMPILING: (S.QUEUED, S.DONE),
    S.QUEUED: (S.COMPUTING, S.DONE),
    S.COMPUTING: (S.SHIPPING, S.DONE),
    S.SHIPPING: (S.SHIPPING, S.AWAITING_ACK, S.DONE),  # to itself: a due transfer put off again
    S.AWAITING_ACK: (S.SHIPPING, S.DONE),
    S.DONE: (),
}


@dataclass
class PrefillAttempt:
    key: AttemptKey
    link: GatewayLink  # the gateway the request came from
    request: p.PrefillRequest
    trace: p.TraceContext
    arrived_at: float = field(default_factory=time.time)  # wall clock
    state: PrefillState = PrefillState.QUEUED
    started_at: float = 0.0  # wall clock of its first scheduled chunk
    asked: bool = False  # its KVQuery went out
    held_answer: int | None = None  # leading blocks the decode worker holds (its KVHeld), once it answered
    # The transfer: which choices go on, and their first tokens (the last group carries them).
    choices: list[int] = field(default_factory=list)
    first_token_ids: list[int] = field(default_factory=list)
    settled: bool = False  # which blocks go is fixed (num_skipped_blocks)
    num_skipped_blocks: int = 0  # leading blocks the decode worker holds: not sent
    parts: dict = field(default_factory=dict)  # layer start -> that group's K and V, kept for resends
    early_layers: int = 0  # layers shipped while the prompt computed
    early_answer: p.KVAck | None = None  # the decode worker's answer to those groups, if it came during the compute
    sent_at: float = 0.0  # monotonic time of the latest whole send; 0: not in flight
    retry_at: float = 0.0  # monotonic time a due transfer may go
    ready_at: float = 0.0  # monotonic time the transfer became due: it is given up some time after
    first_sent_at: float = 0.0  # wall clock, for the transfer's span
    num_sends: int = 0
    num_bytes: int = 0  # of one whole send
    gather_s: float = 0.0  # copying blocks out after the compute: what the transfer adds to decode's wait
    error: str = ""  # a failure while shipping during the compute: the request fails once the step is over

    @property
    def num_kv_tokens(self) -> int:
        """Tokens whose KV goes: the prompt and, for a resumed request, the outputs it had before."""
        return len(self.request.prompt_token_ids) + len(self.request.resume_token_ids)

    @property
    def answer_due(self) -> bool:
        return self.asked and self.held_answer is None

    def compiled(self) -> None:
        move(self, ALLOWED, S.QUEUED)

    def start_computing(self) -> None:
        move(self, ALLOWED, S.COMPUTING)
        self.started_at = time.time()

    def start_shipping(self, continuing: list[tuple[int, int]]) -> None:
        """The prompt is computed; these (choice, first token) go on decoding, so the rest of its KV is due."""
        move(self, ALLOWED, S.SHIPPING)
        self.choices = [c for c, _ in continuing]
        self.first_token_ids = [t for _, t in continuing]
        self.ready_at = time.monotonic()

    def all_sent(self) -> None:
        move(self, ALLOWED, S.AWAITING_ACK)
        self.sent_at = time.monotonic()
        self.num_sends += 1

    def send_again(self, after_s: float) -> None:
        """Not acknowledged (no room, lost, or not placed): due again after a wait."""
        move(self, ALLOWED, S.SHIPPING)
        self.sent_at, self.retry_at = 0.0, time.monotonic() + after_s

    def end(self) -> None:
        """The attempt is over here, whatever the reason; the worker frees what it held for it."""
        move(self, ALLOWED, S.DONE)
        self.parts = {}

"""One prefill worker's record of one request attempt, from arrival to the decode worker's acknowledgement.
PrefillConnector (services/prefill/connector.py) owns the records and drives every transition.

    COMPILING ──compiled──▶ QUEUED ──start_computing──▶ ASKING (KVQuery out) or COMPUTING (nothing to ask)
    while the prompt computes:
        ASKING ──answered──▶ COMPUTING ──start_early──▶ SENDING_EARLY ──early_answered──▶ EARLY_ANSWERED
    once its first tokens are out (`computed`, with the choices that go on):
        ASKING ──▶ AWAITING_HELD ──answered, or its wait ran out: settle──▶ DUE
        COMPUTING ──settle──▶ DUE ──all_sent──▶ AWAITING_ACK ──send_again──▶ DUE (DUE ──settle──▶ DUE: every block)
        SENDING_EARLY ──all_sent──▶ AWAITING_ACK;  EARLY_ANSWERED ──send_again──▶ DUE, or ──end──▶ DONE
    any state ──end (acknowledged, refused, aborted, failed, given up, no choice goes on)──▶ DONE

While the prompt computes, the state says where its transfer stands: ASKING, the decode worker's answer to its
KVQuery (which leading blocks it holds) is still due, so nothing may go yet; COMPUTING, which blocks go can be settled
(answered, or never asked); SENDING_EARLY, settled, and its layer groups go as they are stored (`early_layers` of them
gone); EARLY_ANSWERED, the decode worker answered those groups before the compute ended (`early_answer`), acted on
once it has. After the compute, AWAITING_HELD waits for that answer until `due_at` at most; DUE is settled and goes
whole at `due_at` (at once, or after a retry's wait); AWAITING_ACK went whole at `sent_at`. A state's data is set by
the transition into it, and read only in it.
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
    ASKING = "asking"
    COMPUTING = "computing"
    SENDING_EARLY = "sending_early"
    EARLY_ANSWERED = "early_answered"
    AWAITING_HELD = "awaiting_held"
    DUE = "due"
    AWAITING_ACK = "awaiting_ack"
    DONE = "done"


S = PrefillState
ALLOWED = {
    S.COMPILING: (S.QUEUED, S.DONE),
    S.QUEUED: (S.ASKING, S.COMPUTING, S.DONE),
    S.ASKING: (S.COMPUTING, S.AWAITING_HELD, S.DONE),
    S.COMPUTING: (S.SENDING_EARLY, S.DUE, S.DONE),
    S.SENDING_EARLY: (S.EARLY_ANSWERED, S.AWAITING_ACK, S.DONE),
    S.EARLY_ANSWERED: (S.DUE, S.DONE),
    S.AWAITING_HELD: (S.DUE, S.DONE),
    S.DUE: (S.DUE, S.AWAITING_ACK, S.DONE),  # to itself: settled again (every block) after a refusal
    S.AWAITING_ACK: (S.DUE, S.DONE),
    S.DONE: (),
}
COMPUTING_STATES = (S.ASKING, S.COMPUTING, S.SENDING_EARLY, S.EARLY_ANSWERED)
SHIPPING_STATES = (S.AWAITING_HELD, S.DUE, S.AWAITING_ACK)  # computed, its transfer not yet acknowledged


@dataclass
class PrefillAttempt:
    key: AttemptKey
    link: GatewayLink  # the gateway the request came from
    request: p.PrefillRequest
    trace: p.TraceContext
    arrived_at: float = field(default_factory=time.time)  # wall clock
    state: PrefillState = PrefillState.QUEUED
    started_at: float = 0.0  # wall clock of its first scheduled chunk
    held_answer: int = 0  # leading blocks the decode worker holds (its KVHeld); 0 until it answered, or if not asked
    # The transfer: which choices go on, and their first tokens (the last group carries them).
    choices: list[int] = field(default_factory=list)
    first_token_ids: list[int] = field(default_factory=list)
    num_skipped_blocks: int = 0  # once settled: leading blocks the decode worker holds, not sent
    parts: dict = field(default_factory=dict)  # layer start -> that group's K and V, kept for resends
    early_layers: int = 0  # SENDING_EARLY: layers shipped while the prompt computes
    early_answer: p.KVAck | None = None  # EARLY_ANSWERED: the decode worker's answer to those groups
    due_at: float = 0.0  # AWAITING_HELD, DUE: monotonic time the wait ends, or the transfer may go
    sent_at: float = 0.0  # AWAITING_ACK: monotonic time of the latest whole send
    ready_at: float = 0.0  # monotonic time the prompt was computed: the transfer is given up some time after
    first_sent_at: float = 0.0  # wall clock, for the transfer's span
    num_sends: int = 0
    num_bytes: int = 0  # of one whole send
    gather_s: float = 0.0  # copying blocks out after the compute: what the transfer adds to decode's wait

    @property
    def num_kv_tokens(self) -> int:
        """Tokens whose KV goes: the prompt and, for a resumed request, the outputs it had before."""
        return len(self.request.prompt_token_ids) + len(self.request.resume_token_ids)

    def compiled(self) -> None:
        """Its constraint compiled: it may be scheduled."""
        move(self, ALLOWED, S.QUEUED)

    def start_computing(self, asked: bool) -> None:
        """Its first chunk is scheduled; asked: its KVQuery went out, so nothing goes before the answer."""
        move(self, ALLOWED, S.ASKING if asked else S.COMPUTING)
        self.started_at = time.time()

    def answered(self, num_held: int) -> None:
        """The decode worker's KVHeld; in AWAITING_HELD the caller then settles at once."""
        self.held_answer = num_held
        if self.state is S.ASKING:
            move(self, ALLOWED, S.COMPUTING)

    def _settled(self, num_skipped_blocks: int, num_bytes: int) -> None:
        self.num_skipped_blocks, self.num_bytes, self.parts = num_skipped_blocks, num_bytes, {}

    def start_early(self, choices: list[int], num_skipped_blocks: int, num_bytes: int) -> None:
        """The first layer group is stored while the prompt computes: which blocks go is fixed. choices: announced."""
        move(self, ALLOWED, S.SENDING_EARLY)
        self.choices = choices
        self._settled(num_skipped_blocks, num_bytes)

    def settle(self, num_skipped_blocks: int, num_bytes: int) -> None:
        """Which blocks go is fixed after the compute, or again (every block) after a refusal: due at once."""
        move(self, ALLOWED, S.DUE)
        self._settled(num_skipped_blocks, num_bytes)
        self.due_at = 0.0

    def sent_early(self, layers_end: int) -> None:
        assert self.state is S.SENDING_EARLY
        self.early_layers = layers_end

    def early_answered(self, ack: p.KVAck) -> None:
        """The decode worker answered the early groups during the compute: acted on once it is over."""
        move(self, ALLOWED, S.EARLY_ANSWERED)
        self.early_answer = ack

    def computed(self, continuing: list[tuple[int, int]], wait_s: float) -> None:
        """The prompt is computed; these (choice, first token) go on. ASKING waits wait_s at most for its answer
        (AWAITING_HELD); the others stay, for the caller to settle or send."""
        self.choices = [c for c, _ in continuing]
        self.first_token_ids = [t for _, t in continuing]
        self.ready_at = time.monotonic()
        if self.state is S.ASKING:
            move(self, ALLOWED, S.AWAITING_HELD)
            self.due_at = self.ready_at + wait_s

    def all_sent(self) -> None:
        move(self, ALLOWED, S.AWAITING_ACK)
        self.sent_at = time.monotonic()
        self.num_sends += 1

    def send_again(self, after_s: float) -> None:
        """Not acknowledged (no room, lost, or not placed): due again after a wait."""
        move(self, ALLOWED, S.DUE)
        self.sent_at, self.early_answer, self.due_at = 0.0, None, time.monotonic() + after_s

    def end(self) -> None:
        """The attempt is over here, whatever the reason; the engine releases its blocks (the connector's failed
        list, at its next step)."""
        move(self, ALLOWED, S.DONE)
        self.parts = {}

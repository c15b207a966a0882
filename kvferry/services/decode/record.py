"""One decode worker's record of one request attempt: blocks held for its transfer, the transfer arriving layer
group by layer group, its choices running, and a tombstone once it ended.

    NEW ──hold──▶ HOLDING ──start_receiving──▶ RECEIVING ──start_running──▶ RUNNING
     │  ◀─let_go── │  ▲                           │  │                       │
     │             │  └────── put_back (no room, or groups stopped) ─────────┘  │
     └─────────────┴──────────── end (finished, aborted, refused) ──────────────┴──▶ DONE

NEW also takes a transfer whose prompt asked nothing, and choices that end before their KV comes (cancelled). DONE
is kept as a tombstone for a while: KV that arrives late for it (an Abort can overtake its transfer; a resend can
follow an ack) is acknowledged and dropped.
"""

import enum
import time
from collections import OrderedDict
from dataclasses import dataclass, field

from kvferry.common import protocol as p
from kvferry.services.gateway_link import GatewayLink
from kvferry.services.record_state import move
from kvferry.services.request_keys import AttemptKey, ChoiceKey

TOMBSTONE_S = 600.0  # as long as a request may live at the gateway
HOLD_S = 20.0  # held blocks are let go after this (a lost Abort must not pin them; a later transfer sends all)
INCOMING_S = 10.0  # a transfer whose next layer group has not come this long after the one before is dropped
# Caps on what a flood of messages could make a worker remember. Past one, the oldest go first: a tombstone gone
# early lets a late transfer run until its gateway, which does not know it, aborts it; a hold let go early makes
# its transfer send every block; a cancelled choice forgotten early runs until the gateway drops its tokens.
MAX_TOMBSTONES = 1 << 15
MAX_HOLDS = 1 << 13
MAX_REMEMBERED = 1 << 14  # NEW records that only remember cancelled choices


class DecodeState(enum.Enum):
    NEW = "new"
    HOLDING = "holding"
    RECEIVING = "receiving"
    RUNNING = "running"
    DONE = "done"


S = DecodeState
ALLOWED = {
    S.NEW: (S.HOLDING, S.RECEIVING, S.DONE),
    S.HOLDING: (S.HOLDING, S.NEW, S.RECEIVING, S.DONE),  # to itself: held again after a refusal
    S.RECEIVING: (S.NEW, S.HOLDING, S.RUNNING, S.DONE),
    S.RUNNING: (S.DONE,),
    S.DONE: (),
}


@dataclass
class Incoming:
    """A transfer whose layer groups are arriving: its blocks are allocated and filled group by group."""

    first: p.KVTransfer  # the first group's message: the request's fields
    link: GatewayLink
    choices: list[int]  # announced by the first group, cancelled ones left out
    params: list  # each choice's SamplingParams
    blocks: list[int]  # allocated for the KV that comes, referenced for it
    received_at: float = field(default_factory=time.time)
    expires_at: float = 0.0  # monotonic
    next_layer: int = 0
    num_bytes: int = 0
    trace: p.TraceContext | None = None  # the first group's
    grammar: object = None  # the choices' constraint, compiled (kept here: the cache may let it go before admission)
    # The last group's (peer, envelope without its frame, placed already), admitted once the constraint compiled.
    awaiting_grammar: tuple | None = None
    grammar_error: str = ""  # the constraint's compile failed: the transfer is refused when its last group comes


@dataclass(slots=True)  # tens of thousands of tombstones: no per-record __dict__
class DecodeAttempt:
    key: AttemptKey
    state: DecodeState = DecodeState.NEW
    held: list[int] = field(default_factory=list)  # cached blocks held for the transfer (it leaves them out)
    held_until: float = 0.0  # monotonic
    incoming: Incoming | None = None
    cancelled: set[int] = field(default_factory=set)  # choices ended before their KV came
    link: GatewayLink | None = None  # where its tokens go, once running
    trace: p.TraceContext | None = None
    running: dict[int, ChoiceKey] = field(default_factory=dict)  # choice -> the engine's id for its sequence
    transfer: tuple[float, int] | None = None  # (seconds, bytes), told with the first Tokens, then cleared
    tombstone_until: float = 0.0

    def hold(self, block_ids: list[int]) -> None:
        move(self, ALLOWED, S.HOLDING)
        self.held, self.held_until = block_ids, time.monotonic() + HOLD_S

    def let_go(self, engine, keep: int = 0) -> list[int]:
        """Stop holding blocks but the first `keep`, which are returned: their references pass to the caller."""
        kept, rest = self.held[:keep], self.held[keep:]
        self.held = []
        engine.free_blocks(rest)
        if self.state is S.HOLDING:
            move(self, ALLOWED, S.NEW)
        return kept

    def start_receiving(self, incoming: Incoming, held: list[int]) -> None:
        """The first group came and its blocks are allocated; held: the cached blocks it leaves out, referenced."""
        move(self, ALLOWED, S.RECEIVING)
        self.incoming, self.held = incoming, held
        incoming.expires_at = time.monotonic() + INCOMING_S

    def put_back(self, engine) -> None:
        """A transfer not placed now, or whose groups stopped: its allocated blocks are freed, the held ones kept
        for a while for its retry."""
        if self.incoming is not None:
            engine.free_blocks(self.incoming.blocks)
            self.incoming = None
        if self.held:
            move(self, ALLOWED, S.HOLDING)
            self.held_until = time.monotonic() + HOLD_S
        else:
            move(self, ALLOWED, S.NEW)

    def start_running(self, link: GatewayLink, trace, running: dict[int, ChoiceKey], transfer: tuple[float, int]):
        move(self, ALLOWED, S.RUNNING)
        self.incoming, self.held = None, []
        self.link, self.trace, self.running, self.transfer = link, trace, running, transfer
        self.cancelled = set()

    def choice_ended(self, choice: int) -> bool:
        """A running choice finished or was aborted; True when it was the last."""
        self.running.pop(choice, None)
        return not self.running

    def end(self, engine) -> None:
        """The attempt is over here: its choices stop, every block it held or was filling is freed; a tombstone."""
        for choice_key in self.running.values():
            engine.abort(choice_key)
        if self.incoming is not None:
            engine.free_blocks(self.incoming.blocks)
        engine.free_blocks(self.held)
        self.running, self.incoming, self.held, self.cancelled = {}, None, [], set()
        move(self, ALLOWED, S.DONE)
        self.tombstone_until = time.monotonic() + TOMBSTONE_S


def _due_at(record: DecodeAttempt) -> float | None:
    """When a record's state runs out (monotonic), or None for a state that does not."""
    if record.state is S.HOLDING:
        return record.held_until
    if record.state is S.RECEIVING:
        return record.incoming.expires_at
    if record.state in (S.NEW, S.DONE):
        return record.tombstone_until
    return None


class DecodeRecords:
    """A decode worker's records: the live ones, and the DONE ones as tombstones.

    After any change the worker files a record (`file`): into its state's queue (HOLDING, RECEIVING, or NEW that
    remembers cancelled choices), to the tombstones once DONE, or forgotten (NEW, remembering nothing). A queue's
    records time out a fixed time after it was set, so filing order is expiry order: `expired` pops from the fronts,
    never walking the others; each queue is capped, oldest out first. (A NEW record back from HOLDING keeps the time its
    first choice was cancelled, so it may be forgotten a little late: it holds nothing meanwhile.)"""

    def __init__(self, max_tombstones=MAX_TOMBSTONES, max_holds=MAX_HOLDS, max_remembered=MAX_REMEMBERED):
        self.live: dict[AttemptKey, DecodeAttempt] = {}
        self.tombstones: OrderedDict[AttemptKey, DecodeAttempt] = OrderedDict()  # oldest first
        self.max_tombstones = max_tombstones
        self.queues: dict[DecodeState, OrderedDict[AttemptKey, float]] = {
            S.HOLDING: OrderedDict(),
            S.RECEIVING: OrderedDict(),
            S.NEW: OrderedDict(),
        }  # key -> its due time when filed, earliest first
        self.caps = {S.HOLDING: max_holds, S.NEW: max_remembered}  # RECEIVING: each holds blocks of the pool

    def get(self, key: AttemptKey) -> DecodeAttempt | None:
        return self.live.get(key) or self.tombstones.get(key)

    def get_or_new(self, key: AttemptKey) -> DecodeAttempt:
        record = self.get(key)
        if record is None:
            record = self.live[key] = DecodeAttempt(key)
        return record

    def __len__(self) -> int:
        return len(self.live) + len(self.tombstones)

    def file(self, record: DecodeAttempt) -> None:
        key = record.key
        for queue in self.queues.values():
            queue.pop(key, None)
        if record.state is S.DONE:
            self.live.pop(key, None)
            if key not in self.tombstones:  # a tombstone keeps its place: its time runs from the end
                self.tombstones[key] = record
                if len(self.tombstones) > self.max_tombstones:
                    self.tombstones.popitem(last=False)
            return
        if record.state is S.NEW and not record.cancelled:
            self.live.pop(key, None)  # nothing held, nothing to remember
            return
        self.live[key] = record
        if record.state in self.queues:
            self.queues[record.state][key] = _due_at(record)

    def expired(self, now: float) -> list[DecodeAttempt]:
        """Forget the tombstones and NEW records that ran out (or are past their cap); return the HOLDING and
        RECEIVING ones that did, for the worker to free their blocks and file."""
        while self.tombstones and next(iter(self.tombstones.values())).tombstone_until < now:
            self.tombstones.popitem(last=False)
        due = []
        for state, queue in self.queues.items():
            cap = self.caps.get(state, len(queue))
            while queue:
                key, filed_due = next(iter(queue.items()))
                if filed_due >= now and len(queue) <= cap:
                    break
                del queue[key]
                record = self.live.get(key)
                if record is None or record.state is not state:
                    continue  # filed elsewhere since (the worker files every change: a safeguard)
                actual = _due_at(record)
                if actual > filed_due and actual >= now and len(queue) < cap:
                    queue[key] = actual  # its time was set again without a filing: back in line, which is its place
                elif state is S.NEW:
                    del self.live[key]  # holds nothing: forgetting it is all
                else:
                    due.append(record)
        return due

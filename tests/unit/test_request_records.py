"""The prefill and decode workers' request records: every transition of each state machine, what each one frees,
and that a transition the machine does not allow raises instead of leaving bookkeeping half done."""

import time

import pytest

from kvferry.common import protocol as p
from kvferry.common.sampling import SamplingParams
from kvferry.services.decode.record import ALLOWED as DECODE_ALLOWED
from kvferry.services.decode.record import (
    HOLD_S,
    INCOMING_S,
    TOMBSTONE_S,
    DecodeAttempt,
    DecodeRecords,
    DecodeState,
    Incoming,
)
from kvferry.services.prefill.record import ALLOWED as PREFILL_ALLOWED
from kvferry.services.prefill.record import PrefillAttempt, PrefillState
from kvferry.services.record_state import IllegalTransition
from kvferry.services.request_keys import AttemptKey, ChoiceKey

KEY = AttemptKey("req-1", 2)


class FakeEngine:
    """Stands in for the engine's block and sequence bookkeeping only: the records' own logic is under test."""

    def __init__(self):
        self.freed: list[int] = []
        self.aborted: list = []

    def free_blocks(self, ids):
        self.freed.extend(ids)

    def abort(self, key):
        self.aborted.append(key)
        return True


def prefill_record() -> PrefillAttempt:
    request = p.PrefillRequest([1, 2, 3], SamplingParams(), "decode-0", "tcp://127.0.0.1:1", 1e12, attempt=2)
    return PrefillAttempt(KEY, link=None, request=request, trace=p.TraceContext())


def test_keys_are_typed_and_a_choice_knows_its_attempt():
    assert KEY.choice(3) == ChoiceKey("req-1", 2, 3)
    assert KEY.choice(3).attempt_key == KEY
    assert {KEY: 1}[AttemptKey("req-1", 2)] == 1 and AttemptKey("req-1", 3) != KEY


def test_prefill_record_walks_its_whole_life():
    record = prefill_record()
    assert record.state is PrefillState.QUEUED
    record.start_computing(asked=False)
    assert record.state is PrefillState.COMPUTING and record.started_at > 0
    record.computed([(0, 11), (2, 12)], wait_s=0.1)  # nothing asked, nothing early: settled by the connector
    assert record.state is PrefillState.COMPUTING
    assert (record.choices, record.first_token_ids) == ([0, 2], [11, 12]) and record.ready_at > 0
    record.settle(1, 4096)
    assert record.state is PrefillState.DUE and (record.num_skipped_blocks, record.num_bytes) == (1, 4096)
    record.all_sent()
    assert record.state is PrefillState.AWAITING_ACK and record.num_sends == 1 and record.sent_at > 0
    record.send_again(0.5)  # no room at the decode worker: due again later
    assert record.state is PrefillState.DUE and record.sent_at == 0 and record.due_at > 0
    record.settle(0, 8192)  # the decode worker let go of the blocks it held: every block, at once
    assert record.state is PrefillState.DUE and record.due_at == 0 and record.num_skipped_blocks == 0
    record.all_sent()
    assert record.num_sends == 2
    record.parts = {0: "kv"}
    record.end()
    assert record.state is PrefillState.DONE and record.parts == {}


def test_prefill_record_waits_for_the_held_answer_and_ships_early():
    """The sub-states of a transfer are states: a KVQuery out (ASKING), its answer in (COMPUTING), groups sent
    while computing (SENDING_EARLY), an answer to them during the compute (EARLY_ANSWERED), and a computed prompt
    waiting for its KVHeld (AWAITING_HELD)."""
    asking = prefill_record()
    asking.start_computing(asked=True)
    assert asking.state is PrefillState.ASKING
    asking.computed([(0, 5)], wait_s=0.1)  # the answer is still due: the transfer waits for it, a while
    assert asking.state is PrefillState.AWAITING_HELD and asking.due_at >= asking.ready_at + 0.1
    asking.answered(2)
    assert asking.state is PrefillState.AWAITING_HELD and asking.held_answer == 2
    asking.settle(2, 1024)
    assert asking.state is PrefillState.DUE

    early = prefill_record()
    early.start_computing(asked=True)
    early.answered(3)
    assert early.state is PrefillState.COMPUTING and early.held_answer == 3
    early.start_early([0, 1], 3, 2048)
    assert early.state is PrefillState.SENDING_EARLY and early.choices == [0, 1] and early.num_skipped_blocks == 3
    early.sent_early(4)
    assert early.early_layers == 4
    ack = p.KVAck(False, "no free blocks", True, 2)
    early.early_answered(ack)
    assert early.state is PrefillState.EARLY_ANSWERED and early.early_answer is ack
    early.computed([(1, 9)], wait_s=0.1)
    assert early.state is PrefillState.EARLY_ANSWERED and early.choices == [1]
    early.send_again(0.5)  # the first groups were not placed: the whole transfer again
    assert early.state is PrefillState.DUE and early.early_answer is None

    on_time = prefill_record()
    on_time.start_computing(asked=False)
    on_time.start_early([0], 0, 2048)
    on_time.computed([(0, 7)], wait_s=0.1)
    on_time.all_sent()  # the rest of its groups, the last with the first tokens
    assert on_time.state is PrefillState.AWAITING_ACK


@pytest.mark.parametrize("state", [s for s in PrefillState if s is not PrefillState.DONE])
def test_prefill_record_ends_from_every_live_state(state):
    record = prefill_record()
    record.state = state
    record.end()
    assert record.state is PrefillState.DONE


def test_prefill_record_refuses_transitions_its_machine_lacks():
    record = prefill_record()
    with pytest.raises(IllegalTransition, match="QUEUED -> DUE"):
        record.settle(0, 0)
    with pytest.raises(IllegalTransition):
        record.all_sent()
    with pytest.raises(IllegalTransition, match="QUEUED -> EARLY_ANSWERED"):
        record.early_answered(p.KVAck(True, "", True, 2))
    record.end()
    for transition in (lambda: record.start_computing(False), record.end, lambda: record.send_again(0)):
        with pytest.raises(IllegalTransition):
            transition()
    assert record.state is PrefillState.DONE
    # Every pair the table leaves out raises (checked through the shared mover).
    from kvferry.services.record_state import move

    for src, targets in PREFILL_ALLOWED.items():
        for dst in set(PrefillState) - set(targets):
            record.state = src
            with pytest.raises(IllegalTransition):
                move(record, PREFILL_ALLOWED, dst)


def incoming(blocks=(7, 8)) -> Incoming:
    first = p.KVTransfer("p0", [1, 2, 3], [], [0, 1], SamplingParams(), 3, "float32", [1, 1, 4, 2, 1, 2], 1e12)
    return Incoming(first, link=None, choices=[0, 1], params=[SamplingParams()] * 2, blocks=list(blocks))


def test_decode_record_holds_receives_runs_and_ends():
    engine, record = FakeEngine(), DecodeAttempt(KEY)
    assert record.state is DecodeState.NEW
    record.hold([1, 2, 3])
    assert record.state is DecodeState.HOLDING and record.held_until > 0
    held = record.let_go(engine, keep=2)  # the transfer leaves out 2 blocks: their references pass to it
    assert held == [1, 2] and engine.freed == [3] and record.state is DecodeState.NEW
    record.start_receiving(incoming(), held)
    assert record.state is DecodeState.RECEIVING and record.incoming.expires_at > 0
    record.put_back(engine)  # no room: the allocated blocks go, the held ones wait for the retry
    assert engine.freed == [3, 7, 8] and record.state is DecodeState.HOLDING and record.held == [1, 2]
    record.start_receiving(incoming((9,)), record.let_go(engine, keep=2))
    running = {0: KEY.choice(0), 1: KEY.choice(1)}
    record.start_running("link", p.TraceContext(), running, (0.1, 64))
    assert record.state is DecodeState.RUNNING and record.held == [] and record.incoming is None
    assert not record.choice_ended(0)
    assert record.running == {1: KEY.choice(1)}
    record.end(engine)
    assert engine.aborted == [KEY.choice(1)] and record.state is DecodeState.DONE and record.tombstone_until > 0


def test_decode_record_put_back_without_held_blocks_is_new_again_and_hold_expires():
    engine, record = FakeEngine(), DecodeAttempt(KEY)
    record.start_receiving(incoming(), [])
    record.put_back(engine)
    assert record.state is DecodeState.NEW and engine.freed == [7, 8]
    record.hold([4])
    record.let_go(engine)
    assert record.state is DecodeState.NEW and engine.freed == [7, 8, 4]


@pytest.mark.parametrize("state", [s for s in DecodeState if s is not DecodeState.DONE])
def test_decode_record_end_frees_everything_from_every_live_state(state):
    engine, record = FakeEngine(), DecodeAttempt(KEY)
    record.state, record.held = state, [1, 2]
    if state is DecodeState.RECEIVING:
        record.incoming = incoming()
    if state is DecodeState.RUNNING:
        record.held, record.running = [], {0: KEY.choice(0)}
    record.end(engine)
    assert record.state is DecodeState.DONE
    assert record.held == [] and record.incoming is None and record.running == {}
    expected = {DecodeState.RECEIVING: [7, 8, 1, 2], DecodeState.RUNNING: []}.get(state, [1, 2])
    assert engine.freed == expected
    assert engine.aborted == ([KEY.choice(0)] if state is DecodeState.RUNNING else [])


def test_decode_record_refuses_transitions_its_machine_lacks():
    engine, record = FakeEngine(), DecodeAttempt(KEY)
    with pytest.raises(IllegalTransition, match="NEW -> RUNNING"):
        record.start_running("link", None, {}, (0, 0))
    record.end(engine)
    with pytest.raises(IllegalTransition):
        record.hold([1])
    with pytest.raises(IllegalTransition):
        record.end(engine)
    from kvferry.services.record_state import move

    for src, targets in DECODE_ALLOWED.items():
        for dst in set(DecodeState) - set(targets):
            record.state = src
            with pytest.raises(IllegalTransition):
                move(record, DECODE_ALLOWED, dst)


# -- the decode worker's records: expiry without a walk, and caps --------------------------------------------------
def ended(records: DecodeRecords, engine: FakeEngine, key: AttemptKey) -> DecodeAttempt:
    record = records.get_or_new(key)
    record.end(engine)
    records.file(record)
    return record


def test_tombstones_expire_oldest_first_and_stay_under_their_cap():
    engine, records = FakeEngine(), DecodeRecords(max_tombstones=100)
    for i in range(250):
        ended(records, engine, AttemptKey(f"req-{i}"))
    assert len(records.tombstones) == 100 and not records.live
    assert records.get(AttemptKey("req-149")) is None  # pushed out past the cap, oldest first
    assert records.get(AttemptKey("req-150")).state is DecodeState.DONE
    now = time.monotonic()
    assert records.expired(now) == [] and len(records.tombstones) == 100  # none has run out yet
    records.tombstones[AttemptKey("req-150")].tombstone_until = now - 1  # the oldest runs out first
    records.expired(now)
    assert len(records.tombstones) == 99 and records.get(AttemptKey("req-150")) is None
    assert records.expired(now + TOMBSTONE_S + 1) == [] and len(records) == 0
    # A late message about an ended attempt finds its tombstone, which keeps its place in line.
    record = ended(records, engine, KEY)
    records.file(record)
    assert records.get(KEY) is record and list(records.tombstones) == [KEY]


def test_finding_what_expired_does_not_walk_what_did_not():
    """Twenty thousand tombstones and holds: a thousand tidies in which nothing runs out cost next to nothing (a
    walk over every record would take seconds), and the expired are popped from the front."""
    engine, records = FakeEngine(), DecodeRecords()
    for i in range(20_000):
        ended(records, engine, AttemptKey(f"done-{i}"))
    for i in range(2_000):
        record = records.get_or_new(AttemptKey(f"held-{i}"))
        record.hold([i])
        records.file(record)
    now = time.monotonic()
    started = time.perf_counter()
    for _ in range(1000):
        assert records.expired(now) == []
    assert time.perf_counter() - started < 0.2
    due = records.expired(now + HOLD_S + 1)
    assert [r.key.request_id for r in due] == [f"held-{i}" for i in range(2_000)]  # in the order they were held
    assert len(records.tombstones) == 20_000  # theirs runs for TOMBSTONE_S


def test_each_timed_state_is_filed_found_when_due_and_capped():
    engine, records = FakeEngine(), DecodeRecords(max_holds=3, max_remembered=2)
    now = time.monotonic()
    # NEW holding nothing is not kept; NEW remembering a cancelled choice is, until its time or its cap.
    assert records.get_or_new(KEY) is not None
    records.file(records.get(KEY))
    assert records.get(KEY) is None
    for i in range(3):
        record = records.get_or_new(AttemptKey(f"cancel-{i}"))
        record.cancelled.add(1)
        record.tombstone_until = now + TOMBSTONE_S
        records.file(record)
    assert records.expired(now) == []  # past the cap of 2 the oldest is forgotten: it held nothing
    assert records.get(AttemptKey("cancel-0")) is None and records.get(AttemptKey("cancel-2")) is not None
    # HOLDING past its cap: the oldest are given back to be let go, before their time.
    for i in range(5):
        record = records.get_or_new(AttemptKey(f"hold-{i}"))
        record.hold([i])
        records.file(record)
    assert [r.key.request_id for r in records.expired(now)] == ["hold-0", "hold-1"]
    # RECEIVING: its time is set again with each layer group; it is due only once the latest runs out.
    record = records.get_or_new(AttemptKey("recv"))
    record.start_receiving(incoming(), [])
    records.file(record)
    record.incoming.expires_at = now + INCOMING_S + 5  # another group came (the worker files it: here it does not)
    assert records.expired(now + INCOMING_S + 1) == [] and records.get(AttemptKey("recv")) is record
    assert records.expired(now + INCOMING_S + 6) == [record]
    record.put_back(engine)  # what the worker does with it
    records.file(record)
    assert records.get(AttemptKey("recv")) is None  # NEW, and remembering nothing
    # RUNNING: in no queue; once ended, a tombstone.
    record = records.get_or_new(AttemptKey("run"))
    record.start_receiving(incoming(), [])
    record.start_running("link", None, {0: KEY.choice(0)}, (0.0, 0))
    records.file(record)
    assert all(AttemptKey("run") not in queue for queue in records.queues.values())
    record.end(engine)
    records.file(record)
    assert records.get(AttemptKey("run")) is record and AttemptKey("run") not in records.live

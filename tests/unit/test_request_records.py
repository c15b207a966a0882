"""The prefill and decode workers' request records: every transition of each state machine, what each one frees,
and that a transition the machine does not allow raises instead of leaving bookkeeping half done."""

import pytest

from kvferry.common import protocol as p
from kvferry.common.sampling import SamplingParams
from kvferry.services.decode.record import ALLOWED as DECODE_ALLOWED
from kvferry.services.decode.record import DecodeAttempt, DecodeState, Incoming
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
    record.start_computing()
    assert record.state is PrefillState.COMPUTING and record.started_at > 0
    record.start_shipping([(0, 11), (2, 12)])
    assert record.state is PrefillState.SHIPPING
    assert (record.choices, record.first_token_ids) == ([0, 2], [11, 12])
    record.all_sent()
    assert record.state is PrefillState.AWAITING_ACK and record.num_sends == 1 and record.sent_at > 0
    record.send_again(0.5)  # no room at the decode worker: due again later
    assert record.state is PrefillState.SHIPPING and record.sent_at == 0 and record.retry_at > 0
    record.send_again(0.5)  # put off again before it went
    record.all_sent()
    assert record.num_sends == 2
    record.parts = {0: "kv"}
    record.end()
    assert record.state is PrefillState.DONE and record.parts == {}


@pytest.mark.parametrize("state", [s for s in PrefillState if s is not PrefillState.DONE])
def test_prefill_record_ends_from_every_live_state(state):
    record = prefill_record()
    record.state = state
    record.end()
    assert record.state is PrefillState.DONE


def test_prefill_record_refuses_transitions_its_machine_lacks():
    record = prefill_record()
    with pytest.raises(IllegalTransition, match="QUEUED -> SHIPPING"):
        record.start_shipping([(0, 1)])
    with pytest.raises(IllegalTransition):
        record.all_sent()
    record.end()
    for transition in (record.start_computing, record.end, lambda: record.send_again(0)):
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

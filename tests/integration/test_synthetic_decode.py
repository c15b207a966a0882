"""The synthetic decode worker (a test double, kvferry/tools/bench/synthetic/decode.py) in this process, driven one
loop turn at a time, between raw ZeroMQ sockets on loopback playing its gateway and a prefill worker: it registers as
the synthetic model, streams one token a step for every choice it holds, ends each at its max_tokens or stop token
with a finish reason, and honours a choice's and a request's Abort, also one that comes before the KV."""

import threading
import time

import pytest
import zmq

from kvferry.common import protocol as p
from kvferry.common.sampling import SamplingParams
from kvferry.common.sequence import FinishReason
from kvferry.common.transport import Channel
from kvferry.tools.bench.synthetic.decode import SyntheticDecode
from kvferry.tools.bench.synthetic.model_folder import SYNTHETIC_MODEL_NAME, prepare_model_folder
from kvferry.tools.bench.synthetic.send_counts import SENT, UNSENT, WAITED

WAIT_S = 10.0  # a hang guard only: every wait below ends as soon as what it waits for is there
BACKLOG_MESSAGES = 900  # of 12 KB: 10 MB, past the socket buffers (a few MB), within ZeroMQ's send queue of 1,000


@pytest.fixture
def rig(tmp_path):
    ctx = zmq.Context.instance()
    gateway = ctx.socket(zmq.ROUTER)
    gateway.setsockopt(zmq.LINGER, 0)
    # A gateway that takes little before it is read: a fixed kernel buffer (not one that grows to tens of MB) and a
    # queue of 10 messages, so that what the double sends beyond them waits in its own queue.
    gateway.setsockopt(zmq.RCVBUF, 1 << 16)
    gateway.setsockopt(zmq.RCVHWM, 10)
    gateway.bind("tcp://127.0.0.1:*")
    double = SyntheticDecode(gateway.getsockopt(zmq.LAST_ENDPOINT).decode(), prepare_model_folder(tmp_path), "dx")
    prefill = ctx.socket(zmq.DEALER)
    prefill.setsockopt(zmq.LINGER, 0)
    prefill.setsockopt(zmq.IDENTITY, b"px")
    prefill.connect(double.kv_address())
    try:
        yield Rig(double, gateway, prefill)
    finally:
        double.close()
        gateway.close()
        prefill.close()


class Rig:
    """Each message is delivered into the double's socket before the turn that reads it: a turn reads what came,
    then steps once if it holds a sequence, so the tests know exactly which steps ran."""

    def __init__(self, double: SyntheticDecode, gateway: zmq.Socket, prefill: zmq.Socket):
        self.double, self.gateway, self.prefill = double, gateway, prefill
        self.control = double.links[0].channel.socket
        self.identity = b""

    def turn_on(self, sock: zmq.Socket) -> None:
        """One turn, once sock (the double's) has a message waiting."""
        assert sock.poll(int(WAIT_S * 1000)), "a message to the double did not arrive"
        self.double.turn()

    def steps(self, num: int) -> None:
        for _ in range(num):
            self.double.turn()

    def receive(self, sock: zmq.Socket) -> p.Envelope:
        assert sock.poll(int(WAIT_S * 1000)), "the double sent nothing"
        parts = sock.recv_multipart()
        if sock is self.gateway:
            self.identity, parts = parts[0], parts[1:]
        return p.decode(parts)

    def register(self) -> p.Register:
        self.double.turn()
        register = self.receive(self.gateway).message
        self.gateway.send_multipart([self.identity, *p.encode(p.RegisterReply(True, gateway_id="gw-x"))])
        self.turn_on(self.control)
        assert self.double.links[0].registered
        return register

    def transfer(self, rid: str, choices: list[int], params: SamplingParams) -> p.KVAck:
        """A transfer's KV to the double, its turn (a step of what it holds then) and its answer."""
        first = self.double.cycle[0]
        transfer = p.KVTransfer(
            "px", [1, 2, 3], [first] * len(choices), choices, params, 3, "float32", [1, 0, 0, 2, 0, 0], 1e12,
            sent_at=time.time(), gateway_id="gw-x",
        )  # fmt: skip
        self.prefill.send_multipart(p.encode(transfer, rid, frames=[b""]))
        self.turn_on(self.double.kv_in.socket)
        return self.receive(self.prefill).message

    def abort(self, rid: str, choice: int = -1) -> None:
        """An Abort into the double's socket: the next turn reads it before its step."""
        self.gateway.send_multipart([self.identity, *p.encode(p.Abort(choice), rid)])
        assert self.control.poll(int(WAIT_S * 1000)), "the abort did not arrive"

    def tokens(self, num: int) -> list[tuple[str, p.Tokens]]:
        """The next num Tokens messages the gateway gets."""
        out = []
        while len(out) < num:
            env = self.receive(self.gateway)
            if isinstance(env.message, p.Tokens):
                out.append((env.request_id, env.message))
        return out


def test_it_registers_as_the_synthetic_model_and_streams_each_choice_to_its_end(rig):
    register = rig.register()
    assert (register.model, register.role) == (SYNTHETIC_MODEL_NAME, p.Role.DECODE)
    assert register.kv_address == rig.double.kv_address()
    assert rig.transfer("r1", [0, 2], SamplingParams(max_tokens=4)).accepted  # and a step
    cycle = rig.double.cycle
    rig.steps(2)
    got = rig.tokens(6)  # positions 1, 2 and 3 of both choices; 0 came from prefill
    for choice in (0, 2):
        mine = [t for _, t in got if t.choice == choice]
        assert [(t.start, t.token_ids) for t in mine] == [(i, [cycle[i]]) for i in (1, 2, 3)]
        assert [t.finish_reason for t in mine] == [-1, -1, int(FinishReason.LENGTH)]
    assert not rig.double.requests

    stop_at = 5
    params = SamplingParams(max_tokens=100, stop_token_ids=(cycle[stop_at],))
    assert cycle[stop_at] not in cycle[:stop_at]  # (the cycle's words: the stop token is first met there)
    assert rig.transfer("r2", [0], params).accepted
    rig.steps(stop_at - 1)
    got = [t for _, t in rig.tokens(stop_at)]
    assert [t.start for t in got] == list(range(1, stop_at + 1))
    assert got[-1].finish_reason == int(FinishReason.STOP) and not rig.double.requests


def test_it_ends_a_choice_by_the_engines_rules(rig):
    """As common/finish_rules.py says for the scheduler: a stop token id ends a choice even with ignore_eos, a stop
    token that is also the last one allowed is a stop, and one before min_tokens (which the sampler would have
    masked) ends nothing."""
    rig.register()
    cycle = rig.double.cycle
    stop_at = 5
    assert cycle[stop_at] not in cycle[:stop_at]
    cases = [
        (SamplingParams(max_tokens=100, stop_token_ids=(cycle[stop_at],), ignore_eos=True), stop_at, FinishReason.STOP),
        (SamplingParams(max_tokens=stop_at + 1, stop_token_ids=(cycle[stop_at],)), stop_at, FinishReason.STOP),
        (SamplingParams(max_tokens=stop_at + 1, stop_token_ids=(cycle[stop_at],), min_tokens=stop_at + 1), stop_at,
         FinishReason.LENGTH),
    ]  # fmt: skip
    for i, (params, last, reason) in enumerate(cases):
        assert rig.transfer(f"r{i}", [0], params).accepted
        rig.steps(last - 1)
        got = [t for _, t in rig.tokens(last)]
        assert [t.start for t in got] == list(range(1, last + 1)), params
        assert [t.finish_reason for t in got] == [-1] * (last - 1) + [int(reason)], params
        assert not rig.double.requests


def test_it_honours_a_choices_and_a_requests_abort_also_before_the_kv(rig):
    rig.register()
    assert rig.transfer("r1", [0, 1], SamplingParams(max_tokens=1000)).accepted
    rig.steps(1)
    assert sorted(t.choice for _, t in rig.tokens(4)) == [0, 0, 1, 1]  # two steps
    rig.abort("r1", choice=1)  # a stop string matched choice 1 at the gateway
    rig.steps(3)
    assert [t.choice for _, t in rig.tokens(3)] == [0, 0, 0]  # choice 0 alone
    rig.abort("r1")
    rig.steps(1)
    assert not rig.double.requests

    rig.abort("r2")  # before its KV came: the transfer is taken and nothing runs
    rig.steps(1)
    assert rig.transfer("r2", [0], SamplingParams(max_tokens=1000)).accepted and not rig.double.requests
    assert rig.transfer("r3", [0], SamplingParams(max_tokens=2)).accepted  # and its one step
    # The next message: r3's one token past the first, finished; none of r1's or r2's came before it.
    [(rid, last)] = rig.tokens(1)
    assert (rid, last.finish_reason) == ("r3", int(FinishReason.LENGTH)) and not rig.double.requests


def test_its_last_word_is_a_final_deregister_that_reaches_the_gateway(rig):
    """Even behind a backlog the gateway has not read yet: the double closes its sockets on its way out, and what
    it queued, its Deregister last, still goes out."""
    rig.register()
    backlog = p.Tokens(list(range(50_000, 54_000)))  # about 12 KB
    channel = rig.double.links[0].channel
    for _ in range(BACKLOG_MESSAGES):
        rig.double.send_waiting(channel, backlog, "r1", None)
    rig.double.running = False
    rig.double.serve_forever()  # no turn: straight to its way out
    for _ in range(BACKLOG_MESSAGES):  # read raw: decoding each would outlast the double's linger
        assert rig.gateway.poll(int(WAIT_S * 1000)), "the backlog did not all arrive"
        rig.gateway.recv_multipart()
    assert rig.receive(rig.gateway).message == p.Deregister("dx", final=True)


def test_a_send_that_finds_the_queue_full_waits_for_room_and_is_counted(rig):
    """Where a real worker would drop the message (common/transport.py), a double waits, and counts the wait; one
    that finds no room within its timeout is counted unsent."""
    ctx = zmq.Context.instance()
    reader = ctx.socket(zmq.ROUTER)
    reader.setsockopt(zmq.RCVHWM, 2)
    reader.bind("inproc://synthetic-send-counts")
    sender = ctx.socket(zmq.DEALER)
    sender.setsockopt(zmq.SNDHWM, 2)
    sender.setsockopt(zmq.SNDTIMEO, int(WAIT_S * 1000))
    sender.connect("inproc://synthetic-send-counts")
    channel = Channel(sender, "test/sender")
    counts = rig.double.send_counts.counts

    def drain_once_a_send_waits() -> None:
        while not counts[WAITED]:
            time.sleep(0.001)
        for _ in range(10):
            assert reader.poll(int(WAIT_S * 1000))
            reader.recv_multipart()

    try:
        thread = threading.Thread(target=drain_once_a_send_waits)
        thread.start()
        for _ in range(10):  # 4 fit in the two queues; the 5th waits until the reader takes them
            rig.double.send_waiting(channel, p.Abort(), "r1", None)
        thread.join()
        assert rig.double.send_counts.snapshot() == {"sent": 10, "waited": counts[WAITED], "unsent": 0}
        assert counts[WAITED] >= 1

        sender.setsockopt(zmq.SNDTIMEO, 1)
        for _ in range(5):  # nobody reads now: 4 fit, the 5th waits 1 ms in vain
            rig.double.send_waiting(channel, p.Abort(), "r2", None)
        assert counts[UNSENT] == 1 and counts[SENT] == 15
    finally:
        sender.close(linger=0)
        reader.close(linger=0)

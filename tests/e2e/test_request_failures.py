"""Each kind of request-level failure, made to happen in real worker processes: the request fails with a clear
error to its gateway, and the process goes on serving the next one.

The workers are real processes (a tiny random model with the default tokenizer); the test plays their gateway
on a real ROUTER socket, so that it can send what a gateway never would, and see each reply."""

import time

import numpy as np
import pytest
import zmq

from kvferry.common import protocol as p
from kvferry.common.sampling import MAX_SEED, SamplingParams
from kvferry.common.transport import Channel
from tests.e2e.stack import Stack, tiny_stack

GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
PROMPT = list(range(100, 140))  # 40 tokens: two full blocks and a partial one


class FakeGateway:
    """The control socket a gateway binds: accepts registrations, sends requests, collects replies."""

    def __init__(self, address: str):
        self.sock = zmq.Context.instance().socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.bind(address)
        self.channel = Channel(self.sock, "fake-gateway")
        self.registered: dict[str, tuple[bytes, p.Register]] = {}
        self.inbox: list[p.Envelope] = []
        self.num = 0

    def pump(self, timeout: float = 0.1) -> None:
        if not self.sock.poll(int(timeout * 1000)):
            return
        while self.sock.poll(0):
            received = self.channel.recv()
            if received is None:
                continue
            peer, env = received
            if isinstance(env.message, p.Register):
                self.registered[env.message.worker_id] = (peer, env.message)
                self.channel.send(p.RegisterReply(True, "", 0.5, "fake-gw"), to=peer)
            elif not isinstance(env.message, (p.Heartbeat, p.CacheUpdate, p.Deregister)):
                self.inbox.append(env)

    def wait_registered(self, names: set[str], timeout: float = 120) -> None:
        deadline = time.monotonic() + timeout
        while not names <= set(self.registered):
            assert time.monotonic() < deadline, f"workers {names - set(self.registered)} never registered"
            self.pump()

    def send(self, worker: str, message, request_id: str) -> None:
        self.channel.send(message, request_id, to=self.registered[worker][0])

    def replies(self, request_id: str, until, timeout: float = 60) -> list:
        """Messages about request_id, until until(messages) holds."""
        deadline = time.monotonic() + timeout
        while True:
            got = [e.message for e in self.inbox if e.request_id == request_id]
            if until(got):
                return got
            assert time.monotonic() < deadline, f"{request_id}: only {got} came"
            self.pump()

    def new_id(self) -> str:
        self.num += 1
        return f"req-{self.num}"

    def request(self, decode_address: str, **fields) -> p.PrefillRequest:
        fields = {"prompt_token_ids": PROMPT, "sampling": GREEDY, "decode_worker_id": "decode-a", **fields}
        return p.PrefillRequest(decode_address=decode_address, deadline_s=time.time() + 120, **fields)


def failed(messages) -> bool:
    return any(isinstance(m, p.RequestFailed) for m in messages)


def finished(messages) -> bool:
    return failed(messages) or any(isinstance(m, p.Tokens) and m.finish_reason >= 0 for m in messages)


@pytest.fixture(scope="module")
def workers(tmp_path_factory):
    """A prefill and a decode worker serving the fake gateway, plus one of each whose second engine step fails."""
    stack = tiny_stack(tmp_path_factory.mktemp("failures"))
    gateway = FakeGateway(stack.control)
    faulty = {"KVFERRY_FAULTS": "fail_step=2"}
    try:
        stack.start_worker("prefill-a", "prefill")
        stack.start_worker("decode-a", "decode")
        stack.start_worker("prefill-f", "prefill", env=faulty)
        stack.start_worker("decode-f", "decode", env=faulty)
        gateway.wait_registered({"prefill-a", "decode-a", "prefill-f", "decode-f"})
        yield stack, gateway
    finally:
        stack.close()
        gateway.sock.close()


def kv_address(gateway: FakeGateway, worker: str) -> str:
    return gateway.registered[worker][1].kv_address


def serves(stack: Stack, gateway: FakeGateway, prefill="prefill-a", decode="decode-a") -> None:
    """A whole request still goes through the pair: first token from the prefill worker, the rest from decode."""
    rid = gateway.new_id()
    gateway.send(prefill, gateway.request(kv_address(gateway, decode), decode_worker_id=decode), rid)
    got = gateway.replies(rid, finished)
    assert not failed(got), got
    tokens = [
        t
        for m in got
        if isinstance(m, (p.FirstToken, p.Tokens))
        for t in ([m.token_id] if isinstance(m, p.FirstToken) else m.token_ids)
    ]
    assert len(tokens) == GREEDY.max_tokens
    assert all(stack.procs[name].poll() is None for name in stack.procs)


@pytest.mark.parametrize(
    "fields, code, says",
    [
        (dict(prompt_token_ids=[5, 10**7]), 400, "outside the vocabulary"),
        (dict(n=0), 400, "n must be"),
        (dict(n=2, resume_token_ids=[7]), 400, "exactly one choice"),
        (dict(prompt_token_ids=list(range(1, 9000))), 400, "more than this model's maximum"),
        (dict(sampling=SamplingParams(logit_bias=((10**7, 5.0),))), 400, "logit_bias"),
    ],
)
def test_a_bad_request_fails_alone_at_the_prefill_worker(workers, fields, code, says):
    stack, gateway = workers
    rid = gateway.new_id()
    gateway.send("prefill-a", gateway.request(kv_address(gateway, "decode-a"), **fields), rid)
    [reply] = gateway.replies(rid, failed)
    assert reply.code == code and says in reply.message, reply
    serves(stack, gateway)


def test_the_largest_seed_with_several_choices_is_served(workers):
    """seed 2**63 - 1 with n = 2 once made choice 1's seed overflow inside the step, ending the worker; each choice's
    seed now wraps round, and both choices finish."""
    stack, gateway = workers
    rid = gateway.new_id()
    sampling = SamplingParams(max_tokens=GREEDY.max_tokens, temperature=1.0, seed=MAX_SEED, ignore_eos=True)
    gateway.send("prefill-a", gateway.request(kv_address(gateway, "decode-a"), n=2, sampling=sampling), rid)
    both = lambda got: failed(got) or sum(isinstance(m, p.Tokens) and m.finish_reason >= 0 for m in got) == 2
    got = gateway.replies(rid, both)
    assert not failed(got), got
    assert {m.choice for m in got if isinstance(m, p.Tokens) and m.finish_reason >= 0} == {0, 1}
    serves(stack, gateway)


# Each is refused on arrival, by its form (common/peer_address.py), before anything is computed for it.
@pytest.mark.parametrize("address", ["tcp://no such host:1", "tcp://127.0.0.1:99999", "udp://127.0.0.1:1", "tcp://-:5"])
def test_a_decode_address_zeromq_cannot_use_fails_the_request_not_the_worker(workers, address):
    stack, gateway = workers
    rid = gateway.new_id()
    gateway.send("prefill-a", gateway.request(address), rid)
    reply = gateway.replies(rid, failed)[-1]
    assert reply.code == 503 and reply.retry and address in reply.message, reply  # the gateway moves it elsewhere
    serves(stack, gateway)


def test_a_failing_step_fails_its_requests_and_the_workers_serve_on(workers):
    """fail_step=2: the second engine step raises inside its compute, as a kernel or sampler error would."""
    stack, gateway = workers
    # The faulty prefill worker's first step serves this one; its second raises, and fails that request only.
    serves(stack, gateway, "prefill-f", "decode-a")
    rid = gateway.new_id()
    gateway.send("prefill-f", gateway.request(kv_address(gateway, "decode-a")), rid)
    [reply] = gateway.replies(rid, failed)
    assert reply.code == 500 and "prefill step failed" in reply.message and "KVFERRY_FAULTS" in reply.message
    serves(stack, gateway, "prefill-f", "decode-a")
    # The faulty decode worker's second step (its first is the first request's first decode step) fails mid-stream.
    rid = gateway.new_id()
    gateway.send("prefill-a", gateway.request(kv_address(gateway, "decode-f"), decode_worker_id="decode-f"), rid)
    got = gateway.replies(rid, finished)
    assert failed(got) and "decode step failed" in got[-1].message and got[-1].code == 500
    serves(stack, gateway, "prefill-a", "decode-f")


def kv_transfer(num_layers: int, shape: list[int], **fields) -> tuple[p.KVTransfer, list]:
    fields = {"prompt_token_ids": PROMPT, "output_token_ids": [9], "choices": [0], **fields}
    message = p.KVTransfer(
        prefill_worker_id="test",
        sampling=GREEDY,
        num_computed_tokens=len(fields["prompt_token_ids"]),
        dtype="float32",
        shape=shape,
        deadline_s=time.time() + 60,
        gateway_id="fake-gw",
        **fields,
    )
    return message, [np.zeros(int(np.prod(shape)), dtype=np.float32)]


@pytest.mark.parametrize(
    "shape, fields, says",
    [
        ([2, 3, 16, 2, 1, 64], {}, "KV of shape"),  # decodable, but not this model's heads
        ([2, 3, 16, 2, 2, 16], {"choices": [0, 0], "output_token_ids": [9, 9]}, "distinct choice"),
        ([2, 3, 16, 2, 2, 16], {"prompt_token_ids": [10**7] * 40}, "outside the vocabulary"),
        ([2, 3, 16, 2, 2, 16], {"choices": [500]}, "distinct choice"),
    ],
)
def test_a_malformed_transfer_is_refused_alone_by_the_decode_worker(workers, shape, fields, says):
    stack, gateway = workers
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(kv_address(gateway, "decode-a"))
    channel = Channel(sock, "test->decode")
    rid = gateway.new_id()
    try:
        message, frames = kv_transfer(2, shape, **fields)
        channel.send(message, rid, frames=frames)
        assert sock.poll(30_000), "no KVAck"
        ack = channel.recv()[1].message
        assert isinstance(ack, p.KVAck) and not ack.accepted and not ack.retry and says in ack.reason, ack
    finally:
        sock.close()
    [reply] = gateway.replies(rid, failed)
    assert reply.code == 400 and says in reply.message
    serves(stack, gateway)

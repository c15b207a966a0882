"""The gateway's control socket against misbehaving peers: the real GatewayCore in this process, and raw ZeroMQ
DEALER sockets on loopback playing the workers (a stuck one, a forger, a restarted one). No model is needed: the
gateway never runs one."""

import asyncio
import re
import time

import pytest
import zmq

from kvferry.common import protocol as p
from kvferry.common.sampling import SamplingParams
from kvferry.services.gateway.metrics import GatewayMetrics
from kvferry.services.gateway.server import Deadlines, GatewayCore

MODEL, BLOCK = "tiny", 16


class FakeWorker:
    """A DEALER that speaks the protocol as a worker would, and reads only when told to."""

    def __init__(self, core: GatewayCore, worker_id: str, role: p.Role, identity: str | None = None, hwm: int = 0):
        self.worker_id, self.role = worker_id, role
        self.sock = zmq.Context.instance().socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.IDENTITY, (identity or worker_id).encode())
        if hwm:  # a worker that stops reading fills its queues after this many messages
            self.sock.setsockopt(zmq.RCVHWM, hwm)
            self.sock.setsockopt(zmq.RCVBUF, 4096)
        self.sock.connect(core.control_endpoint)

    def send(self, message, request_id: str = "") -> None:
        self.sock.send_multipart(p.encode(message, request_id))

    def register(self, instance_id: str = "i1", kv_address: str = "tcp://127.0.0.1:5999") -> None:
        register = p.Register(
            int(self.role), self.worker_id, MODEL, "float32", BLOCK, 64, 1024, instance_id=instance_id
        )
        if self.role == p.Role.DECODE:
            register.kv_address = kv_address
        self.send(register)

    async def next(self, kind, timeout: float = 5.0):
        """The next message of that kind (others skipped), with its request id."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.sock.poll(0):
                env = p.decode(self.sock.recv_multipart())
                if isinstance(env.message, kind):
                    return env.message, env.request_id
            else:
                await asyncio.sleep(0.01)
        raise AssertionError(f"{self.worker_id}: no {kind.__name__} within {timeout} s")

    def close(self) -> None:
        self.sock.close(linger=0)


def run(test) -> None:
    """Run an async test against a fresh gateway on a free loopback port."""

    async def main():
        # Heartbeats are not what these tests are about: an interval long enough that no fake worker expires.
        core = GatewayCore("tcp://127.0.0.1:0", MODEL, BLOCK, heartbeat_interval_s=30, deadlines=Deadlines())
        core.start()
        try:
            await asyncio.wait_for(test(core), 60)  # a hang guard only
        finally:
            await core.stop()

    asyncio.run(main())


async def pair(core: GatewayCore) -> tuple[FakeWorker, FakeWorker]:
    prefill, decode = FakeWorker(core, "prefill-a", p.Role.PREFILL), FakeWorker(core, "decode-a", p.Role.DECODE)
    for worker in (prefill, decode):
        worker.register()
        reply, _ = await worker.next(p.RegisterReply)
        assert reply.accepted, reply.reason
    return prefill, decode


async def first_event(core: GatewayCore, stream):
    return await asyncio.wait_for(stream.__anext__(), 10)


def test_a_stuck_worker_does_not_hold_up_the_control_socket():
    async def test(core):
        stuck = FakeWorker(core, "prefill-stuck", p.Role.PREFILL, hwm=1)
        stuck.register()
        await stuck.next(p.RegisterReply)
        other = FakeWorker(core, "decode-a", p.Role.DECODE)
        other.register()
        await other.next(p.RegisterReply)
        # The stuck worker never reads again: its queues fill, and sends to it must fail, never wait.
        big = p.PrefillRequest(list(range(5000)), SamplingParams(), "decode-a", "tcp://127.0.0.1:1", 0.0)
        for _ in range(5000):
            if not await asyncio.wait_for(core._send(big, b"prefill-stuck", "r"), 2):
                break
        else:
            raise AssertionError("the stuck worker's queue never filled: nothing was tested")
        assert await asyncio.wait_for(core._send(p.Abort(), b"decode-a", "r2"), 2)
        message, rid = await other.next(p.Abort)
        assert rid == "r2"

    run(test)


def test_messages_from_connections_that_did_not_register_the_worker_are_dropped_and_counted():
    async def test(core):
        prefill, decode = await pair(core)
        forger = FakeWorker(core, "forger", p.Role.DECODE, identity="nobody-1")
        # An unhealthy heartbeat in a real worker's name would have it dropped and its requests moved.
        stats = p.WorkerStats(64, 64, 0, 0, 0)
        forger.send(p.Heartbeat("decode-a", stats, healthy=False))
        forger.send(p.Deregister("prefill-a", final=True))
        forger.send(p.CacheUpdate("prefill-a", [b"x" * 16], full=True))
        await asyncio.sleep(0.3)
        assert set(core.registry.workers) == {"prefill-a", "decode-a"}
        assert core.registry.workers["prefill-a"].cached == set()
        assert core.num_forged == 3
        assert b"kvferry:forged_messages_total 3.0" in GatewayMetrics(core).exposition()

        stream = core.generate([1, 2, 3], SamplingParams(max_tokens=4, temperature=0), "req-1")
        pending = asyncio.ensure_future(first_event(core, stream))
        request, rid = await prefill.next(p.PrefillRequest)
        # A forged failure and forged tokens for a request assigned to other workers change nothing.
        forger.send(p.RequestFailed("forged", 500), rid)
        forger.send(p.FirstToken(7, finish_reason=0), rid)
        # The prefill worker's heartbeat connection may not speak for the request either: only its control one.
        await asyncio.sleep(0.2)
        prefill.send(p.FirstToken(5), rid)
        event = await pending
        assert event.error is None and event.token_ids == [5]
        decode.send(p.Tokens([6, 7, 8], finish_reason=1, start=1), rid)
        events = [e async for e in stream]
        assert [t for e in events for t in e.token_ids] == [6, 7, 8] and events[-1].error is None
        assert core.num_forged == 5

    run(test)


def test_a_worker_id_claimed_from_another_socket_is_refused_but_a_restart_moves_its_requests_at_once():
    async def test(core):
        prefill, decode = await pair(core)
        impostor = FakeWorker(core, "decode-a", p.Role.DECODE, identity="impostor")
        impostor.register(instance_id="i9")  # a socket not named after the worker id it claims
        reply, _ = await impostor.next(p.RegisterReply)
        assert not reply.accepted and "control socket" in reply.reason
        assert core.registry.workers["decode-a"].instance_id == "i1"

        stream = core.generate([1, 2, 3], SamplingParams(max_tokens=8, temperature=0), "req-2")
        pending = asyncio.ensure_future(first_event(core, stream))
        _, rid = await prefill.next(p.PrefillRequest)
        prefill.send(p.FirstToken(5), rid)
        assert (await pending).token_ids == [5]
        reading = asyncio.ensure_future(first_event(core, stream))  # the reader waits for the next tokens
        # decode-a restarts (a new process, a new instance id): the request moves now, not at its step deadline.
        # The new process connects before the gateway has seen the old connection end (ROUTER_HANDOVER).
        restarted = FakeWorker(core, "decode-a", p.Role.DECODE)
        restarted.register(instance_id="i2")
        reply, _ = await restarted.next(p.RegisterReply)
        assert reply.accepted
        moved, _ = await prefill.next(p.PrefillRequest, timeout=3)
        assert moved.attempt == 1 and moved.resume_token_ids == [5]
        reading.cancel()
        decode.close()

    run(test)


def test_a_decode_worker_with_an_unusable_kv_address_is_refused_at_registration():
    async def test(core):
        decode = FakeWorker(core, "decode-bad", p.Role.DECODE)
        decode.register(kv_address="tcp://no such host!:1")
        reply, _ = await decode.next(p.RegisterReply)
        assert not reply.accepted and "KV ingress address" in reply.reason
        assert "decode-bad" not in core.registry.workers

    run(test)


def test_a_request_past_the_wire_bound_is_refused_before_anything_is_sent():
    """A prompt longer than any message may carry (the HTTP layer answers 400 naming the field) never reaches a
    worker, and leaves nothing behind."""

    async def test(core):
        prefill, _ = await pair(core)
        # Token ids as wide as the wire's bound assumes, and more of them than it allows.
        prompt = [2**31] * (p.MAX_CONTEXT_TOKENS + 50_000)
        stream = core.generate(prompt, SamplingParams(max_tokens=1), "req-big")
        with pytest.raises(p.MessageTooLarge) as refused:
            await stream.__anext__()
        assert refused.value.field == "prompt_token_ids" and not core.flights
        assert not prefill.sock.poll(200)

    run(test)


def test_a_worker_learns_the_gateways_id_which_carries_64_random_bits():
    """Workers shared by several gateways route replies by it: 32 bits would let two of many gateways draw one."""

    async def test(core):
        worker = FakeWorker(core, "prefill-a", p.Role.PREFILL)
        worker.register()
        reply, _ = await worker.next(p.RegisterReply)
        assert reply.gateway_id == core.gateway_id and re.fullmatch(r"gw-[0-9a-f]{16}", reply.gateway_id), reply

    run(test)


def test_with_several_gateway_processes_every_series_names_the_gateway_that_answered():
    async def test(core):
        await pair(core)
        metrics = GatewayMetrics(core, gateway_index=1)
        metrics.request_success.labels("stop").inc()
        lines = [line for line in metrics.exposition().decode().splitlines() if not line.startswith("#")]
        # The process's index, the same at every start, not its id: a restart continues its series.
        assert len(lines) > 50 and all('gateway="1"' in line for line in lines), lines
        assert 'kvferry:request_success_total{finished_reason="stop",gateway="1"} 1.0' in lines
        running = 'kvferry:num_requests_running{gateway="1",role="decode",worker="decode-a"} 0.0'
        assert running in lines  # a worker's series keep their own labels beside it
        assert b"gateway=" not in GatewayMetrics(core).exposition()  # one gateway's output is as it was

    run(test)

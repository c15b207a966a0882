"""With CURVE on, what a worker may say is bound to the key it connected with: a key registers only as the role it
was admitted for, and a worker id registered under one key is that key's while the worker lives (no other key
re-registers it, heartbeats for it or speaks for it). The real GatewayCore with its authenticator, and raw CURVE
DEALER sockets on loopback playing the workers, each with a key of its own from `kvferry keys --client`."""

import asyncio
import time

import pytest
import zmq
import zmq.asyncio

from kvferry.common import protocol as p
from kvferry.common.curve import KV_CLIENTS, CurveKeys, add_client, generate
from kvferry.services.gateway.server import Deadlines, GatewayCore

MODEL, BLOCK = "tiny", 16
KEYS = {"prefill-1": "prefill", "prefill-2": "prefill", "decode-1": "decode"}


@pytest.fixture(scope="module")
def keys(tmp_path_factory):
    folder = tmp_path_factory.mktemp("binding") / "keys"
    generate(folder)
    for name, role in KEYS.items():
        add_client(folder, name, role)
    return folder


class KeyedWorker:
    """A DEALER presenting one client key, named `identity` (default: the worker id it speaks for)."""

    def __init__(self, core, ctx, keys, key: str, worker_id: str, role: p.Role, identity: str | None = None):
        self.worker_id, self.role = worker_id, role
        self.sock = ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.IDENTITY, (identity or worker_id).encode())
        CurveKeys.load(keys, client=key, admits=None).connect(self.sock)
        self.sock.connect(core.control_endpoint)

    def send(self, message) -> None:
        self.sock.send_multipart(p.encode(message))

    def register(self, instance_id: str = "i1") -> None:
        kv = "tcp://127.0.0.1:5999" if self.role == p.Role.DECODE else ""
        self.send(
            p.Register(int(self.role), self.worker_id, MODEL, "float32", BLOCK, 64, 1024, kv, "none", instance_id)
        )

    async def reply(self, timeout: float = 10.0) -> p.RegisterReply:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.sock.poll(0):
                env = p.decode(self.sock.recv_multipart())
                if isinstance(env.message, p.RegisterReply):
                    return env.message
            await asyncio.sleep(0.01)
        raise AssertionError(f"{self.worker_id}: no RegisterReply within {timeout} s")


ZAP_ENDPOINT = "inproc://zeromq.zap.01"  # one authenticator per context: the one the gateways of these tests share


def wait_for_zap_endpoint(timeout: float = 10.0) -> None:
    """The previous test's authenticator closed its socket, and ZeroMQ frees an inproc name only later (a closed
    socket is reaped by a thread of its own): wait until it is free, as a guard against a hang, not a timing."""
    ctx = zmq.Context.shadow(zmq.asyncio.Context.instance().underlying)
    deadline = time.monotonic() + timeout
    while True:
        probe = ctx.socket(zmq.REP)
        try:
            probe.bind(ZAP_ENDPOINT)
            probe.unbind(ZAP_ENDPOINT)  # an unbind frees the name at once, unlike a close
            return
        except zmq.ZMQError:
            assert time.monotonic() < deadline, f"{ZAP_ENDPOINT} still bound"
            time.sleep(0.05)
        finally:
            probe.close(0)


def run(keys, test) -> None:
    async def main():
        wait_for_zap_endpoint()
        core = GatewayCore(
            "tcp://127.0.0.1:0",
            MODEL,
            BLOCK,
            heartbeat_interval_s=30,
            deadlines=Deadlines(),
            curve=CurveKeys.load(keys),
        )
        core.start()
        ctx = zmq.Context()
        try:
            await asyncio.wait_for(test(core, lambda *a, **k: KeyedWorker(core, ctx, keys, *a, **k)), 60)  # hang guard
        finally:
            ctx.destroy(linger=0)
            await core.stop()

    asyncio.run(main())


async def settle(condition=lambda: True, timeout: float = 10.0) -> None:
    """Let the gateway handle what was sent: until condition holds (a guard against a hang, not a timing)."""
    deadline = time.monotonic() + timeout
    await asyncio.sleep(0.3)
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.05)


def test_a_key_registers_only_as_the_role_it_was_admitted_for(keys):
    async def test(core, worker):
        forger = worker("decode-1", "p-forged", p.Role.PREFILL)  # a decode worker's key, claiming to be prefill
        forger.register()
        reply = await forger.reply()
        assert not reply.accepted and "decode-1" in reply.reason and "prefill" in reply.reason
        assert core.registry.live(p.Role.PREFILL) == [] and core.num_forged == 1
        for key, worker_id, role in (("prefill-1", "p-1", p.Role.PREFILL), ("decode-1", "d-1", p.Role.DECODE)):
            honest = worker(key, worker_id, role)
            honest.register()
            assert (await honest.reply()).accepted
        assert [w.worker_id for w in core.registry.live(p.Role.PREFILL)] == ["p-1"]
        assert core.num_forged == 1

    run(keys, test)


def test_a_worker_id_registered_under_one_key_is_not_taken_over_by_another(keys):
    async def test(core, worker):
        real = worker("prefill-1", "prefill-a", p.Role.PREFILL)
        real.register(instance_id="i1")
        assert (await real.reply()).accepted
        # Another prefill key, on a socket named after the live worker: the name stays with the real connection, so
        # what the rival sends never reaches the gateway.
        rival = worker("prefill-2", "prefill-a", p.Role.PREFILL)
        rival.register(instance_id="i9")
        with pytest.raises(AssertionError, match="no RegisterReply"):
            await rival.reply(timeout=2)
        rival.sock.close(0)
        real.sock.close(0)  # the real worker's connection ends, its registration lives on until its heartbeats stop
        await asyncio.sleep(0.5)
        # Now the name is free: the rival claims the id, as a restart (a new instance, which would evict the real
        # one) and as the same instance.
        for instance_id in ("i9", "i1"):
            rival = worker("prefill-2", "prefill-a", p.Role.PREFILL)
            rival.register(instance_id=instance_id)
            reply = await rival.reply()
            assert not reply.accepted and "another key" in reply.reason
            rival.sock.close(0)
            await asyncio.sleep(0.3)
        worker_info = core.registry.workers["prefill-a"]
        assert worker_info.instance_id == "i1" and core.num_forged == 2
        # The key that registered it restarts it: a new instance under the same key is taken at once.
        restarted = worker("prefill-1", "prefill-a", p.Role.PREFILL)
        restarted.register(instance_id="i2")
        assert (await restarted.reply()).accepted
        assert core.registry.workers["prefill-a"].instance_id == "i2"

    run(keys, test)


def test_heartbeats_and_cache_updates_for_a_worker_from_another_key_are_ignored(keys):
    async def test(core, worker):
        real = worker("prefill-1", "prefill-a", p.Role.PREFILL)
        real.register()
        assert (await real.reply()).accepted
        before = core.registry.workers["prefill-a"].stats
        # From the real worker's heartbeat socket name, under another key: stats that would attract every request,
        # then an unhealthy heartbeat that would drop it, a cache that would attract prefixes, and a deregistration.
        forger = worker("prefill-2", "prefill-a", p.Role.PREFILL, identity="prefill-a/heartbeat")
        forger.send(p.Heartbeat("prefill-a", p.WorkerStats(10**6, 10**6, 0, 0, 0)))
        forger.send(p.Heartbeat("prefill-a", p.WorkerStats(0, 64, 0, 0, 0), healthy=False))
        await settle(lambda: core.num_forged >= 2)
        forger.sock.close(0)
        await asyncio.sleep(0.3)  # the name is free again (a live worker's own names are never handed over)
        impostor = worker("decode-1", "prefill-a", p.Role.PREFILL, identity="prefill-a/heartbeat")
        impostor.send(p.CacheUpdate("prefill-a", [b"x" * 16], full=True))
        impostor.send(p.Deregister("prefill-a", final=True))
        await settle(lambda: core.num_forged >= 4)
        assert core.num_forged == 4
        info = core.registry.workers["prefill-a"]
        assert info.stats == before and info.cached == set() and not info.draining
        impostor.sock.close(0)
        await asyncio.sleep(0.3)
        # The key that registered it is heard.
        honest = worker("prefill-1", "prefill-a", p.Role.PREFILL, identity="prefill-a/heartbeat")
        honest.send(p.Heartbeat("prefill-a", p.WorkerStats(7, 64, 0, 0, 0)))
        await settle(lambda: core.registry.workers["prefill-a"].stats.num_free_blocks == 7)
        assert core.num_forged == 4

    run(keys, test)


def test_a_kv_ingress_admits_a_prefill_workers_own_key_but_no_decode_key(keys):
    """A decode worker's KV ingress admits kv-clients/ only: a per-worker prefill key is there, a decode one is not."""
    kv_ingress = CurveKeys.load(keys, client="decode-1", admits=KV_CLIENTS)
    assert {holder.name for holder in kv_ingress.admitted.values()} == {"prefill", "prefill-1", "prefill-2"}
    assert {holder.role for holder in kv_ingress.admitted.values()} == {"prefill"}


def test_a_connection_named_after_a_live_worker_does_not_take_its_messages(keys):
    """Another admitted key connects a socket named after a registered worker: ZeroMQ would hand the name over to it
    (ROUTER_HANDOVER), and with it every message the gateway sends that worker. Under CURVE the name stays with the
    connection that registered it."""

    async def test(core, worker):
        real = worker("prefill-1", "p-1", p.Role.PREFILL)
        real.register()
        assert (await real.reply()).accepted
        rival = worker("prefill-2", "p-1", p.Role.PREFILL)  # the same socket name, under another key
        rival.register()  # its handshake done, and a frame sent
        await settle()
        assert await core._send(p.RegisterReply(True, "", 30.0, core.gateway_id), b"p-1")
        assert (await real.reply()).accepted  # the gateway's message reached the worker that registered
        await asyncio.sleep(0.5)
        assert not rival.sock.poll(0)  # and nothing reached the rival, not even its own refusal
        assert "p-1" in core.registry.workers

    run(keys, test)

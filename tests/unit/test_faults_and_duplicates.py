"""KVFERRY_FAULTS and duplicate dropping, over real ZeroMQ sockets."""

import pytest
import zmq

from kvferry.common import faults
from kvferry.common import protocol as p
from kvferry.common.errors import ConfigError
from kvferry.common.transport import Channel


def test_the_spec_parses_and_refuses_what_it_does_not_know():
    spec = faults.FaultSpec.parse("drop=0.02, dup=0.5,delay_ms=5,seed=7")
    assert (spec.drop, spec.dup, spec.delay_ms, spec.seed) == (0.02, 0.5, 5.0, 7) and spec.touches_messages
    assert not faults.FaultSpec.parse("stall_after_steps=3,stall_s=2").touches_messages
    assert faults.FaultSpec.parse("step_delay_ms=25").step_delay_ms == 25.0
    for bad in ("drop", "lose=0.1", "drop=x", "drop=2", "delay_ms=-1", "seed=1.5", "step_delay_ms=-5"):
        with pytest.raises(ConfigError, match="KVFERRY_FAULTS"):
            faults.FaultSpec.parse(bad)


def test_faults_are_deterministic_for_a_seed_and_differ_between_seeds():
    def draws(seed, name="chan"):
        f = faults.MessageFaults(faults.FaultSpec(drop=0.2, dup=0.2, delay_ms=5, seed=seed), name)
        return [f.plan() for _ in range(500)]

    assert draws(7) == draws(7)
    assert draws(7) != draws(8) and draws(7) != draws(7, "other")
    plans = draws(7)
    dropped, doubled = sum(c == 0 for c, _ in plans), sum(c == 2 for c, _ in plans)
    assert 60 < dropped < 140 and 50 < doubled < 130  # about 20% each (of the 80% not dropped, for dup)
    assert all(0 <= wait <= 0.005 for _, wait in plans)


def pair(name):
    ctx = zmq.Context.instance()
    a, b = ctx.socket(zmq.PAIR), ctx.socket(zmq.PAIR)
    a.bind(f"inproc://{name}")
    b.connect(f"inproc://{name}")
    return Channel(a, "sender"), Channel(b, "receiver")


def receive_all(channel):
    got = []
    while channel.socket.poll(100):
        received = channel.recv()
        if received is not None:
            got.append(received[1])
    return got


def test_duplicates_and_drops_happen_on_send_and_copies_are_dropped_on_receive(monkeypatch):
    monkeypatch.setenv(faults.ENV, "drop=0.1,dup=0.3,seed=3")
    sender, receiver = pair("faults")
    try:
        for i in range(300):
            sender.send(p.Tokens([i], start=i), f"r{i}")
        got = receive_all(receiver)
        ids = [env.message.start for env in got]
        assert ids == sorted(set(ids)), "every message arrives at most once, in order"
        assert len(ids) == 300 - sender.faults.num_dropped
        assert receiver.num_duplicates == sender.faults.num_duplicated > 30
    finally:
        sender.close(), receiver.close()


def test_a_resend_is_a_new_message_and_a_replayed_frame_is_a_duplicate(monkeypatch):
    monkeypatch.delenv(faults.ENV, raising=False)
    sender, receiver = pair("replay")
    try:
        assert sender.faults is None
        parts, ctx = sender.pack(p.Abort(), "r")
        for _ in range(3):  # the same bytes three times: a replay
            sender.socket.send_multipart(parts)
        sender.send(p.Abort(), "r")  # sent again by the sender: its own id
        got = receive_all(receiver)
        assert [env.trace.span_id for env in got][0] == ctx.span_id and len(got) == 2
        assert receiver.num_duplicates == 2
    finally:
        sender.close(), receiver.close()


def test_curve_keys_are_written_loaded_and_checked(tmp_path):
    from kvferry.common.curve import CurveKeys, generate

    files = generate(tmp_path / "k")
    assert {f.name for f in files} >= {"server.key", "server.key_secret", "prefill.key", "prefill.key_secret"}
    keys, worker = CurveKeys.load(tmp_path / "k"), CurveKeys.load(tmp_path / "k", client="prefill", admits=None)
    assert len(keys.server_public) == 40 and worker.client_secret != keys.server_secret
    assert CurveKeys.load(None) is None
    with pytest.raises(ConfigError, match="kvferry keys"):
        CurveKeys.load(tmp_path / "missing")
    # A server and a client with the keys talk; a plain (NULL-mechanism) client cannot: the server speaks CURVE.
    # (More in test_curve_keys.py.)
    from zmq.utils.monitor import recv_monitor_message

    ctx = zmq.Context.instance()
    auth = keys.authenticator(ctx)
    server, client, plain = ctx.socket(zmq.ROUTER), ctx.socket(zmq.DEALER), ctx.socket(zmq.DEALER)
    monitor = plain.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL)
    try:
        keys.serve(server)
        port = server.bind_to_random_port("tcp://127.0.0.1")
        plain.connect(f"tcp://127.0.0.1:{port}")
        plain.send(b"plain")  # queued on the client: the handshake it needs never succeeds
        assert monitor.poll(5000), "no handshake event for the plain client"
        event = recv_monitor_message(monitor)
        assert event["event"] == zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL, event
        assert event["value"] == zmq.PROTOCOL_ERROR_ZMTP_MECHANISM_MISMATCH, event
        worker.connect(client)
        client.connect(f"tcp://127.0.0.1:{port}")
        client.send(b"hello")
        assert server.poll(5000) and server.recv_multipart()[1] == b"hello"
        assert not server.poll(0), "the plain client's message got through"
    finally:
        plain.disable_monitor()
        for sock in (monitor, server, client, plain):
            sock.close(0)
        auth.stop()

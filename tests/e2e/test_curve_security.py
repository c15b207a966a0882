"""Closed by default, on real processes and sockets: a ZeroMQ bind beyond loopback without keys refuses to start
(unless --insecure), a worker whose key was revoked never registers and both sides log why, and a decode worker's KV
ingress takes prefill keys only."""

import shutil
import subprocess
import sys

import pytest
import zmq
import zmq.auth
from zmq.utils.monitor import recv_monitor_message

from kvferry.common.curve import CurveKeys
from tests.e2e.stack import Stack
from tests.tiny_models import save_tiny_chat_model

BODY = {"prompt": "Hello", "max_tokens": 4, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> str:
    folder = tmp_path_factory.mktemp("model") / "tiny-chat"
    save_tiny_chat_model(folder)
    return str(folder)


def kvferry(*args: str, env: dict | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "kvferry.tools.cli", *args], capture_output=True, text=True, timeout=timeout, env=env
    )


def public_key(path) -> str:
    return zmq.auth.load_certificate(path)[0].decode()


def test_a_zeromq_bind_beyond_loopback_needs_keys_or_insecure(make_stack, tiny):
    stack: Stack = make_stack(model=tiny)
    exposed = f"tcp://0.0.0.0:{stack.control_port}"
    for args in (
        ["gateway", "--port", str(stack.port), "--control", exposed],
        ["decode", "--gateway", stack.control, "--kv-bind", "tcp://0.0.0.0:0"],
    ):
        done = kvferry(*args, env=stack.env)
        assert done.returncode == 2, done.stderr[-2000:]
        [line] = [line for line in done.stderr.splitlines() if line.startswith("kvferry: error:")]
        for fix in ("without CURVE", "--curve-keys", "kvferry keys DIR", "--insecure"):
            assert fix in line, (fix, line)
    # --insecure (flag or variable) starts them, with a loud warning, and they serve.
    stack.start("gateway", "gateway", "--port", str(stack.port), "--control", exposed, "--insecure")
    stack.start_worker("prefill-a", "prefill")
    stack.start_worker("decode-a", "decode", "--kv-bind", "tcp://0.0.0.0:0", "--advertise-host", "127.0.0.1",
                       env={"KVFERRY_INSECURE": "1"})  # fmt: skip
    stack.wait_for(lambda: stack.get("/health")[0] == 200, 180, "the insecure stack healthy")
    status, reply = stack.post("/v1/completions", BODY)
    assert status == 200 and reply["usage"]["completion_tokens"] == 4, reply
    for name in ("gateway", "decode-a"):
        assert "INSECURE (--insecure (KVFERRY_INSECURE))" in stack.log(name), name


def test_a_worker_with_a_revoked_key_is_refused_and_both_sides_say_so(make_stack, tiny, tmp_path):
    keys, rogue = tmp_path / "keys", tmp_path / "rogue-keys"
    assert kvferry("keys", str(keys)).returncode == 0
    assert kvferry("keys", str(keys), "--client", "rogue", "--role", "prefill").returncode == 0
    rogue.mkdir()  # what the worker's machine holds: the servers' public key and its own pair
    for name in ("server.key", "rogue.key", "rogue.key_secret"):
        shutil.copy2(keys / name, rogue / name)
    done = kvferry("keys", str(keys), "--revoke", "rogue")
    assert done.returncode == 0 and "restart the servers" in done.stdout
    stack: Stack = make_stack(model=tiny, extra_env={"KVFERRY_CURVE_KEYS": str(keys)})
    stack.start_gateway()
    stack.start_worker("prefill-a", "prefill")
    stack.start_worker("rogue", "prefill", env={"KVFERRY_CURVE_KEYS": str(rogue), "KVFERRY_CURVE_CLIENT": "rogue"})
    stack.wait_workers({"prefill-a"})
    rogue_key = public_key(rogue / "rogue.key")
    stack.wait_for(
        lambda: rogue_key in stack.log("gateway") and "refused this worker's CURVE key 'rogue'" in stack.log("rogue"),
        120,
        "both sides to log the refusal",
    )
    [refusal] = [line for line in stack.log("gateway").splitlines() if rogue_key in line]
    assert "refused a client at 127.0.0.1" in refusal and "not admitted" in refusal
    [client_side] = [line for line in stack.log("rogue").splitlines() if "refused this worker's CURVE key" in line]
    assert "ERROR" in client_side and "--curve-client" in client_side and "kvferry keys DIR --client" in client_side
    assert stack.procs["rogue"].poll() is None and set(stack.workers()) == {"prefill-a"}
    assert stack.get("/v1/workers")[1]["gateway"]["protocol_errors"] == 0


def test_a_kv_ingress_admits_prefill_keys_and_refuses_a_decode_key(make_stack, tiny, tmp_path):
    keys = tmp_path / "keys"
    assert kvferry("keys", str(keys)).returncode == 0
    stack: Stack = make_stack(model=tiny, extra_env={"KVFERRY_CURVE_KEYS": str(keys)}).start_pair()
    status, reply = stack.post("/v1/completions", BODY)  # the prefill worker's KV got in
    assert status == 200 and reply["usage"]["completion_tokens"] == 4, reply
    kv_address = stack.workers()["decode-a"]["kv_address"]
    ctx = zmq.Context.instance()

    def knock(client: str) -> zmq.Socket:
        """A raw socket with this client pair, one message sent to the KV ingress; returns its monitor."""
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        CurveKeys.load(keys, client=client, admits=None).connect(sock)
        monitor = sock.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_HANDSHAKE_FAILED_AUTH)
        sock.connect(kv_address)
        sock.send_multipart([b"not a message"])
        sockets.append(sock)
        return monitor

    sockets: list[zmq.Socket] = []
    try:
        refused, admitted = knock("decode"), knock("prefill")
        assert refused.poll(10_000) and recv_monitor_message(refused)["event"] == zmq.EVENT_HANDSHAKE_FAILED_AUTH
        assert admitted.poll(10_000) and recv_monitor_message(admitted)["event"] == zmq.EVENT_HANDSHAKE_SUCCEEDED
        # Only the prefill key's garbage reached the decode worker (and was counted as a protocol error).
        stack.wait_for(lambda: stack.workers()["decode-a"]["protocol_errors"] == 1, 30, "the admitted garbage counted")
        decode_key = public_key(keys / "decode.key")
        stack.wait_for(lambda: decode_key in stack.log("decode-a"), 30, "the decode worker to log the refusal")
        assert "kv-clients" in next(line for line in stack.log("decode-a").splitlines() if decode_key in line)
    finally:
        for sock in sockets:
            sock.close(0)
    assert stack.post("/v1/completions", BODY)[0] == 200  # and the pair serves on

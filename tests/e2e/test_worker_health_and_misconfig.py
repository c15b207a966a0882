"""What Kubernetes probes read from a worker (`--health-port`), `kvferry health`, and misconfiguration that must
fail fast with a message naming the setting. Real processes, real ports."""

import json
import socket
import subprocess
import sys
import threading
import urllib.error
import urllib.request

import pytest

from kvferry.services.launcher import free_port
from tests.e2e.stack import Stack

pytestmark = pytest.mark.slow


def probe(port: int, path: str) -> tuple[int, dict]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as reply:
            return reply.status, json.loads(reply.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def kvferry(*args: str, env: dict | None = None, timeout: float = 240) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "kvferry.tools.cli", *args], capture_output=True, text=True, timeout=timeout, env=env
    )


def test_worker_health_says_registered_and_stepping_and_catches_a_stuck_loop(make_stack):
    stack: Stack = make_stack()
    prefill_health, decode_health = free_port(), free_port()
    # Its first step sleeps 8 s: with --stall-timeout 2 the loop counts as stuck for about 6 s of it.
    stack.start_worker(
        "prefill-h",
        "prefill",
        "--health-port",
        str(prefill_health),
        "--stall-timeout",
        "2",
        env={"KVFERRY_FAULTS": "stall_after_steps=1,stall_s=8"},
    )
    stack.start_worker("decode-h", "decode", env={"KVFERRY_HEALTH_PORT": str(decode_health)})
    # No gateway yet: the loop turns (live) but nothing has accepted the worker (not ready).
    stack.wait_for(lambda: probe(prefill_health, "/live")[0] == 200, 180, "prefill worker live")
    status, body = probe(prefill_health, "/health")
    assert (status, body["status"], body["registered_with"]) == (503, "registering", [])
    stack.start_gateway()
    for port in (prefill_health, decode_health):
        stack.wait_for(lambda port=port: probe(port, "/health")[0] == 200, 60, "workers ready")
    status, body = probe(decode_health, "/health")
    assert body["role"] == "decode" and body["worker_id"] == "decode-h" and body["registered_with"] == [stack.control]
    assert probe(decode_health, "/nowhere")[0] == 404

    # `kvferry health` (the image's HEALTHCHECK) asks the worker port first, then the gateway's.
    env = {**stack.env, "KVFERRY_HEALTH_PORT": str(decode_health), "KVFERRY_PORT": "1"}
    assert kvferry("health", env=env).returncode == 0
    image_check = subprocess.run(
        [sys.executable, "-m", "kvferry.services.health_probe"], capture_output=True, text=True, timeout=60, env=env
    )  # the Dockerfile's HEALTHCHECK
    assert image_check.returncode == 0 and f"{decode_health}/health: 200" in image_check.stdout
    assert (
        "torch"
        not in subprocess.run(
            [sys.executable, "-c", "import sys, kvferry.services.health_probe; print(sorted(sys.modules))"],
            capture_output=True,
            text=True,
            timeout=60,
        ).stdout
    ), "the health check stays light"
    env = {**stack.env, "KVFERRY_HEALTH_PORT": str(free_port()), "KVFERRY_PORT": str(stack.port)}
    done = kvferry("health", env=env)
    assert done.returncode == 0 and f"127.0.0.1:{stack.port}/health: 200" in done.stdout
    env = {**stack.env, "KVFERRY_HEALTH_PORT": str(free_port()), "KVFERRY_PORT": str(free_port())}
    done = kvferry("health", env=env)
    assert done.returncode == 1 and "nothing answers" in done.stderr

    reply = {}
    request = threading.Thread(
        target=lambda: reply.update(
            result=stack.post("/v1/completions", {"prompt": "Hello", "max_tokens": 4}, timeout=120)
        )
    )
    request.start()
    stack.wait_for(lambda: probe(prefill_health, "/live")[0] == 503, 30, "the stuck loop to fail /live")
    status, body = probe(prefill_health, "/health")
    assert status == 503 and body["status"] == "stuck" and body["loop_age_s"] >= 2
    request.join(120)
    assert reply["result"][0] == 200, reply
    # The stall began after the step that sent the prompt's KV on: the loop comes round again when it ends.
    stack.wait_for(lambda: probe(prefill_health, "/live")[0] == 200, 30, "the loop to come round again")
    stack.wait_for(lambda: probe(prefill_health, "/health")[0] == 200, 30, "ready again")


def test_a_port_in_use_fails_at_once_naming_the_setting(tmp_path):
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    port = taken.getsockname()[1]
    try:
        for args, setting in (
            (["gateway", "--port", str(port), "--control", f"tcp://127.0.0.1:{free_port()}"], "--port (KVFERRY_PORT)"),
            (
                ["gateway", "--port", str(free_port()), "--control", f"tcp://127.0.0.1:{port}"],
                "--control (KVFERRY_CONTROL)",
            ),
            (["prefill", "--health-port", str(port)], "--health-port (KVFERRY_HEALTH_PORT)"),
            (["decode", "--kv-bind", f"tcp://127.0.0.1:{port}"], "--kv-bind (KVFERRY_KV_BIND)"),
        ):
            done = kvferry(*args)
            assert done.returncode == 2, done.stderr[-2000:]
            assert f"kvferry: error: {setting}: cannot listen on" in done.stderr
            assert "Address already in use" in done.stderr and "choose a free port" in done.stderr
    finally:
        taken.close()


def test_a_worker_pointed_at_an_unreachable_gateway_retries_and_says_so(make_stack):
    stack = make_stack()
    nowhere = f"tcp://127.0.0.1:{free_port()}"
    proc = stack.start("lost", "prefill", "--gateway", nowhere, "--worker-id", "lost")
    stack.wait_for(lambda: "(attempt 3)" in stack.log("lost"), 180, "three registration attempts")
    assert proc.poll() is None, "it keeps trying: a gateway that starts late still gets it"
    lines = [line for line in stack.log("lost").splitlines() if "no answer from the gateway" in line]
    assert nowhere in lines[0] and "check --gateway (KVFERRY_GATEWAY)" in lines[0]
    waits = [float(line.split("trying again in ")[1].split(" s")[0]) for line in lines]
    assert waits == sorted(waits) and waits[-1] > waits[0], "the waits between attempts grow"


def test_a_worker_with_another_model_is_refused_naming_the_setting(make_stack, tmp_path):
    from tests.tiny_models import save_tiny_model

    save_tiny_model("llama", tmp_path / "other-model")
    stack = make_stack()
    stack.start_gateway()
    proc = stack.start_worker("odd-model", "prefill", "--model", str(tmp_path / "other-model"))
    assert proc.wait(timeout=180) == 2
    for log in (stack.log("odd-model"), stack.log("gateway")):
        assert "model mismatch: the gateway serves 'SmolLM2-135M-Instruct', the worker has 'other-model'" in log
        assert "the same --model (KVFERRY_MODEL)" in log

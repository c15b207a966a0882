"""Three hosts on one machine: the gateway, a prefill worker and a decode worker, each in its own network
namespace, joined by veth links with their own addresses. Completions cross real TCP links, the KV
transfer included (prefill host to decode host); then the decode host is cut off and brought back."""

import concurrent.futures
import time

import pytest

from kvferry.common.curve import generate
from tests.e2e.netns import Hosts, ensure_ip
from tests.e2e.stack import Stack, engine_texts
from tests.environment import lacking

pytestmark = pytest.mark.slow
BODY = {"temperature": 0, "ignore_eos": True}
PROMPTS = ["The capital of France is", "Once upon a time,", "def fibonacci(n):", "The three laws of robotics"]


@pytest.fixture
def hosts():
    reason = ensure_ip()
    if reason:
        lacking(f"multi-host test needs network namespaces: {reason}")
    hosts = Hosts()
    try:
        for host in ("gw", "pf", "dc"):
            hosts.add(host)
        yield hosts
    finally:
        hosts.close()


@pytest.fixture(scope="module")
def reference():
    return engine_texts(PROMPTS, max_tokens=16, **BODY)


def test_three_hosts_serve_over_tcp_and_recover_from_a_cut_decode_host(
    make_stack, hosts, reference, monkeypatch, tmp_path
):
    client, gw_to_pf = hosts.link(Hosts.ROOT, "gw")[0], hosts.link("gw", "pf")
    gw_to_dc, pf_to_dc = hosts.link("gw", "dc"), hosts.link("pf", "dc")
    gateway_ip = hosts.address("gw", Hosts.ROOT)
    monkeypatch.setenv("no_proxy", gateway_ip)  # the test's HTTP goes straight to the gateway's host
    monkeypatch.setenv("NO_PROXY", gateway_ip)
    # The ZeroMQ sockets listen on the hosts' links, beyond loopback: with CURVE keys, as they must across machines;
    # the HTTP API too: with an API key.
    generate(tmp_path / "keys")
    stack: Stack = make_stack(
        extra_env={
            "KVFERRY_STEP_TIMEOUT": "10",
            "KVFERRY_FIRST_TOKEN_TIMEOUT": "30",
            "KVFERRY_CURVE_KEYS": str(tmp_path / "keys"),
            "KVFERRY_API_KEY": "multihost-key",
        }
    )
    stack.url = f"http://{gateway_ip}:{stack.port}"
    stack.start(
        "gateway",
        "gateway",
        "--host",
        "0.0.0.0",
        "--port",
        str(stack.port),
        "--control",
        "tcp://0.0.0.0:5557",
        prefix=hosts.exec_prefix("gw"),
    )
    stack.start(
        "prefill-a",
        "prefill",
        "--worker-id",
        "prefill-a",
        "--gateway",
        f"tcp://{gw_to_pf[0]}:5557",
        prefix=hosts.exec_prefix("pf"),
    )
    decode_ip = pf_to_dc[1]  # where the prefill host reaches the decode host
    stack.start(
        "decode-a",
        "decode",
        "--worker-id",
        "decode-a",
        "--gateway",
        f"tcp://{gw_to_dc[0]}:5557",
        "--kv-bind",
        "tcp://0.0.0.0:5600",
        "--advertise-host",
        decode_ip,
        prefix=hosts.exec_prefix("dc"),
    )
    stack.wait_for(lambda: stack.get("/health")[0] == 200, 180, "the three hosts to join")
    assert client != gateway_ip

    workers = stack.workers()
    assert workers["decode-a"]["kv_address"] == f"tcp://{decode_ip}:5600"
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        replies = list(
            pool.map(
                lambda prompt: stack.post("/v1/completions", {**BODY, "prompt": prompt, "max_tokens": 16}), PROMPTS
            )
        )
    assert [reply["choices"][0]["text"] for status, reply in replies] == reference
    # The KV crossed the prefill-to-decode link (the figure comes with the next heartbeat).
    stack.wait_for(lambda: stack.workers()["prefill-a"]["kv_bytes_sent"] > 0, 10, "the prefill worker's KV bytes")

    # Cut the decode host off mid-stream.
    stream = concurrent.futures.ThreadPoolExecutor(1).submit(
        stack.stream, "/v1/completions", {**BODY, "prompt": PROMPTS[0], "max_tokens": 2000}, 180
    )
    stack.wait_for(lambda: stack.workers()["decode-a"]["running"] > 0, 60, "the stream decoding")
    hosts.set_links("dc", up=False)
    cut_at = time.monotonic()
    stack.wait_for(lambda: "decode-a" not in stack.workers(), 30, "the gateway to drop the silent decode host")
    events = stream.result(timeout=120)
    errors = [event for event in events if isinstance(event, dict) and "error" in event]
    assert errors and errors[-1]["error"]["code"] == 503, events[-3:]
    assert "no live workers to move the request to" in errors[-1]["error"]["message"]
    assert time.monotonic() - cut_at < 60
    status, reply = stack.post("/v1/completions", {**BODY, "prompt": PROMPTS[1], "max_tokens": 4})
    assert status == 503 and "no workers to serve the request" in reply["error"]["message"]
    assert stack.get("/health")[0] == 503

    # Back on the network: the decode worker hears that it was forgotten, registers again, and serves.
    hosts.set_links("dc", up=True)
    stack.wait_for(lambda: stack.get("/health")[0] == 200, 90, "the decode host to register again")
    status, reply = stack.post("/v1/completions", {**BODY, "prompt": PROMPTS[2], "max_tokens": 16})
    assert status == 200 and reply["choices"][0]["text"] == reference[2]
    assert stack.procs["decode-a"].poll() is None and stack.procs["gateway"].poll() is None
    # The cut-off stream's blocks come back too: the gateway no longer knows it, so the decode worker frees it.
    stack.wait_for(
        lambda: all(w["free_blocks"] == w["num_blocks"] for w in stack.workers().values()), 60, "every block free again"
    )

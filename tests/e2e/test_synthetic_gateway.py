"""The synthetic workers (test doubles, kvferry/tools/bench/synthetic/) against the real gateway: real processes,
real sockets, real HTTP. Each stream's text is the doubles' token cycle as the gateway detokenizes it, stop strings
cut it where they match, usage and finish reasons are a real worker's; `kvferry bench gateway` reports its figures,
for one gateway and for two on one port (the streams each served); and a gateway serving a real model refuses a
double, which stops with the gateway's reason."""

import concurrent.futures
import json
import os
import subprocess
import sys
import urllib.error
import urllib.request

from kvferry.common.text_tokenizer import TextTokenizer
from kvferry.services.launcher import free_port
from kvferry.tools.bench.synthetic.model_folder import cycle_text, prepare_model_folder
from kvferry.tools.bench.synthetic.stack import double_command, synthetic_stack

NEVER = "<|never matches|>"
STREAMS, TOKENS = 8, 32


def post(url: str, body: dict) -> tuple[int, dict]:
    request = urllib.request.Request(
        url + "/v1/chat/completions", json.dumps(body).encode(), {"content-type": "application/json"}
    )
    try:
        with urllib.request.urlopen(request, timeout=60) as reply:
            return reply.status, json.loads(reply.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


def stream(url: str, body: dict) -> list:
    """A streamed chat completion's events: each JSON chunk, then "[DONE]"."""
    body = {**body, "stream": True, "stream_options": {"include_usage": True}}
    request = urllib.request.Request(
        url + "/v1/chat/completions", json.dumps(body).encode(), {"content-type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=60) as reply:
        payloads = [line[6:].strip() for line in reply.read().decode().splitlines() if line.startswith("data: ")]
    return [p if p == "[DONE]" else json.loads(p) for p in payloads]


def chat(max_tokens: int, **extra) -> dict:
    return {"messages": [{"role": "user", "content": "Say something."}], "max_tokens": max_tokens, **extra}


def streamed_text(events: list) -> tuple[str, str, dict]:
    """(the content, the finish reason, the usage) of a one-choice stream."""
    chunks = [e for e in events[:-1] if e["choices"]]
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks)
    reason = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"][0]["finish_reason"]]
    assert events[-1] == "[DONE]" and len(reason) == 1, events[-3:]
    return text, reason[0], events[-2]["usage"]


def test_the_doubles_stream_their_cycle_through_the_real_gateway(tmp_path):
    folder = prepare_model_folder(tmp_path)
    tokenizer = TextTokenizer(folder)
    with synthetic_stack(folder, tmp_path) as stack:
        body = chat(TOKENS, ignore_eos=True, stop=[NEVER])
        with concurrent.futures.ThreadPoolExecutor(STREAMS) as pool:
            results = list(pool.map(lambda _: streamed_text(stream(stack.url, body)), range(STREAMS)))
        want = cycle_text(tokenizer, TOKENS)
        for text, reason, usage in results:
            assert (text, reason, usage["completion_tokens"]) == (want, "length", TOKENS)

        # Several choices, whole: each its own cycle; usage counts them all.
        status, reply = post(stack.url, chat(12, n=3))
        assert status == 200, reply
        assert [c["message"]["content"] for c in reply["choices"]] == [cycle_text(tokenizer, 12)] * 3
        assert {c["finish_reason"] for c in reply["choices"]} == {"length"}
        assert reply["usage"]["completion_tokens"] == 36

        # A stop string that matches cuts the stream before it (the decode double is told to stop the choice).
        cut = " lazy"
        text, reason, _ = streamed_text(stream(stack.url, chat(TOKENS, stop=[NEVER, cut])))
        assert (text, reason) == (want[: want.index(cut)], "stop")

        # One token: the prefill double's first token ends it; nothing goes to decode.
        text, reason, usage = streamed_text(stream(stack.url, chat(1)))
        assert (text, reason, usage["completion_tokens"]) == (cycle_text(tokenizer, 1), "length", 1)

        # What a double cannot fake is refused, and says why.
        status, reply = post(stack.url, chat(4, logprobs=True, top_logprobs=2))
        assert status == 400 and "test double" in reply["error"]["message"], reply


def test_bench_gateway_reports_every_figure_for_one_gateway_and_for_two(tmp_path):
    command = [sys.executable, "-m", "kvferry.tools.cli", "bench", "gateway", "--streams", "32", "--tokens", "128"]
    command += ["--gateways", "1,2", "--repeat", "1", "--json"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout)
    one, two = report["runs"]
    for run, num_gateways in ((one, 1), (two, 2)):
        assert (run["streams"], run["gateways"], run["tokens"]) == (32, num_gateways, 32 * 128)
        # Positive where the figure spans many clock ticks (/proc counts CPU in 10 ms ticks): the gateway's (over
        # 100 µs a token, 4,096 tokens) and the client's (its own process time); the decode double's (about 25 µs
        # a token) may span a few ticks only, and its figure is only read here.
        for figure in ("tok_per_s", "gateway_cpu_us_per_token", "client_cpu_us_per_token"):
            assert run[figure] > 0, (figure, run)
        assert run["decode_cpu_us_per_token"] >= 0 and run["prefill_cpu_us_per_token"] >= 0, run
        assert run["loop_lag_samples"] > 0 and 0 < run["loop_lag_p50_ms"] <= run["loop_lag_p99_ms"], run
        assert not run["loop_lag_past_top_bucket"] and run["loop_lag_p99_ms"] <= run["loop_lag_max_ms"], run
        # The decode double's sends, counted: at most a message per token past each stream's first (prefill's), fewer
        # where a message carries a step's tokens; and those that waited among them.
        assert 0 < run["decode_sends"] <= 32 * 127 and 0 <= run["decode_sends_waited"] <= run["decode_sends"], run
        assert run["sends_unsent"] == 0, run

    # Each gateway process of the two counted the streams it served, read from its own /metrics through the shared
    # port: together, every stream once. Each served some (32 connections all hashed to one: 1 in 2**31).
    gateways = two["per_gateway"]
    assert len({g["id"] for g in gateways}) == len({g["pid"] for g in gateways}) == 2, gateways
    assert sum(g["streams"] for g in gateways) == two["streams_counted"] == 32, gateways
    assert all(g["streams"] > 0 and g["cpu_us_per_token"] > 0 for g in gateways), gateways
    assert abs(sum(g["share"] for g in gateways) - 1) < 1e-3, gateways
    assert [g["streams"] for g in one["per_gateway"]] == [32], one["per_gateway"]
    assert abs(two["gateway_cpu_s"] - sum(g["cpu_s"] for g in gateways)) < 1e-3, two
    [against_one] = report["comparisons"]
    assert (against_one["streams"], against_one["gateways"], against_one["against"]) == (32, 2, 1), against_one
    assert against_one["cpu_per_token_ratio"] > 0 and len(against_one["per_round_ratios"]) == 1, against_one


def test_a_gateway_serving_a_real_model_refuses_a_double(tmp_path):
    folder = prepare_model_folder(tmp_path)
    port, control = free_port(), f"tcp://127.0.0.1:{free_port()}"
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVFERRY_") or k == "KVFERRY_CACHE_DIR"}
    gateway_log = open(tmp_path / "gateway.log", "w")
    gateway = subprocess.Popen(  # the default model: a real one
        [sys.executable, "-m", "kvferry.services.commands", "gateway", "--port", str(port), "--control", control],
        stdout=gateway_log,
        stderr=subprocess.STDOUT,
        env=env,
    )
    try:
        double = subprocess.run(double_command("decode", control, folder), capture_output=True, text=True, timeout=60)
    finally:
        gateway.terminate()
        gateway.wait(timeout=30)
        gateway_log.close()
    assert double.returncode == 2, double.stderr[-2000:]
    assert "model mismatch" in double.stderr and "'kvferry-synthetic'" in double.stderr, double.stderr[-2000:]
    assert "refused worker" in (tmp_path / "gateway.log").read_text()

"""Tracing, metrics and traffic capture on one real stack: trace files from three processes, `kvferry trace`,
/metrics, traceparent, the capture files and `kvferry replay`."""

import concurrent.futures
import json
import shutil
import subprocess
import sys

import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvferry.common import capture
from kvferry.tools.trace.reader import load
from tests.e2e.stack import running_pair, tiny_stack

pytestmark = pytest.mark.slow
CLIENT_TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_SPAN = "00f067aa0ba902b7"
API_KEY = "sk-capture-test-0123456789"


def kvferry(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "kvferry.tools.cli", *args], capture_output=True, text=True, timeout=120
    )


@pytest.fixture(scope="module")
def traced(tmp_path_factory):
    folder = tmp_path_factory.mktemp("traced")
    trace_dir = folder / "traces"
    env = {
        "KVFERRY_TRACE_DIR": str(trace_dir),
        "KVFERRY_LOG_FORMAT": "json",
        "KVFERRY_CAPTURE_DIR": str(folder / "capture"),
        "KVFERRY_API_KEY": API_KEY,
    }
    with running_pair(folder, extra_env=env) as s:
        # Token-id prompts of known lengths and exact output lengths: the metrics must match them exactly.
        asks = [
            (
                {
                    "prompt": list(range(100, 100 + 7 * (i + 1))),
                    "max_tokens": 4 + 3 * i,
                    "ignore_eos": True,
                    "temperature": 0,
                },
                {},
            )
            for i in range(5)
        ]
        asks.append(
            (
                {"prompt": [5, 6, 7, 8], "max_tokens": 6, "ignore_eos": True},
                {"traceparent": f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-01"},
            )
        )
        asks.append(({"prompt": [9, 10, 11], "max_tokens": 5, "ignore_eos": True}, {"traceparent": "not-a-trace"}))
        with concurrent.futures.ThreadPoolExecutor(len(asks)) as pool:
            replies = list(pool.map(lambda a: s.exchange("/v1/completions", *a), asks))
        assert all(status == 200 for status, _, _ in replies), replies
        rids = [headers["x-request-id"] for _, headers, _ in replies]

        def all_finished():  # trace files are flushed at most every 0.2 s, at the next line
            return all(any(e.get("name") == "finish" for e in load(str(trace_dir)).for_request(r)) for r in rids)

        s.wait_for(all_finished, timeout=30, what="every request's finish in the trace files")
        yield s, trace_dir, asks, replies


def test_trace_show_lists_every_hop_in_causal_order(traced):
    s, trace_dir, asks, replies = traced
    for _, headers, reply in replies:
        rid = headers["x-request-id"]
        assert reply["id"] == rid  # one id: the HTTP reply, the header and every message
        shown = kvferry("trace", "show", str(trace_dir), rid)
        assert shown.returncode == 0, shown.stderr
        lines = shown.stdout.splitlines()[2:]
        events = [
            line.split()[2] + ("" if line.split()[2] not in ("send", "recv") else " " + line.split()[3])
            for line in lines
            if len(line.split()) > 2 and not line.startswith("decode steps") and line.split()[0] != "with"
        ]

        def first(what):
            assert what in events, f"{rid}: no {what} in\n{shown.stdout}"
            return events.index(what)

        order = [
            first("arrival"),
            first("send PrefillRequest"),
            first("recv PrefillRequest"),
            first("prefill"),
            first("send FirstToken"),
            first("recv FirstToken"),
        ]
        assert order == sorted(order), shown.stdout
        kv = [first("send KVTransfer"), first("recv KVTransfer"), first("kv.transfer_in"), first("decode.step")]
        assert kv == sorted(kv), shown.stdout
        # Layer groups may go out while the prompt computes; the last one always follows the first token.
        kv_sends = [i for i, e in enumerate(events) if e == "send KVTransfer"]
        assert first("prefill") < kv_sends[0] and first("send FirstToken") < kv_sends[-1], shown.stdout
        first("kv.transfer_out")
        last_tokens = max(i for i, e in enumerate(events) if e == "recv Tokens")
        assert first("finish") > last_tokens
        assert "decode steps:" in shown.stdout


def test_trace_show_names_each_decode_steps_batch_mates(traced, tmp_path):
    """Two requests that shared decode steps each list the other in those steps: abbreviated, in full with
    --verbose, with the step's batch size and duration; the Chrome export's step slices name them both."""
    s, trace_dir, asks, replies = traced
    rids = [headers["x-request-id"] for _, headers, _ in replies]
    steps = [r for r in load(str(trace_dir)).records if r.get("name") == "decode.step"]
    shared = next(step for step in steps if sum(rid in step["attrs"]["rids"] for rid in rids) >= 2)
    first, second = [rid for rid in rids if rid in shared["attrs"]["rids"]][:2]
    for me, other in ((first, second), (second, first)):
        brief = kvferry("trace", "show", str(trace_dir), me)
        full = kvferry("trace", "show", str(trace_dir), me, "--verbose")
        assert brief.returncode == full.returncode == 0, brief.stderr + full.stderr
        lines = full.stdout.splitlines()
        step_lines = [i for i, line in enumerate(lines) if " decode.step " in line]
        mates = [lines[i + 1].split(":", 1)[1].split() for i in step_lines]
        assert all(me not in m for m in mates) and any(other in m for m in mates), full.stdout
        together = next(i for i, m in zip(step_lines, mates) if other in m)
        assert "batch " in lines[together] and lines[together].rstrip().endswith(" ms")  # its size and duration
        assert f"with {len(mates[step_lines.index(together)])}:" in lines[together + 1]
        assert other.rsplit("-", 1)[-1][:6] in brief.stdout and other not in brief.stdout
    out = tmp_path / "steps.json"
    assert kvferry("trace", "export", str(trace_dir), "--chrome", str(out)).returncode == 0
    slices = [e for e in json.loads(out.read_text())["traceEvents"] if e.get("name") == "decode.step"]
    assert any({first, second} <= set(e["args"]["rids"]) for e in slices)


def test_trace_list_export_and_plot(traced, tmp_path):
    s, trace_dir, asks, replies = traced
    listed = kvferry("trace", "list", str(trace_dir))
    assert listed.returncode == 0, listed.stderr
    for (body, _), (_, headers, _reply) in zip(asks, replies):
        row = next(line for line in listed.stdout.splitlines() if line.startswith(headers["x-request-id"]))
        assert row.split()[3:5] == [str(len(body["prompt"])), str(body["max_tokens"])]
    out = tmp_path / "trace.json"
    exported = kvferry("trace", "export", str(trace_dir), "--chrome", str(out))
    assert exported.returncode == 0, exported.stderr
    events = json.loads(out.read_text())["traceEvents"]
    lanes = {e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "process_name"}
    assert lanes == {"gateway", "prefill-a", "decode-a"}
    assert len({e["pid"] for e in events if e["ph"] == "X"}) == 3
    starts = [e["id"] for e in events if e["ph"] == "s"]
    ends = [e["id"] for e in events if e["ph"] == "f"]
    assert starts and sorted(starts) == sorted(ends) and len(set(starts)) == len(starts)
    png = tmp_path / "r.png"
    plotted = kvferry("trace", "plot", str(trace_dir), replies[0][1]["x-request-id"], "-o", str(png))
    assert plotted.returncode == 0, plotted.stderr
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000


def test_a_skewed_clock_is_corrected_and_reported(traced, tmp_path):
    s, trace_dir, asks, replies = traced
    skewed = tmp_path / "skewed"
    shutil.copytree(trace_dir, skewed)
    (decode_file,) = skewed.glob("decode-a-*.jsonl")
    lines = [json.loads(x) for x in decode_file.read_text().splitlines() if x.strip()]
    decode_file.write_text("".join(json.dumps({**r, "ts": r["ts"] - 3.0}) + "\n" for r in lines))
    traces = load(str(skewed))
    assert any("decode-a" in note and "behind" in note for note in traces.notes)
    assert traces.offsets["decode-a"] == pytest.approx(3.0, abs=0.05) and traces.offsets["prefill-a"] == 0.0
    for _, headers, _ in replies:
        events = traces.for_request(headers["x-request-id"])
        sends = {e["span_id"]: i for i, e in enumerate(events) if e["ev"] == "send"}
        assert all(sends[e["span_id"]] < i for i, e in enumerate(events) if e["ev"] == "recv" and e["span_id"] in sends)
    shown = kvferry("trace", "show", str(skewed), replies[0][1]["x-request-id"])
    assert shown.returncode == 0 and "clock skew" in shown.stderr


def test_metrics_match_what_was_sent(traced):
    s, trace_dir, asks, replies = traced
    families = {f.name: f for f in text_string_to_metric_families(s.text("/metrics"))}

    def value(name, **labels):
        family = families[name]
        return sum(
            x.value
            for x in family.samples
            if x.name in (name, name + "_total") and all(x.labels.get(k) == v for k, v in labels.items())
        )

    assert value("kvferry:prompt_tokens") == sum(len(body["prompt"]) for body, _ in asks)
    assert value("kvferry:generation_tokens") == sum(body["max_tokens"] for body, _ in asks)
    assert value("kvferry:request_success", finished_reason="length") == len(asks)
    for name in (
        "time_to_first_token_seconds",
        "e2e_request_latency_seconds",
        "request_queue_time_seconds",
        "request_prefill_time_seconds",
        "kv_transfer_time_seconds",
        "kv_transfer_bytes",
    ):
        count = next(x.value for x in families[f"kvferry:{name}"].samples if x.name.endswith("_count"))
        assert count == len(asks), name
    itl = next(x.value for x in families["kvferry:inter_token_latency_seconds"].samples if x.name.endswith("_count"))
    assert itl == sum(body["max_tokens"] - 1 for body, _ in asks)
    assert value("kvferry:num_workers", role="prefill") == 1 and value("kvferry:num_workers", role="decode") == 1
    usage = [x for x in families["kvferry:kv_cache_usage_perc"].samples if x.labels["worker"] == "decode-a"]
    assert len(usage) == 1 and 0.0 <= usage[0].value <= 1.0
    assert value("kvferry:protocol_errors", process="gateway") == 0
    assert {x.labels["worker"] for x in families["kvferry:num_preemptions"].samples} == {"prefill-a", "decode-a"}


def test_the_client_traceparent_names_the_trace(traced):
    s, trace_dir, asks, replies = traced
    _, headers, _ = replies[5]
    version, trace_id, span_id, flags = headers["traceparent"].split("-")
    assert trace_id == CLIENT_TRACE and span_id != CLIENT_SPAN and version == "00"
    traces = load(str(trace_dir))
    events = traces.for_request(headers["x-request-id"])
    assert {e["trace_id"] for e in events if e.get("trace_id")} == {CLIENT_TRACE}
    assert {e["proc"] for e in events if e.get("trace_id") == CLIENT_TRACE} == {"gateway", "prefill-a", "decode-a"}
    http = next(e for e in events if e.get("name") == "http")
    assert http["span_id"] == span_id and http["parent_id"] == CLIENT_SPAN


def test_a_malformed_traceparent_starts_a_new_trace_and_warns(traced):
    s, trace_dir, asks, replies = traced
    _, headers, _ = replies[6]
    rid = headers["x-request-id"]
    _, trace_id, _, _ = headers["traceparent"].split("-")
    assert len(trace_id) == 32 and trace_id != CLIENT_TRACE
    events = load(str(trace_dir)).for_request(rid)
    assert {e["trace_id"] for e in events if e.get("trace_id")} == {trace_id}
    logged = [json.loads(line) for line in s.log("gateway").splitlines() if line.startswith("{")]
    warning = next(x for x in logged if "malformed traceparent" in x["msg"])
    assert warning["level"] == "warning" and warning["request_id"] == rid


def test_every_log_line_is_json(traced):
    s, trace_dir, asks, replies = traced
    for name in ("gateway", "prefill-a", "decode-a"):
        lines = [line for line in s.log(name).splitlines() if line.strip()]
        parsed = [json.loads(line) for line in lines]  # raises on a plain-text line
        assert parsed and all({"ts", "level", "logger", "process", "msg"} <= set(x) for x in parsed)
        assert {x["process"] for x in parsed} == {name}


def test_a_batch_of_prompts_is_one_request_in_the_traces(traced):
    s, trace_dir, asks, replies = traced
    status, headers, reply = s.exchange(
        "/v1/completions", {"prompt": [[5, 6, 7], [8, 9]], "max_tokens": 3, "ignore_eos": True}
    )
    assert status == 200 and len(reply["choices"]) == 2
    rid = headers["x-request-id"]
    # Each process flushes its file within a heartbeat or so: wait for the gateway's end and the decode steps.
    names = lambda: {e.get("name") for e in load(str(trace_dir)).for_request(rid)}
    s.wait_for(lambda: {"finish", "decode.step"} <= names(), 30, "finish and decode steps in the trace")
    events = load(str(trace_dir)).for_request(rid)
    assert {e["rid"] for e in events if e["ev"] == "send" and e["kind"] == "PrefillRequest"} == {
        f"{rid}/p0",
        f"{rid}/p1",
    }
    assert any(e.get("name") == "decode.step" for e in events)
    listed = kvferry("trace", "list", str(trace_dir)).stdout
    assert [line.split()[3:5] for line in listed.splitlines() if line.startswith(rid)] == [["5", "6"]]


def captured(s, rids: list[str]) -> dict[str, capture.Record]:
    """The capture's records of these requests, once the gateway's writer thread has written them all."""
    folder = s.log_dir / "capture"
    by_id = lambda: {r.request_id: r for r in capture.load([folder])} if folder.exists() else {}
    s.wait_for(lambda: set(rids) <= set(by_id()), 30, "the requests' capture lines")
    return by_id()


def test_the_capture_holds_what_each_client_received(traced):
    s, trace_dir, asks, replies = traced
    streamed = {"prompt": [11, 12, 13, 14], "max_tokens": 6, "temperature": 0, "return_token_ids": True}
    chunks = [c for c in s.stream("/v1/completions", streamed) if c != "[DONE]"]
    asks = [
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Name a colour."}], "max_tokens": 5}),
        ("/v1/completions", {"prompt": ["One", "Two, three"], "max_tokens": 4, "temperature": 0}),
    ]
    asks[0][1].update(n=2, seed=7, temperature=0.8)
    answers = [s.exchange(path, {**body, "return_token_ids": True}) for path, body in asks]
    records = captured(s, [chunks[0]["id"]] + [headers["x-request-id"] for _, headers, _ in answers])
    seen = [(records[chunks[0]["id"]], "/v1/completions", {**streamed, "stream": True}, stream_choices(chunks), None)]
    for (path, body), (status, headers, reply) in zip(asks, answers):
        assert status == 200, reply
        seen.append((records[reply["id"]], path, {**body, "return_token_ids": True}, reply["choices"], headers))
    served = "HuggingFaceTB/SmolLM2-135M-Instruct"  # the name responses report: the default model's hub id
    for r, path, body, choices, headers in seen:
        assert (r.status, r.endpoint, r.model, r.moves, r.body) == (200, path, served, 0, body)
        if headers is not None:
            assert r.trace_id == headers["traceparent"].split("-")[1]
        assert r.output_token_ids == [c["token_ids"] for c in choices]
        assert r.output_text == [c["text"] if "text" in c else c["message"]["content"] for c in choices]
        assert r.finish_reasons == [c["finish_reason"] for c in choices]
        assert r.routes == [[{"prefill": "prefill-a", "decode": "decode-a"}]] * len(r.prompt_token_ids)
        assert [len(gaps) for gaps in r.itl_s] == [len(ids) - 1 for ids in r.output_token_ids]
        assert 0 < r.ttft_s <= r.e2e_s and all(g >= 0 for gaps in r.itl_s for g in gaps)
    assert seen[0][0].prompt_token_ids == [[11, 12, 13, 14]] and len(seen[2][0].prompt_token_ids) == 2
    for path in (s.log_dir / "capture").iterdir():  # sent on every request, in the Authorization header
        assert API_KEY.encode() not in path.read_bytes()


def stream_choices(chunks: list[dict]) -> list[dict]:
    """A completions stream's chunks -> its choices whole: text, token ids and finish reason."""
    whole: dict[int, dict] = {}
    for chunk in chunks:
        for c in chunk["choices"]:
            one = whole.setdefault(c["index"], {"text": "", "token_ids": [], "finish_reason": None})
            one["text"] += c["text"]
            one["token_ids"] += c.get("token_ids", [])
            one["finish_reason"] = c["finish_reason"] or one["finish_reason"]
    return [whole[i] for i in sorted(whole)]


def test_a_replay_against_the_same_stack_reproduces_every_greedy_output(traced, tmp_path):
    s, trace_dir, asks, replies = traced
    folder = tmp_path / "capture"
    shutil.copytree(s.log_dir / "capture", folder)
    broken = next(folder.iterdir())
    with open(broken, "a") as f:
        f.write('{"v": 1, "request_id": "cut-off", "arri\n')
    replay = kvferry("replay", str(folder), "--url", s.url, "--api-key", API_KEY, "--speed", "50", "--json")
    assert replay.returncode == 0, replay.stdout + replay.stderr
    report = json.loads(replay.stdout)
    assert report["errors"] == [] and report["differences"] == []
    assert report["compared"] >= 8 and report["identical"] == report["compared"]
    assert f"{broken}:{len(broken.read_text().splitlines())}: not JSON" in replay.stderr  # named, skipped, went on
    assert report["latency"]["replayed"]["ttft_s"]["p50"] > 0


def test_a_replay_against_another_model_reports_where_outputs_differ(traced, tmp_path):
    s, trace_dir, asks, replies = traced
    other = tiny_stack(tmp_path)
    try:
        other.start_pair()
        replay = kvferry(
            "replay", str(s.log_dir / "capture"), "--url", other.url, "--model", "tiny-chat", "--speed", "50", "--json"
        )
    finally:
        other.close()
    assert replay.returncode == 1, replay.stdout + replay.stderr
    report = json.loads(replay.stdout)
    assert report["errors"] == [] and report["compared"] >= 8 and report["identical"] < report["compared"]
    diff = report["differences"][0]
    assert diff["char"] >= 0 and diff["token"] >= 0 and diff["captured"] != diff["replayed"]
    unreachable = kvferry("replay", str(s.log_dir / "capture"), "--url", "http://127.0.0.1:9")
    assert unreachable.returncode == 2 and "cannot reach http://127.0.0.1:9" in unreachable.stderr

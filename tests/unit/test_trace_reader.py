"""`kvferry trace` on hand-made trace folders: causal order across skewed clocks, Chrome export, bad folders."""

import json

import pytest

from kvferry.tools.cli import main
from kvferry.tools.trace.chrome import chrome_trace
from kvferry.tools.trace.reader import TraceError, load

TRACE = "ab" * 16


def write_request(folder, rid: str, t0: float, decode_clock_offset: float = 0.0) -> None:
    """One request's hops as three processes record them; the decode worker's clock is off by the offset."""
    n = [0]

    def msg(ev, proc, kind, peer, t, span):
        return {
            "ts": t + (decode_clock_offset if proc == "decode-a" else 0.0),
            "role": proc.split("-")[0],
            "proc": proc,
            "ev": ev,
            "kind": kind,
            "peer": peer,
            "rid": rid,
            "trace_id": TRACE,
            "span_id": span,
            "parent_id": "",
            "header_bytes": 100,
            "payload_bytes": 4096 if kind == "KVTransfer" else 0,
        }

    def span(proc, name, t, dur, **attrs):
        n[0] += 1
        return {
            "ts": t + (decode_clock_offset if proc == "decode-a" else 0.0),
            "dur": dur,
            "role": proc.split("-")[0],
            "proc": proc,
            "ev": "span",
            "name": name,
            "rid": "" if "rids" in attrs else rid,
            "attrs": attrs,
        }

    hops = [
        (
            "gateway",
            [
                span("gateway", "http", t0, 0.5, prompt_tokens=5, completion_tokens=3, finish_reason="length"),
                msg("send", "gateway", "PrefillRequest", "prefill-a", t0 + 0.001, rid + "1"),
                msg("recv", "gateway", "FirstToken", "prefill-a", t0 + 0.102, rid + "2"),
                msg("recv", "gateway", "Tokens", "decode-a", t0 + 0.302, rid + "4"),
            ],
        ),
        (
            "prefill-a",
            [
                msg("recv", "prefill-a", "PrefillRequest", "gateway", t0 + 0.002, rid + "1"),
                span("prefill-a", "prefill", t0 + 0.003, 0.09),
                msg("send", "prefill-a", "FirstToken", "gateway", t0 + 0.1, rid + "2"),
                msg("send", "prefill-a", "KVTransfer", "decode-a", t0 + 0.11, rid + "3"),
            ],
        ),
        (
            "decode-a",
            [
                msg("recv", "decode-a", "KVTransfer", "prefill-a", t0 + 0.12, rid + "3"),
                span("decode-a", "decode.step", t0 + 0.2, 0.1, step=1, batch_size=1, rids=[rid]),
                msg("send", "decode-a", "Tokens", "gateway", t0 + 0.3, rid + "4"),
            ],
        ),
    ]
    for proc, records in hops:
        with open(folder / f"{proc}-1.jsonl", "a") as f:
            for r in records:
                f.write(json.dumps(r) + "\n")


def assert_causal(events):
    sends = {e["span_id"]: e for e in events if e["ev"] == "send"}
    for i, e in enumerate(events):
        if e["ev"] == "recv":
            assert events.index(sends[e["span_id"]]) < i, f"{e['kind']} received before it was sent"


def test_synchronised_clocks_are_left_alone(tmp_path):
    write_request(tmp_path, "r1", 1000.0)
    traces = load(str(tmp_path))
    assert traces.offsets == {"gateway": 0.0, "prefill-a": 0.0, "decode-a": 0.0} and traces.notes == []
    events = traces.for_request("r1")
    assert_causal(events)
    assert events[0]["name"] == "http" and any(e.get("name") == "decode.step" for e in events)


def test_a_skewed_clock_is_reported_and_events_keep_causal_order(tmp_path):
    write_request(tmp_path, "r1", 1000.0, decode_clock_offset=-5.0)  # decode's clock 5 s behind
    write_request(tmp_path, "r2", 1001.0, decode_clock_offset=-5.0)
    traces = load(str(tmp_path))
    assert traces.offsets["decode-a"] == pytest.approx(5.0, abs=0.05)
    assert any("decode-a" in note and "behind" in note for note in traces.notes)
    for rid in ("r1", "r2"):
        events = traces.for_request(rid)
        assert_causal(events)
        kinds = [e.get("kind") or e.get("name") for e in events]
        assert kinds.index("KVTransfer") < kinds.index("decode.step") < kinds.index("Tokens")


def test_show_and_list_print_the_timeline(tmp_path, capsys):
    write_request(tmp_path, "r1", 1000.0, decode_clock_offset=2.0)
    assert main(["trace", "list", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "r1" in out and "500.0" in out and "1 requests" in out
    assert main(["trace", "show", str(tmp_path), "r1"]) == 0
    captured = capsys.readouterr()
    lines = captured.out.splitlines()
    order = [
        next(i for i, line in enumerate(lines) if what in line)
        for what in ("recv PrefillRequest", "send KVTransfer", "recv KVTransfer", "decode.step", "recv Tokens")
    ]
    assert order == sorted(order)
    assert "clock skew" in captured.err and "decode-a" in captured.err


def test_chrome_export_pairs_every_flow(tmp_path):
    write_request(tmp_path, "r1", 1000.0)
    write_request(tmp_path, "r2", 1000.2)
    doc = chrome_trace(load(str(tmp_path)))
    events = doc["traceEvents"]
    json.dumps(doc)
    assert len({e["pid"] for e in events if e["ph"] == "X"}) == 3
    starts = {e["id"] for e in events if e["ph"] == "s"}
    ends = {e["id"] for e in events if e["ph"] == "f"}
    assert starts == ends and len(starts) == 8  # four messages per request
    names = {e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "process_name"}
    assert names == {"gateway", "prefill-a", "decode-a"}


def test_truncated_lines_are_skipped_with_a_note(tmp_path, capsys):
    write_request(tmp_path, "r1", 1000.0)
    with open(tmp_path / "decode-a-1.jsonl", "a") as f:
        f.write('{"ts": 1000.4, "role": "decode", "proc": "dec')  # a crash mid-line
    traces = load(str(tmp_path))
    assert any("skipped 1 unreadable" in note for note in traces.notes)
    assert main(["trace", "show", str(tmp_path), "r1"]) == 0
    assert "skipped 1 unreadable" in capsys.readouterr().err


@pytest.mark.parametrize(
    "make,expected",
    [
        (lambda d: d / "missing", "does not exist"),
        (lambda d: d, "no trace files"),
        (lambda d: (d / "x.jsonl").write_text('{"ts": 1, "ev"\n') and d, "no readable trace lines"),
    ],
)
def test_bad_folders_give_a_clear_message(tmp_path, capsys, make, expected):
    folder = make(tmp_path)
    with pytest.raises(TraceError, match=expected):
        load(str(folder))
    for command in (
        ["list", str(folder)],
        ["show", str(folder), "r1"],
        ["export", str(folder), "--chrome", str(tmp_path / "o.json")],
    ):
        assert main(["trace", *command]) == 2
        err = capsys.readouterr().err
        assert expected in err and "Traceback" not in err


def test_an_unknown_request_is_named(tmp_path, capsys):
    write_request(tmp_path, "cmpl-abc", 1000.0)
    assert main(["trace", "show", str(tmp_path), "abc"]) == 2
    assert "did you mean cmpl-abc" in capsys.readouterr().err


def test_lines_with_mistyped_fields_are_skipped_not_fatal(tmp_path, capsys):
    write_request(tmp_path, "r1", 1000.0)
    odd = [
        {"ts": 1000.3, "ev": "span", "proc": "decode-a", "dur": 0.1, "name": "decode.step", "attrs": "x"},
        {"ts": 1000.3, "ev": "span", "proc": "decode-a", "dur": 0.1, "name": "decode.step", "attrs": {"rids": 5}},
        {"ts": 1000.3, "ev": "recv", "proc": "decode-a", "rid": 7},
        {"ts": "soon", "ev": "send", "proc": "gateway"},
        [1, 2],
    ]
    with open(tmp_path / "decode-a-1.jsonl", "a") as f:
        f.write("".join(json.dumps(x) + "\n" for x in odd))
    for command in (["list"], ["show", "r1"]):
        assert main(["trace", command[0], str(tmp_path), *command[1:]]) == 0
    assert "skipped 5 unreadable" in capsys.readouterr().err

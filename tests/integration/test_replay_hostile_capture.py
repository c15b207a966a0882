"""`kvferry replay` on crafted capture lines: each is skipped with a message naming its file and line, or the replay
stops with status 2 and one clear line; never a traceback, never a stall. Real subprocesses of `kvferry replay`
against a small real HTTP server that answers as an OpenAI-compatible one."""

import http.server
import json
import subprocess
import sys

import pytest

from kvferry.common import capture
from tests.local_http import serving


class Completions(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self._send(200, "application/json", json.dumps({"data": [{"id": "m"}]}).encode())

    def do_POST(self):
        self.rfile.read(int(self.headers["content-length"]))
        chunk = {"choices": [{"index": 0, "text": "hi", "token_ids": [5], "finish_reason": "length"}]}
        self._send(200, "text/event-stream", f"data: {json.dumps(chunk)}\n\ndata: [DONE]\n\n".encode())

    def _send(self, status: int, kind: str, body: bytes):
        self.send_response(status)
        self.send_header("content-type", kind)
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


@pytest.fixture(scope="module")
def url():
    with serving(Completions) as base:
        yield base


def good(i: int, **fields) -> dict:
    record = capture.Record(
        f"cmpl-{i}", "ab" * 16, "m", 1_700_000_000.0 + i, 5.0 + i, "/v1/completions", 200,
        {"prompt": "x", "max_tokens": 1, "temperature": 0},
        output_text=["hi"], output_token_ids=[[5]], finish_reasons=["length"], ttft_s=0.01, e2e_s=0.02,
    )  # fmt: skip
    return {**json.loads(record.to_line()), **fields}


def raw(record: dict, literal: str) -> str:
    """The record as a line, its "@" value replaced by a JSON literal that json.dumps would not write."""
    return json.dumps(record).replace('"@"', literal)


def nested(depth: int):
    value = {}
    for _ in range(depth):
        value = {"a": value}
    return value


# Each line, and the word the skip message must give for it.
HOSTILE = [
    (json.dumps(good(1, output_text=5)), "output_text"),
    (json.dumps(good(2, ttft_s="soon")), "ttft_s"),
    (json.dumps(good(3, itl_s=[["a"]])), "itl_s"),
    (json.dumps(good(4, prompt_token_ids="abc")), "prompt_token_ids"),
    (json.dumps(good(5, model=["m"])), "model"),
    (json.dumps(good(6, body=[1, 2])), "body"),
    (json.dumps(good(7, finish_reasons=[7])), "finish_reasons"),
    (json.dumps(good(8, routes="p0")), "routes"),
    (json.dumps(good(9, output_token_ids=[[1.5]])), "output_token_ids"),
    (raw(good(10, arrival_unix="@"), "1e400"), "arrival_unix"),  # parsed as infinity
    (raw(good(11, arrival_unix="@"), "9" * 400), "arrival_unix"),  # an int no float holds
    (raw(good(12, status="@"), "9" * 5000), "not JSON"),  # more digits than Python converts
    (json.dumps(good(13, arrival_unix=-5.0)), "arrival_unix"),
    (json.dumps(good(14, e2e_s=-3.0)), "e2e_s"),
    (json.dumps(good(15, ttft_s=-1.0)), "ttft_s"),
    (json.dumps(good(16, moves=-1)), "moves"),
    ("[" * 200_000 + "]" * 200_000, "nested"),
    (json.dumps(good(17, body={"prompt": "x", "deep": nested(500)})), "nested"),
    (json.dumps(good(18, request_id={"$gt": ""})), "request_id"),
    (raw(good(19, arrival_monotonic="@"), "-" + "9" * 400), "arrival_monotonic"),  # an int no float holds
    (json.dumps(good(20, arrival_monotonic=True)), "arrival_monotonic"),
]


def replay(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "kvferry.tools.cli", "replay", *args], capture_output=True, text=True, timeout=120
    )


def test_every_crafted_line_is_skipped_and_named_and_the_good_ones_replay(url, tmp_path):
    path = tmp_path / "capture-hostile.jsonl"
    with open(path, "wb") as f:
        f.write(json.dumps(good(0)).encode() + b"\n")
        for text, _ in HOSTILE:
            f.write(text.encode() + b"\n")
        f.write(json.dumps(good(99))[:-1].encode() + b', "x": "caf\xe9"}\n')  # Latin-1, not UTF-8
        f.write(json.dumps(good(100)).encode() + b"\n")
    result = replay(str(path), "--url", url, "--speed", "100", "--json")
    assert "Traceback" not in result.stderr, result.stderr
    assert result.returncode == 0, result.stdout + result.stderr
    report = json.loads(result.stdout)
    assert report["requests"] == 2 and report["identical"] == 2
    skipped = report["skipped_lines"]
    assert [s.split(": ")[0] for s in skipped] == [f"{path}:{n}" for n in range(2, len(HOSTILE) + 3)]
    for message, (_, word) in zip(skipped, HOSTILE):
        assert word in message, message
    assert "UTF-8" in skipped[-1]


def test_an_arrival_that_would_stall_the_replay_exits_2_naming_its_line(url, tmp_path):
    path = tmp_path / "capture-far.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in (good(0), good(1, arrival_unix=1e12), good(2))))
    result = replay(str(path), "--url", url)
    assert result.returncode == 2, result.stdout + result.stderr
    [message] = result.stderr.splitlines()
    assert message.startswith("kvferry: error:") and f"{path}:2" in message and "--max-duration" in message
    faster = replay(str(path), "--url", url, "--speed", "1e13", "--json")  # the operator's explicit choice runs
    assert faster.returncode == 0, faster.stdout + faster.stderr


def test_a_line_past_the_line_cap_is_skipped_without_reading_it_whole(tmp_path):
    path = tmp_path / "capture-long.jsonl"
    path.write_bytes(json.dumps(good(0)).encode() + b"\n" + b"x" * 50_000 + b"\n" + json.dumps(good(1)).encode())
    skipped = []
    records = capture.load([path], skipped.append, max_line_bytes=10_000)
    assert [r.request_id for r in records] == ["cmpl-0", "cmpl-1"]
    assert len(skipped) == 1 and skipped[0].startswith(f"{path}:2: longer than 10000 bytes")

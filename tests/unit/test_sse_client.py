"""The tools' one client for a streamed response, against a small real HTTP server on 127.0.0.1: the chunks in order
and timed, [DONE] left out, an error chunk's message, a refusal's status, headers and message, and a stream left
early closing the connection (what the soak benchmark's cancellations rely on)."""

import asyncio
import http.server
import json
import threading
import time

import httpx
import pytest

from kvferry.tools.sse_client import Refused, greedy_completion, open_stream
from tests.local_http import serving

CHUNKS = [
    {"choices": [{"index": 0, "text": "a", "finish_reason": None}]},
    {"error": {"message": "constraint dead end", "code": 500}},
    {"choices": [], "usage": {"completion_tokens": 1}},
]


class Server(http.server.BaseHTTPRequestHandler):
    closed = threading.Event()  # the endless stream's client went away

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["content-length"])))
        if body["prompt"] == "refuse":
            raw = json.dumps({"error": {"message": "too many waiting", "code": 429}}).encode()
            self.send_response(429)
            self.send_header("retry-after", "1")
            self.send_header("content-length", str(len(raw)))
            self.end_headers()
            self.wfile.write(raw)
            return
        self.send_response(200)
        self.send_header("content-type", "text/event-stream")
        self.end_headers()  # HTTP/1.0: the body runs to the connection's close
        if body["prompt"] == "endless":
            try:
                for _ in range(500):
                    self.wfile.write(b'data: {"choices": [{"index": 0, "text": "x"}]}\n\n')
                    self.wfile.flush()
                    time.sleep(0.01)
            except OSError:
                Server.closed.set()
            return
        for chunk in CHUNKS:
            self.wfile.write(f"data: {json.dumps(chunk)}\n\n".encode())
            self.wfile.flush()
            time.sleep(0.02)
        self.wfile.write(b"data: [DONE]\n\n")

    def log_message(self, *args):
        pass


@pytest.fixture(scope="module")
def url():
    with serving(Server) as base:
        yield base + "/v1/completions"


def run(url: str, prompt: str, take: int | None = None):
    async def go():
        async with httpx.AsyncClient(timeout=10.0) as client:
            got = []
            async with open_stream(client, url, greedy_completion("m", prompt, 3)) as stream:
                async for chunk in stream.chunks():
                    got.append(chunk)
                    if len(got) == take:
                        break
            return got

    return asyncio.run(go())


def test_each_data_event_is_a_chunk_in_order_timed_from_the_send_and_done_is_not_one(url):
    chunks = run(url, "three")
    assert [c.data for c in chunks] == CHUNKS
    assert 0 < chunks[0].at_s < chunks[1].at_s < chunks[2].at_s
    assert chunks[2].at_s - chunks[0].at_s >= 0.03  # the server's pauses between them
    assert [c.error for c in chunks] == [None, "constraint dead end", None]


def test_a_refusal_raises_with_its_status_headers_message_and_answer_time(url):
    with pytest.raises(Refused) as refused:
        run(url, "refuse")
    assert refused.value.status == 429
    assert refused.value.headers["retry-after"] == "1"
    assert refused.value.message == "too many waiting"
    assert 0 < refused.value.answered_s < 10


def test_leaving_the_stream_early_closes_the_connection(url):
    assert len(run(url, "endless", take=2)) == 2
    assert Server.closed.wait(5.0), "the server went on writing to a client that had left"


def test_the_greedy_body_asks_for_usage_only_when_told():
    assert "stream_options" not in greedy_completion("m", [1, 2], 4)
    body = greedy_completion("m", [1, 2], 4, usage=True)
    assert body["stream_options"] == {"include_usage": True}
    assert body | {"stream_options": None} == {
        "model": "m", "prompt": [1, 2], "max_tokens": 4, "temperature": 0, "ignore_eos": True, "stream": True,
        "stream_options": None,
    }  # fmt: skip

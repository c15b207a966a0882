"""What the gateway lets in at once, over real HTTP: the real Api (with no workers) served by uvicorn on a loopback
port, and raw sockets as clients that send a request's head and hold back part of its body, so that the request is
let in and stays unanswered for as long as the test likes. Requests are bounded in number (--max-waiting) and in
body bytes (--max-waiting-bytes), on every route that parses a body."""

import contextlib
import json
import socket
import threading
import time

import pytest
import uvicorn

from kvferry.common.gateway_config import GatewayConfig
from kvferry.services.gateway.admission import Admission
from kvferry.services.gateway.api import Api
from kvferry.services.gateway.main import load_text_side
from kvferry.services.gateway.server import GatewayCore
from tests.gateway_api import MODEL


@pytest.fixture(scope="module")
def tokenizer():
    return load_text_side(None)[0]


@contextlib.contextmanager
def serving(tokenizer, max_waiting: int = 0, max_waiting_bytes: int = 0):
    """(port, api): the Api served by uvicorn on a thread of its own, stopped after."""
    core = GatewayCore("tcp://127.0.0.1:0", MODEL, 16)
    config = GatewayConfig(max_waiting=max_waiting, max_waiting_bytes=max_waiting_bytes)
    api = Api(core, tokenizer, MODEL, 2048, config)
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(api.app(), log_level="warning", log_config=None))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [listener]}, daemon=True)
    thread.start()
    try:
        wait_for(lambda: server.started, "the server to start")
        yield listener.getsockname()[1], api
    finally:
        server.should_exit = True
        thread.join(30)
        listener.close()


def wait_for(condition, what: str, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout  # a hang guard only
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


def head(path: str, length: int | None) -> bytes:
    framing = f"Content-Length: {length}" if length is not None else "Transfer-Encoding: chunked"
    return f"POST {path} HTTP/1.1\r\nHost: gw\r\nContent-Type: application/json\r\n{framing}\r\n\r\n".encode()


class Held:
    """A request whose head and the first part of its body are sent, the rest held back until finish()."""

    def __init__(self, port: int, path: str, body: bytes):
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=60)
        self.rest = body[len(body) // 2 :]
        self.sock.sendall(head(path, len(body)) + body[: len(body) // 2])

    def finish(self) -> tuple[int, dict, dict]:
        self.sock.sendall(self.rest)
        return reply(self.sock)


def reply(sock: socket.socket) -> tuple[int, dict, dict]:
    """(status, headers, JSON body) of one response; the connection is closed after."""
    data = b""
    with sock:
        while b"\r\n\r\n" not in data:
            data += sock.recv(65536) or b"\0"
        top, _, rest = data.partition(b"\r\n\r\n")
        lines = top.decode().split("\r\n")
        headers = dict(line.lower().split(": ", 1) for line in lines[1:])
        length = int(headers["content-length"])
        while len(rest) < length:
            more = sock.recv(65536)
            assert more, "the connection closed mid-body"
            rest += more
    return int(lines[0].split()[1]), headers, json.loads(rest[:length])


def send(port: int, path: str, body: bytes, chunked: bool = False) -> tuple[int, dict, dict]:
    sock = socket.create_connection(("127.0.0.1", port), timeout=60)
    if chunked:
        sock.sendall(head(path, None) + b"%x\r\n%s\r\n0\r\n\r\n" % (len(body), body))
    else:
        sock.sendall(head(path, len(body)) + body)
    return reply(sock)


def prompt_of(num_bytes: int) -> bytes:
    """A /tokenize body of exactly num_bytes."""
    return json.dumps({"prompt": "x" * (num_bytes - len('{"prompt": ""}'))}).encode()


def test_bodies_past_the_byte_budget_get_429_while_those_let_in_go_on(tokenizer):
    with serving(tokenizer, max_waiting_bytes=150_000) as (port, api):
        large = prompt_of(100_000)
        held = Held(port, "/tokenize", large)  # let in: its Content-Length is charged before its body is read
        wait_for(lambda: api.admission.num_unanswered == 1, "the held request to be let in")
        for path in ("/tokenize", "/detokenize", "/v1/completions", "/v1/chat/completions"):
            status, headers, body = send(port, path, large)
            assert status == 429 and headers.get("retry-after") == "1", (path, status, body)
            assert body["error"]["type"] == "rate_limit_error" and "bytes" in body["error"]["message"], body
        status, _, body = send(port, "/tokenize", large, chunked=True)  # counted as the Guards read it
        assert status == 429, body
        # A small one fits beside the held one.
        assert send(port, "/tokenize", json.dumps({"prompt": "hello"}).encode())[0] == 200
        status, _, body = held.finish()
        assert status == 200 and body["count"] > 0
        wait_for(lambda: api.admission.num_unanswered_bytes == 0, "the budget to be given back")
        assert send(port, "/tokenize", large)[0] == 200


def test_a_lone_body_larger_than_the_budget_is_let_in(tokenizer):
    with serving(tokenizer, max_waiting_bytes=1000) as (port, _):
        assert send(port, "/tokenize", prompt_of(5000))[0] == 200


def test_tokenize_and_detokenize_count_against_max_waiting(tokenizer):
    with serving(tokenizer, max_waiting=1) as (port, api):
        held = Held(port, "/detokenize", json.dumps({"tokens": [5] * 500}).encode())
        wait_for(lambda: api.admission.num_unanswered == 1, "the held request to be let in")
        for path, body in (
            ("/tokenize", {"prompt": "hi"}),
            ("/detokenize", {"tokens": [5]}),
            ("/v1/completions", {"prompt": "hi"}),
        ):
            status, headers, reply_body = send(port, path, json.dumps(body).encode())
            assert status == 429 and headers.get("retry-after") == "1", (path, status, reply_body)
            assert "too many requests waiting" in reply_body["error"]["message"]
        assert held.finish()[0] == 200
        wait_for(lambda: api.admission.num_unanswered == 0, "the held request to be answered")
        assert send(port, "/tokenize", json.dumps({"prompt": "hi"}).encode())[0] == 200


def test_a_chunked_body_is_read_under_a_reservation_of_the_largest_body(tokenizer):
    """Nobody knows a chunked body's size until it is read, and the Guards read it whole before the route's
    admission: read under a reservation of --max-body-size, so that bodies read at once are bounded too."""
    with serving(tokenizer, max_waiting_bytes=150_000) as (port, api):
        body = prompt_of(1000)
        held = socket.create_connection(("127.0.0.1", port), timeout=60)
        held.sendall(head("/tokenize", None) + b"%x\r\n%s" % (len(body), body[:500]))  # half of its one chunk
        wait_for(lambda: api.admission.num_unanswered_bytes >= api.config.max_body_size, "the reservation")
        for chunked in (True, False):
            status, headers, reply_body = send(port, "/tokenize", prompt_of(100_000), chunked=chunked)
            assert status == 429 and headers.get("retry-after") == "1", (chunked, status, reply_body)
        held.sendall(body[500:] + b"\r\n0\r\n\r\n")
        status, _, reply_body = reply(held)
        assert status == 200 and reply_body["count"] > 0
        wait_for(lambda: api.admission.num_unanswered_bytes == 0, "the reservation to be given back")
        assert send(port, "/tokenize", prompt_of(100_000), chunked=True)[0] == 200


def test_one_admission_holds_both_bounds_and_what_they_count(tokenizer):
    """The count's bound and the bytes' bound, and the requests and bytes let in, all in one Admission: the Api's,
    built with both from the gateway's config."""
    admission = Admission(max_waiting=2, max_waiting_bytes=100)
    assert admission.refusal(1000) is None  # a lone request, whatever its size
    admission.admit(60)
    refused = admission.refusal(50)
    assert refused.status == 429 and "bytes" in refused.message
    assert admission.refusal(40) is None
    admission.admit(40)
    refused = admission.refusal(0)
    assert refused.status == 429 and "too many requests waiting (2)" in refused.message
    admission.release(60)
    admission.release(40)
    assert (admission.num_unanswered, admission.num_unanswered_bytes) == (0, 0)
    core = GatewayCore("tcp://127.0.0.1:0", MODEL, 16)
    try:
        api = Api(core, tokenizer, MODEL, 2048, GatewayConfig(max_waiting=3, max_waiting_bytes=7))
        assert (api.admission.max_waiting, api.admission.max_waiting_bytes) == (3, 7)
    finally:
        core.control.close()

"""The gateway bench's client (bench/sse_load.py): its count of a streamed response's events, whatever the reads
it comes in, and its check of a finished stream (a short stream, a missing usage chunk or [DONE], a refusal, a
status line cut short by the first read); and a client process that crashes is an error that quotes its stderr."""

import asyncio
import json
import subprocess
import sys
import tempfile

import pytest

from kvferry.common.errors import KvferryError
from kvferry.tools.bench.gateway import Client
from kvferry.tools.bench.sse_load import StreamCounter, check

TOKENS = 4
HEAD = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"


def chunk(payload: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(payload), payload)


def event(body) -> bytes:
    return b"data: " + (body if isinstance(body, bytes) else json.dumps(body).encode()) + b"\n\n"


def response(num_tokens: int = TOKENS, usage: int | None = TOKENS, done: bool = True, head: bytes = HEAD) -> bytes:
    """A streamed chat completion as the gateway frames it: the role chunk, a chunk per token (the last with its
    finish reason), the usage chunk, [DONE], each event its own HTTP chunk."""
    events = [event({"choices": [{"index": 0, "delta": {"role": "assistant"}, "finish_reason": None}]})]
    for i in range(num_tokens):
        reason = "length" if i == num_tokens - 1 else None
        events.append(event({"choices": [{"index": 0, "delta": {"content": " fox"}, "finish_reason": reason}]}))
    if usage is not None:
        events.append(event({"choices": [], "usage": {"prompt_tokens": 9, "completion_tokens": usage}}))
    if done:
        events.append(event(b"[DONE]"))
    return head + b"".join(map(chunk, events)) + b"0\r\n\r\n"


def received(data: bytes, cuts: list[int]) -> StreamCounter:
    """A StreamCounter fed data in the reads that cuts (offsets) make of it, then closed."""

    async def feed() -> StreamCounter:
        counter = StreamCounter(b"")
        for start, end in zip([0, *cuts], [*cuts, len(data)]):
            if end > start:
                counter.data_received(data[start:end])
        counter.connection_lost(None)
        return counter

    return asyncio.run(feed())


def test_a_whole_response_passes_however_its_bytes_are_split():
    data = response()
    assert check(received(data, []), TOKENS) is None
    for at in range(1, len(data)):  # two reads, cut at every byte: a blank line or the status line split too
        assert check(received(data, [at]), TOKENS) is None, at
    assert check(received(data, list(range(1, len(data)))), TOKENS) is None  # a byte a read


def test_a_status_line_in_pieces_is_whole_before_it_is_judged():
    data = response()
    counter = received(data, [5, 9, 11])  # "HTTP/" "1.1 " "20" "0 OK\r\n...": every read under 12 bytes
    assert bytes(counter.head).startswith(b"HTTP/1.1 200 OK\r\n") and check(counter, TOKENS) is None
    refused = b"HTTP/1.1 429 Too Many Requests\r\ncontent-length: 2\r\n\r\n{}"
    assert "429" in check(received(refused, [3]), TOKENS)


@pytest.mark.parametrize(
    "data, says",
    [
        (response(num_tokens=TOKENS - 1, usage=TOKENS), "3 token chunks"),  # a token's event lost
        (response(num_tokens=TOKENS - 1, usage=TOKENS - 1), "3 tokens in its usage"),  # a short stream
        (response(usage=None), "without its usage chunk"),
        (response(done=False), "[DONE]"),
        (response()[: len(response()) // 2], "without its usage chunk"),  # cut off midway
    ],
)
def test_a_stream_not_exactly_its_tokens_is_a_failure_that_says_why(data, says):
    why = check(received(data, [len(data) // 3]), TOKENS)
    assert why is not None and says in why, why


def test_a_client_that_crashes_is_an_error_with_its_stderr():
    stderr = tempfile.TemporaryFile("w+")
    crash = "import sys; print('ready', flush=True); sys.stdin.readline(); sys.exit('boom: the client broke')"
    proc = subprocess.Popen(
        [sys.executable, "-c", crash], stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=stderr, text=True
    )
    client = Client(proc, stderr)
    try:
        assert client.line() == "ready\n"
        client.go()
        with pytest.raises(KvferryError, match="exit status 1") as error:
            client.figures()
        assert "boom: the client broke" in str(error.value)
    finally:
        client.close()

"""`kvferry bench gateway`'s load: concurrent streaming chat completions from one process, as cheap per token as a
client can be, so that the gateway and not the client is what is measured. Raw HTTP/1.1 over asyncio protocols: the
bytes of each response are counted as they come, never parsed per event. A server-sent event ends in a blank line
("\\n\\n"), which the chunked framing around it ("\\r\\n<size>\\r\\n") cannot make or split into two, so the
blank lines in the raw bytes count the events; only the last ones (the finish reason, the usage) are decoded, once
the response ends. What is checked of each stream: its status 200, its number of events (one per token besides the
role chunk, the usage chunk and [DONE]), the usage's completion_tokens, and a finish reason "length"; not what each
event holds. Anything else is a failure, reported.

Run as `python -m kvferry.tools.bench.sse_load HOST PORT STREAMS TOKENS STOP MODEL`: it connects nothing until a
line comes on stdin (the bench reads every process's CPU first), then prints one JSON line of figures.
"""

import asyncio
import json
import re
import sys
import time

NON_TOKEN_EVENTS = 3  # the role chunk, the usage chunk and [DONE]
TAIL_BYTES = 4096  # kept of each response: its last events
MAX_HEAD_BYTES = 200  # kept of each response's start, until its status line is whole
USAGE = re.compile(rb'"usage":\s*\{')
FINISHED_FOR_LENGTH = re.compile(rb'"finish_reason":\s*"length"')


def chat_request(host: str, port: int, tokens: int, stop: str, model: str) -> bytes:
    body = json.dumps(
        {
            "model": model,
            "messages": [{"role": "user", "content": "Say something."}],
            "max_tokens": tokens,
            "ignore_eos": True,
            "stop": [stop],
            "stream": True,
            "stream_options": {"include_usage": True},
        }
    ).encode()
    head = (
        f"POST /v1/chat/completions HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
    )
    return head.encode() + body


class StreamCounter(asyncio.Protocol):
    """One request's response: its bytes' blank lines counted, its tail kept."""

    def __init__(self, request: bytes):
        self.request = request
        self.num_blank_lines = 0
        self.ended_in_newline = False
        self.head = bytearray()  # the response's first bytes: its status line, whatever the first read brought
        self.head_whole = False
        self.tail = bytearray()
        self.done = asyncio.get_running_loop().create_future()

    def connection_made(self, transport) -> None:
        transport.write(self.request)

    def data_received(self, data: bytes) -> None:
        self.num_blank_lines += data.count(b"\n\n") + (self.ended_in_newline and data[:1] == b"\n")
        self.ended_in_newline = data[-1:] == b"\n"
        if not self.head_whole:
            self.head += data[: MAX_HEAD_BYTES - len(self.head)]
            self.head_whole = b"\r\n" in self.head or len(self.head) >= MAX_HEAD_BYTES
        self.tail += data
        if len(self.tail) > 2 * TAIL_BYTES:
            del self.tail[:-TAIL_BYTES]

    def connection_lost(self, exc) -> None:
        if not self.done.done():
            self.done.set_result(exc)


def check(counter: StreamCounter, tokens: int) -> str | None:
    """Why a finished response is not exactly tokens tokens, finished for their length (None: it is)."""
    status_line = bytes(counter.head).partition(b"\r\n")[0]
    if status_line.split(b" ", 2)[:2] != [b"HTTP/1.1", b"200"]:
        return f"answered {bytes(counter.head[:120])!r}"
    num_events = counter.num_blank_lines - NON_TOKEN_EVENTS
    tail = bytes(counter.tail)
    usage = list(USAGE.finditer(tail))
    if not usage:
        return f"ended without its usage chunk: ...{tail[-300:]!r}"
    at = usage[-1].start()
    start, end = tail.rfind(b"data: ", 0, at) + len(b"data: "), tail.find(b"\n\n", at)
    if end < 0 or b"data: [DONE]\n\n" not in tail[end:]:
        return f"did not end with its usage chunk and [DONE]: ...{tail[-300:]!r}"
    try:
        completion_tokens = json.loads(tail[start:end])["usage"]["completion_tokens"]
    except (ValueError, KeyError, TypeError):
        return f"a usage chunk that does not parse: {tail[start:end][:300]!r}"
    if completion_tokens != tokens or num_events != tokens:
        return f"{completion_tokens} tokens in its usage and {num_events} token chunks, expected {tokens}"
    if not FINISHED_FOR_LENGTH.search(tail):
        return f"did not finish for its length: ...{tail[-300:]!r}"
    return None


async def run_load(host: str, port: int, streams: int, tokens: int, stop: str, model: str) -> dict:
    loop = asyncio.get_running_loop()
    request = chat_request(host, port, tokens, stop, model)
    cpu_at, started = time.process_time(), time.time()
    counters = []
    for _ in range(streams):
        counter = StreamCounter(request)
        await loop.create_connection(lambda c=counter: c, host, port)
        counters.append(counter)
    errors = await asyncio.gather(*(c.done for c in counters))
    ended = time.time()
    failures = [str(e) for e in errors if e is not None] + [why for c in counters if (why := check(c, tokens))]
    return {
        "streams": streams,
        "started": started,
        "ended": ended,
        "cpu_s": time.process_time() - cpu_at,
        "tokens": streams * tokens if not failures else 0,
        "failures": failures[:5],
        "num_failures": len(failures),
    }


def main(argv: list[str]) -> int:
    host, port, streams, tokens, stop, model = argv[0], int(argv[1]), int(argv[2]), int(argv[3]), argv[4], argv[5]
    print("ready", flush=True)
    sys.stdin.readline()
    print(json.dumps(asyncio.run(run_load(host, port, streams, tokens, stop, model))), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

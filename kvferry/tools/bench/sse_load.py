"""`kvferry bench gateway`'s load: concurrent streaming chat completions from one process, as cheap per token as a
client can be, so that the gateway and not the client is what is measured. Raw HTTP/1.1 over asyncio protocols: the
bytes of each response are counted as they come, never parsed per event. A server-sent event ends in a blank line
("\\n\\n"), which the chunked framing around it ("\\r\\n<size>\\r\\n") cannot make or split into two, so the blank lines in
the raw bytes count the events; only the last ones (the finish reason, the usage) are decoded, once the response
ends. Each stream must get exactly its tokens, one content chunk each; anything else is a failure, reported.

Run as `python -m kvferry.tools.bench.sse_load HOST PORT STREAMS TOKENS STOP`: it connects nothing until a line
comes on stdin (the bench reads every process's CPU first), then prints one JSON line of figures.
"""

import asyncio
import json
import sys
import time

NON_TOKEN_EVENTS = 3  # the role chunk, the usage chunk and [DONE]
TAIL_BYTES = 4096  # kept of each response: its last events


def chat_request(host: str, port: int, tokens: int, stop: str) -> bytes:
    body = json.dumps(
        {
            "model": "kvferry-synthetic",
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
        self.head = b""  # the response's first bytes: its status line
        self.tail = bytearray()
        self.done = asyncio.get_running_loop().create_future()

    def connection_made(self, transport) -> None:
        transport.write(self.request)

    def data_received(self, data: bytes) -> None:
        self.num_blank_lines += data.count(b"\n\n") + (self.ended_in_newline and data[:1] == b"\n")
        self.ended_in_newline = data[-1:] == b"\n"
        if not self.head:
            self.head = data[:200]
        self.tail += data
        if len(self.tail) > 2 * TAIL_BYTES:
            del self.tail[:-TAIL_BYTES]

    def connection_lost(self, exc) -> None:
        if not self.done.done():
            self.done.set_result(exc)


def check(counter: StreamCounter, tokens: int) -> str | None:
    """Why a finished response is not exactly tokens tokens, finished for their length (None: it is)."""
    if not counter.head.startswith(b"HTTP/1.1 200"):
        return f"answered {bytes(counter.head[:120])!r}"
    num_events = counter.num_blank_lines - NON_TOKEN_EVENTS
    tail = bytes(counter.tail)
    at = tail.rfind(b'"usage": {')
    if at < 0 or b"data: [DONE]" not in tail[at:]:
        return f"ended without its usage chunk: ...{tail[-300:]!r}"
    start, end = tail.rfind(b"data: ", 0, at) + len(b"data: "), tail.find(b"\n\n", at)
    completion_tokens = json.loads(tail[start:end])["usage"]["completion_tokens"]
    if completion_tokens != tokens or num_events != tokens:
        return f"{completion_tokens} tokens in its usage and {num_events} token chunks, expected {tokens}"
    if b'"finish_reason": "length"' not in tail:
        return f"did not finish for its length: ...{tail[-300:]!r}"
    return None


async def run_load(host: str, port: int, streams: int, tokens: int, stop: str) -> dict:
    loop = asyncio.get_running_loop()
    request = chat_request(host, port, tokens, stop)
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
    host, port, streams, tokens, stop = argv[0], int(argv[1]), int(argv[2]), int(argv[3]), argv[4]
    print("ready", flush=True)
    sys.stdin.readline()
    print(json.dumps(asyncio.run(run_load(host, port, streams, tokens, stop))), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

"""The tools' one client for a streamed OpenAI-style response: the server-sent events' JSON chunks, each timed from
the moment the request went out. A refused request (any status but 200) raises Refused as the block opens; leaving
the block, however early, closes the connection, and the server aborts the request.
"""

import json
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass


@dataclass(frozen=True)
class Chunk:
    at_s: float  # seconds from sending the request to reading this chunk
    data: dict

    @property
    def error(self) -> str | None:
        """The message of an error the server reported in the stream (None for an ordinary chunk)."""
        if "error" not in self.data:
            return None
        error = self.data["error"]
        return str(error.get("message", error)) if isinstance(error, dict) else str(error)


class Refused(Exception):
    """The server answered with a status other than 200, after answered_s seconds."""

    def __init__(self, status: int, headers, message: str, answered_s: float):
        super().__init__(f"HTTP {status}: {message}")
        self.status, self.headers, self.message, self.answered_s = status, headers, message, answered_s


class Stream:
    def __init__(self, response, sent: float):
        self.response, self.sent = response, sent
        self.readers: list = []  # the chunks() iterators handed out: closed with the stream

    def elapsed_s(self) -> float:
        return time.perf_counter() - self.sent

    def chunks(self) -> AsyncIterator[Chunk]:
        """Each `data:` event's JSON, in order, up to the stream's end; the closing [DONE] is not a chunk."""
        self.readers.append(self._read())
        return self.readers[-1]

    async def _read(self) -> AsyncIterator[Chunk]:
        async for line in self.response.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                yield Chunk(self.elapsed_s(), json.loads(line[6:]))


@asynccontextmanager
async def open_stream(client, url: str, body: dict) -> AsyncIterator[Stream]:
    """POST body to url on client (an httpx.AsyncClient) and stream the answer."""
    sent = time.perf_counter()
    async with client.stream("POST", url, json=body) as response:
        if response.status_code != 200:
            raw = await response.aread()
            raise Refused(response.status_code, response.headers, error_text(raw), time.perf_counter() - sent)
        stream = Stream(response, sent)
        try:
            yield stream
        finally:
            for reader in stream.readers:  # one left early (a break, a return) stops reading before the close
                await reader.aclose()


def error_text(raw: bytes) -> str:
    """An error body's message: error.message of an OpenAI-style error, else the body's first 500 characters."""
    try:
        body = json.loads(raw)
        return str(body["error"]["message"]) if isinstance(body.get("error"), dict) else str(body)[:500]
    except (ValueError, AttributeError, KeyError):
        return raw[:500].decode(errors="replace")


def greedy_completion(model: str, prompt, max_tokens: int, usage: bool = False) -> dict:
    """A streamed /v1/completions body whose output is exactly max_tokens greedy tokens (ignore_eos); usage: the
    last chunk carries the token counts."""
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    if usage:
        body["stream_options"] = {"include_usage": True}
    return body

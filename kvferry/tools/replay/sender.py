"""Sending captured requests again, each at its captured offset (scaled). Every request goes out streamed, whatever
it was captured as, so that its tokens can be timed, and asks for the output's token ids (`return_token_ids`, vLLM's
and kvferry's) unless told not to, so that a difference is placed at a token too.
"""

import asyncio
import contextlib
import copy
import time
from dataclasses import dataclass, field

from kvferry.common.capture import Record
from kvferry.common.errors import KvferryError
from kvferry.tools.sse_client import Refused, open_stream

ENDPOINTS = ("/v1/completions", "/v1/chat/completions")
CONNECT_TIMEOUT_S = 5.0


@dataclass
class Replayed:
    status: int = 0
    error: str = ""
    output_text: dict[int, str] = field(default_factory=dict)  # per choice index
    output_token_ids: dict[int, list[int]] = field(default_factory=dict)  # where the server returned them
    finish_reasons: dict[int, str | None] = field(default_factory=dict)
    ttft_s: float | None = None
    itl_s: list[float] = field(default_factory=list)
    e2e_s: float = 0.0
    tool_calls: bool = False  # the chat answered with tool calls: its text holds only the content around them


def replayable(record: Record) -> bool:
    return isinstance(record.body, dict) and record.endpoint in ENDPOINTS


def request_body(record: Record, model: str | None, token_ids: bool) -> dict:
    body = copy.deepcopy(record.body)
    body["model"] = model or body.get("model") or record.model
    body["stream"] = True
    body["stream_options"] = {"include_usage": True}
    if token_ids:
        body["return_token_ids"] = True
    return body


async def check_reachable(client, url: str) -> None:
    """Fail at once, with what to do, when nothing answers at url or it refuses the key."""
    import httpx

    try:
        response = await client.get(url + "/v1/models", timeout=CONNECT_TIMEOUT_S)
    except httpx.HTTPError as exc:
        raise KvferryError(
            f"cannot reach {url}: {exc or type(exc).__name__}; is the server up, is the URL right?"
        ) from None
    if response.status_code in (401, 403):
        raise KvferryError(f"{url} refused the API key (HTTP {response.status_code}); give it with --api-key")


async def send(client, url: str, record: Record, body: dict) -> Replayed:
    out, sent = Replayed(), time.perf_counter()
    last_at: dict[int, float] = {}
    try:
        async with open_stream(client, url + record.endpoint, body) as stream:
            out.status = 200
            async for chunk in stream.chunks():
                if chunk.error is not None:
                    out.error = chunk.error
                    continue
                for choice in chunk.data.get("choices") or []:
                    _take(out, choice, chunk.at_s, last_at)
    except Refused as refused:
        out.status, out.error = refused.status, refused.message
        return out
    except Exception as exc:  # a dropped connection, a malformed chunk: this request's error, not the replay's end
        out.error = out.error or f"{type(exc).__name__}: {exc}"
    out.e2e_s = time.perf_counter() - sent
    return out


def _take(out: Replayed, choice: dict, at: float, last_at: dict[int, float]) -> None:
    """One streamed choice delta into the request's answer, timing the tokens it brings."""
    index = choice.get("index", 0)
    delta = choice.get("delta")
    text = (delta.get("content") if delta is not None else choice.get("text")) or ""
    out.tool_calls |= bool(delta and delta.get("tool_calls"))
    ids = choice.get("token_ids")
    out.output_text[index] = out.output_text.get(index, "") + text
    if ids is not None:
        out.output_token_ids.setdefault(index, []).extend(ids)
    if choice.get("finish_reason") is not None:
        out.finish_reasons[index] = choice["finish_reason"]
    num_tokens = len(ids) if ids is not None else int(bool(text))
    if not num_tokens:
        return
    if out.ttft_s is None:
        out.ttft_s = at
    if index in last_at:
        out.itl_s.extend([(at - last_at[index]) / num_tokens] * num_tokens)
    last_at[index] = at


async def replay_all(
    url: str,
    records: list[Record],
    speed: float = 1.0,
    concurrency: int = 0,
    model: str | None = None,
    api_key: str | None = None,
    token_ids: bool = True,
) -> tuple[list[Replayed], float]:
    """Every record sent at its captured offset divided by speed, at most concurrency at once (0: no cap); the
    answers in the records' order, and the replay's duration."""
    import httpx

    headers = {"authorization": f"Bearer {api_key}"} if api_key else {}
    limits = httpx.Limits(max_connections=(concurrency or len(records)) + 4)
    async with httpx.AsyncClient(timeout=httpx.Timeout(900.0), limits=limits, headers=headers) as client:
        await check_reachable(client, url)
        gate = asyncio.Semaphore(concurrency) if concurrency else contextlib.nullcontext()
        first = records[0].arrival_unix if records else 0.0
        start = time.perf_counter()

        async def one(record: Record) -> Replayed:
            await asyncio.sleep(max(0.0, (record.arrival_unix - first) / speed - (time.perf_counter() - start)))
            async with gate:
                return await send(client, url, record, request_body(record, model, token_ids))

        answers = await asyncio.gather(*(one(r) for r in records))
        return list(answers), time.perf_counter() - start

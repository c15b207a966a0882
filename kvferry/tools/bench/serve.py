"""Replay a workload over HTTP against a running stack: streaming completions, all at once or at a Poisson rate."""

import asyncio
import json
import time

from kvferry.tools.percentiles import summary
from kvferry.tools.sse_client import Refused, greedy_completion, open_stream


async def _one(client, url: str, model: str, request: dict, start: float, extra_body: dict) -> dict:
    await asyncio.sleep(max(0.0, request["arrival_s"] - (time.perf_counter() - start)))
    body = extra_body | greedy_completion(model, request["prompt_token_ids"], request["max_tokens"], usage=True)
    token_at, num_tokens, kv_transfer_s = [], 0, 0.0
    try:
        async with open_stream(client, url + "/v1/completions", body) as stream:
            async for chunk in stream.chunks():
                if chunk.error is not None:
                    raise RuntimeError(f"{request['id']}: {chunk.data['error']}")
                if chunk.data["choices"]:
                    token_at.append(chunk.at_s)
                    kv_transfer_s = chunk.data.get("kvferry", {}).get("kv_transfer_s", kv_transfer_s)
                if chunk.data.get("usage"):
                    num_tokens = chunk.data["usage"]["completion_tokens"]
    except Refused as refused:
        raise RuntimeError(f"{request['id']}: {refused}") from None
    if num_tokens != request["max_tokens"]:
        raise RuntimeError(f"{request['id']}: {num_tokens} tokens, expected {request['max_tokens']}")
    tpot = (token_at[-1] - token_at[0]) / max(1, len(token_at) - 1)
    return {"ttft": token_at[0], "tpot": tpot, "tokens": num_tokens, "kv_transfer_s": kv_transfer_s}


async def replay(url: str, model: str, requests: list[dict], extra_body: dict | None = None) -> dict:
    """Figures of the whole run, and per group for workloads whose requests name one. extra_body: fields every
    request also sends (a constraint, say)."""
    import httpx

    limits = httpx.Limits(max_connections=len(requests) + 4)
    async with httpx.AsyncClient(timeout=httpx.Timeout(900.0), limits=limits) as client:
        start = time.perf_counter()
        results = await asyncio.gather(*(_one(client, url, model, r, start, extra_body or {}) for r in requests))
        elapsed = time.perf_counter() - start
    total = sum(r["tokens"] for r in results)
    report = {
        "elapsed_s": round(elapsed, 2),
        "output_tokens": total,
        "output_tok_per_s": round(total / elapsed, 1),
        "requests_per_s": round(len(requests) / elapsed, 3),
        **_latencies(results),
    }
    groups = sorted({r["group"] for r in requests if "group" in r})
    if groups:
        report["groups"] = {
            g: _latencies([res for req, res in zip(requests, results) if req.get("group") == g]) for g in groups
        }
    return report


def _latencies(results: list[dict]) -> dict:
    values = lambda key: [r[key] for r in results]
    return {
        **summary(values("ttft"), (50, 99), digits=4, key="ttft_{}_s"),
        **summary(values("tpot"), (50, 99), 1000, 1, key="tpot_{}_ms"),
        **summary(values("kv_transfer_s"), (50, 99), 1000, 2, key="kv_transfer_{}_ms"),
    }


def served_quantization(url: str) -> str | None:
    """The quantization kvferry's workers at url compute with ("int8"), from /v1/workers; None for float weights,
    or from a server without /v1/workers."""
    import urllib.request

    try:
        with urllib.request.urlopen(url + "/v1/workers", timeout=5) as r:
            found = {w.get("quantization", "none") for w in json.loads(r.read())["workers"]}
    except (OSError, ValueError, KeyError):
        return None
    return None if found <= {"none"} else "/".join(sorted(found - {"none"}))


def prefill_counters(url: str, num_prompts: int = 0, timeout_s: float = 10.0) -> dict | None:
    """kvferry's prompt counters summed over its prefill workers, once they count num_prompts prefilled prompts
    (stats ride on heartbeats, so they lag a little); None from a server without /v1/workers."""
    import urllib.request

    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with urllib.request.urlopen(url + "/v1/workers", timeout=5) as r:
                workers = [w for w in json.loads(r.read())["workers"] if w["role"] == "prefill"]
        except (OSError, ValueError, KeyError):
            return None
        counters = {
            key: sum(w[key] for w in workers)
            for key in (
                "prompts_prefilled",
                "prompt_tokens_computed",
                "prompt_tokens_cached",
                "kv_bytes_sent",
                "kv_bytes_skipped",
            )
        }
        if counters["prompts_prefilled"] >= num_prompts or time.monotonic() > deadline:
            return counters
        time.sleep(0.25)


def counters_delta(before: dict | None, after: dict | None) -> dict | None:
    if before is None or after is None:
        return None
    delta = {k: after[k] - before[k] for k in after}
    computed, cached = delta["prompt_tokens_computed"], delta["prompt_tokens_cached"]
    sent, skipped = delta["kv_bytes_sent"], delta["kv_bytes_skipped"]
    return {
        **delta,
        "cached_share": round(cached / max(1, computed + cached), 4),
        "kv_bytes_saved_share": round(skipped / max(1, sent + skipped), 4),
    }

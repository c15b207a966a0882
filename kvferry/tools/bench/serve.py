"""Replay a workload over HTTP against a running stack: streaming completions, all at once or at a Poisson rate."""

import asyncio
import json
import time

import numpy as np


async def _one(client, url: str, model: str, request: dict, start: float, extra_body: dict) -> dict:
    await asyncio.sleep(max(0.0, request["arrival_s"] - (time.perf_counter() - start)))
    body = {
        **extra_body,
        "model": model,
        "prompt": request["prompt_token_ids"],
        "max_tokens": request["max_tokens"],
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    sent = time.perf_counter()
    token_times, num_tokens, kv_transfer_s = [], 0, 0.0
    async with client.stream("POST", url + "/v1/completions", json=body) as response:
        if response.status_code != 200:
            raise RuntimeError(f"{request['id']}: HTTP {response.status_code}: {await response.aread()}")
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                raise RuntimeError(f"{request['id']}: {chunk['error']}")
            if chunk["choices"]:
                token_times.append(time.perf_counter())
                kv_transfer_s = chunk.get("kvferry", {}).get("kv_transfer_s", kv_transfer_s)
            if chunk.get("usage"):
                num_tokens = chunk["usage"]["completion_tokens"]
    if num_tokens != request["max_tokens"]:
        raise RuntimeError(f"{request['id']}: {num_tokens} tokens, expected {request['max_tokens']}")
    ttft = token_times[0] - sent
    tpot = (token_times[-1] - token_times[0]) / max(1, len(token_times) - 1)
    return {"ttft": ttft, "tpot": tpot, "tokens": num_tokens, "kv_transfer_s": kv_transfer_s}


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
    pct = lambda key, q, unit=1: round(float(np.percentile([r[key] for r in results], q)) * unit, 4)
    return {
        "ttft_p50_s": pct("ttft", 50),
        "ttft_p99_s": pct("ttft", 99),
        "tpot_p50_ms": round(pct("tpot", 50, 1000), 1),
        "tpot_p99_ms": round(pct("tpot", 99, 1000), 1),
        "kv_transfer_p50_ms": round(pct("kv_transfer_s", 50, 1000), 2),
        "kv_transfer_p99_ms": round(pct("kv_transfer_s", 99, 1000), 2),
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

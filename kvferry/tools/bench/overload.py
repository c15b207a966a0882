"""`kvferry bench overload`: the gateway at twice the rate it can sustain.

First the capacity: a batch of requests sent at once gives the requests per second the stack
completes. Then Poisson arrivals at half that rate (the sustainable baseline) and at twice it,
each for the same time. Past --max-waiting the gateway answers 429 at once; the figures show
that every request it accepts still completes, and how its TTFT compares with the baseline's.
"""

import asyncio
import json
import random
import time

import numpy as np

from kvferry.tools.bench.stack import served_model


async def _one(client, url: str, model: str, prompt: list[int], max_tokens: int, delay: float) -> dict:
    await asyncio.sleep(delay)
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    sent = time.perf_counter()
    first, num_tokens = None, 0
    async with client.stream("POST", url + "/v1/completions", json=body) as response:
        if response.status_code != 200:
            await response.aread()
            return {
                "status": response.status_code,
                "retry_after": response.headers.get("retry-after"),
                "answered_s": time.perf_counter() - sent,
            }
        async for line in response.aiter_lines():
            if line.startswith("data: {"):
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    return {"status": 500, "error": chunk["error"]}
                if chunk["choices"]:
                    first = first or time.perf_counter()
                    num_tokens += 1
    return {
        "status": 200 if num_tokens == max_tokens else 500,
        "ttft": first - sent if first else None,
        "e2e": time.perf_counter() - sent,
    }


def _requests(rng: random.Random, rate: float, duration_s: float) -> list[tuple[list[int], int, float]]:
    """(prompt, max_tokens, arrival) at a Poisson rate for duration_s; a rate of 0 sends 32 at once."""
    out, arrival = [], 0.0
    while True:
        arrival = arrival + rng.expovariate(rate) if rate else 0.0
        if (rate and arrival > duration_s) or (not rate and len(out) == 32):
            return out
        out.append(([rng.randrange(256, 40000) for _ in range(rng.randint(32, 128))], rng.randint(16, 48), arrival))


async def _run(url: str, model: str, requests) -> tuple[list[dict], float]:
    import httpx

    started = time.perf_counter()
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0), limits=httpx.Limits(max_connections=1000)) as client:
        results = await asyncio.gather(*(_one(client, url, model, p, n, a) for p, n, a in requests))
    return results, time.perf_counter() - started


def _figures(results: list[dict], elapsed: float) -> dict:
    ok = [r for r in results if r["status"] == 200]
    ttft = np.array([r["ttft"] for r in ok]) if ok else np.zeros(1)
    refused = [r for r in results if r["status"] == 429]
    pct = lambda a, q: round(float(np.percentile(a, q)), 3)
    return {
        "sent": len(results),
        "completed": len(ok),
        "refused_429": len(refused),
        "errors": len(results) - len(ok) - len(refused),
        "completed_per_s": round(len(ok) / elapsed, 3),
        "ttft_p50_s": pct(ttft, 50),
        "ttft_p99_s": pct(ttft, 99),
        "ttft_max_s": round(float(ttft.max()), 3),
        "refusal_answered_p99_ms": pct(np.array([r["answered_s"] for r in refused]) * 1000, 99) if refused else 0,
        "retry_after_on_every_429": all(r.get("retry_after") for r in refused),
    }


def overload(url: str, duration_s: float = 60.0, seed: int = 0) -> dict:
    model = served_model(url)
    rng = random.Random(seed)
    results, elapsed = asyncio.run(_run(url, model, _requests(rng, 0, 0)))
    capacity = len([r for r in results if r["status"] == 200]) / elapsed
    report = {"capacity_per_s": round(capacity, 3)}
    for label, factor in (("half", 0.5), ("double", 2.0)):
        results, elapsed = asyncio.run(_run(url, model, _requests(rng, capacity * factor, duration_s)))
        report[label] = dict(_figures(results, elapsed), rate_per_s=round(capacity * factor, 3))
    return report

"""`kvferry bench overload`: the gateway at twice the rate it can sustain.

The capacity (requests per second, from 32 sent at once), then Poisson arrivals at half and at twice it. Past
--max-waiting the gateway answers 429 at once: the figures show that every request it accepts still completes, and
its TTFT against the sustainable rate's.
"""

import asyncio
import json
import random
import time

from kvferry.common import settings
from kvferry.tools.bench.stack import fresh_stack, served_model
from kvferry.tools.percentiles import summary
from kvferry.tools.sse_client import Refused, greedy_completion, open_stream


async def _one(client, url: str, model: str, prompt: list[int], max_tokens: int, delay: float) -> dict:
    await asyncio.sleep(delay)
    first, num_tokens = None, 0
    try:
        async with open_stream(client, url + "/v1/completions", greedy_completion(model, prompt, max_tokens)) as stream:
            async for chunk in stream.chunks():
                if chunk.error is not None:
                    return {"status": 500, "error": chunk.data["error"]}
                if chunk.data["choices"]:
                    first = first if first is not None else chunk.at_s
                    num_tokens += 1
            e2e = stream.elapsed_s()
    except Refused as refused:
        return {
            "status": refused.status,
            "retry_after": refused.headers.get("retry-after"),
            "answered_s": refused.answered_s,
        }
    return {"status": 200 if num_tokens == max_tokens else 500, "ttft": first, "e2e": e2e}


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
    refused = [r for r in results if r["status"] == 429]
    answered = summary([r["answered_s"] for r in refused], (99,), 1000, 3)["p99"]
    return {
        "sent": len(results),
        "completed": len(ok),
        "refused_429": len(refused),
        "errors": len(results) - len(ok) - len(refused),
        "completed_per_s": round(len(ok) / elapsed, 3),
        **summary([r["ttft"] for r in ok] or [0.0], (50, 99, 100), digits=3, key="ttft_{}_s"),
        "refusal_answered_p99_ms": answered if refused else 0,
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


def cmd_bench_overload(args) -> int:
    with fresh_stack(args.model, {settings.env_name("max_waiting"): str(args.max_waiting)}) as (url, _):
        report = overload(url, args.duration)
    report["max_waiting"] = args.max_waiting
    if args.json:
        print(json.dumps(report))
        return 0
    print(f"capacity {report['capacity_per_s']} requests/s (32 sent at once); --max-waiting {args.max_waiting}")
    for label in ("half", "double"):
        r = report[label]
        print(
            f"at {r['rate_per_s']}/s ({label}): sent {r['sent']}, completed {r['completed']}, 429 "
            f"{r['refused_429']} (answered in p99 {r['refusal_answered_p99_ms']} ms, Retry-After on all: "
            f"{r['retry_after_on_every_429']}), errors {r['errors']}; TTFT p50/p99/max {r['ttft_p50_s']}/"
            f"{r['ttft_p99_s']}/{r['ttft_max_s']} s"
        )
    return 0

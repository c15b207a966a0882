"""The soak test_soak.py runs: many requests, a seeded fifth of them cancelled at random points, over 2 prefill and 2
decode workers. Afterwards nothing may be left: every worker's blocks free, no request in flight, and no process
grown by more than 10% in memory since warm-up. (Until 2026-12-07 also the command `kvferry bench soak`.)"""

import asyncio
import json
import random
import time
import urllib.request

from kvferry.tools.bench.stack import served_model
from kvferry.tools.sse_client import Refused, greedy_completion, open_stream

WARM_UP = 200  # requests before the memory baseline is taken (a multiple of 100)


def rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def workers_state(url: str) -> dict:
    with urllib.request.urlopen(url + "/v1/workers", timeout=10) as r:
        return json.loads(r.read())


def plan(num_requests: int, cancel_share: float, cancel_within_s: float, seed: int) -> list[tuple]:
    """The requests, drawn from the seed alone: (prompt, max_tokens, cancel) each. cancel is None, ('tokens', k):
    close the stream after k tokens (1 <= k < max_tokens), or ('time', s): close it s seconds after sending,
    wherever the request is (queued, prefilling, decoding), or after max_tokens - 1 tokens if that comes first.
    Either way a cancelled request never gets its last token, so the number cancelled is the number planned,
    however fast the stack runs."""
    rng = random.Random(seed)
    requests = []
    for _ in range(num_requests):
        prompt = [rng.randrange(256, 40000) for _ in range(rng.randint(16, 96))]
        max_tokens = rng.randint(4, 24)
        cancel = None
        if rng.random() < cancel_share:
            cancel = (
                ("tokens", rng.randint(1, max_tokens - 1))
                if rng.random() < 0.5
                else ("time", rng.uniform(0, cancel_within_s))
            )
        requests.append((prompt, max_tokens, cancel))
    return requests


async def _one(client, url: str, model: str, prompt: list[int], max_tokens: int, cancel: tuple | None) -> str:
    """-> 'ok', 'cancelled' or an error; cancel as in plan()."""
    body = greedy_completion(model, prompt, max_tokens)
    close_after = None if cancel is None else cancel[1] if cancel[0] == "tokens" else max_tokens - 1

    async def receive() -> str:
        num_tokens = 0
        try:
            async with open_stream(client, url + "/v1/completions", body) as stream:
                async for chunk in stream.chunks():
                    if chunk.error is not None:
                        return f"error {chunk.error[:80]}"
                    num_tokens += len(chunk.data["choices"])
                    if close_after is not None and num_tokens >= close_after:
                        return "cancelled"  # leaving the block closes the connection: the gateway must abort
        except Refused as refused:
            return f"http {refused.status}"
        return "ok" if num_tokens == max_tokens else f"short {num_tokens}/{max_tokens}"

    if cancel and cancel[0] == "time":
        try:
            return await asyncio.wait_for(receive(), cancel[1])
        except TimeoutError:
            return "cancelled"
    return await receive()


async def _drive(url: str, model: str, requests: list[tuple], concurrency: int, on_hundred) -> list[str]:
    import httpx

    semaphore = asyncio.Semaphore(concurrency)
    done = 0

    async def one(prompt, max_tokens, cancel) -> str:
        nonlocal done
        async with semaphore:
            outcome = await _one(client, url, model, prompt, max_tokens, cancel)
        done += 1
        if done % 100 == 0:
            on_hundred(done)
        return outcome

    async with httpx.AsyncClient(
        timeout=httpx.Timeout(300.0), limits=httpx.Limits(max_connections=concurrency * 2)
    ) as client:
        return await asyncio.gather(*(one(*request) for request in requests))


def soak(
    url: str,
    pids: dict[str, int],
    num_requests: int = 1000,
    concurrency: int = 16,
    cancel_share: float = 0.2,
    seed: int = 0,
    settle_s: float = 30.0,
    cancel_within_s: float = 0.6,
) -> dict:
    """Drive the stack at url; pids: process name -> pid, for memory. Returns the report. Half the cancellations
    close the stream after a number of tokens, half after up to cancel_within_s seconds (a request's usual
    length, so that they land while it is queued, prefilling or decoding) or one token short of the end;
    outcomes' 'cancelled' is always cancels_planned (see plan())."""
    model = served_model(url)
    trace: dict[str, list[float]] = {name: [] for name in pids}  # MiB after every 100 requests

    def sample(done: int) -> None:
        for name, pid in pids.items():
            trace[name].append(round(rss_bytes(pid) / 2**20, 1))

    requests = plan(num_requests, cancel_share, cancel_within_s, seed)
    started = time.monotonic()
    outcomes = asyncio.run(_drive(url, model, requests, concurrency, sample))
    elapsed = time.monotonic() - started
    deadline = time.monotonic() + settle_s  # heartbeats carry the final block counts
    while True:
        state = workers_state(url)
        leaks = {
            w["id"]: w["num_blocks"] - w["free_blocks"] for w in state["workers"] if w["free_blocks"] != w["num_blocks"]
        }
        stuck = state["gateway"]["requests_in_flight"]
        if (not leaks and not stuck) or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    final = {name: rss_bytes(pid) / 2**20 for name, pid in pids.items()}
    warm = {name: trace[name][WARM_UP // 100 - 1] for name in pids if len(trace[name]) >= WARM_UP // 100}
    counts: dict[str, int] = {}
    for outcome in outcomes:
        counts[outcome] = counts.get(outcome, 0) + 1
    return {
        "requests": num_requests,
        "cancels_planned": sum(cancel is not None for _, _, cancel in requests),
        "elapsed_s": round(elapsed, 1),
        "outcomes": counts,
        "blocks_leaked": leaks,
        "requests_stuck": stuck,
        "workers": len(state["workers"]),
        "moves": state["gateway"]["moves"],
        "rss_mib_every_100": trace,
        "rss_mib_final": {name: round(v, 1) for name, v in final.items()},
        "rss_growth": {name: round(final[name] / warm[name] - 1, 4) for name in warm},
    }

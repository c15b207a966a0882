"""`kvferry bench pathological`: one request made to cost the gateway the most text work it allows (a long output,
several choices, the most and longest stop strings, none matching), while a probe asks for /v1/models every 50 ms.
Both run on the gateway's event loop: the probe's latency against its idle one shows whether that work blocks it.
"""

import asyncio
import json
import logging
import threading
import time

from kvferry.common import settings
from kvferry.tools.bench.stack import fresh_stack, served_model
from kvferry.tools.percentiles import summary
from kvferry.tools.sse_client import open_stream

PROBE_INTERVAL_S = 0.05
IDLE_PROBE_S = 2.0  # the probe alone first, for its latency with nothing running
NEVER_MATCHES = "\u9f98"  # a rare CJK character: a stop string of it repeated never shows up in the output


def default_stops() -> tuple[int, int]:
    """As many stop strings as the default limits allow, each of the longest allowed length."""
    length = settings.default("max_stop_length")
    return min(settings.default("max_stop"), settings.default("max_stop_chars") // length), length


def stop_strings(count: int, length: int) -> list[str]:
    return [(NEVER_MATCHES * length)[: length - len(str(i))] + str(i) for i in range(count)]


class Probe:
    """GET /v1/models every PROBE_INTERVAL_S on a thread of its own: each answer's latency, in seconds."""

    def __init__(self, url: str):
        self.url, self.latencies, self.stopping = url, [], threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        import httpx

        with httpx.Client(timeout=60.0) as client:
            due = time.perf_counter()
            while not self.stopping.is_set():
                sent = time.perf_counter()
                client.get(self.url + "/v1/models").raise_for_status()
                self.latencies.append(time.perf_counter() - sent)
                due = max(due + PROBE_INTERVAL_S, time.perf_counter())  # a late answer skips the probes it missed
                self.stopping.wait(due - time.perf_counter())

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.stopping.set()
        self.thread.join()

    def figures(self) -> dict:
        return {"probes": len(self.latencies), **summary(self.latencies, (50, 99, 100), 1000, 2, key="{}_ms")}


async def _request(url: str, body: dict) -> dict:
    """Stream the request through; its duration, chunks, output tokens and finish reasons."""
    import httpx

    chunks, usage, reasons = 0, None, {}
    async with httpx.AsyncClient(timeout=httpx.Timeout(900.0)) as client:
        async with open_stream(client, url + "/v1/completions", body) as stream:
            async for chunk in stream.chunks():
                if chunk.error is not None:
                    raise RuntimeError(f"error in the stream: {chunk.data['error']}")
                chunks += 1
                usage = chunk.data.get("usage") or usage
                for choice in chunk.data["choices"]:
                    if choice["finish_reason"]:
                        reasons[choice["index"]] = choice["finish_reason"]
            duration_s = stream.elapsed_s()
    return {
        "duration_s": round(duration_s, 2),
        "chunks": chunks,
        "output_tokens": usage["completion_tokens"] if usage else None,
        "finish_reasons": sorted(set(reasons.values())),
    }


def pathological(url: str, max_tokens: int, n: int, num_stops: int, stop_length: int) -> dict:
    logging.getLogger("httpx").setLevel(logging.WARNING)  # not a line per probe
    stops = stop_strings(num_stops, stop_length)
    body = {
        "model": served_model(url),
        "prompt": "Once upon a time",
        "max_tokens": max_tokens,
        "n": n,
        "temperature": 1.0,
        "seed": 0,
        "ignore_eos": True,
        "stop": stops,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    with Probe(url) as idle:
        time.sleep(IDLE_PROBE_S)
    with Probe(url) as busy:
        request = asyncio.run(_request(url, body))
    return {
        "request": {
            "max_tokens": max_tokens,
            "n": n,
            "stop_strings": num_stops,
            "stop_length": stop_length,
            **request,
        },
        "probe_idle": idle.figures(),
        "probe_during_request": busy.figures(),
    }


def cmd_bench_pathological(args) -> int:
    count, length = default_stops()
    stops = (args.stops or count, args.stop_length or length)
    if args.url:
        report = pathological(args.url, args.max_tokens, args.n, *stops)
    else:
        with fresh_stack(args.model) as (url, _):
            report = pathological(url, args.max_tokens, args.n, *stops)
    if args.json:
        print(json.dumps(report))
        return 0
    r, idle, busy = report["request"], report["probe_idle"], report["probe_during_request"]
    print(
        f"request: max_tokens {r['max_tokens']}, n {r['n']}, {r['stop_strings']} stop strings of {r['stop_length']} "
        f"characters: {r['duration_s']} s, {r['output_tokens']} tokens in {r['chunks']} chunks, {r['finish_reasons']}"
    )
    for label, p in (("idle", idle), ("during the request", busy)):
        print(
            f"/v1/models {label}: {p['probes']} probes, p50 {p['p50_ms']} ms, p99 {p['p99_ms']} ms, max {p['max_ms']} ms"
        )
    return 0

"""Replay a workload over HTTP against a running stack: streaming completions, all at once or at a Poisson rate."""

import asyncio
import json
import time

from kvferry.tools.bench import workload
from kvferry.tools.percentiles import summary
from kvferry.tools.sse_client import Refused, greedy_completion, open_stream


def request_body(model: str, request: dict, extra_body: dict) -> dict:
    """A workload request as a streamed /v1/completions body: exactly max_tokens tokens, sampled as it says."""
    body = greedy_completion(model, request["prompt_token_ids"], request["max_tokens"], usage=True)
    return body | extra_body | workload.sampling(request)


async def _one(client, url: str, model: str, request: dict, start: float, extra_body: dict) -> dict:
    await asyncio.sleep(max(0.0, request["arrival_s"] - (time.perf_counter() - start)))
    body = request_body(model, request, extra_body)
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
    """The quantization kvferry's workers at url compute with ("int8", "int4"), from /v1/workers; None for float weights,
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


def cmd_bench_serve(args) -> int:
    import torch

    from kvferry.common import settings
    from kvferry.common.engine_setup import resolve_device, resolve_dtype
    from kvferry.common.model_config import ModelConfig
    from kvferry.common.model_files import resolve_model
    from kvferry.tools.bench import hf_baseline
    from kvferry.tools.bench.floor import alternate_with_floor
    from kvferry.tools.bench.report import against_the_floor, say
    from kvferry.tools.bench.roofline_measure import add_quick_roofline
    from kvferry.tools.bench.stack import served_model

    hf_baseline.refuse_sampled(args)
    torch.set_num_threads(args.threads)
    model_name = served_model(args.url)
    model_dir = resolve_model(args.model)
    vocab_size = ModelConfig.load(model_dir).vocab_size
    warmup = workload.warmup(vocab_size)
    if args.sweep_rates:
        from kvferry.tools.bench.sweep import sweep_command

        asyncio.run(replay(args.url, model_name, warmup))

        def replay_at(rate: float, seed: int) -> dict:
            requests = workload.generate(args.workload, vocab_size, rate=rate, seed=seed)
            return asyncio.run(replay(args.url, model_name, requests))

        return sweep_command(args, replay_at)
    requests = workload.generate(args.workload, vocab_size, rate=args.rate)
    report = {"workload": args.workload, "rate": args.rate, "url": args.url}
    hf_model = hf_baseline.load_hf_model_dir(model_dir) if not args.no_floor or args.baseline == "hf" else None
    asyncio.run(replay(args.url, model_name, warmup))  # after the floor's model loads, just before the rounds

    def run_once(rnd: int) -> dict:
        return asyncio.run(replay(args.url, model_name, workload.for_round(requests, rnd, vocab_size)))

    baseline_once = None
    if args.baseline_url:
        baseline_model = served_model(args.baseline_url)
        asyncio.run(replay(args.baseline_url, baseline_model, warmup))

        def baseline_once(rnd: int) -> dict:
            return asyncio.run(replay(args.baseline_url, baseline_model, workload.for_round(requests, rnd, vocab_size)))

    before = prefill_counters(args.url)  # kvferry's own counters; other servers have none
    alternate_with_floor(args, "serve", run_once, hf_model, requests, report, baseline_once)
    if not args.no_roofline:
        device = resolve_device(settings.from_env("device"))  # as the floor's model: a stack started here runs there
        args.quantization = served_quantization(args.url)  # the roofline of the weights the stack reads
        dtype = resolve_dtype(settings.from_env("dtype"), device)
        add_quick_roofline(report, args, model_dir, device, dtype, requests)
    report["prefill_all_runs"] = counters_delta(
        before, prefill_counters(args.url, (before or {}).get("prompts_prefilled", 0) + args.repeat * len(requests))
    )
    # One 512-token prompt alone: its KV transfer against the time it took to reach decode.
    prompt_512 = [t for r in requests for t in r["prompt_token_ids"]][:512]
    probe_request = {"id": "probe-512", "prompt_token_ids": prompt_512, "max_tokens": 2, "arrival_s": 0.0}
    probe = asyncio.run(replay(args.url, model_name, [probe_request]))
    report["probe_512"] = {
        "ttft_s": probe["ttft_p50_s"],
        "kv_transfer_ms": probe["kv_transfer_p50_ms"],
        "transfer_share": round(probe["kv_transfer_p50_ms"] / 1000 / probe["ttft_p50_s"], 4),
    }
    say(args, "512-token prompt", report["probe_512"])
    if args.baseline == "hf":
        hf_baseline.add_hf_baseline(args, hf_model, requests, report)
    if args.json:
        print(json.dumps(report))
        return 0
    k = report["kvferry"]
    print(f"\n== {args.workload} over HTTP at {args.url} (rate {args.rate or 'all at once'}) ==")
    print(
        f"output tok/s {k['output_tok_per_s']}, requests/s {k['requests_per_s']} ({k['elapsed_s']} s; runs "
        f"{k['runs_s']} s)"
    )
    print(
        f"TTFT p50/p99 {k['ttft_p50_s']}/{k['ttft_p99_s']} s, TPOT p50/p99 {k['tpot_p50_ms']}/{k['tpot_p99_ms']} "
        f"ms, KV transfer per request p50/p99 {k['kv_transfer_p50_ms']}/{k['kv_transfer_p99_ms']} ms"
    )
    for g, figures in k.get("groups", {}).items():
        print(f"{g} prompts: TTFT p50/p99 {figures['ttft_p50_s']}/{figures['ttft_p99_s']} s")
    if report["prefill_all_runs"]:
        c = report["prefill_all_runs"]
        print(
            f"prefill workers over the {args.repeat} runs: {c['prompts_prefilled']} prompts, "
            f"{c['prompt_tokens_computed']} prompt tokens computed, {c['prompt_tokens_cached']} from the cache "
            f"({c['cached_share']:.1%}); KV shipped {c['kv_bytes_sent'] / 2**20:.0f} MiB, "
            f"{c['kv_bytes_skipped'] / 2**20:.0f} MiB left out as held by decode ({c['kv_bytes_saved_share']:.1%})"
        )
    print("\n".join(against_the_floor(report)))
    if "baseline" in report:
        b = report["baseline"]
        extra = f", {b['fraction_of_floor']:.0%} of the floor" if "fraction_of_floor" in b else ""
        print(
            f"baseline {args.baseline_url}: {b['output_tok_per_s']} tok/s (runs {b['runs_s']} s; TTFT p50/p99 "
            f"{b['ttft_p50_s']}/{b['ttft_p99_s']} s, TPOT p50/p99 {b['tpot_p50_ms']}/{b['tpot_p99_ms']} ms{extra}); "
            f"the stack is {k['speedup_vs_baseline']}x"
        )
    pr = report["probe_512"]
    print(
        f"512-token prompt: {pr['ttft_s']} s to its first token, KV transfer {pr['kv_transfer_ms']} ms "
        f"(+{pr['transfer_share']:.1%} on its way to decode)"
    )
    return 0

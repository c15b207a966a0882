"""`kvferry bench feature`: one feature on against off, each on a fresh stack, over the workload that measures it.

Rounds alternate off and on, so that a slow spell on a shared machine hits both sides; the best run of each
side is compared. The prefill workers' counters give the prompt tokens computed and taken from the cache.
"""

import asyncio
import json
import sys

from kvferry.common import settings
from kvferry.tools.bench import structured, workload
from kvferry.tools.bench.serve import counters_delta, prefill_counters, replay
from kvferry.tools.bench.stack import fresh_stack, served_model

FEATURES = {  # name: (the environment setting that turns it off, the workload that measures it)
    "prefix-caching": (settings.env_name("no_prefix_caching"), "shared-prefix"),
    "chunked-prefill": (settings.env_name("no_chunked_prefill"), "head-of-line"),
    "structured-output": (None, "std-32"),  # on: every request constrained to a JSON schema (bench/structured.py)
}


def add_parser(bench) -> None:
    p = bench.add_parser(
        "feature",
        help="a feature on against off: prefix caching over the shared-prefix workload, chunked prefill over "
        "head-of-line (each on fresh stacks), structured output over std-32 (on one stack)",
    )
    p.add_argument("--feature", required=True, choices=sorted(FEATURES))
    p.add_argument("--workload", default=None, choices=workload.NAMES, help="default: the feature's own")
    p.add_argument("--model", default=None)
    p.add_argument("--repeat", type=int, default=2, help="rounds of (off, on)")
    p.add_argument("--prefill-threads", type=int, default=1)
    p.add_argument("--decode-threads", type=int, default=1)
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_bench_feature)


def _run(args, requests: list[dict], warmup: list[dict], on: bool) -> dict:
    setting, _ = FEATURES[args.feature]
    with fresh_stack(
        args.model,
        {} if on else {setting: "1"},
        prefill_threads=args.prefill_threads,
        decode_threads=args.decode_threads,
    ) as (url, _):
        model = served_model(url)
        asyncio.run(replay(url, model, warmup))
        before = prefill_counters(url, len(warmup))
        report = asyncio.run(replay(url, model, requests))
        report["prefill"] = counters_delta(before, prefill_counters(url, len(warmup) + len(requests)))
        return report


def _ratio(off: float, on: float) -> float:
    return round(off / on, 2) if on else float("inf")


def cmd_bench_feature(args) -> int:
    if args.feature == "structured-output":
        return structured.run(args)
    from kvferry.common.model_config import ModelConfig
    from kvferry.common.model_files import resolve_model

    name = args.workload or FEATURES[args.feature][1]
    vocab_size = ModelConfig.load(resolve_model(args.model)).vocab_size
    requests = workload.generate(name, vocab_size)
    # Warm-up requests share nothing with the workload: its first prompts find an empty cache.
    warmup = [dict(r, max_tokens=4, arrival_s=0.0) for r in workload.generate("std-32", vocab_size, seed=99)[:2]]
    sides = {"off": [], "on": []}
    for i in range(args.repeat):
        for side in ("off", "on"):
            sides[side].append(_run(args, requests, warmup, side == "on"))
            print(f"round {i + 1} {args.feature} {side}: " + json.dumps(sides[side][-1]), file=sys.stderr)
    best = {side: min(runs, key=lambda r: r["ttft_p50_s"]) for side, runs in sides.items()}
    off, on = best["off"], best["on"]
    report = {
        "feature": args.feature,
        "workload": name,
        "rounds": args.repeat,
        "off": off,
        "on": on,
        "ttft_p50_speedup": _ratio(off["ttft_p50_s"], on["ttft_p50_s"]),
        "ttft_p99_speedup": _ratio(off["ttft_p99_s"], on["ttft_p99_s"]),
        "throughput_ratio": round(on["output_tok_per_s"] / off["output_tok_per_s"], 3),
    }
    if (
        on.get("prefill")
        and off.get("prefill")
        and (on["prefill"]["prompt_tokens_cached"] or off["prefill"]["prompt_tokens_cached"])
    ):
        computed_off, computed_on = off["prefill"]["prompt_tokens_computed"], on["prefill"]["prompt_tokens_computed"]
        report["prompt_tokens_computed_drop"] = round(1 - computed_on / computed_off, 4)
    if "groups" in on:
        report["groups"] = {
            g: {
                "ttft_p50_speedup": _ratio(off["groups"][g]["ttft_p50_s"], on["groups"][g]["ttft_p50_s"]),
                "ttft_p99_speedup": _ratio(off["groups"][g]["ttft_p99_s"], on["groups"][g]["ttft_p99_s"]),
            }
            for g in on["groups"]
        }
    if args.json:
        print(json.dumps(report))
        return 0
    print(f"\n== {args.feature} off vs on, workload {name} ({args.repeat} rounds, fresh stacks, best of each) ==")
    for side in ("off", "on"):
        r = best[side]
        line = (
            f"{side:>3}: TTFT p50/p99 {r['ttft_p50_s']}/{r['ttft_p99_s']} s, {r['output_tok_per_s']} tok/s "
            f"({r['elapsed_s']} s)"
        )
        if r.get("prefill"):
            c = r["prefill"]
            line += (
                f", prompt tokens computed {c['prompt_tokens_computed']}, from the cache "
                f"{c['prompt_tokens_cached']}; KV shipped {c['kv_bytes_sent'] / 2**20:.0f} MiB, left out as held "
                f"by the decode worker {c['kv_bytes_skipped'] / 2**20:.0f} MiB"
            )
        for g, figures in r.get("groups", {}).items():
            line += f"; {g} prompts TTFT p50/p99 {figures['ttft_p50_s']}/{figures['ttft_p99_s']} s"
        print(line)
    print(
        f"TTFT p50 {report['ttft_p50_speedup']}x better, p99 {report['ttft_p99_speedup']}x; throughput "
        f"{report['throughput_ratio']}x"
    )
    if "prompt_tokens_computed_drop" in report:
        print(f"prompt tokens computed drop by {report['prompt_tokens_computed_drop']:.1%}")
    for g, figures in report.get("groups", {}).items():
        print(f"{g} prompts: TTFT p50 {figures['ttft_p50_speedup']}x better, p99 {figures['ttft_p99_speedup']}x")
    return 0

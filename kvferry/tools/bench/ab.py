"""`kvferry bench ab --feature NAME`: one feature off against on, each side on a fresh stack (a gateway, 1 prefill and
1 decode worker) over the workload that measures it.

Rounds alternate off and on, so that a slow spell on a shared machine hits both sides; each side warms up with two
short requests that share no prefix with the workload. The report compares the best run of each side. Structured
output runs both sides on one stack instead (structured.py).
"""

import asyncio
import json
import os
import shutil
import sys
import tempfile
from dataclasses import dataclass

from kvferry.common import settings
from kvferry.tools.bench import structured, workload
from kvferry.tools.bench.serve import counters_delta, prefill_counters, replay
from kvferry.tools.bench.stack import fresh_stack, served_model


@dataclass(frozen=True)
class Feature:
    setting: str  # the setting the feature hangs on
    observer: bool  # the setting turns it on, naming the folder it writes to; otherwise "1" turns it off
    workload: str  # the one that measures it
    decode_threads: int = 1


FEATURES = {
    "prefix-caching": Feature("no_prefix_caching", False, "shared-prefix"),
    "chunked-prefill": Feature("no_chunked_prefill", False, "head-of-line"),
    "tracing": Feature("trace_dir", True, "std-32", decode_threads=2),
    "capture": Feature("capture_dir", True, "std-32", decode_threads=2),
}
ONE_STACK = {"structured-output": structured.run}  # every request constrained to a JSON schema, or none


def add_parser(bench) -> None:
    p = bench.add_parser(
        "ab",
        help="a feature off against on, on fresh stacks: prefix caching (shared-prefix workload), chunked prefill "
        "(head-of-line), tracing and capture (std-32); structured output (std-32, on one stack)",
    )
    p.add_argument("--feature", required=True, choices=sorted(FEATURES) + sorted(ONE_STACK))
    p.add_argument("--workload", default=None, choices=workload.NAMES, help="default: the feature's own")
    p.add_argument("--model", default=None)
    p.add_argument("--repeat", type=int, default=2, help="rounds of (off, on)")
    p.add_argument("--prefill-threads", type=int, default=1)
    p.add_argument("--decode-threads", type=int, default=None, help="default: 2 for tracing and capture, else 1")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_bench_ab)


def run_side(args, feature: Feature, requests: list[dict], warmup: list[dict], on: bool) -> dict:
    """One side's replay on a stack of its own: bench serve's figures, the prefill workers' counters over the
    workload ("prefill"), and for an observer turned on what it wrote ("written": lines and bytes)."""
    folder = tempfile.mkdtemp(prefix=f"kvferry-{feature.setting}-") if feature.observer and on else None
    value = folder if feature.observer else (None if on else "1")
    env = {settings.env_name(feature.setting): value} if value else {}
    threads = {"prefill_threads": args.prefill_threads, "decode_threads": args.decode_threads or feature.decode_threads}
    try:
        with fresh_stack(args.model, env, **threads) as (url, _):
            model = served_model(url)
            asyncio.run(replay(url, model, warmup))
            before = prefill_counters(url, len(warmup))
            report = asyncio.run(replay(url, model, requests))
            report["prefill"] = counters_delta(before, prefill_counters(url, len(warmup) + len(requests)))
        if folder:
            files = [os.path.join(folder, f) for f in os.listdir(folder)]
            lines = sum(sum(1 for _ in open(f, encoding="utf-8")) for f in files)
            report["written"] = {"lines": lines, "bytes": sum(os.path.getsize(f) for f in files)}
        return report
    finally:
        if folder:
            shutil.rmtree(folder, ignore_errors=True)


# What each comparison makes of the rounds: every run of each side ({"off": [...], "on": [...]}, bench serve's
# figures) in, the report (printed with --json) and its text out.
def _ratio(off: float, on: float) -> float:
    return round(off / on, 2) if on else float("inf")


def latency(feature: str, workload: str, sides: dict[str, list[dict]]) -> tuple[dict, str]:
    """A feature that should shorten TTFT (prefix caching, chunked prefill): each side's run with the lowest TTFT
    p50, their TTFT ratios (per prompt group too) and throughput ratio, and the drop in prompt tokens computed
    where either side took some from the cache."""
    best = {side: min(runs, key=lambda r: r["ttft_p50_s"]) for side, runs in sides.items()}
    off, on = best["off"], best["on"]
    report = {
        "feature": feature,
        "workload": workload,
        "rounds": len(sides["off"]),
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
    lines = [
        f"\n== {feature} off vs on, workload {workload} ({report['rounds']} rounds, fresh stacks, best of each) =="
    ]
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
        lines.append(line)
    lines.append(
        f"TTFT p50 {report['ttft_p50_speedup']}x better, p99 {report['ttft_p99_speedup']}x; throughput "
        f"{report['throughput_ratio']}x"
    )
    if "prompt_tokens_computed_drop" in report:
        lines.append(f"prompt tokens computed drop by {report['prompt_tokens_computed_drop']:.1%}")
    for g, figures in report.get("groups", {}).items():
        lines.append(f"{g} prompts: TTFT p50 {figures['ttft_p50_speedup']}x better, p99 {figures['ttft_p99_speedup']}x")
    return report, "\n".join(lines)


def cost(feature: str, workload: str, sides: dict[str, list[dict]]) -> tuple[dict, str]:
    """An observer (tracing, capture): each side's best throughput, what the observer costs of it (overhead: the
    share lost), and the lines and bytes it wrote in its last run."""
    off, on = sides["off"], sides["on"]
    best_off = max(r["output_tok_per_s"] for r in off)
    best_on = max(r["output_tok_per_s"] for r in on)
    report = {
        "workload": workload,
        "off_tok_per_s": [r["output_tok_per_s"] for r in off],
        "on_tok_per_s": [r["output_tok_per_s"] for r in on],
        "best_off": best_off,
        "best_on": best_on,
        "overhead": round(1 - best_on / best_off, 4),
        **on[-1]["written"],
    }
    text = "\n".join(
        [
            f"\n== {workload} over HTTP, {feature} off vs on ({len(off)} rounds, best of each) ==",
            f"{feature} off {best_off} tok/s (runs {report['off_tok_per_s']})",
            f"{feature} on  {best_on} tok/s (runs {report['on_tok_per_s']}); {report['lines']} lines, "
            f"{report['bytes'] / 2**20:.2f} MiB per run",
            f"overhead of {feature}: {report['overhead']:+.1%} of throughput",
        ]
    )
    return report, text


def cmd_bench_ab(args) -> int:
    if args.feature in ONE_STACK:
        args.decode_threads = args.decode_threads or 1
        return ONE_STACK[args.feature](args)
    from kvferry.common.model_config import ModelConfig
    from kvferry.common.model_files import resolve_model

    feature = FEATURES[args.feature]
    name = args.workload or feature.workload
    vocab_size = ModelConfig.load(resolve_model(args.model)).vocab_size
    requests = workload.generate(name, vocab_size)
    warmup = workload.warmup(vocab_size, max_tokens=4)
    sides = {"off": [], "on": []}
    for i in range(args.repeat):
        for side in ("off", "on"):
            sides[side].append(run_side(args, feature, requests, warmup, side == "on"))
            print(f"round {i + 1} {args.feature} {side}: " + json.dumps(sides[side][-1]), file=sys.stderr)
    compare = cost if feature.observer else latency
    report, text = compare(args.feature, name, sides)
    print(json.dumps(report) if args.json else text)
    return 0

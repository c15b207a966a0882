"""What `kvferry bench ab` makes of its rounds: each function takes every run of each side ({"off": [...], "on":
[...]}, bench serve's figures) and returns the report (printed with --json) and its text."""


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

"""`kvferry bench serve --sweep-rates R1,R2,...`: the workload replayed once per Poisson rate, TTFT and TPOT p50/p99
against the rate (`--plot FILE.png` draws them)."""

import json


def sweep(replay_at, rates: list[float]) -> list[dict]:
    """replay_at(rate, seed) -> bench serve's figures of the workload at that rate; one replay each, lowest rate
    first. Each rate gets its own seed: replaying the same prompts would find them in the server's prefix cache."""
    points = []
    for i, rate in enumerate(sorted(rates)):
        result = replay_at(rate, i + 1)
        points.append({"rate": rate, **{k: v for k, v in result.items() if k != "groups"}})
    return points


def plot(points: list[dict], title: str, output: str) -> None:
    import matplotlib

    matplotlib.use("Agg")  # files only: no display needed
    import matplotlib.pyplot as plt

    fig, (ttft, tpot) = plt.subplots(1, 2, figsize=(12, 4.5))
    rates = [p["rate"] for p in points]
    for q, style in (("p50", "o-"), ("p99", "s--")):
        ttft.plot(rates, [p[f"ttft_{q}_s"] for p in points], style, label=f"TTFT {q}")
        tpot.plot(rates, [p[f"tpot_{q}_ms"] for p in points], style, label=f"TPOT {q}")
    ttft.set(xlabel="request rate (requests/s)", ylabel="seconds", title="time to first token")
    tpot.set(xlabel="request rate (requests/s)", ylabel="ms per output token", title="time per output token")
    for ax in (ttft, tpot):
        ax.grid(alpha=0.3)
        ax.legend()
        for p in points:  # what the server achieved at each offered rate
            ax.annotate(
                f"{p['output_tok_per_s']:.0f} tok/s",
                (p["rate"], ax.get_ylim()[0]),
                fontsize=7,
                rotation=90,
                va="bottom",
                ha="right",
                alpha=0.6,
            )
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(output, dpi=110)
    plt.close(fig)


def sweep_command(args, replay_at) -> int:
    """bench serve's --sweep-rates, on a server already warmed up."""
    points = sweep(replay_at, args.sweep_rates)
    if args.plot:
        plot(points, f"{args.workload} at {args.url}", args.plot)
    if args.json:
        print(json.dumps({"workload": args.workload, "url": args.url, "points": points}))
        return 0
    print(f"\n== {args.workload} over HTTP at {args.url}, one replay per rate ==")
    print(f"{'rate/s':>7} {'tok/s':>7} {'TTFT p50':>9} {'TTFT p99':>9} {'TPOT p50':>9} {'TPOT p99':>9}")
    for pt in points:
        print(
            f"{pt['rate']:>7} {pt['output_tok_per_s']:>7} {pt['ttft_p50_s']:>8}s {pt['ttft_p99_s']:>8}s "
            f"{pt['tpot_p50_ms']:>7}ms {pt['tpot_p99_ms']:>7}ms"
        )
    if args.plot:
        print(f"curve drawn to {args.plot}")
    return 0

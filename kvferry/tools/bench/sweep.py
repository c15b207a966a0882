"""`kvferry bench serve --sweep-rates R1,R2,...`: the latency-throughput curve of a running server.

The workload is replayed once per request rate (Poisson arrivals, the same seeded requests), and TTFT and
TPOT p50/p99 are drawn against the achieved throughput with `--plot FILE.png`.
"""

import asyncio


def sweep(url: str, model: str, requests_at, rates: list[float]) -> list[dict]:
    """requests_at(rate, seed) -> the workload at that rate; one replay each, lowest rate first. Each rate gets
    its own seed: replaying the same prompts would find them in the server's prefix cache."""
    from kvferry.tools.bench.serve import replay

    points = []
    for i, rate in enumerate(sorted(rates)):
        result = asyncio.run(replay(url, model, requests_at(rate, i + 1)))
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

"""`kvferry simulate --plot`: latencies by arrival and each decode worker's KV usage over time, as a PNG
(matplotlib is optional)."""

from kvferry.tools.sim.report import Report


def plot_report(report: Report, output: str) -> None:
    import matplotlib

    matplotlib.use("Agg")  # files only: no display needed
    import matplotlib.pyplot as plt

    served = [r for r in report.requests if not r["error"] and r["ttft_s"] is not None]
    arrivals = [r["arrival_s"] for r in served]
    fig, axes = plt.subplots(4, 1, figsize=(12, 13), sharex=True)
    ax = axes[0]
    ax.scatter(arrivals, [r["ttft_s"] for r in served], s=4, label="TTFT")
    ax.scatter(arrivals, [r["queue_s"] for r in served], s=4, label="queueing")
    ax.set_ylabel("seconds")
    ax.legend(loc="upper left")
    ax.set_title(f"{report.shape['prefill']}P+{report.shape['decode']}D, arrivals x{report.shape['rate_scale']:g}")
    ax = axes[1]
    with_gaps = [r for r in served if r["itl_mean_s"] is not None]
    ax.scatter([r["arrival_s"] for r in with_gaps], [r["itl_mean_s"] * 1000 for r in with_gaps], s=4)
    ax.set_ylabel("mean ITL ms")
    ax = axes[2]
    finished = [r for r in served if r["e2e_s"] is not None]
    ax.scatter([r["arrival_s"] for r in finished], [r["e2e_s"] for r in finished], s=4)
    ax.set_ylabel("e2e s")
    ax = axes[3]
    for worker, samples in report.kv_usage.items():
        ax.plot([t for t, _ in samples], [u * 100 for _, u in samples], label=worker, lw=1)
    ax.set_ylabel("KV used %")
    ax.set_xlabel("virtual time s (requests by arrival)")
    if report.kv_usage:
        ax.legend(loc="upper left")
    fig.tight_layout()
    fig.savefig(output, dpi=110)
    plt.close(fig)

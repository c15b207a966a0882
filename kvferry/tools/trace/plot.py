"""`kvferry trace plot`: one request's timeline as a PNG, a lane per process, arrows for messages."""

from kvferry.tools.trace.reader import BATCH_SPANS, TraceSet, process_order

COLORS = {
    "http": "#c7d7ef",
    "queue": "#f2c14e",
    "grammar.compile": "#d4a5e8",
    "prefill": "#f08a4b",
    "kv.gather": "#8fbc8f",
    "kv.transfer_out": "#5b9f6f",
    "kv.transfer_in": "#2e7d5b",
    "decode.step": "#7b6fd0",
    "decode.recompute": "#c04d7b",
    "prefill.step": "#e76f51",
    "detokenize": "#999999",
}
LABELLED = ("PrefillRequest", "FirstToken", "KVTransfer", "KVAck", "Abort", "RequestFailed")


def plot_request(traces: TraceSet, request_id: str, events: list[dict], output: str) -> None:
    import matplotlib

    matplotlib.use("Agg")  # files only: no display needed
    import matplotlib.pyplot as plt

    procs = sorted({e["proc"] for e in events}, key=process_order)
    lane = {proc: len(procs) - 1 - i for i, proc in enumerate(procs)}  # the gateway on top
    t0 = events[0]["t"]

    def ms(t: float) -> float:
        return (t - t0) * 1000

    fig, ax = plt.subplots(figsize=(14, 1.4 + 1.1 * len(procs)))
    labelled_spans = set()
    for e in events:
        if e["ev"] != "span" or e.get("name") in ("finish", "arrival"):
            continue
        name = e.get("name", "?")
        # The http span frames the request: drawn thin, behind the rest.
        height, y = (0.7, lane[e["proc"]] - 0.35) if name != "http" else (0.15, lane[e["proc"]] + 0.3)
        ax.broken_barh(
            [(ms(e["t"]), max(e["dur"] * 1000, 0.05))],
            (y, height),
            facecolors=COLORS.get(name, "#bbbbbb"),
            edgecolor="none",
            label=name if name not in labelled_spans else None,
        )
        labelled_spans.add(name)
    for r in events:
        send = traces.send_of(r) if r["ev"] == "recv" else None
        if send is None or send["proc"] not in lane:
            continue
        kind = r.get("kind", "?")
        ax.annotate(
            "",
            xy=(ms(r["t"]), lane[r["proc"]]),
            xytext=(ms(send["t"]), lane[send["proc"]]),
            arrowprops={"arrowstyle": "->", "color": "#333333" if kind in LABELLED else "#aaaaaa", "lw": 0.8},
        )
        if kind in LABELLED:
            ax.text(
                (ms(send["t"]) + ms(r["t"])) / 2,
                (lane[send["proc"]] + lane[r["proc"]]) / 2 + 0.1,
                kind,
                fontsize=7,
                ha="center",
            )
    steps = sum(1 for e in events if e.get("name") in BATCH_SPANS)
    ax.set_yticks(list(lane.values()), list(lane.keys()))
    ax.set_ylim(-0.7, len(procs) - 0.3)
    ax.set_xlabel("ms since the request's first event")
    ax.set_title(f"{request_id}: {len(events)} events, {steps} batch steps")
    ax.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=7)
    ax.grid(axis="x", alpha=0.3)
    fig.tight_layout()
    fig.savefig(output, dpi=110)
    plt.close(fig)

"""`kvferry trace list|show|export|plot`: read a trace folder written with --trace-dir."""

import argparse
import json
import sys

from kvferry.tools.trace.reader import BATCH_SPANS, TraceError, TraceSet, load, process_order, request_of

MATES_SHOWN = 8  # batch mates named on a step's line without --verbose


def add_trace_parser(sub) -> None:
    p = sub.add_parser("trace", help="read message traces written with --trace-dir")
    tsub = p.add_subparsers(dest="trace_command", required=True)
    folder = argparse.ArgumentParser(add_help=False)  # what every subcommand takes first
    folder.add_argument("trace_dir")
    one = argparse.ArgumentParser(add_help=False, parents=[folder])
    one.add_argument("request_id")
    q = tsub.add_parser("list", parents=[folder], help="the traced requests, with latency and token counts")
    q.set_defaults(func=cmd_list)
    q = tsub.add_parser("show", parents=[one], help="one request's timeline across the gateway and the workers")
    q.add_argument("--verbose", action="store_true", help="name every batch mate of each step in full")
    q.set_defaults(func=cmd_show)
    q = tsub.add_parser("export", parents=[folder], help="Chrome trace-event JSON (open it in https://ui.perfetto.dev)")
    q.add_argument("--chrome", required=True, metavar="OUT_JSON")
    q.set_defaults(func=cmd_export)
    q = tsub.add_parser("plot", parents=[one], help="draw one request's timeline as a picture")
    q.add_argument("-o", "--output", required=True, metavar="OUT_PNG")
    q.set_defaults(func=cmd_plot)


def _load(trace_dir: str) -> TraceSet:
    traces = load(trace_dir)
    for note in traces.notes:
        print(f"note: {note}", file=sys.stderr)
    return traces


def _request(traces: TraceSet, request_id: str) -> list[dict]:
    if not request_id:
        raise TraceError("give a request id (kvferry trace list shows them)")
    events = traces.for_request(request_id)
    if not events:
        known = [r.request_id for r in traces.requests()]
        close = [rid for rid in known if request_id in rid or rid in request_id][:5]
        hint = (
            f"; did you mean {', '.join(close)}?" if close else f"; `kvferry trace list` shows the {len(known)} traced"
        )
        raise TraceError(f"no request {request_id!r} in the traces{hint}")
    return events


def cmd_list(args) -> int:
    traces = _load(args.trace_dir)
    rows = traces.requests()
    if not rows:
        print("no requests in the traces (only worker heartbeats)")
        return 0
    t0 = rows[0].start
    print(f"{'request id':<42} {'start s':>8} {'latency ms':>10} {'prompt':>6} {'output':>6}  finish   processes")
    for r in rows:
        latency = f"{r.latency_s * 1000:.1f}" if r.latency_s is not None else "-"
        prompt = "-" if r.prompt_tokens is None else r.prompt_tokens
        output = "-" if r.completion_tokens is None else r.completion_tokens
        print(
            f"{r.request_id:<42} {r.start - t0:>8.3f} {latency:>10} {prompt:>6} {output:>6}  {r.finish_reason:<8} "
            f"{','.join(r.processes)}"
        )
    print(f"{len(rows)} requests")
    return 0


def describe(r: dict, traces: TraceSet) -> tuple[str, str, str, str]:
    """(what, peer or detail, bytes, latency or duration) of one event, for `show`."""
    if r["ev"] in ("send", "recv"):
        size = r.get("header_bytes", 0) + r.get("payload_bytes", 0)
        arrow = "->" if r["ev"] == "send" else "<-"
        latency = ""
        if r["ev"] == "recv":
            send = traces.send_of(r)
            latency = f"hop {(r['t'] - send['t']) * 1000:.2f} ms" if send else "hop ? (send not traced)"
        return f"{r['ev']} {r.get('kind', '?')}", f"{arrow} {r.get('peer', '?')}", str(size), latency
    attrs = r.get("attrs", {})
    name = r.get("name", "?")
    if name == "prefill.step":
        detail = f"batch {attrs.get('batch_size', '?')}, {attrs.get('num_tokens', '?')} tokens"
    elif name in BATCH_SPANS:
        detail = f"step {attrs.get('step', '?')}, batch {attrs.get('batch_size', '?')}"
    elif name in ("finish", "http"):
        detail = (
            f"{attrs.get('status', '')} {attrs.get('finish_reason') or attrs.get('error') or ''} "
            f"{attrs.get('prompt_tokens', '?')}+{attrs.get('completion_tokens', '?')} tokens"
        )
    else:
        detail = ", ".join(f"{k}={v}" for k, v in attrs.items() if k != "rids")
    size = str(attrs.get("bytes", "")) if "bytes" in attrs else ""
    duration = f"{r['dur'] * 1000:.2f} ms" if r["dur"] else ""
    return name, detail[:48], size, duration


def abbreviated(request_id: str) -> str:
    """The part of an id that tells requests apart: 'cmpl-3f9a0c...' -> '3f9a0c'."""
    return request_id.rsplit("-", 1)[-1][:6]


def mates_line(mates: list[str], verbose: bool) -> str:
    if verbose or len(mates) <= MATES_SHOWN:
        names = mates if verbose else [abbreviated(m) for m in mates]
        return " ".join(names)
    return " ".join(abbreviated(m) for m in mates[:MATES_SHOWN]) + f" +{len(mates) - MATES_SHOWN} more"


def cmd_show(args) -> int:
    traces = _load(args.trace_dir)
    events = _request(traces, args.request_id)
    t0 = events[0]["t"]
    trace_id = next((e["trace_id"] for e in events if e.get("trace_id")), "?")
    procs = sorted({e["proc"] for e in events}, key=process_order)
    print(f"request {args.request_id}  trace {trace_id}  {len(events)} events in {', '.join(procs)}")
    print(f"{'t ms':>10}  {'process':<18} {'event':<22} {'peer / detail':<48} {'bytes':>9}  latency")
    for r in events:
        what, detail, size, latency = describe(r, traces)
        print(f"{(r['t'] - t0) * 1000:>10.3f}  {r['proc']:<18} {what:<22} {detail:<48} {size:>9}  {latency}")
        if r.get("name") in BATCH_SPANS:  # who shared the step: what a slow step's time was spent on
            mates = dict.fromkeys(request_of(rid) for rid in r.get("attrs", {}).get("rids", ()))  # in step order
            mates.pop(args.request_id, None)
            print(f"{'':>10}  {'':<18} {'':<22} with {len(mates)}: {mates_line(list(mates), args.verbose) or '-'}")
    steps = [r for r in events if r.get("name") == "decode.step"]
    sizes = [size for r in steps if isinstance(size := r.get("attrs", {}).get("batch_size"), int)]
    if sizes:
        print(f"decode steps: {len(steps)}, batch size {min(sizes)}..{max(sizes)} (mean {sum(sizes) / len(sizes):.1f})")
    for proc, offset in traces.offsets.items():
        if offset:
            print(f"note: {proc}'s times shifted by {offset * 1000:+.1f} ms (clock skew)")
    return 0


def cmd_export(args) -> int:
    from kvferry.tools.trace.chrome import chrome_trace

    traces = _load(args.trace_dir)
    document = chrome_trace(traces)
    try:
        with open(args.chrome, "w", encoding="utf-8") as f:
            json.dump(document, f, separators=(",", ":"))
    except OSError as exc:
        raise TraceError(f"cannot write {args.chrome}: {exc.strerror}") from None
    num_flows = sum(1 for e in document["traceEvents"] if e["ph"] == "s")
    print(
        f"wrote {args.chrome}: {len(document['traceEvents'])} events, {len(traces.processes)} processes, "
        f"{num_flows} message flows (open it in https://ui.perfetto.dev)"
    )
    return 0


def cmd_plot(args) -> int:
    from kvferry.tools.trace.plot import plot_request

    traces = _load(args.trace_dir)
    events = _request(traces, args.request_id)
    try:
        plot_request(traces, args.request_id, events, args.output)
    except (OSError, ValueError) as exc:  # an unwritable path, or a picture format matplotlib does not know
        raise TraceError(f"cannot write {args.output}: {exc}") from None
    print(f"wrote {args.output}")
    return 0

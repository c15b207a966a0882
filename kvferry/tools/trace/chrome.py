"""Chrome trace-event JSON of a whole trace folder, for Perfetto (ui.perfetto.dev) or chrome://tracing.

A process lane per service; in it, batch steps share a "steps" track, each request has a track of its own, and
messages of no request (registration, heartbeats) go on a "control" track. Every message whose both ends were
traced becomes a flow arrow from the send to the receive.
"""

from kvferry.tools.trace.reader import BATCH_SPANS, TraceSet

STEPS_TID, CONTROL_TID = 1, 2
MESSAGE_US = 1.0  # messages are drawn as 1 us slices so that flow arrows have a slice to bind to


def chrome_trace(traces: TraceSet) -> dict:
    t0 = min(r["t"] for r in traces.records)
    pids = {proc: i + 1 for i, proc in enumerate(traces.processes)}
    request_tids: dict[str, int] = {}
    named: set[tuple[int, int]] = set()  # (pid, tid) of request tracks, each named once

    def us(t: float) -> float:
        return round((t - t0) * 1e6, 3)

    def tid_of(r: dict) -> int:
        if r["ev"] == "span" and r.get("name") in BATCH_SPANS:
            return STEPS_TID
        rid = r.get("rid")
        if not rid:
            return CONTROL_TID
        return request_tids.setdefault(rid, CONTROL_TID + 1 + len(request_tids))

    def meta(pid: int, tid: int, what: str, **args) -> dict:
        return {"ph": "M", "name": what, "pid": pid, "tid": tid, "args": args}

    events = []
    for proc, pid in pids.items():
        events += [meta(pid, 0, "process_name", name=proc), meta(pid, 0, "process_sort_index", sort_index=pid)]
        for tid, name in ((STEPS_TID, "steps"), (CONTROL_TID, "control")):
            events.append(meta(pid, tid, "thread_name", name=name))
    for r in sorted(traces.records, key=lambda r: r["t"]):
        pid, tid = pids[r["proc"]], tid_of(r)
        if tid > CONTROL_TID and (pid, tid) not in named:
            named.add((pid, tid))
            events.append(meta(pid, tid, "thread_name", name=r["rid"]))
        event = {"ph": "X", "pid": pid, "tid": tid, "ts": us(r["t"])}
        if r["ev"] == "span":
            args = {"request_id": r.get("rid", ""), **r.get("attrs", {})}
            event.update(name=r.get("name", "?"), cat="span", dur=round(r["dur"] * 1e6, 3), args=args)
        else:
            args = {
                "request_id": r.get("rid", ""),
                "peer": r.get("peer", ""),
                "bytes": r.get("header_bytes", 0) + r.get("payload_bytes", 0),
                "span_id": r.get("span_id", ""),
                "trace_id": r.get("trace_id", ""),
            }
            event.update(name=f"{r['ev']} {r.get('kind', '?')}", cat="message", dur=MESSAGE_US, args=args)
        events.append(event)
    for flow_id, (send, recv) in enumerate(traces.message_pairs(), start=1):
        for r, phase in ((send, "s"), (recv, "f")):
            event = {"ph": phase, "id": flow_id, "name": r.get("kind", "?"), "cat": "message"}
            event.update(pid=pids[r["proc"]], tid=tid_of(r), ts=us(r["t"]))
            if phase == "f":
                event["bp"] = "e"  # bind to the receive slice that encloses this point
            events.append(event)
    return {
        "traceEvents": events,
        "displayTimeUnit": "ms",
        "otherData": {"clock_offsets_ms": {p: round(o * 1000, 3) for p, o in traces.offsets.items()}},
    }

"""Chrome trace-event JSON of a whole trace folder, for Perfetto (ui.perfetto.dev) or chrome://tracing.

One process lane per service. Inside it, batch steps share a "steps" track, each request has a
track of its own (its spans and messages), and messages with no request (registration,
heartbeats) go on a "control" track. Every message whose both ends were traced becomes a flow
arrow from the send to the receive.
"""

import json

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

    events = []
    for proc, pid in pids.items():
        events.append({"ph": "M", "name": "process_name", "pid": pid, "tid": 0, "args": {"name": proc}})
        events.append({"ph": "M", "name": "process_sort_index", "pid": pid, "tid": 0, "args": {"sort_index": pid}})
        for tid, name in ((STEPS_TID, "steps"), (CONTROL_TID, "control")):
            events.append({"ph": "M", "name": "thread_name", "pid": pid, "tid": tid, "args": {"name": name}})
    for r in sorted(traces.records, key=lambda r: r["t"]):
        pid, tid = pids[r["proc"]], tid_of(r)
        if tid > CONTROL_TID and (pid, tid) not in named:
            named.add((pid, tid))
            events.append({"ph": "M", "name": "thread_name", "pid": pid, "tid": tid, "args": {"name": r["rid"]}})
        if r["ev"] == "span":
            args = {"request_id": r.get("rid", ""), **r.get("attrs", {})}
            events.append(
                {
                    "ph": "X",
                    "name": r.get("name", "?"),
                    "cat": "span",
                    "pid": pid,
                    "tid": tid,
                    "ts": us(r["t"]),
                    "dur": round(r["dur"] * 1e6, 3),
                    "args": args,
                }
            )
        else:
            events.append(
                {
                    "ph": "X",
                    "name": f"{r['ev']} {r.get('kind', '?')}",
                    "cat": "message",
                    "pid": pid,
                    "tid": tid,
                    "ts": us(r["t"]),
                    "dur": MESSAGE_US,
                    "args": {
                        "request_id": r.get("rid", ""),
                        "peer": r.get("peer", ""),
                        "bytes": r.get("header_bytes", 0) + r.get("payload_bytes", 0),
                        "span_id": r.get("span_id", ""),
                        "trace_id": r.get("trace_id", ""),
                    },
                }
            )
    for flow_id, (send, recv) in enumerate(traces.message_pairs(), start=1):
        for r, phase in ((send, "s"), (recv, "f")):
            event = {
                "ph": phase,
                "id": flow_id,
                "name": r.get("kind", "?"),
                "cat": "message",
                "pid": pids[r["proc"]],
                "tid": tid_of(r),
                "ts": us(r["t"]),
            }
            if phase == "f":
                event["bp"] = "e"  # bind to the receive slice that encloses this point
            events.append(event)
    return {
        "traceEvents": events,
        "displayTimeUnit": "ms",
        "otherData": {"clock_offsets_ms": {p: round(o * 1000, 3) for p, o in traces.offsets.items()}},
    }


def write_json(document: dict, path: str) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(document, f, separators=(",", ":"))

"""Reading a trace folder back: every process's JSON lines, clocks reconciled, grouped by request.

A receive never comes before its send, so the messages a process exchanged with those already placed bound its
clock's offset from the reference (the gateway). Where an offset of 0 breaks that bound, the clock is skewed: the
offset is estimated NTP-style from the fastest message each way, applied, and reported.
"""

import glob
import json
import math
import os
from collections import defaultdict
from dataclasses import dataclass, field

from kvferry.common.errors import KvferryError

EVENT_KINDS = ("send", "recv", "span")
BATCH_SPANS = ("prefill.step", "decode.step", "decode.recompute")


class TraceError(KvferryError):
    """A trace folder that cannot be read; the message says what to do."""


@dataclass
class TraceSet:
    records: list[dict]  # every line, each with "t": its time on the reference clock
    offsets: dict[str, float] = field(default_factory=dict)  # seconds added to a process's clock
    notes: list[str] = field(default_factory=list)  # skewed clocks, unreadable lines
    _sends: dict | None = field(default=None, repr=False)  # (span id, kind) -> send line, built on first use

    @property
    def processes(self) -> list[str]:
        return sorted({r["proc"] for r in self.records}, key=process_order)

    def for_request(self, request_id: str) -> list[dict]:
        """The request's events in causal order: its own (with its prompts' flights, <id>/p<n>), and the batch
        steps it rode in."""
        if not request_id:
            return []
        mine = [
            r
            for r in self.records
            if request_of(r.get("rid", "")) == request_id
            or any(request_of(x) == request_id for x in r.get("attrs", {}).get("rids", ()))
        ]
        # At equal times a send sorts before its receive, and a span's start before the messages it caused.
        return sorted(mine, key=lambda r: (r["t"], {"span": 0, "send": 1, "recv": 2}[r["ev"]]))

    def requests(self) -> list["RequestSummary"]:
        by_rid: dict[str, list[dict]] = defaultdict(list)
        for r in self.records:
            if r.get("rid"):
                by_rid[request_of(r["rid"])].append(r)
        rows = [RequestSummary.of(rid, events) for rid, events in by_rid.items()]
        return sorted(rows, key=lambda row: row.start)

    def send_of(self, recv: dict) -> dict | None:
        """The send line of a received message (same span id and kind), when it was traced."""
        if self._sends is None:
            self._sends = {
                (r.get("span_id"), r.get("kind")): r for r in self.records if r["ev"] == "send" and r.get("span_id")
            }
        return self._sends.get((recv.get("span_id"), recv.get("kind")))

    def message_pairs(self) -> list[tuple[dict, dict]]:
        """(send, receive) of every message whose both ends were recorded."""
        pairs = []
        for r in self.records:
            if r["ev"] == "recv":
                send = self.send_of(r)
                if send is not None and send["proc"] != r["proc"]:
                    pairs.append((send, r))
        return pairs


@dataclass
class RequestSummary:
    request_id: str
    trace_id: str
    start: float
    latency_s: float | None  # the HTTP span, when the gateway recorded one
    prompt_tokens: int | None
    completion_tokens: int | None
    finish_reason: str
    processes: list[str]

    @classmethod
    def of(cls, rid: str, events: list[dict]) -> "RequestSummary":
        http = next((e for e in events if e["ev"] == "span" and e.get("name") == "http"), None)
        attrs = http.get("attrs", {}) if http else {}
        trace_id = next((e["trace_id"] for e in events if e.get("trace_id")), "")
        count = lambda v: v if isinstance(v, int) else None  # noqa: E731 - whatever a line holds, never a crash
        finish = str(attrs.get("finish_reason") or attrs.get("error") or "")[:40] or ("" if http else "(no http span)")
        return cls(
            rid,
            trace_id,
            min(e["t"] for e in events),
            http["dur"] if http else None,
            count(attrs.get("prompt_tokens")),
            count(attrs.get("completion_tokens")),
            finish,
            sorted({e["proc"] for e in events}, key=process_order),
        )


def request_of(flight_id: str) -> str:
    """A batch's prompts fly as <request id>/p<n>: they belong to the request."""
    return flight_id.split("/", 1)[0]


def process_order(proc: str):
    """Gateway first, then prefill, then decode workers: the way a request travels."""
    return next((i for i, role in enumerate(("gateway", "prefill", "decode")) if proc.startswith(role)), 3), proc


def _valid(record) -> bool:
    """A line kvferry could have written: the fields every reader relies on have their types."""
    if not isinstance(record, dict) or record.get("ev") not in EVENT_KINDS:
        return False
    attrs = record.get("attrs", {})
    return (
        _finite(record.get("ts"))
        and isinstance(record.get("proc"), str)
        and all(isinstance(record.get(k, ""), str) for k in ("rid", "kind", "name", "span_id", "trace_id", "peer"))
        and all(isinstance(record.get(k, 0), (int, float)) for k in ("header_bytes", "payload_bytes"))
        and isinstance(attrs, dict)
        and isinstance(attrs.get("rids", []), list)
        and (record["ev"] != "span" or _finite(record.get("dur")))
    )


def _finite(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def load(trace_dir: str) -> TraceSet:
    if not os.path.isdir(trace_dir):
        raise TraceError(
            f"the trace folder {trace_dir!r} does not exist (start the services with --trace-dir "
            f"{trace_dir} to write one)"
        )
    paths = sorted(glob.glob(os.path.join(trace_dir, "*.jsonl")))
    if not paths:
        raise TraceError(f"no trace files (*.jsonl) in {trace_dir!r}: start the services with --trace-dir {trace_dir}")
    records, notes = [], []
    for path in paths:
        num_bad = 0
        try:
            f = open(path, encoding="utf-8", errors="replace")
        except OSError as exc:
            notes.append(f"skipped {os.path.basename(path)}: {exc.strerror}")
            continue
        with f:
            for line in f:
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                except json.JSONDecodeError:
                    record = None
                if not _valid(record):
                    num_bad += 1
                    continue
                records.append(record)
        if num_bad:
            notes.append(f"skipped {num_bad} unreadable line(s) in {os.path.basename(path)} (truncated by a crash?)")
    if not records:
        raise TraceError(f"the trace files in {trace_dir!r} hold no readable trace lines")
    traces = TraceSet(records, notes=notes)
    _reconcile_clocks(traces)
    return traces


def _reconcile_clocks(traces: TraceSet) -> None:
    for r in traces.records:
        r["t"] = r["ts"]
    # fastest[(a, b)]: the smallest (receive time on b) - (send time on a) over messages a -> b
    fastest: dict[tuple[str, str], float] = {}
    for send, recv in traces.message_pairs():
        key = (send["proc"], recv["proc"])
        fastest[key] = min(fastest.get(key, float("inf")), recv["ts"] - send["ts"])
    procs = traces.processes
    reference = procs[0]
    offsets = {reference: 0.0}
    linked = lambda a, b: (a, b) in fastest or (b, a) in fastest
    while True:  # place processes one at a time, each next to those already placed (breadth first)
        proc = next((x for x in procs if x not in offsets and any(linked(x, q) for q in offsets)), None)
        if proc is None:
            break
        # Every message q -> proc needs offset(proc) >= offset(q) - fastest[q, proc];
        # every message proc -> q needs offset(proc) <= offset(q) + fastest[proc, q].
        low = max((offsets[q] - fastest[q, proc] for q in offsets if (q, proc) in fastest), default=-float("inf"))
        high = min((offsets[q] + fastest[proc, q] for q in offsets if (proc, q) in fastest), default=float("inf"))
        if low <= 0.0 <= high:
            offset = 0.0
        elif low > -float("inf") and high < float("inf"):
            offset = (low + high) / 2  # NTP: the fastest message each way took about as long
        else:
            offset = low if low > 0 else high
        offsets[proc] = offset
        if offset:
            way = "behind" if offset > 0 else "ahead of"
            traces.notes.append(
                f"clock skew: {proc}'s clock looks {abs(offset) * 1000:.1f} ms {way} {reference}'s "
                f"(messages arrived before they were sent); its times were shifted to keep every "
                f"send before its receive"
            )
    for r in traces.records:
        r["t"] = r["ts"] + offsets.get(r["proc"], 0.0)
    # An offset cannot absorb clocks that drift; the last word is causality, message by message.
    for send, recv in traces.message_pairs():
        if recv["t"] < send["t"]:
            recv["t"] = send["t"]
    traces.offsets = offsets

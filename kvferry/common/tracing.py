"""Message-level tracing: trace ids, W3C traceparent, and the per-process JSON-lines sink.

Every message carries a TraceContext: the request's trace id, the message's own span id, and the span that caused
it. With a trace folder set, each process appends one JSON line per message it sends or receives and per span of its
own work; `kvferry trace` reads them back. Tracing off, the process's tracer is a NullTracer that does nothing, and
hot paths test `tracer.enabled` before they build anything to record.
"""

import atexit
import json
import logging
import os
import re
import secrets
import threading
import time

from kvferry.common.logs import setup_logging
from kvferry.common.protocol import TraceContext

log = logging.getLogger("kvferry.tracing")
FLUSH_EVERY_S = 0.2  # a crashed process loses at most this much of its trace
TRACEPARENT = re.compile(r"^([0-9a-f]{2})-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})(-.*)?$")


def child_of(parent: TraceContext | None) -> TraceContext:
    """The context of a new span (or message) caused by parent; a new trace when there is none."""
    if parent is None or not parent.trace_id:  # W3C's sizes: 16-byte trace ids, 8-byte span ids
        return TraceContext(secrets.token_hex(16), secrets.token_hex(8), "")
    return TraceContext(parent.trace_id, secrets.token_hex(8), parent.span_id)


def parse_traceparent(header: str | None) -> TraceContext | None:
    """A W3C traceparent as the remote parent (its span id); None when absent or malformed."""
    if not header:
        return None
    match = TRACEPARENT.match(header.strip())
    if not match:
        return None
    version, trace_id, span_id, _flags, rest = match.groups()
    # Version ff is forbidden; version 00 has nothing after the flags; all-zero ids are invalid.
    if version == "ff" or (version == "00" and rest) or trace_id == "0" * 32 or span_id == "0" * 16:
        return None
    return TraceContext(trace_id, span_id, "")


def format_traceparent(ctx: TraceContext) -> str:
    return f"00-{ctx.trace_id}-{ctx.span_id}-01"


class NullTracer:
    """Tracing off."""

    enabled = False

    def message(self, *args, **kwargs) -> None:
        pass

    def span(self, *args, **kwargs) -> None:
        pass

    def close(self) -> None:
        pass


class Tracer(NullTracer):
    """Appends this process's trace lines to DIR/<process>-<pid>.jsonl (no file without a trace_dir: export only),
    and exports spans to OpenTelemetry when an exporter is set; thread-safe."""

    enabled = True

    def __init__(self, trace_dir: str | None, role: str, process: str, exporter=None):
        self.role, self.process, self.exporter = role, process, exporter
        self.export_failed = False
        self.file = None
        if trace_dir:
            os.makedirs(trace_dir, exist_ok=True)
            self.path = os.path.join(trace_dir, f"{process}-{os.getpid()}.jsonl")
            self.file = open(self.path, "a", encoding="utf-8", buffering=1 << 16)
        self.lock = threading.Lock()
        self.flushed_at = time.monotonic()
        atexit.register(self.close)

    def _write(self, record: dict) -> None:
        if self.file is None:
            return
        line = json.dumps(record, separators=(",", ":")) + "\n"
        with self.lock:
            if self.file.closed:
                return
            self.file.write(line)
            now = time.monotonic()
            if now - self.flushed_at > FLUSH_EVERY_S:
                self.file.flush()
                self.flushed_at = now

    def message(
        self,
        direction: str,
        kind: str,
        peer: str,
        request_id: str,
        ctx: TraceContext,
        header_bytes: int,
        payload_bytes: int = 0,
    ) -> None:
        """One message sent ("send") or received ("recv"). A message sent is exported as an instant span: the spans
        it causes on the receiver name it as their parent."""
        now = time.time()
        record = self._record(direction, now, request_id, ctx)
        record.update(kind=kind, peer=peer, header_bytes=header_bytes, payload_bytes=payload_bytes)
        self._write(record)
        if direction == "send":
            self._export(
                f"send {kind}", now, now, request_id, ctx, {"peer": peer, "bytes": header_bytes + payload_bytes}
            )

    def span(
        self, name: str, start: float, end: float, request_id: str = "", ctx: TraceContext | None = None, **attrs
    ) -> None:
        """Work this process did from start to end (wall-clock seconds); a batch step lists its requests in
        attrs["rids"]. An instant event has start == end."""
        record = self._record("span", start, request_id, ctx)
        record.update(dur=max(0.0, end - start), name=name)
        if attrs:
            record["attrs"] = attrs
        self._write(record)
        self._export(name, start, end, request_id, ctx, attrs)

    def _record(self, event: str, ts: float, request_id: str, ctx: TraceContext | None) -> dict:
        record = {"ts": ts, "role": self.role, "proc": self.process, "pid": os.getpid(), "ev": event, "rid": request_id}
        if ctx is not None:
            record.update(trace_id=ctx.trace_id, span_id=ctx.span_id, parent_id=ctx.parent_id)
        return record

    def _export(self, name: str, start: float, end: float, request_id: str, ctx, attrs: dict) -> None:
        """To OpenTelemetry, when an exporter is set; a failure there is logged, never raised into a worker's step."""
        if self.exporter is None:
            return
        try:
            self.exporter.export(name, start, end, request_id, ctx, attrs)
        except Exception as exc:  # a malformed id from a peer, an SDK error
            if not self.export_failed:
                self.export_failed = True
                log.warning("OpenTelemetry export failed (reported once): %s", exc)

    def close(self) -> None:
        with self.lock:
            if self.file is not None and not self.file.closed:
                self.file.close()
        if self.exporter is not None:
            self.exporter.shutdown()
            self.exporter = None


_tracer: NullTracer = NullTracer()


def tracer() -> NullTracer:
    """This process's tracer (a NullTracer until configure() turns tracing on)."""
    return _tracer


def configure(role: str, process: str, trace_dir: str | None, otlp_endpoint: str | None = None) -> NullTracer:
    """Set this process's tracer from --trace-dir and --otlp-endpoint; call once at start-up."""
    global _tracer
    exporter = None
    if otlp_endpoint:
        from kvferry.common.otel import OtlpExporter  # only here: without an endpoint nothing is imported

        exporter = OtlpExporter(otlp_endpoint, f"kvferry-{role}", process)
    _tracer = Tracer(trace_dir, role, process, exporter) if trace_dir or exporter is not None else NullTracer()
    return _tracer


def observe(args, role: str, process: str) -> None:
    """Logs, the trace folder and OpenTelemetry export for this process, from its settings (log_format, trace_dir,
    otlp_endpoint)."""
    setup_logging(args.log_format, process)
    configure(role, process, args.trace_dir, args.otlp_endpoint)

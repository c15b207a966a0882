"""Optional OpenTelemetry export of kvferry's spans over OTLP/HTTP (imported only with --otlp-endpoint).

kvferry mints its own trace and span ids (they travel in every message), so the SDK is made to
use them: an id generator hands the SDK the ids of the span being exported. A request then has
the same trace id, and its spans the same ids, in the trace files and in the OTel backend.
"""

import threading
from urllib.parse import urlsplit

from kvferry.common.errors import ConfigError

try:
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor
    from opentelemetry.sdk.trace.id_generator import IdGenerator, RandomIdGenerator
    from opentelemetry.trace import NonRecordingSpan, SpanContext, TraceFlags, set_span_in_context
except ImportError as exc:  # an optional extra
    raise ConfigError(f"--otlp-endpoint needs the OpenTelemetry SDK: pip install 'kvferry[otlp]' ({exc})") from None


class _GivenIds(IdGenerator):
    """Returns the ids set for the span being started on this thread; random ones otherwise."""

    def __init__(self):
        self.given = threading.local()
        self.fallback = RandomIdGenerator()

    def generate_span_id(self) -> int:
        return getattr(self.given, "span_id", None) or self.fallback.generate_span_id()

    def generate_trace_id(self) -> int:
        return getattr(self.given, "trace_id", None) or self.fallback.generate_trace_id()


def traces_url(endpoint: str) -> str:
    """'http://collector:4318' -> 'http://collector:4318/v1/traces'; a full path is kept."""
    parts = urlsplit(endpoint)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise ConfigError(f"--otlp-endpoint {endpoint!r} is not an http(s) URL, e.g. http://localhost:4318")
    return endpoint if parts.path.strip("/") else endpoint.rstrip("/") + "/v1/traces"


class OtlpExporter:
    def __init__(self, endpoint: str, service: str, process: str):
        self.ids = _GivenIds()
        self.provider = TracerProvider(
            resource=Resource.create({"service.name": service, "service.instance.id": process}), id_generator=self.ids
        )
        self.provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=traces_url(endpoint))))
        self.tracer = self.provider.get_tracer("kvferry")
        self.lock = threading.Lock()
        self.closed = False

    def export(self, name: str, start: float, end: float, request_id: str, ctx, attrs: dict) -> None:
        attributes = {f"kvferry.{k}": v for k, v in attrs.items() if isinstance(v, (str, int, float, bool, list))}
        if request_id:
            attributes["kvferry.request_id"] = request_id
        parent = None
        with self.lock:  # the id hand-over is per thread, the lock keeps start_span calls apart anyway
            if ctx is not None and ctx.trace_id:
                self.ids.given.trace_id = int(ctx.trace_id, 16)
                self.ids.given.span_id = int(ctx.span_id, 16) if ctx.span_id else None
                if ctx.parent_id:
                    parent = set_span_in_context(
                        NonRecordingSpan(
                            SpanContext(
                                int(ctx.trace_id, 16),
                                int(ctx.parent_id, 16),
                                is_remote=True,
                                trace_flags=TraceFlags(TraceFlags.SAMPLED),
                            )
                        )
                    )
            try:
                span = self.tracer.start_span(name, context=parent, attributes=attributes, start_time=int(start * 1e9))
            finally:
                self.ids.given.trace_id = self.ids.given.span_id = None
        span.end(end_time=int(end * 1e9))

    def shutdown(self) -> None:
        if not self.closed:
            self.closed = True
            self.provider.shutdown()  # flushes what the batch processor still holds

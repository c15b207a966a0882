"""OpenTelemetry export keeps kvferry's ids (checked against a real OTLP/HTTP receiver); JSON logs carry request ids."""

import gzip
import http.server
import io
import json
import logging

import pytest

from kvferry.common import protocol as p
from kvferry.common import tracing
from kvferry.common.logs import JsonFormatter, request_id_var, setup_logging
from tests.local_http import serving


class Collector(http.server.BaseHTTPRequestHandler):
    received: list = []

    def do_POST(self):
        body = self.rfile.read(int(self.headers["content-length"]))
        if self.headers.get("content-encoding") == "gzip":
            body = gzip.decompress(body)
        Collector.received.append((self.path, body))
        self.send_response(200)
        self.send_header("content-type", "application/x-protobuf")
        self.end_headers()

    def log_message(self, *args):
        pass


def test_spans_reach_an_otlp_collector_with_our_ids(tmp_path):
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

    from kvferry.common.otel import OtlpExporter

    with serving(Collector) as endpoint:
        exporter = OtlpExporter(endpoint, "kvferry-gateway", "gateway")
        tracer = tracing.Tracer(str(tmp_path), "gateway", "gateway", exporter=exporter)
        http_ctx = tracing.child_of(
            tracing.parse_traceparent("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01")
        )
        tracer.span("http", 100.0, 100.5, "cmpl-1", http_ctx, status=200, prompt_tokens=5)
        root = tracing.child_of(None)
        tracer.span("prefill", 100.1, 100.2, "cmpl-2", root)
        tracer.close()  # flushes the batch processor
    spans = {}
    for path, body in Collector.received:
        assert path == "/v1/traces"
        request = ExportTraceServiceRequest.FromString(body)
        for resource_spans in request.resource_spans:
            for scope in resource_spans.scope_spans:
                for span in scope.spans:
                    spans[span.name] = span
    http_span, prefill = spans["http"], spans["prefill"]
    assert http_span.trace_id.hex() == http_ctx.trace_id and http_span.span_id.hex() == http_ctx.span_id
    assert http_span.parent_span_id.hex() == "00f067aa0ba902b7"
    assert http_span.start_time_unix_nano == 100_000_000_000 and http_span.end_time_unix_nano == 100_500_000_000
    attrs = {a.key: a.value for a in http_span.attributes}
    assert attrs["kvferry.request_id"].string_value == "cmpl-1" and attrs["kvferry.status"].int_value == 200
    assert prefill.trace_id.hex() == root.trace_id and prefill.parent_span_id == b""


def test_a_bad_otlp_endpoint_is_a_config_error():
    from kvferry.common.errors import ConfigError
    from kvferry.common.otel import traces_url

    assert traces_url("http://collector:4318") == "http://collector:4318/v1/traces"
    assert traces_url("https://c/otlp/v1/traces") == "https://c/otlp/v1/traces"
    with pytest.raises(ConfigError, match="not an http"):
        traces_url("collector:4318")


def test_json_logs_carry_the_request_id():
    record = logging.LogRecord("kvferry.gateway", logging.WARNING, __file__, 1, "bad %s", ("thing",), None)
    record.request_id = "cmpl-9"
    line = json.loads(JsonFormatter("gateway").format(record))
    assert line["msg"] == "bad thing" and line["request_id"] == "cmpl-9" and line["level"] == "warning"
    assert line["process"] == "gateway" and line["logger"] == "kvferry.gateway"


def test_the_request_id_comes_from_the_context_or_extra(capsys):
    root = logging.getLogger()
    saved = root.handlers[:], root.level
    try:
        setup_logging("json", "decode-a")
        stream = io.StringIO()
        root.handlers[0].setStream(stream)
        log = logging.getLogger("kvferry.test")
        token = request_id_var.set("cmpl-ctx")
        log.info("from the context")
        request_id_var.reset(token)
        log.info("from extra", extra={"request_id": "cmpl-extra"})
        log.info("about no request")
        lines = [json.loads(x) for x in stream.getvalue().splitlines()]
        assert [x.get("request_id") for x in lines] == ["cmpl-ctx", "cmpl-extra", None]
        setup_logging("text", "decode-a")
        root.handlers[0].setStream(stream := io.StringIO())
        log.info("plain", extra={"request_id": "cmpl-t"})
        assert stream.getvalue().rstrip().endswith("plain [cmpl-t]")
    finally:
        root.handlers[:], _ = saved[0], root.setLevel(saved[1])


def test_a_failing_exporter_never_breaks_the_caller(tmp_path, caplog):
    class Broken:
        def export(self, *args):
            raise ValueError("invalid literal for int() with base 16: 'zz'")

        def shutdown(self):
            pass

    tracer = tracing.Tracer(str(tmp_path), "prefill", "prefill-a", exporter=Broken())
    ctx = p.TraceContext("zz" * 16, "zz" * 8, "")
    with caplog.at_level(logging.WARNING, logger="kvferry.tracing"):
        tracer.span("prefill", 1.0, 2.0, "r1", ctx)
        tracer.message("send", "FirstToken", "gateway", "r1", ctx, 10)
    tracer.close()
    assert [r.message for r in caplog.records].count(
        "OpenTelemetry export failed (reported once): invalid literal for int() with base 16: 'zz'"
    ) == 1
    assert len(next(tmp_path.glob("*.jsonl")).read_text().splitlines()) == 2  # the file still has both lines

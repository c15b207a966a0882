"""One process's observability, from its flags: logs, the trace folder and OpenTelemetry export."""

import argparse
import os


def add_observability_args(parser: argparse.ArgumentParser) -> None:
    from kvferry.common.logs import FORMATS

    env = os.environ.get
    g = parser.add_argument_group("observability (each also read from KVFERRY_<NAME>)")
    g.add_argument(
        "--trace-dir",
        default=env("KVFERRY_TRACE_DIR") or None,
        help="append one JSON line per message and span to files in this folder (read with kvferry trace)",
    )
    g.add_argument(
        "--otlp-endpoint",
        default=env("KVFERRY_OTLP_ENDPOINT") or None,
        help="also export spans to this OpenTelemetry collector (OTLP/HTTP), e.g. http://localhost:4318",
    )
    g.add_argument("--log-format", default=env("KVFERRY_LOG_FORMAT", "text"), choices=FORMATS)


def observe(args, role: str, process: str) -> None:
    """Logs, the trace folder and OpenTelemetry export for this process, from its flags."""
    from kvferry.common import tracing
    from kvferry.common.logs import setup_logging

    setup_logging(args.log_format, process)
    tracing.configure(role, process, args.trace_dir, args.otlp_endpoint)

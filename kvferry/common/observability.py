"""One process's observability, from its settings (trace_dir, otlp_endpoint, log_format): logs, the trace folder
and OpenTelemetry export."""


def observe(args, role: str, process: str) -> None:
    """Logs, the trace folder and OpenTelemetry export for this process, from its flags."""
    from kvferry.common import tracing
    from kvferry.common.logs import setup_logging

    setup_logging(args.log_format, process)
    tracing.configure(role, process, args.trace_dir, args.otlp_endpoint)

"""The settings every long-running process takes beside its role's (ProcessConfig): how it stops, its keys, its logs
and traces; and the folder every command keeps converted models in. Each declared once as a field."""

from kvferry.common.logs import FORMATS
from kvferry.common.setting import COMMANDS, PATH, SERVICES, setting, settings_class


@settings_class(SERVICES, "deadlines and overload")
class ProcessConfig:
    drain_timeout: float = setting(
        30,
        "on SIGTERM, stop taking new work and finish what is in flight for at most this long (a worker then "
        "hands the rest back)",
        min=0,
    )
    curve_keys: str | None = setting(
        None,
        "encrypt and authenticate every ZeroMQ socket with the keys in DIR (kvferry keys DIR)",
        kind=PATH,
        metavar="DIR",
        section="security",
    )
    insecure: bool = setting(
        False,
        "allow ZeroMQ sockets bound beyond loopback without --curve-keys, and the HTTP API without --api-key (only "
        "on a private network you trust)",
    )
    trace_dir: str | None = setting(
        None,
        "append one JSON line per message and span to files in this folder (read with kvferry trace)",
        kind=PATH,
        section="observability",
    )
    otlp_endpoint: str | None = setting(
        None, "also export spans to this OpenTelemetry collector (OTLP/HTTP), e.g. http://localhost:4318"
    )
    log_format: str = setting("text", "the log lines' format", choices=FORMATS)
    cache_dir: str = setting(
        "~/.cache/kvferry",
        "where converted models live (a .gguf file is converted once, into this folder)",
        kind=PATH,
        flag="",  # read from the environment only
        commands=COMMANDS,
        section="files",
    )

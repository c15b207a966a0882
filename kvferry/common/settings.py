"""Every kvferry setting, walked from the config classes that declare them, each once: EngineConfig (config.py),
GatewayConfig, WorkerConfig, ServeConfig and ProcessConfig. A field there is the setting: its name, type, default,
bounds, help and the commands that take it (setting.py).

From them come each command's flags (`--max-num-seqs`), the environment variables (`KVFERRY_` plus the
upper-case name, written nowhere else), what `kvferry serve` passes to its child processes, and the settings table
in docs/operations.md. A flag overrides the environment, and the environment overrides the default. An empty
variable counts as unset.

To add a setting: add one field to its role's config class, read it from the config (or `args.<name>`), then run
`make docs` (it writes the table into docs/operations.md).

Standard library only: the gateway and the image's health check import this.
"""

import argparse
import os
import sys
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from kvferry.common.config import EngineConfig
from kvferry.common.errors import ConfigError
from kvferry.common.gateway_config import GatewayConfig
from kvferry.common.logs import FORMATS
from kvferry.common.setting import (
    _FALSE,
    _TRUE,
    BENCH,
    COMMANDS,
    DECODE,
    ENGINE,
    ENV_PREFIX,
    FLOAT,
    GATEWAY,
    GENERATE,
    INT,
    NAMES,
    PATH,
    PREFILL,
    PREPARE,
    SERVE,
    SERVICES,
    SIZE,
    STR,
    SWITCH,
    WORKERS,
    EnvText,
    Setting,
    parse_names,
    settings_of,
)

__all__ = [
    "BENCH", "COMMANDS", "DECODE", "ENGINE", "ENV_PREFIX", "FLOAT", "GATEWAY", "GENERATE", "INT", "NAMES", "PATH",
    "PREFILL", "PREPARE", "SERVE", "SERVICES", "SIZE", "STR", "SWITCH", "WORKERS", "Setting", "SPEC", "get",
    "env_name", "label", "default", "from_env", "for_command", "add_arguments", "child_environment",
    "apply_environment", "markdown_table", "write_docs", "docs_table_of", "main",
]  # fmt: skip

# The sections of the docs table and of --help, in their order.
SECTIONS = (
    "model and engine",
    "gateway",
    "worker",
    "deadlines and overload",
    "API",
    "security",
    "observability",
    "files",
)

_NOT_IN_A_CONFIG_YET: tuple[Setting, ...] = (
    # Where the gateway listens; what `kvferry serve` starts.
    Setting(
        "control_port",
        INT,
        "5557",
        "the port on 127.0.0.1 where serve's workers register at its gateway",
        (SERVE,),
        "gateway",
        min=1,
        max=65535,
    ),
    # On a small machine both workers take every core, and the decode worker runs at a lower priority: a prompt's
    # prefill then has the cores while it lasts (its GEMMs are the machine's most efficient work, and its requests
    # join the decode batch sooner), and decode takes what prefill leaves. std-32 over HTTP ran about 14%
    # faster than with the cores split between them (docs/benchmarks.md), at the price of decode's pace while a
    # burst of prompts is prefilled. decode_nice 0 shares the cores evenly.
    Setting("prefill_threads", INT, "2", "torch threads of serve's prefill worker", (SERVE,), "gateway", min=1),
    Setting("decode_threads", INT, "2", "torch threads of serve's decode worker", (SERVE,), "gateway", min=1),
    Setting(
        "decode_nice",
        INT,
        "10",
        "niceness of serve's decode worker, as nice(1)'s: how far it yields the cores to prefill",
        (SERVE,),
        "gateway",
        min=0,
        max=19,
    ),
    # Workers.
    Setting(
        "gateway",
        STR,
        "tcp://127.0.0.1:5557",
        "the gateway's control address; several, comma-separated, to serve gateways that share this worker",
        WORKERS,
        "worker",
    ),
    Setting(
        "worker_id",
        STR,
        None,
        "this worker's name in logs, traces and /v1/workers; default: the role and a random suffix",
        WORKERS,
        "worker",
    ),
    Setting(
        "grammar_compile_timeout",
        FLOAT,
        "5",
        "a structured-output constraint not compiled this long (seconds) after it reached a worker's compile queue "
        "fails: a 400 when its own compile took most of it (that compile is killed), else a 503 that another worker "
        "may take; at most 8, below the 10 s a prefill worker waits for a decode worker to take a transfer (the "
        "set-up of the tokenizer, xgrammar and the compile process, about 3 s on a 2-core CPU once and again after "
        "each kill, is not counted)",
        (*WORKERS, SERVE),
        "worker",
        above=0,
        max=8,
    ),
    Setting(
        "grammar_cache_bytes",
        SIZE,
        "256MiB",
        "the compiled structured-output grammars a worker keeps, by the memory they hold (a large enum's holds tens "
        "of MiB, an ordinary schema's tens of KiB); one larger than this is served, not kept. The default fits a "
        "4 GiB worker beside the default model (540 MB), its 1 GiB KV cache, torch and the compile process",
        (*WORKERS, SERVE),
        "worker",
        min=0,
    ),
    Setting(
        "stall_timeout",
        FLOAT,
        "30",
        "report unhealthy (the gateway moves the requests) when the step loop is stuck this long",
        WORKERS,
        "worker",
        above=0,
    ),
    Setting(
        "health_port",
        INT,
        None,
        "serve GET /health (registered and stepping) and /live (loop not stuck) on this port, on every "
        "interface: the kubelet probes the pod's address (default: off)",
        WORKERS,
        "worker",
        min=1,
        max=65535,
    ),
    Setting(
        "kv_bind",
        STR,
        "tcp://127.0.0.1:0",
        "where prefill workers send KV (port 0: any free port)",
        (DECODE,),
        "worker",
    ),
    Setting(
        "advertise_host",
        STR,
        None,
        "the address prefill workers reach a 0.0.0.0 --kv-bind at (default: this host's IP; in Kubernetes, "
        "give the pod IP)",
        (DECODE,),
        "worker",
    ),
    # Deadlines and overload.
    Setting(
        "drain_timeout",
        FLOAT,
        "30",
        "on SIGTERM, stop taking new work and finish what is in flight for at most this long (a worker then "
        "hands the rest back)",
        SERVICES,
        "deadlines and overload",
        min=0,
    ),
    # The HTTP API.
    # Security.
    Setting(
        "curve_keys",
        PATH,
        None,
        "encrypt and authenticate every ZeroMQ socket with the keys in DIR (kvferry keys DIR)",
        SERVICES,
        "security",
        metavar="DIR",
    ),
    Setting(
        "insecure",
        SWITCH,
        False,
        "allow ZeroMQ sockets bound beyond loopback without --curve-keys, and the HTTP API without --api-key (only "
        "on a private network you trust)",
        SERVICES,
        "security",
    ),
    Setting(
        "curve_client",
        STR,
        None,
        "the CURVE client key pair this worker presents, DIR/NAME.key_secret (default: its role, prefill or decode); "
        "a pair of its own (kvferry keys DIR --client NAME) can be revoked alone",
        WORKERS,
        "security",
        metavar="NAME",
    ),
    # Observability.
    Setting(
        "trace_dir",
        PATH,
        None,
        "append one JSON line per message and span to files in this folder (read with kvferry trace)",
        SERVICES,
        "observability",
    ),
    Setting(
        "otlp_endpoint",
        STR,
        None,
        "also export spans to this OpenTelemetry collector (OTLP/HTTP), e.g. http://localhost:4318",
        SERVICES,
        "observability",
    ),
    Setting("log_format", STR, "text", "the log lines' format", SERVICES, "observability", choices=FORMATS),
    # Read from the environment only.
    Setting(
        "cache_dir",
        PATH,
        "~/.cache/kvferry",
        "where converted models live (a .gguf file is converted once, into this folder)",
        COMMANDS,
        "files",
        flag="",
    ),
)

CONFIGS = (EngineConfig, GatewayConfig)
SPEC: tuple[Setting, ...] = tuple(
    sorted(
        (*(s for config in CONFIGS for s in settings_of(config)), *_NOT_IN_A_CONFIG_YET),
        key=lambda s: SECTIONS.index(s.group),
    )
)
SETTINGS: dict[str, Setting] = {s.name: s for s in SPEC}


def get(name: str) -> Setting:
    return SETTINGS[name]


def env_name(name: str) -> str:
    """'max_waiting' -> 'KVFERRY_MAX_WAITING'."""
    return SETTINGS[name].env


def label(name: str) -> str:
    """'port' -> '--port (KVFERRY_PORT)': how a message names a setting."""
    return SETTINGS[name].label


def default(name: str) -> Any:
    return SETTINGS[name].value_default


def from_env(name: str, environ: Mapping[str, str] | None = None) -> Any:
    return SETTINGS[name].from_env(environ)


def for_command(command: str) -> list[Setting]:
    """The settings a command takes on its command line, in the spec's order."""
    if command not in COMMANDS:
        raise KeyError(f"no command {command!r}; the commands with settings are {', '.join(COMMANDS)}")
    return [s for s in SPEC if command in s.commands and s.option]


class _ArgType:
    """argparse's `type` for a setting: flag and environment text go through the same parse and bounds."""

    def __init__(self, setting: Setting):
        self.setting = setting
        self.__name__ = setting.kind  # argparse names the type in a few messages

    def __call__(self, text: str) -> Any:
        try:
            return self.setting.parse(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None


class _Switch(argparse.Action):
    """A flag without a value (--enforce-eager). Its default may be a variable's text, which argparse parses
    with `type` like any other text default; the flag itself stores `const`."""

    def __init__(self, option_strings, dest, const, default=None, type=None, help=None):
        super().__init__(option_strings, dest, nargs=0, const=const, default=default, type=type, help=help)

    def __call__(self, parser, namespace, values, option_string=None):
        setattr(namespace, self.dest, self.const)


class _Names(argparse.Action):
    """A names setting's flag: its arguments (each parsed to names already) as one tuple, checked together."""

    def __call__(self, parser, namespace, values, option_string=None):
        try:
            names = parse_names([name for value in values for name in value])
        except ValueError as exc:
            raise argparse.ArgumentError(self, str(exc)) from None
        setattr(namespace, self.dest, names)


def add_arguments(
    parser: argparse.ArgumentParser, command: str, environ: Mapping[str, str] | None = None
) -> list[Setting]:
    """The command's settings as flags, each defaulting to its variable, else to its default."""
    environ = os.environ if environ is None else environ
    groups: dict[str, argparse._ArgumentGroup] = {}
    added = for_command(command)
    for s in added:
        if s.group not in groups:
            groups[s.group] = parser.add_argument_group(f"{s.group} (each also read from {ENV_PREFIX}<NAME>)")
        text = environ.get(s.env, "")
        # Text defaults go through `type` once parsing is done, and only when the flag is absent: a bad
        # variable then gets the same one-line usage error as a bad flag, and a flag overrides it.
        value = EnvText(text, s.env) if text else s.value_default
        kwargs: dict[str, Any] = dict(dest=s.attr, default=value, type=_ArgType(s), help=s.help)
        if s.kind == SWITCH:
            kwargs.update(action=_Switch, const=not s.negate)
        elif s.kind == NAMES:
            kwargs.update(action=_Names, nargs="+", metavar=s.metavar or "NAME")
        else:
            kwargs.update(choices=s.choices, metavar=s.metavar)
        groups[s.group].add_argument(s.option, **kwargs)
    return added


def child_environment(args: argparse.Namespace, command: str, children: Iterable[str]) -> dict[str, str | None]:
    """What a launcher sets in its children's environment so that they run with its settings: each setting
    `command` and a child both take, as variable -> text (None: unset it)."""
    children = set(children)
    return {s.env: s.to_env(getattr(args, s.attr)) for s in for_command(command) if children & set(s.commands)}


def apply_environment(env: dict[str, str], changes: Mapping[str, str | None]) -> dict[str, str]:
    for name, text in changes.items():
        if text is None:
            env.pop(name, None)
        else:
            env[name] = text
    return env


# The settings table in docs/operations.md.

DOCS_BEGIN, DOCS_END = "<!-- settings-table:begin -->", "<!-- settings-table:end -->"
DOCS_COMMAND = "python -m kvferry.common.settings --write-docs docs/operations.md"


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _default_text(s: Setting) -> str:
    if s.kind == SWITCH:
        return "off"
    return "" if s.default is None else f"`{s.default}`"


def markdown_table() -> str:
    lines = [
        "<!-- Generated from kvferry/common/settings.py by `make docs`; edit the spec, not this table. -->",
        "",
        "| setting | flag | environment variable | default | commands | what it does |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for s in SPEC:
        bounds = s.bounds()
        what = s.help + (f" ({'one of ' if s.choices else ''}{bounds})" if bounds and s.kind != SWITCH else "")
        flag = f"`{s.option}`" if s.option else "(environment only)"
        commands = "all" if set(s.commands) == set(COMMANDS) else ", ".join(s.commands)
        lines.append(f"| {s.name} | {flag} | `{s.env}` | {_default_text(s)} | {commands} | {_cell(what)} |")
    lines += [
        "",
        "`bench` is each benchmark that runs the engine in process: `bench engine`, `bench step` and "
        "`bench quantization`. A flag overrides its variable; an empty variable counts as unset. A switch's "
        f"variable takes {', '.join(_TRUE)} or {', '.join(_FALSE)}.",
    ]
    return "\n".join(lines)


def _split_docs(text: str, path: Path) -> tuple[str, str, str]:
    if text.count(DOCS_BEGIN) != 1 or text.count(DOCS_END) != 1 or text.index(DOCS_BEGIN) > text.index(DOCS_END):
        raise ConfigError(f"{path}: needs one {DOCS_BEGIN} line and, after it, one {DOCS_END} line")
    head, rest = text.split(DOCS_BEGIN)
    body, tail = rest.split(DOCS_END)
    return head, body, tail


def docs_table_of(path: Path) -> str:
    """The table now between the markers of a Markdown file."""
    return _split_docs(Path(path).read_text(), Path(path))[1].strip("\n")


def write_docs(path: Path) -> bool:
    """Writes the table between the markers; returns whether the file changed."""
    path = Path(path)
    text = path.read_text()
    head, _, tail = _split_docs(text, path)
    new = f"{head}{DOCS_BEGIN}\n{markdown_table()}\n{DOCS_END}{tail}"
    if new != text:
        path.write_text(new)
    return new != text


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvferry.common.settings", description=__doc__.split("\n")[0])
    action = parser.add_mutually_exclusive_group(required=True)
    action.add_argument("--write-docs", metavar="MARKDOWN", help="write the settings table between its markers")
    action.add_argument("--check-docs", metavar="MARKDOWN", help="exit 1 when the table there is out of date")
    action.add_argument("--table", action="store_true", help="print the table")
    args = parser.parse_args(argv)
    if args.table:
        print(markdown_table())
    elif args.write_docs:
        print(f"{args.write_docs}: {'updated' if write_docs(args.write_docs) else 'already up to date'}")
    elif docs_table_of(args.check_docs) != markdown_table():
        print(
            f"{args.check_docs}: the settings table is out of date; run `make docs` ({DOCS_COMMAND})", file=sys.stderr
        )
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Every kvferry setting, walked from the config classes that declare each once (EngineConfig, GatewayConfig,
WorkerConfig, ServeConfig, ProcessConfig: a field is the setting, see setting.py).

From them come each command's flags (`--max-num-seqs`), the environment variables (`KVFERRY_` plus the upper-case
name), what `kvferry serve` passes to its children, and the settings table in docs/operations.md. A flag overrides
the environment, which overrides the default; an empty variable counts as unset. To add a setting, add a field to its
role's config class and run `make docs`. Standard library only: the gateway and the image's health check import this.
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
from kvferry.common.process_config import ProcessConfig
from kvferry.common.serve_config import ServeConfig
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
    SWITCH,
    EnvText,
    Setting,
    parse_names,
    settings_of,
)
from kvferry.common.worker_config import WorkerConfig

__all__ = [
    "BENCH", "COMMANDS", "DECODE", "ENGINE", "ENV_PREFIX", "FLOAT", "GATEWAY", "GENERATE", "INT", "NAMES", "PATH",
    "PREFILL", "PREPARE", "SERVE", "SERVICES", "SIZE", "SWITCH", "Setting", "SPEC", "ArgType", "get",
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


CONFIGS = (EngineConfig, GatewayConfig, ServeConfig, ProcessConfig, WorkerConfig)  # in a section, in this order
SPEC: tuple[Setting, ...] = tuple(
    sorted(
        (s for config in CONFIGS for s in settings_of(config)),
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


class ArgType:
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
        kwargs: dict[str, Any] = dict(dest=s.attr, default=value, type=ArgType(s), help=s.help)
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
        "<!-- Generated from the config classes (kvferry/common/*config.py) by `make docs`; edit a field there, not this table. -->",
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
    parser = argparse.ArgumentParser(
        prog="python -m kvferry.common.settings",
        description="the settings table: print it, write it into the docs, or check the docs' copy",
    )
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

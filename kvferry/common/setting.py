"""One setting (its name, type, default, bounds, help, the commands that take it), and how a config class
declares its settings as fields: `max_n: int = setting(16, "the largest n a request may ask for", min=1)`.

The flag is --name-with-dashes and the variable KVFERRY_NAME, both made from the field's name. A field's type gives
the setting's kind (bool: a switch, int, float, str); a size, a path or a list of names says its kind. The config
classes are in config.py, gateway_config.py, worker_config.py and process_config.py; settings.py walks them.

Standard library only: the gateway and the image's health check import this.
"""

import os
import re
import types
import typing
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field, fields
from typing import Any

from kvferry.common.errors import ConfigError

ENV_PREFIX = "KVFERRY_"

# The commands that take settings. "bench" is each benchmark that runs the engine in process
# (bench engine, bench step, bench quantization).
PREPARE, GENERATE, GATEWAY, PREFILL, DECODE, SERVE, BENCH = (
    "prepare",
    "generate",
    "gateway",
    "prefill",
    "decode",
    "serve",
    "bench",
)
COMMANDS = (GATEWAY, PREFILL, DECODE, SERVE, GENERATE, BENCH, PREPARE)
ENGINE = (GENERATE, PREFILL, DECODE, BENCH)  # the commands that run an engine: EngineConfig's settings
WORKERS = (PREFILL, DECODE)
SERVICES = (GATEWAY, PREFILL, DECODE, SERVE)  # long-running processes

# "k", "kb": 10**3 bytes; "kib": 2**10; and so on for m and g.
_SIZE_UNITS = {"": 1, "b": 1} | {
    prefix + suffix: 2 ** (10 * power) if suffix == "ib" else 10 ** (3 * power)
    for power, prefix in enumerate("kmg", 1)
    for suffix in ("", "b", "ib")
}
_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")


def parse_size(text: str | int) -> int:
    """'1GiB', '512MiB', '2g', '1048576' -> bytes."""
    if isinstance(text, int):
        return text
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(text))
    if not match or match.group(2).lower() not in _SIZE_UNITS:
        raise ValueError(f"not a size: {text!r} (try 512MiB or 2GiB)")
    return int(float(match.group(1)) * _SIZE_UNITS[match.group(2).lower()])


def parse_bool(text: str | bool) -> bool:
    if isinstance(text, bool):
        return text
    if text.strip().lower() in _TRUE:
        return True
    if text.strip().lower() in _FALSE:
        return False
    raise ValueError(f"not a yes or no: {text!r} (try {', '.join(_TRUE)} or {', '.join(_FALSE)})")


MAX_NAMES, MAX_NAME_CHARS = 16, 256  # a names setting's bounds (--served-model-name)


def parse_names(text: str | Iterable[str]) -> tuple[str, ...]:
    """'a b' (a variable's text, or one flag argument) or names already split -> ('a', 'b'): at most MAX_NAMES,
    each of 1 to MAX_NAME_CHARS printable characters without whitespace, none twice."""
    names = tuple(text.split() if isinstance(text, str) else text)
    if not names:
        raise ValueError("needs at least one name")
    if len(names) > MAX_NAMES:
        raise ValueError(f"at most {MAX_NAMES} names, got {len(names)}")
    for name in names:
        if not (isinstance(name, str) and 0 < len(name) <= MAX_NAME_CHARS and name.isprintable()):
            raise ValueError(f"a name has 1 to {MAX_NAME_CHARS} printable characters, got {str(name)[:80]!r}")
        if len(name.split()) != 1:
            raise ValueError(f"a name has no whitespace, got {name[:80]!r}")
    twice = next((name for i, name in enumerate(names) if name in names[:i]), None)
    if twice is not None:
        raise ValueError(f"{twice[:80]!r} is named twice")
    return names


def _number(kind: type) -> Callable[[Any], Any]:
    """int or float, with argparse's wording for text that is not one."""

    def parse(text: Any) -> Any:
        try:
            return kind(text)
        except ValueError:
            raise ValueError(f"invalid {kind.__name__} value: {text!r}") from None

    return parse


# A setting's kind: how its text becomes a value, and how a value goes back into the environment.
# NAMES: one or more names (a flag taking several arguments; a variable's text separated by spaces).
STR, INT, FLOAT, SIZE, PATH, SWITCH, NAMES = "str", "int", "float", "size", "path", "switch", "names"
_PARSERS: dict[str, Callable[[Any], Any]] = {
    STR: str,
    INT: _number(int),
    FLOAT: _number(float),
    SIZE: parse_size,
    PATH: str,
    SWITCH: parse_bool,
    NAMES: parse_names,
}


class EnvText(str):
    """A value read from the environment, which remembers its variable for error messages."""

    variable: str

    def __new__(cls, text: str, variable: str):
        self = super().__new__(cls, text)
        self.variable = variable
        return self


@dataclass(frozen=True)
class Setting:
    name: str  # snake_case; the flag is --name-with-dashes, the variable KVFERRY_NAME
    kind: str
    default: Any  # text as a user would write it ("1GiB"), a value, or None
    help: str
    commands: tuple[str, ...]
    group: str
    choices: tuple | None = None
    min: float | None = None  # inclusive
    above: float | None = None  # exclusive (for a float that must be positive)
    max: float | None = None  # inclusive, given with min or above
    flag: str | None = None  # a flag other than --name-with-dashes; "" for a setting read from the environment only
    dest: str | None = None  # the attribute in the parsed arguments, when it is not the name
    negate: bool = False  # a switch whose attribute is its opposite (--no-prefix-caching -> enable_prefix_caching)
    metavar: str | None = None

    @property
    def env(self) -> str:
        return ENV_PREFIX + self.name.upper()

    @property
    def option(self) -> str | None:
        """The flag, or None for a setting read from the environment only."""
        if self.flag == "":
            return None
        return self.flag or "--" + self.name.replace("_", "-")

    @property
    def attr(self) -> str:
        return self.dest or self.name

    @property
    def label(self) -> str:
        """How messages name the setting: '--port (KVFERRY_PORT)'."""
        return f"{self.option} ({self.env})" if self.option else self.env

    def bounds(self) -> str | None:
        """What a valid value is, as words, or None when anything of the type goes."""
        if self.choices:
            words = [str(c) for c in self.choices]
            return ", ".join(words[:-1]) + " or " + words[-1] if len(words) > 1 else words[0]
        if self.min is not None and self.max is not None:
            return f"between {self.min:g} and {self.max:g}"
        if self.min is not None:
            return f"at least {self.min:g}"
        if self.above is not None and self.max is not None:
            return f"more than {self.above:g} and at most {self.max:g}"
        return f"more than {self.above:g}" if self.above is not None else None

    def problem(self, value: Any) -> str | None:
        """Why a value (of the setting's type) is out of bounds, or None. None itself always passes."""
        if value is None or self.kind == SWITCH:
            return None
        bad = (
            (self.choices is not None and value not in self.choices)
            or (self.min is not None and not value >= self.min)
            or (self.above is not None and not value > self.above)
            or (self.max is not None and not value <= self.max)
        )
        return f"must be {self.bounds()}, got {value!r}" if bad else None

    def check(self, value: Any) -> Any:
        """The value, or a ConfigError naming the setting (for values set in code, e.g. EngineConfig's)."""
        problem = self.problem(value)
        if problem:
            raise ConfigError(f"{self.name} {problem}")
        return value

    def parse(self, text: Any) -> Any:
        """A flag's or variable's text -> the setting's value (a negated switch's opposite included).

        Raises ValueError whose message says what is wrong and, for a variable's text, which variable."""
        source = f" (from {text.variable})" if isinstance(text, EnvText) else ""
        try:
            value = _PARSERS[self.kind](text)
        except ValueError as exc:
            raise ValueError(f"{exc}{source}") from None
        problem = self.problem(value)
        if problem:
            raise ValueError(f"{problem}{source}")
        return (not value) if self.negate else value

    @property
    def value_default(self) -> Any:
        """The default as the parsed arguments hold it."""
        return None if self.default is None else self.parse(self.default)

    def from_env(self, environ: Mapping[str, str] | None = None) -> Any:
        """The value from the environment, or the default: for what reads a setting without a command line."""
        text = (os.environ if environ is None else environ).get(self.env, "")
        if not text:
            return self.value_default
        try:
            return self.parse(EnvText(text, self.env))
        except ValueError as exc:
            raise ConfigError(f"{self.label}: {exc}") from None

    def to_env(self, value: Any) -> str | None:
        """A parsed value as a variable's text, which parses back to it; None: leave the variable unset."""
        if self.kind == SWITCH:
            return "1" if bool(value) != self.negate else "0"
        if value is None:
            return None
        if self.kind == PATH:
            return os.path.abspath(value)
        if self.kind == NAMES:
            return " ".join(value)
        return repr(value) if self.kind == FLOAT else str(value)


# How a config class declares its settings.

_METADATA = "kvferry.setting"  # a field's metadata key: its Setting
_KIND_OF_TYPE = {bool: SWITCH, int: INT, float: FLOAT, str: STR}


@dataclass(frozen=True)
class _Declared:
    default: Any
    help: str
    options: dict[str, Any]


def setting(default: Any, help: str, **options: Any) -> Any:
    """A config class's field that is a setting. default: a value, or text as a user would write it ("1GiB").
    options: kind (when the field's type does not say it: SIZE, PATH, NAMES), choices, min, above (exclusive),
    max, flag (another flag, or "" for the environment only), metavar, commands (when not the class's), section
    (from this field on), off (the name of the switch that turns this on-by-default field off)."""
    return _Declared(default, help, options)


def _kind_of(annotation: Any) -> str:
    if isinstance(annotation, types.UnionType):  # `int | None`
        annotation = next(t for t in typing.get_args(annotation) if t is not type(None))
    return _KIND_OF_TYPE[annotation]


def _as_setting(name: str, annotation: Any, declared: _Declared, commands: tuple[str, ...], section: str) -> Setting:
    options = dict(declared.options)
    off = options.pop("off", None)
    kind = options.pop("kind", None) or _kind_of(annotation)
    commands, section = options.pop("commands", commands), options.pop("section", section)
    if off is None:
        return Setting(name, kind, declared.default, declared.help, commands, section, **options)
    if declared.default is not True:
        raise TypeError(f"{name}: a field turned off by a switch ({off}) is on by default")
    return Setting(off, SWITCH, False, declared.help, commands, section, dest=name, negate=True, **options)


def settings_class(commands: tuple[str, ...], section: str) -> Callable[[type], type]:
    """Makes a class whose fields are settings (declared with `setting`) into a dataclass. commands: those that
    take its settings; section: the first field's section in the docs and in --help (a field may start another).
    A class without its own __post_init__ gets one that checks every setting's bounds."""

    def make(cls: type) -> type:
        current = section
        for name, annotation in cls.__annotations__.items():
            declared = cls.__dict__.get(name)
            if isinstance(declared, _Declared):
                s = _as_setting(name, annotation, declared, commands, current)
                current = s.group
                setattr(cls, name, field(default=s.value_default, metadata={_METADATA: s}))
        unannotated = [name for name, value in vars(cls).items() if isinstance(value, _Declared)]
        if unannotated:
            raise TypeError(f"{cls.__name__}: a setting's field needs a type: {', '.join(unannotated)}")
        if "__post_init__" not in cls.__dict__:
            cls.__post_init__ = check_settings
        return dataclass(cls)

    return make


def settings_of(cls: type) -> tuple[Setting, ...]:
    """A config class's settings, in the order of its fields."""
    return tuple(f.metadata[_METADATA] for f in fields(cls) if _METADATA in f.metadata)


def check_settings(config: Any) -> None:
    """A ConfigError naming the first setting of a config whose value is out of bounds (for values set in code)."""
    for s in settings_of(type(config)):
        s.check(getattr(config, s.attr))


def from_args(cls: type, args: Any) -> Any:
    """The config of a command's parsed arguments; a setting the command does not take keeps its default."""
    return cls(**{s.attr: getattr(args, s.attr) for s in settings_of(cls) if hasattr(args, s.attr)})

"""The settings (kvferry/common/settings.py, walked from the config classes that declare them): variables, flags,
bounds, the parsers made from them, what `kvferry serve` hands its children, each role's config, and the settings
table in docs/operations.md."""

import argparse
import dataclasses
import re
from pathlib import Path

import pytest

from kvferry.common import settings
from kvferry.common.config import EngineConfig
from kvferry.common.errors import ConfigError
from kvferry.common.gateway_config import GatewayConfig
from kvferry.common.process_config import ProcessConfig
from kvferry.common.serve_config import ServeConfig
from kvferry.common.setting import from_args, setting, settings_class, settings_of
from kvferry.common.worker_config import WorkerConfig

ROOT = Path(__file__).resolve().parents[2]
OPERATIONS = ROOT / "docs" / "operations.md"


def parser_for(command: str, environ: dict) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=f"kvferry {command}", exit_on_error=True)
    settings.add_arguments(parser, command, environ)
    return parser


def parse_error(parser: argparse.ArgumentParser, argv: list[str], capsys) -> str:
    with pytest.raises(SystemExit) as exited:
        parser.parse_args(argv)
    assert exited.value.code == 2
    return capsys.readouterr().err


def sample_text(s: settings.Setting) -> str:
    """A valid value other than the default, as a user would write it."""
    if s.kind == settings.SWITCH:
        return "1"
    if s.choices:
        return str(next(c for c in reversed(s.choices) if c != s.value_default))
    return {
        settings.INT: str(int(s.max if s.max is not None else (s.min or 0) + 7)),
        settings.FLOAT: "2.5" if s.max is None else str(s.max / 2),  # a share (0, 1]: one half
        settings.SIZE: "3MiB",
    }.get(s.kind, f"/some/{s.name}")


def test_each_variable_is_derived_from_the_name_and_unique():
    names = [s.name for s in settings.SPEC]
    assert len(names) == len(set(names))
    for s in settings.SPEC:
        assert re.fullmatch(r"[a-z][a-z0-9_]*", s.name), s.name
        assert s.env == "KVFERRY_" + s.name.upper()
        assert s.commands and set(s.commands) <= set(settings.COMMANDS), s.name
        assert s.help and s.group
    options = [s.option for s in settings.SPEC if s.option]
    assert len(options) == len(set(options))
    assert settings.label("port") == "--port (KVFERRY_PORT)"
    assert settings.get("seed").option == "--engine-seed"  # `generate --seed` is the request's sampling seed


def test_every_default_is_valid_and_goes_through_the_environment_unchanged():
    for s in settings.SPEC:
        value = s.value_default  # parses, and within bounds
        text = s.to_env(value)
        if text is None:
            assert value is None
        else:
            assert s.parse(text) == (value if s.kind != settings.PATH else text), s.name


@pytest.mark.parametrize("command", settings.COMMANDS)
def test_a_variable_is_read_and_a_flag_overrides_it(command):
    for s in settings.for_command(command):
        text = sample_text(s)
        from_env = vars(parser_for(command, {s.env: text}).parse_args([]))
        by_flag = vars(parser_for(command, {}).parse_args([s.option] + ([] if s.kind == settings.SWITCH else [text])))
        unset = vars(parser_for(command, {s.env: ""}).parse_args([]))  # empty counts as unset
        assert from_env == by_flag, s.name
        assert from_env[s.attr] == s.parse(text) != s.value_default, s.name
        assert unset[s.attr] == s.value_default == vars(parser_for(command, {}).parse_args([]))[s.attr]
    parser = parser_for(settings.GATEWAY, {"KVFERRY_MAX_N": "3", "KVFERRY_PORT": "not a port"})
    args = parser.parse_args(["--max-n", "5", "--port", "9000"])  # the flag wins, and a bad variable it covers
    assert (args.max_n, args.port) == (5, 9000)
    assert parser.parse_args(["--port", "9000"]).max_n == 3


def test_switches_read_yes_and_no_and_negated_ones_store_their_opposite():
    for text, on in (("1", True), ("yes", True), ("TRUE", True), ("on", True), ("0", False), ("no", False)):
        args = parser_for(settings.GENERATE, {"KVFERRY_NO_PREFIX_CACHING": text, "KVFERRY_ENFORCE_EAGER": text})
        parsed = args.parse_args([])
        assert parsed.enable_prefix_caching is (not on) and parsed.enforce_eager is on
    parsed = parser_for(settings.GENERATE, {}).parse_args(["--no-chunked-prefill", "--enforce-eager"])
    assert parsed.enable_chunked_prefill is False and parsed.enforce_eager is True


@pytest.mark.parametrize(
    "command,environ,argv,message",
    [
        (
            "generate",
            {"KVFERRY_MAX_NUM_SEQS": "lots"},
            [],
            "argument --max-num-seqs: invalid int value: 'lots' (from KVFERRY_MAX_NUM_SEQS)",
        ),
        ("generate", {}, ["--max-num-seqs", "lots"], "argument --max-num-seqs: invalid int value: 'lots'"),
        ("generate", {}, ["--block-size", "12"], "argument --block-size: must be 8, 16 or 32, got 12"),
        (
            "gateway",
            {"KVFERRY_BLOCK_SIZE": "12"},
            [],
            "argument --block-size: must be 8, 16 or 32, got 12 (from KVFERRY_BLOCK_SIZE)",
        ),
        ("gateway", {}, ["--port", "70000"], "argument --port: must be between 0 and 65535, got 70000"),
        ("gateway", {}, ["--max-waiting", "-1"], "argument --max-waiting: must be at least 0, got -1"),
        ("gateway", {}, ["--step-timeout", "0"], "argument --step-timeout: must be more than 0, got 0.0"),
        ("gateway", {}, ["--step-timeout", "nan"], "argument --step-timeout: must be more than 0, got nan"),
        (
            "gateway",
            {"KVFERRY_LOG_FORMAT": "xml"},
            [],
            "argument --log-format: must be text or json, got 'xml' (from KVFERRY_LOG_FORMAT)",
        ),
        ("serve", {}, ["--max-body-size", "lots"], "argument --max-body-size: not a size: 'lots'"),
        ("serve", {}, ["--gateways", "0"], "argument --gateways: must be between 1 and 64, got 0"),
        (
            "gateway",
            {"KVFERRY_GATEWAYS": "65"},
            [],
            "argument --gateways: must be between 1 and 64, got 65 (from KVFERRY_GATEWAYS)",
        ),
        (
            "decode",
            {"KVFERRY_ENFORCE_EAGER": "maybe"},
            [],
            "argument --enforce-eager: not a yes or no: 'maybe' (try 1, true, yes, on or 0, false, no, off) "
            "(from KVFERRY_ENFORCE_EAGER)",
        ),
    ],
)
def test_a_bad_value_is_a_usage_error_naming_the_setting(command, environ, argv, message, capsys):
    err = parse_error(parser_for(command, environ), argv, capsys)
    assert message in err and "Traceback" not in err


def test_served_model_name_takes_several_names_by_flag_or_by_variable(capsys):
    names = lambda environ, argv: parser_for(settings.GATEWAY, environ).parse_args(argv).served_model_name  # noqa: E731
    assert names({}, []) is None
    assert names({}, ["--served-model-name", "org/m", "m", "--port", "1"]) == ("org/m", "m")
    assert names({"KVFERRY_SERVED_MODEL_NAME": " org/m   m "}, []) == ("org/m", "m")
    assert names({"KVFERRY_SERVED_MODEL_NAME": "a b"}, ["--served-model-name", "c"]) == ("c",)
    serve = parser_for(settings.SERVE, {}).parse_args(["--served-model-name", "org/m", "m"])
    child = settings.apply_environment({}, settings.child_environment(serve, settings.SERVE, [settings.GATEWAY]))
    assert child["KVFERRY_SERVED_MODEL_NAME"] == "org/m m"
    assert names(child, []) == ("org/m", "m")  # serve's gateway gets them all
    for environ, argv, message in (
        ({}, ["--served-model-name", "m", "m"], "argument --served-model-name: 'm' is named twice"),
        ({}, ["--served-model-name"], "argument --served-model-name: expected at least one argument"),
        ({}, ["--served-model-name", *map(str, range(17))], "at most 16 names, got 17"),
        ({}, ["--served-model-name", "x" * 257], "a name has 1 to 256 printable characters"),
        ({}, ["--served-model-name", "a\x01"], "a name has 1 to 256 printable characters"),
        ({"KVFERRY_SERVED_MODEL_NAME": "a a"}, [], "'a' is named twice (from KVFERRY_SERVED_MODEL_NAME)"),
    ):
        err = parse_error(parser_for(settings.GATEWAY, environ), argv, capsys)
        assert message in err and "Traceback" not in err, err


def test_settings_read_without_a_command_line_name_their_variable():
    assert settings.from_env("port", {}) == 8000
    assert settings.from_env("port", {"KVFERRY_PORT": "9001"}) == 9001
    assert settings.from_env("health_port", {"KVFERRY_HEALTH_PORT": ""}) is None
    with pytest.raises(ConfigError, match=r"--port \(KVFERRY_PORT\): invalid int value: 'http' \(from KVFERRY_PORT\)"):
        settings.from_env("port", {"KVFERRY_PORT": "http"})
    assert settings.get("cache_dir").option is None and settings.from_env("cache_dir", {}) == "~/.cache/kvferry"


def test_engine_config_is_the_engine_commands_settings():
    engine = settings.for_command(settings.GENERATE)
    assert {s.attr for s in engine} == {f.name for f in dataclasses.fields(EngineConfig)}
    assert settings.for_command(settings.BENCH) == engine
    for command in settings.ENGINE:  # the workers take more
        assert all(s in settings.for_command(command) for s in engine)
    config = EngineConfig()
    for s in engine:
        expected = None if s.name == "quantization" else s.value_default  # "none" is held as None
        assert getattr(config, s.attr) == expected, s.name
    args = parser_for(settings.GENERATE, {"KVFERRY_KV_CACHE_MEMORY": "64MiB", "KVFERRY_QUANTIZATION": "int8"})
    config = EngineConfig.from_args(args.parse_args(["--engine-seed", "7", "--no-prefix-caching"]))
    assert (config.kv_cache_memory, config.quantization, config.seed) == (64 * 2**20, "int8", 7)
    assert config.enable_prefix_caching is False
    with pytest.raises(ConfigError, match="block_size must be 8, 16 or 32, got 12"):
        EngineConfig(block_size=12)
    with pytest.raises(ConfigError, match="kv_cache_memory must be at least 1, got 0"):
        EngineConfig(kv_cache_memory=0)


def test_serve_hands_its_children_every_setting_they_share(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    args = parser_for(settings.SERVE, {"KVFERRY_MAX_N": "3"}).parse_args(
        ["--trace-dir", "traces", "--max-waiting", "0", "--quantization", "int8", "--max-body-size", "1KiB"]
    )
    env = settings.child_environment(args, settings.SERVE, (settings.GATEWAY, settings.PREFILL, settings.DECODE))
    shared = {
        s.env
        for s in settings.for_command(settings.SERVE)
        if {settings.GATEWAY, settings.PREFILL, settings.DECODE} & set(s.commands)
    }
    assert set(env) == shared
    assert "KVFERRY_PREFILL_THREADS" not in env and "KVFERRY_CONTROL_PORT" not in env  # serve's own
    assert env["KVFERRY_TRACE_DIR"] == str(tmp_path / "traces")  # children may start elsewhere
    assert (env["KVFERRY_MAX_WAITING"], env["KVFERRY_MAX_N"], env["KVFERRY_QUANTIZATION"]) == ("0", "3", "int8")
    assert env["KVFERRY_MAX_BODY_SIZE"] == "1024" and env["KVFERRY_API_KEY"] is None
    child = settings.apply_environment({"KVFERRY_API_KEY": "stale", "PATH": "/bin"}, env)
    assert "KVFERRY_API_KEY" not in child and child["PATH"] == "/bin"
    for command in (settings.GATEWAY, settings.PREFILL, settings.DECODE):  # each child parses the same values
        parsed = vars(parser_for(command, child).parse_args([]))
        for s in settings.for_command(command):
            if s.env in env:
                assert parsed[s.attr] == (str(tmp_path / "traces") if s.name == "trace_dir" else vars(args)[s.attr])


def test_serve_takes_the_engine_settings_another_model_needs_and_its_workers_get_them():
    argv = ["--kv-cache-memory", "3GiB", "--dtype", "float16", "--device", "cuda:1", "--max-model-len", "4096"]
    args = parser_for(settings.SERVE, {}).parse_args([*argv, "--no-prefix-caching"])
    child = settings.apply_environment({}, settings.child_environment(args, settings.SERVE, settings.SERVICES))
    for role in (settings.PREFILL, settings.DECODE):
        config = EngineConfig.from_args(parser_for(role, child).parse_args([]))
        assert (config.kv_cache_memory, config.dtype, config.device) == (3 * 2**30, "float16", "cuda:1")
        assert config.max_model_len == 4096 and config.enable_prefix_caching is False
    assert parser_for(settings.GATEWAY, child).parse_args([]).max_model_len == 4096
    assert "--num-threads" not in {s.option for s in settings.for_command(settings.SERVE)}  # serve's own per worker


def test_the_gateway_runs_with_its_config_parsed_from_its_flags():
    from kvferry.services.gateway.openapi import openapi_spec
    from kvferry.services.gateway.request_fields import COMPLETIONS
    from kvferry.services.gateway.server import Deadlines

    argv = ["--max-body-size", "1KiB", "--max-tokens-limit", "5", "--max-n", "2", "--step-timeout", "2"]
    config = from_args(GatewayConfig, parser_for(settings.GATEWAY, {"KVFERRY_MAX_MOVES": "0"}).parse_args(argv))
    # The request schema's bounds are the config's own fields, read where they are checked
    properties = openapi_spec("0", config)["components"]["schemas"][COMPLETIONS]["properties"]
    assert (config.max_body_size, properties["max_tokens"]["maximum"], properties["n"]["maximum"]) == (1024, 5, 2)
    deadlines = Deadlines(config)
    assert (deadlines.step_s, deadlines.max_moves, deadlines.request_s) == (2.0, 0, 600.0)
    with pytest.raises(ConfigError, match="port must be between 0 and 65535, got 70000"):
        GatewayConfig(port=70000)


def test_every_setting_is_one_field_of_one_config_and_its_default_is_the_fields():
    declared = [s for config in settings.CONFIGS for s in settings_of(config)]
    assert len(declared) == len(settings.SPEC) and set(declared) == set(settings.SPEC)
    for config in settings.CONFIGS:
        instance = config()
        for s in settings_of(config):
            assert getattr(instance, s.attr) == (None if s.name == "quantization" else s.value_default), s.name


def test_a_config_field_declares_its_setting():
    @settings_class((settings.GATEWAY,), "API")
    class Example:
        size: int = setting("2KiB", "a size", kind=settings.SIZE, min=1)
        on: bool = setting(True, "turned off by --no-on", off="no_on")
        plain: float | None = setting(None, "a float", above=0, section="files")
        not_a_setting: int = 3

    size, on, plain = settings_of(Example)
    assert (size.kind, size.value_default, Example().size, size.bounds()) == (settings.SIZE, 2048, 2048, "at least 1")
    assert (on.name, on.attr, on.option, on.env, Example().on) == ("no_on", "on", "--no-on", "KVFERRY_NO_ON", True)
    assert (plain.kind, plain.group, size.group, plain.commands) == (settings.FLOAT, "files", "API", ("gateway",))
    assert from_args(Example, argparse.Namespace(size=5, on=False, not_a_setting=9)) == Example(size=5, on=False)
    with pytest.raises(ConfigError, match="plain must be more than 0, got 0"):
        Example(plain=0)
    with pytest.raises(TypeError, match="on by default"):

        @settings_class((settings.GATEWAY,), "API")
        class OffByDefault:
            on: bool = setting(False, "a switch's field turned off must be on by default", off="no_on")


def test_a_worker_and_serve_run_with_their_configs_parsed_from_their_flags():
    argv = ["--kv-bind", "tcp://127.0.0.1:5", "--drain-timeout", "0", "--insecure"]
    args = parser_for(settings.DECODE, {"KVFERRY_STALL_TIMEOUT": "4"}).parse_args(argv)
    worker, process = from_args(WorkerConfig, args), from_args(ProcessConfig, args)
    assert (worker.stall_timeout, worker.kv_bind, process.drain_timeout, process.insecure) == (
        4.0,
        "tcp://127.0.0.1:5",
        0.0,
        True,
    )
    prefill = from_args(WorkerConfig, parser_for(settings.PREFILL, {}).parse_args(["--worker-id", "p"]))
    assert (prefill.worker_id, prefill.kv_bind) == ("p", "tcp://127.0.0.1:0")  # one it does not take: the default
    serve = parser_for(settings.SERVE, {"KVFERRY_DECODE_NICE": "0"}).parse_args(["--prefill-threads", "3"])
    assert from_args(ServeConfig, serve) == ServeConfig(prefill_threads=3, decode_nice=0)
    with pytest.raises(ConfigError, match="grammar_compile_timeout must be more than 0 and at most 8, got 9"):
        WorkerConfig(grammar_compile_timeout=9)


def test_the_settings_table_in_docs_operations_is_the_spec():
    """docs/operations.md's settings table is generated from the configs' fields. When this fails, run `make docs`
    (`.venv/bin/python -m kvferry.common.settings --write-docs docs/operations.md`) and commit the file."""
    assert OPERATIONS.is_file(), f"{OPERATIONS} is missing"
    table = settings.docs_table_of(OPERATIONS)
    assert table == settings.markdown_table(), (
        f"the settings table in {OPERATIONS.relative_to(ROOT)} is out of date: run `make docs` "
        f"(.venv/bin/python -m kvferry.common.settings --write-docs docs/operations.md)"
    )
    for s in settings.SPEC:
        assert f"`{s.env}`" in table


def test_write_docs_fills_the_markers_and_check_docs_notices_a_stale_table(tmp_path, capsys):
    doc = tmp_path / "ops.md"
    doc.write_text(f"# Ops\n\n{settings.DOCS_BEGIN}\nold\n{settings.DOCS_END}\n\nafter\n")
    assert settings.main(["--check-docs", str(doc)]) == 1
    assert "--write-docs docs/operations.md" in capsys.readouterr().err
    assert settings.main(["--write-docs", str(doc)]) == 0
    text = doc.read_text()
    assert text.startswith("# Ops\n\n") and text.endswith(f"{settings.DOCS_END}\n\nafter\n")
    assert settings.main(["--check-docs", str(doc)]) == 0
    assert not settings.write_docs(doc)  # nothing to change
    doc.write_text("no markers")
    with pytest.raises(ConfigError, match="settings-table:begin"):
        settings.write_docs(doc)


def subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    return next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices


def test_each_command_of_kvferry_takes_exactly_its_settings(monkeypatch):
    from kvferry.services.commands import build_parser as services_parser
    from kvferry.tools.cli import build_parser

    for key in [k for k in __import__("os").environ if k.startswith(settings.ENV_PREFIX)]:
        monkeypatch.delenv(key)
    commands = subcommands(build_parser())
    parsers = {command: [commands[command]] for command in settings.COMMANDS if command != settings.BENCH}
    parsers[settings.BENCH] = [subcommands(commands["bench"])[name] for name in ("engine", "step", "quantization")]
    for command, parser in subcommands(services_parser()).items():  # what `kvferry serve` starts its children with
        parsers.get(command, []).append(parser)
    by_option = {s.option: s for s in settings.SPEC if s.option}
    for command, found in parsers.items():
        expected = {s.option for s in settings.for_command(command)}
        for parser in found:
            actions = {option: a for a in parser._actions for option in a.option_strings}
            taken = {o for o, a in actions.items() if o in by_option and a.dest == by_option[o].attr}
            assert taken == expected, f"{command}: {sorted(taken ^ expected)}"
            dests = [a.dest for a in parser._actions]
            assert len(dests) == len(set(dests)), f"{command}: two flags write one attribute"
            args = parser.parse_args(["--prompt", "hi"] if command == settings.GENERATE else [])
            assert all(getattr(args, s.attr) == s.value_default for s in settings.for_command(command))


@pytest.mark.parametrize("setting", settings.SPEC, ids=lambda s: s.name or s.dest or "?")
def test_every_default_is_within_its_own_bounds(setting):
    # A default past its bound makes every command that takes the setting refuse to start.
    assert setting.problem(setting.value_default) is None

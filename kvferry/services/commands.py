"""The long-running roles' subcommands: gateway, prefill, decode, serve (the three as child processes) and health.
`kvferry serve` starts its children through this module's own main: the services never reach up into the tools.
"""

import argparse
import contextlib
import os
import sys

from kvferry.common import settings
from kvferry.common.config import EngineConfig
from kvferry.common.errors import KvferryError
from kvferry.common.process_config import ProcessConfig
from kvferry.common.setting import from_args
from kvferry.common.tracing import observe
from kvferry.common.worker_config import WorkerConfig


def cmd_gateway(args) -> int:
    if args.gateways > 1 and args.gateway_index is None:
        from kvferry.services.gateway_group import run_gateway_group

        return run_gateway_group(args)
    if args.gateway_index is not None and not 0 <= args.gateway_index < args.gateways:
        raise KvferryError(
            f"--gateway-index {args.gateway_index} is not one of {settings.label('gateways')}'s 0 to {args.gateways - 1}"
        )
    from kvferry.services.gateway.main import run_gateway

    run_gateway(args)
    return 0


def _run_worker(args, cls, config: WorkerConfig, process: ProcessConfig) -> int:
    import signal
    import uuid

    from kvferry.common.curve import CurveKeys
    from kvferry.services.launcher import _interrupt
    from kvferry.services.stop_signals import StopSignals

    role = cls.role.name.lower()
    worker_id = config.worker_id or f"{role}-{uuid.uuid4().hex[:8]}"
    # oneDNN and ideep cache a kernel per matmul shape, 1024 by default: a prefill worker sees a new token count at
    # almost every step, so its memory would climb for good (tests/e2e/soak.py). 64 holds a decode batch's shapes.
    # Both are read at the first matmul, so setting them here works.
    for cache in ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY"):
        os.environ.setdefault(cache, "64")
    observe(args, role, worker_id)  # before the worker: its channels take the tracer
    # Read before the model loads, so that bad keys fail at once. Each role presents a client pair of its own.
    curve = CurveKeys.for_role(process.curve_keys, role, config.curve_client)
    signal.signal(signal.SIGTERM, _interrupt)  # until it serves: stop like Ctrl-C
    from kvferry.services.worker_health import WorkerHealthServer

    health = WorkerHealthServer("0.0.0.0", config.health_port) if config.health_port is not None else None

    engine_config = EngineConfig.from_args(args)
    worker = cls(engine_config, config.gateway, worker_id, worker_config=config, process=process, curve=curve)
    if health:
        health.worker = worker

    stops = StopSignals()

    def drain(*_):  # the first SIGTERM drains; a second one stops at once, unless it is the first's echo
        if stops.is_echo(signal.SIGTERM):
            return
        if worker.stop_requested:
            raise KeyboardInterrupt
        worker.stop_requested = True

    signal.signal(signal.SIGTERM, drain)
    with contextlib.suppress(KeyboardInterrupt):
        worker.serve_forever()
    return 0


def cmd_prefill(args) -> int:
    from kvferry.services.prefill.worker import PrefillWorker

    return _run_worker(args, PrefillWorker, from_args(WorkerConfig, args), from_args(ProcessConfig, args))


def cmd_decode(args) -> int:
    from kvferry.common.bind_check import check_exposed

    config, process = from_args(WorkerConfig, args), from_args(ProcessConfig, args)
    # Refused now, not after torch and the model load. With --insecure the worker warns as it binds.
    if not process.insecure:
        check_exposed(config.kv_bind, "the decode worker's KV ingress", curve=bool(process.curve_keys))
    from kvferry.services.decode.worker import DecodeWorker

    return _run_worker(args, DecodeWorker, config, process)


def cmd_serve(args) -> int:
    from kvferry.services.launcher import serve

    return serve(args)


def add_service_parsers(sub) -> None:
    """`kvferry gateway`, `prefill`, `decode`, `health` and `serve`, on the subparsers of a `kvferry` parser."""
    from kvferry.services.health_probe import check

    p = sub.add_parser("gateway", help="the HTTP API and the worker registry")
    settings.add_arguments(p, settings.GATEWAY)
    # Not a setting: which of --gateways N processes this one is, given by the process that starts them.
    p.add_argument("--gateway-index", type=int, default=None, help=argparse.SUPPRESS)
    p.set_defaults(func=cmd_gateway)

    for role, func in ((settings.PREFILL, cmd_prefill), (settings.DECODE, cmd_decode)):
        p = sub.add_parser(role, help=f"one {role} worker")
        settings.add_arguments(p, role)
        p.set_defaults(func=func)

    p = sub.add_parser("health", help="exit 0 when this container's gateway or worker is healthy (for HEALTHCHECK)")
    p.add_argument("--url", action="append", help="probe this URL instead (repeatable; the first that answers decides)")
    p.set_defaults(func=lambda args: check(args.url))

    p = sub.add_parser("serve", help="gateway + 1 prefill + 1 decode worker as child processes")
    settings.add_arguments(p, settings.SERVE)
    p.set_defaults(func=cmd_serve)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvferry", description="kvferry's long-running roles")
    add_service_parsers(parser.add_subparsers(dest="command", required=True))
    return parser


def run(args) -> int:
    """Run a parsed command: a KvferryError is one line and exit status 2, Ctrl-C is 130."""
    try:
        return args.func(args)
    except KvferryError as exc:
        print(f"kvferry: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


def main(argv: list[str] | None = None) -> int:
    return run(build_parser().parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())

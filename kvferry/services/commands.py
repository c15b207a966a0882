"""The long-running roles' subcommands: gateway, prefill, decode, serve (the three as child processes) and health.

`kvferry` (kvferry.tools.cli) adds these beside its tools; `kvferry serve` starts its children through this
module's own main, so that the services never reach up into the tools.
"""

import argparse
import os
import sys

from kvferry.common.config import EngineConfig
from kvferry.common.errors import KvferryError
from kvferry.common.observability import add_observability_args, observe


def cmd_gateway(args) -> int:
    from kvferry.services.gateway.main import run_gateway

    run_gateway(args)
    return 0


def add_security_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--curve-keys",
        default=os.environ.get("KVFERRY_CURVE_KEYS") or None,
        metavar="DIR",
        help="encrypt and authenticate every ZeroMQ socket with the keys in DIR (kvferry keys DIR)",
    )


def add_api_args(parser: argparse.ArgumentParser) -> None:
    from kvferry.common.config import parse_size
    from kvferry.services.gateway.request_parsing import Limits

    env, limits = os.environ.get, Limits()
    g = parser.add_argument_group("API (each also read from KVFERRY_<NAME>)")
    g.add_argument(
        "--api-key",
        default=env("KVFERRY_API_KEY") or None,
        help="require 'Authorization: Bearer KEY' on every route but /health, /metrics, /version, /openapi.json",
    )
    g.add_argument(
        "--max-body-size",
        type=parse_size,
        default=env("KVFERRY_MAX_BODY_SIZE", str(limits.max_body_bytes)),
        help="larger request bodies get 413",
    )
    g.add_argument("--max-n", type=int, default=env("KVFERRY_MAX_N", str(limits.max_n)))
    g.add_argument(
        "--max-tokens-limit",
        type=int,
        default=env("KVFERRY_MAX_TOKENS_LIMIT", str(limits.max_tokens)),
        help="the largest max_tokens a request may ask for",
    )
    g.add_argument(
        "--max-stop",
        type=int,
        default=env("KVFERRY_MAX_STOP", str(limits.max_stop)),
        help="the most stop strings a request may send",
    )
    g.add_argument(
        "--max-prompts",
        type=int,
        default=env("KVFERRY_MAX_PROMPTS", str(limits.max_prompts)),
        help="the most prompts one completions request may carry",
    )


def add_reliability_args(parser: argparse.ArgumentParser) -> None:
    from kvferry.services.gateway.server import Deadlines

    env, d = os.environ.get, Deadlines()
    g = parser.add_argument_group("deadlines and overload (each also read from KVFERRY_<NAME>)")
    g.add_argument(
        "--max-waiting",
        type=int,
        default=env("KVFERRY_MAX_WAITING", "256"),
        help="requests waiting for their first token; past this, new ones get 429 (0: no bound)",
    )
    g.add_argument(
        "--drain-timeout",
        type=float,
        default=env("KVFERRY_DRAIN_TIMEOUT", "30"),
        help="on SIGTERM, stop admitting and finish the requests in flight for at most this long",
    )
    g.add_argument(
        "--first-token-timeout",
        type=float,
        default=env("KVFERRY_FIRST_TOKEN_TIMEOUT", str(d.first_token_s)),
        help="a request without its first token this long moves to other workers",
    )
    g.add_argument(
        "--step-timeout",
        type=float,
        default=env("KVFERRY_STEP_TIMEOUT", str(d.step_s)),
        help="a decoding request without new tokens this long moves to other workers",
    )
    g.add_argument("--request-timeout", type=float, default=env("KVFERRY_REQUEST_TIMEOUT", str(d.request_s)))
    g.add_argument(
        "--max-moves",
        type=int,
        default=env("KVFERRY_MAX_MOVES", str(d.max_moves)),
        help="how often a request may move off a failed worker before it fails",
    )


def _run_worker(args, cls, **kwargs) -> int:
    import signal
    import uuid

    from kvferry.services.launcher import _interrupt

    worker_id = args.worker_id or f"{cls.role.name.lower()}-{uuid.uuid4().hex[:8]}"
    # oneDNN, and ideep above it, cache a compiled kernel per matmul shape, 1024 of each by default. A prefill
    # worker sees a new token count at almost every step, so its memory would climb by hundreds of MB over
    # thousands of requests (found by `kvferry bench soak`). 64 still holds every shape a decode batch cycles
    # through. Both are read at the first matmul, so setting them here works.
    for cache in ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY"):
        os.environ.setdefault(cache, "64")
    observe(args, cls.role.name.lower(), worker_id)  # before the worker: its channels take the tracer
    signal.signal(signal.SIGTERM, _interrupt)  # until it serves: stop like Ctrl-C
    from kvferry.common.curve import CurveKeys
    from kvferry.services.worker_health import WorkerHealthServer

    health = WorkerHealthServer("0.0.0.0", args.health_port) if args.health_port is not None else None

    worker = cls(
        EngineConfig.from_args(args),
        args.gateway,
        worker_id,
        stall_timeout_s=args.stall_timeout,
        drain_timeout_s=args.drain_timeout,
        curve=CurveKeys.load(args.curve_keys),
        **kwargs,
    )
    if health:
        health.worker = worker

    def drain(*_):  # the first SIGTERM drains; a second one stops at once
        if worker.stop_requested:
            raise KeyboardInterrupt
        worker.stop_requested = True

    signal.signal(signal.SIGTERM, drain)
    try:
        worker.serve_forever()
    except KeyboardInterrupt:
        pass
    return 0


def cmd_prefill(args) -> int:
    from kvferry.services.prefill.worker import PrefillWorker

    return _run_worker(args, PrefillWorker)


def cmd_decode(args) -> int:
    from kvferry.services.decode.worker import DecodeWorker

    return _run_worker(args, DecodeWorker, kv_bind=args.kv_bind, advertise_host=args.advertise_host)


def cmd_serve(args) -> int:
    from kvferry.services.launcher import serve

    return serve(args)


def add_service_parsers(sub) -> None:
    """`kvferry gateway`, `prefill`, `decode`, `health` and `serve`, on the subparsers of a `kvferry` parser."""
    from kvferry.services.health_probe import cmd_health

    env = os.environ.get
    p = sub.add_parser("gateway", help="the HTTP API and the worker registry")
    p.add_argument("--model", default=env("KVFERRY_MODEL"))
    p.add_argument("--host", default=env("KVFERRY_HOST", "127.0.0.1"))
    p.add_argument("--port", type=int, default=env("KVFERRY_PORT", "8000"))
    p.add_argument(
        "--control",
        default=env("KVFERRY_CONTROL", "tcp://127.0.0.1:5557"),
        help="where workers register (binding beyond 127.0.0.1 lets any host on the network talk to it)",
    )
    p.add_argument("--block-size", type=int, default=env("KVFERRY_BLOCK_SIZE", "16"))
    p.add_argument("--max-model-len", type=int, default=env("KVFERRY_MAX_MODEL_LEN"))
    p.add_argument("--heartbeat-interval", type=float, default=env("KVFERRY_HEARTBEAT_INTERVAL", "1.0"))
    add_reliability_args(p)
    add_security_args(p)
    add_api_args(p)
    add_observability_args(p)
    p.set_defaults(func=cmd_gateway)

    for role, func in (("prefill", cmd_prefill), ("decode", cmd_decode)):
        p = sub.add_parser(role, help=f"one {role} worker")
        p.add_argument(
            "--gateway",
            default=env("KVFERRY_GATEWAY", "tcp://127.0.0.1:5557"),
            help="the gateway's control address; several, comma-separated, to serve gateways that share this worker",
        )
        p.add_argument("--worker-id", default=env("KVFERRY_WORKER_ID"))
        p.add_argument(
            "--stall-timeout",
            type=float,
            default=env("KVFERRY_STALL_TIMEOUT", "30"),
            help="report unhealthy (the gateway moves the requests) when the step loop is stuck this long",
        )
        p.add_argument(
            "--drain-timeout",
            type=float,
            default=env("KVFERRY_DRAIN_TIMEOUT", "30"),
            help="on SIGTERM, finish what this worker holds for at most this long, then hand it back",
        )
        p.add_argument(
            "--health-port",
            type=int,
            default=env("KVFERRY_HEALTH_PORT"),
            help="serve GET /health (registered and stepping) and /live (loop not stuck) on this port, on "
            "every interface: the kubelet probes the pod's address (default: off)",
        )
        if role == "decode":
            p.add_argument(
                "--kv-bind",
                default=env("KVFERRY_KV_BIND", "tcp://127.0.0.1:0"),
                help="where prefill workers send KV (port 0: any free port)",
            )
            p.add_argument(
                "--advertise-host",
                default=env("KVFERRY_ADVERTISE_HOST"),
                help="the address prefill workers reach a 0.0.0.0 --kv-bind at (default: this host's "
                "IP; in Kubernetes, give the pod IP)",
            )
        EngineConfig.add_args(p)
        add_security_args(p)
        add_observability_args(p)
        p.set_defaults(func=func)

    p = sub.add_parser("health", help="exit 0 when this container's gateway or worker is healthy (for HEALTHCHECK)")
    p.add_argument(
        "--url",
        action="append",
        default=None,
        help="probe this URL instead (repeatable; the first that answers decides)",
    )
    p.set_defaults(func=cmd_health)

    p = sub.add_parser("serve", help="gateway + 1 prefill + 1 decode worker as child processes")
    p.add_argument("--host", default=env("KVFERRY_HOST", "127.0.0.1"))
    p.add_argument("--port", type=int, default=env("KVFERRY_PORT", "8000"))
    p.add_argument("--control-port", type=int, default=env("KVFERRY_CONTROL_PORT", "5557"))
    p.add_argument("--model", default=env("KVFERRY_MODEL"))
    # On two cores: the decode worker is busy all the time, the prefill worker in bursts (measured with
    # `kvferry bench serve`: 1+2 threads beat 1+1, and 2+2 oversubscribes badly).
    p.add_argument("--prefill-threads", type=int, default=env("KVFERRY_PREFILL_THREADS", "1"))
    p.add_argument("--decode-threads", type=int, default=env("KVFERRY_DECODE_THREADS", "2"))
    p.add_argument(
        "--quantization",
        default=env("KVFERRY_QUANTIZATION", "none"),
        choices=["none", "int8"],
        help="int8: int8 weights in both workers (see `kvferry prefill --help`)",
    )
    add_reliability_args(p)
    add_security_args(p)
    add_api_args(p)
    add_observability_args(p)
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

"""`kvferry simulate` and `kvferry plan`: a capture through simulated stacks, and the cheapest one that meets an SLO.

Both take the workers' engine settings with the flags and KVFERRY_ variables the workers themselves read, so a
simulated worker is configured like the real one it stands for.
"""

import argparse
import importlib.util
import json
import os
import sys

from kvferry.common import settings
from kvferry.common.config import EngineConfig
from kvferry.common.errors import ConfigError, KvferryError
from kvferry.tools.sim import workload as workloads
from kvferry.tools.sim.cost_model import CostModel
from kvferry.tools.sim.plan import Planner
from kvferry.tools.sim.plot import plot_report
from kvferry.tools.sim.simulator import SimOptions, Simulator
from kvferry.tools.sim.slo import SLO
from kvferry.tools.sim.worker_config import Placement, WorkerConfig

# The settings a simulated worker is built from (the model's, for the size of a KV block).
ENGINE_SETTINGS = (
    "model",
    "device",
    "dtype",
    "kv_cache_dtype",
    "block_size",
    "kv_cache_memory",
    "max_num_seqs",
    "max_num_batched_tokens",
    "max_model_len",
    "no_prefix_caching",
    "no_chunked_prefill",
    "long_prefill_threshold",
)
# serve's threads for each worker, and the gateway's heartbeats and bound.
STACK_SETTINGS = ("prefill_threads", "decode_threads", "heartbeat_interval", "max_waiting")


def add_sim_parsers(sub) -> None:
    p = sub.add_parser(
        "simulate",
        help="replay a capture through simulated prefill and decode workers (the real scheduler, a fitted cost model)",
        description="Feed a capture's arrivals into P simulated prefill and D decode workers (the real Scheduler, "
        "BlockManager and gateway routing, in virtual time, each step timed by a cost model from `kvferry bench "
        "costs`) and report TTFT, inter-token latency, e2e, queueing, preemptions and KV usage.",
    )
    _add_common(p)
    p.add_argument("--prefill", type=_positive_int, default=1, metavar="P", help="prefill workers (default 1)")
    p.add_argument("--decode", type=_positive_int, default=1, metavar="D", help="decode workers (default 1)")
    p.add_argument("--per-request", action="store_true", help="also print a line per request")
    p.add_argument("--plot", metavar="FILE.png", help="draw latencies and KV usage over time (needs matplotlib)")
    p.set_defaults(func=cmd_simulate)

    p = sub.add_parser(
        "plan",
        help="the cheapest prefill/decode pool shape whose simulation meets TTFT and ITL p90 objectives",
        description="Simulate the capture on every shape with P + D <= --max-workers, cheapest first, and print "
        "the cheapest that meets both p90 objectives, the runners-up, and the load at which it stops meeting them. "
        "Exit status 0 when a shape meets them, 1 when none does.",
    )
    _add_common(p)
    p.add_argument("--ttft-p90", type=_positive_float, required=True, metavar="S", help="TTFT p90 bound, seconds")
    p.add_argument("--itl-p90", type=_positive_float, required=True, metavar="S", help="ITL p90 bound, seconds")
    p.add_argument("--max-workers", type=_positive_int, default=8, metavar="N", help="P + D at most (default 8)")
    p.set_defaults(func=cmd_plan)


def _add_common(p: argparse.ArgumentParser) -> None:
    p.add_argument("captures", nargs="+", metavar="CAPTURE", help="capture files or folders (--capture-dir)")
    p.add_argument("--costs", required=True, metavar="FILE", help="the cost model from `kvferry bench costs`")
    p.add_argument(
        "--cores",
        type=_non_negative_int,
        default=os.cpu_count() or 1,
        help="the cores the workers share (default: this machine's); 0: each worker has cores of its own",
    )
    p.add_argument(
        "--background-threads",
        type=_non_negative_float,
        default=0.0,
        metavar="X",
        help="cores' worth of other work on the same cores all along (the gateway, a load generator); default 0",
    )
    p.add_argument(
        "--rate-scale",
        "--speed",
        dest="rate_scale",
        type=_positive_float,
        default=1.0,
        metavar="X",
        help="arrivals X times closer together (2: twice the captured load)",
    )
    p.add_argument(
        "--num-blocks",
        type=_positive_int,
        metavar="N",
        help="KV blocks of each worker (default: --kv-cache-memory over the model's block size)",
    )
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    group = p.add_argument_group(
        f"the stack's settings, as its processes read them (each also from {settings.ENV_PREFIX}<NAME>)"
    )
    for name in ENGINE_SETTINGS + STACK_SETTINGS:
        # Left out, a setting is read from its variable or its default when the command runs (a bad variable then
        # fails this command, not the building of every command's parser).
        s = settings.get(name)
        kwargs = dict(dest=s.attr, default=None, help=s.help)
        if s.kind == settings.SWITCH:
            kwargs.update(action="store_const", const=not s.negate)
        else:
            kwargs.update(type=settings.ArgType(s), metavar=s.metavar)
        group.add_argument(s.option, **kwargs)


def _setting(args, name: str):
    s = settings.get(name)
    value = getattr(args, s.attr)
    return s.from_env() if value is None else value


def _bounded(kind, low, strict: bool = False):
    """An argparse type: a kind (int, float) at least low, or more than low where strict."""

    def parse(text: str):
        value = kind(text)
        if not (value > low if strict else value >= low):  # "not": a NaN fails too
            raise argparse.ArgumentTypeError(f"must be {'more than' if strict else 'at least'} {low}, got {value}")
        return value

    parse.__name__ = kind.__name__  # argparse names it in "invalid int value"
    return parse


_positive_int, _non_negative_int = _bounded(int, 1), _bounded(int, 0)
_positive_float, _non_negative_float = _bounded(float, 0, strict=True), _bounded(float, 0)


def _inputs(args):
    """The workload, cost model, worker config, placement and options the arguments name."""
    try:
        costs = CostModel.load(args.costs)
    except OSError as exc:
        raise KvferryError(f"cannot read the cost model {args.costs}: {exc.strerror or exc} (fit one on the machine "
                           "to plan for with `kvferry bench costs`)") from None  # fmt: skip
    except ValueError as exc:
        raise KvferryError(f"{exc}") from None
    try:
        work = workloads.load(args.captures)
    except FileNotFoundError as exc:
        raise KvferryError(str(exc)) from None
    if not work.requests:
        raise KvferryError(
            f"the capture has no request to replay ({work.num_not_ok} not ok, {work.num_without_prompt} without "
            f"prompt token ids, {work.num_malformed} malformed lines)"
        )
    engine = EngineConfig(**{settings.get(n).attr: _setting(args, n) for n in ENGINE_SETTINGS})
    config = WorkerConfig.from_engine_config(engine, args.num_blocks)
    if config.block_size != costs.block_size:
        print(
            f"warning: the cost model was fitted with {costs.block_size}-token blocks, the workers have "
            f"{config.block_size}",
            file=sys.stderr,
        )
    placement = Placement(
        cores=args.cores,
        prefill_threads=_setting(args, "prefill_threads"),
        decode_threads=_setting(args, "decode_threads"),
        background_threads=args.background_threads,
    )
    options = SimOptions(
        rate_scale=args.rate_scale,
        heartbeat_interval_s=_setting(args, "heartbeat_interval"),
        max_waiting=_setting(args, "max_waiting"),
    )
    return work, costs, config, placement, options


def cmd_simulate(args) -> int:
    if args.plot and importlib.util.find_spec("matplotlib") is None:
        raise KvferryError("--plot needs matplotlib, which is not installed: pip install matplotlib")
    work, costs, config, placement, options = _inputs(args)
    try:
        report = Simulator(work, costs, config, placement, args.prefill, args.decode, options).run()
    except ConfigError as exc:
        raise KvferryError(str(exc)) from None
    print(json.dumps(report.to_json(), separators=(",", ":")) if args.json else report.text(args.per_request))
    if args.plot:
        try:
            plot_report(report, args.plot)
        except (OSError, ValueError) as exc:
            raise KvferryError(f"cannot write {args.plot}: {exc}") from None
        print(f"wrote {args.plot}", file=sys.stderr if args.json else sys.stdout)
    return 0


def cmd_plan(args) -> int:
    if args.max_workers < 2:
        raise KvferryError("--max-workers must be at least 2: a stack has a prefill and a decode worker")
    work, costs, config, placement, options = _inputs(args)
    slo = SLO(args.ttft_p90, args.itl_p90)
    result = Planner(work, costs, config, placement, slo, args.max_workers, options).run()
    print(json.dumps(result.to_json(), indent=2) if args.json else result.text())
    return 0 if result.found else 1

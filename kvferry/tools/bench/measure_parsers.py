"""The flags of the bench commands that measure this machine in process: costs, transfer, step (with its --measure).

Their modules import torch. Every kvferry command builds the whole CLI first, so each command here imports its
module only when it runs: `kvferry gateway` must not load torch to read its flags.
"""

import argparse
import importlib

from kvferry.common import settings
from kvferry.tools.bench import workload


def _command(module: str, function: str):
    """The command function module.function, imported when it is called."""

    def run(args) -> int:
        return getattr(importlib.import_module(f"kvferry.tools.bench.{module}"), function)(args)

    return run


def _thread_list(text: str) -> list[int]:
    try:
        threads = sorted({int(t) for t in text.split(",") if t.strip()})
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a list of thread counts: {text!r} (try 1,2)") from None
    if not threads or threads[0] < 1:
        raise argparse.ArgumentTypeError(f"thread counts must be positive, got {text!r}")
    return threads


def add_parsers(bench) -> None:
    p = bench.add_parser(
        "costs", help="fit the simulator's cost model on this machine: step times per thread count, KV transfer"
    )
    p.add_argument("--out", required=True, metavar="FILE.json", help="where the cost model is written")
    p.add_argument(
        "--threads",
        type=_thread_list,
        default=None,
        metavar="T1,T2,...",
        help="torch thread counts to fit (default: --num-threads if given, else 1 to the machine's cores)",
    )
    p.add_argument("--quick", action="store_true", help="a small design (small models, tests)")
    p.add_argument("--no-transfer", action="store_true", help="skip the KV transfer (its costs stay 0)")
    p.add_argument(
        "--no-contention", action="store_true", help="skip the slowdown beside busy processes (a fair share assumed)"
    )
    settings.add_arguments(p, settings.BENCH)
    p.set_defaults(func=_command("costs", "cmd_bench_costs"))

    p = bench.add_parser("transfer", help="a prompt's KV transfer against raw ZeroMQ over the same TCP loopback")
    p.add_argument("--model", default=None, help="whose KV layout to move (default: the default model)")
    p.add_argument("--blocks", type=int, nargs="+", default=[8, 32, 128], help="blocks of 16 tokens per transfer")
    p.add_argument("--rounds", type=int, default=20, help="alternated kv and raw transfers; medians compared")
    p.add_argument(
        "--layer-groups",
        type=int,
        nargs="+",
        default=None,
        help="messages per transfer (default: 1, unpipelined, and the workers' own count)",
    )
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=_command("transfer", "cmd_bench_transfer"))

    p = bench.add_parser(
        "step",
        aliases=["breakdown", "roofline"],  # their earlier names: `bench breakdown` is `bench step --measure breakdown`
        help="the engine's step in process, by --measure: split (the model's share of a decode step and the rest), "
        "breakdown (a decode step and a prefill chunk part by part, against rooflines), paging (paged against "
        "contiguous caches), roofline (this machine's GEMM rate and read bandwidth, and a workload's roofline)",
        description="Each --measure takes the engine's flags and --json; the other options go with the measures "
        "named in their help, and are refused with another.",
    )
    p.add_argument(
        "--measure", default=None, choices=["split", "breakdown", "paging", "roofline"], help="default: split"
    )
    p.add_argument("--batch", type=int, default=None, help="split, breakdown, paging: decoding sequences (32)")
    p.add_argument(
        "--context", type=int, default=None, help="split, breakdown, paging: prompt tokens of each sequence (256)"
    )
    p.add_argument(
        "--steps",
        type=int,
        default=None,
        help="split, breakdown, paging: timed steps, medians reported (split 20, breakdown 6); paging: the best of "
        "this many alternated rounds (10)",
    )
    p.add_argument("--chunk", type=int, default=None, help="breakdown: tokens of the prefill chunk (512)")
    p.add_argument(
        "--profile", action="store_true", help="split: also print the top functions outside the model (cProfile)"
    )
    p.add_argument("--workload", default=None, choices=list(workload.WORKLOADS), help="roofline: the workload (std-32)")
    p.add_argument("--trials", type=int, default=None, help="roofline: trials of each limit; the best is kept (3)")
    p.add_argument(
        "--measured-tok-s", type=float, default=None, help="roofline: a measured output tok/s to set against it"
    )
    p.add_argument("--engine", action="store_true", help="roofline: also run the workload through the engine")
    p.add_argument("--json", action="store_true")
    settings.add_arguments(p, settings.BENCH)
    p.set_defaults(func=_command("step", "cmd_bench_step"))

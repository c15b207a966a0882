"""`kvferry bench`: every bench command's flags.

Every kvferry command builds the whole CLI first, so a bench command imports its module (torch, for most) only when
it runs: `kvferry gateway` must not load torch to read its flags.
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


def _positive_list(convert, what: str, example: str):
    """An argparse type: a comma-separated list of positive numbers."""

    def parse(text: str) -> list:
        try:
            values = [convert(v) for v in text.split(",") if v.strip()]
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a list of {what}: {text!r} (try {example})") from None
        if not values or min(values) <= 0:
            raise argparse.ArgumentTypeError(f"{what} must be positive, got {text!r}")
        return values

    return parse


_rates = _positive_list(float, "rates (requests per second)", "0.5,1,2,4")
_threads = _positive_list(int, "thread counts", "1,2")
_batches = _positive_list(int, "batch sizes", "1,32,256")


def _names(text: str) -> list[str]:
    """A comma-separated list of names (checked by the command that takes them)."""
    return [name.strip() for name in text.split(",") if name.strip()]


def _against_the_floor(p, runs: str) -> None:
    """engine's and serve's options for what the workload is set against."""
    p.add_argument(
        "--baseline",
        choices=["none", "hf"],
        default="none",
        help="hf: also run transformers' own continuous batching on the same workload",
    )
    p.add_argument("--no-floor", action="store_true", help="skip the compute-floor measurement")
    p.add_argument(
        "--no-roofline", action="store_true", help="skip the roofline (`bench step --measure roofline`, quickly)"
    )
    p.add_argument("--repeat", type=int, default=2, help=f"{runs}, alternated; the best of each is reported")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of a table")


def _add_gateway_parser(bench) -> None:
    p = bench.add_parser(
        "gateway",
        help="the real gateway alone on one core (or --gateways N on one port), against synthetic workers (test "
        "doubles): streamed tok/s, CPU per token of each process, the event loop's lag, each gateway's share",
    )
    p.add_argument(
        "--streams",
        type=_positive_list(int, "stream counts", "64,256"),
        default=[64, 256],
        metavar="N1,N2,...",
        help="concurrent streaming chat completions, one measurement each",
    )
    p.add_argument("--tokens", type=int, default=256, help="tokens of each stream")
    p.add_argument(
        "--gateways",
        type=_positive_list(int, "gateway counts", "1,2"),
        default=[1],
        metavar="N1,N2,...",
        help="gateway processes on the one port (`kvferry gateway --gateways N`); several counts run side by side in "
        "alternated rounds, each set against the first: CPU per token summed over the processes, each one's share "
        "of the streams. The gateways are pinned to as many cores as the largest count, the rest to the cores "
        "left; with no core left, nothing is pinned",
    )
    p.add_argument(
        "--repeat",
        type=int,
        default=2,
        help="rounds: runs of each stream count (at each gateway count); the fastest is reported",
    )
    p.add_argument("--clients", type=int, default=1, help="client processes the streams are spread over")
    p.add_argument(
        "--step-interval", type=float, default=0.0, help="the decode double's seconds between steps (0: no wait)"
    )
    p.add_argument("--no-pin", action="store_true", help="leave every process free to run on any core")
    p.add_argument(
        "--profile",
        default=None,
        metavar="FILE",
        help="record the gateway with py-spy over the measured runs (collapsed stacks into FILE) and print its top "
        "functions, self and cumulative; py-spy pauses the gateway for each sample, so the runs' figures are marked "
        "profiled, not comparable with others",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    p.set_defaults(func=_command("gateway", "cmd_bench_gateway"))


def add_bench_parser(sub) -> None:
    bench = sub.add_parser("bench", help="benchmarks").add_subparsers(dest="bench", required=True)
    p = bench.add_parser("engine", help="offline workload through the in-process engine")
    p.add_argument("--workload", default="std-32", choices=[*workload.WORKLOADS, *workload.SAMPLED])
    p.add_argument("--no-paging", action="store_true", help="skip the paged-vs-contiguous decode step")
    _against_the_floor(p, "runs of the engine and of the floor")
    settings.add_arguments(p, settings.BENCH)
    p.set_defaults(func=_command("offline", "cmd_bench_engine"))

    p = bench.add_parser("serve", help="the workload over HTTP against a running stack, streaming")
    p.add_argument("--url", default="http://127.0.0.1:8000")
    p.add_argument("--model", default=None, help="the served model, for the floor and the baseline")
    p.add_argument("--workload", default="std-32", choices=workload.NAMES)
    p.add_argument("--rate", type=float, default=0.0, help="Poisson arrivals per second; 0: all at once")
    p.add_argument(
        "--sweep-rates",
        type=_rates,
        default=None,
        metavar="R1,R2,...",
        help="replay once at each rate instead: TTFT and TPOT p50/p99 against the rate",
    )
    p.add_argument("--plot", default=None, metavar="FILE.png", help="with --sweep-rates: draw the curve")
    p.add_argument(
        "--baseline-url",
        default=None,
        metavar="URL",
        help="another OpenAI-compatible server (llama.cpp's, vLLM): the same workload, alternating rounds",
    )
    p.add_argument("--threads", type=int, default=2, help="torch threads for the floor and the baseline")
    _against_the_floor(p, "runs of the workload and of the floor")
    p.set_defaults(func=_command("serve", "cmd_bench_serve"))

    p = bench.add_parser(
        "costs", help="fit the simulator's cost model on this machine: step times per thread count, KV transfer"
    )
    p.add_argument("--out", required=True, metavar="FILE.json", help="where the cost model is written")
    p.add_argument(
        "--threads",
        type=lambda text: sorted(set(_threads(text))),
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
        "--measure", default=None, choices=["split", "breakdown", "paging", "roofline", "loop"], help="default: split"
    )
    p.add_argument(
        "--batch",
        type=_batches,
        default=None,
        metavar="N[,N...]",
        help="split, breakdown, paging: decoding sequences (32); loop: a list of them (1,32,64,256)",
    )
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
        "--profile",
        action="store_true",
        help="split, loop: also print the top functions (cProfile; loop: of every run, over its timed steps)",
    )
    p.add_argument(
        "--sampling",
        type=_names,
        default=None,
        metavar="MODE[,MODE...]",
        help="loop: each sequence's sampling: greedy, temperature (0.8, a seed each), sampled (temperature 0.8, top_p "
        "0.95, a seed each) or penalized (sampled, with repetition, frequency and presence penalties) "
        "(greedy,temperature,sampled)",
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

    from kvferry.tools.bench import ab, quantization, random_model, scaling, sim_check

    sim_check.add_parser(bench)
    ab.add_parser(bench)
    quantization.add_parser(bench)
    random_model.add_parser(bench)
    scaling.add_parser(bench)

    _add_gateway_parser(bench)

    p = bench.add_parser("overload", help="Poisson arrivals at half and at twice the capacity: 429s, completions, TTFT")
    p.add_argument("--duration", type=float, default=60.0, help="seconds of arrivals at each rate")
    p.add_argument("--max-waiting", type=int, default=16, help="the gateway's admission bound for the run")
    p.add_argument("--model", default=None)
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=_command("overload", "cmd_bench_overload"))

    p = bench.add_parser(
        "pathological",
        help="one request with the most text work the gateway allows (a long output, n choices, the longest stop "
        "strings), while a probe times /v1/models every 50 ms",
    )
    p.add_argument("--url", default=None, help="a running stack; without it a fresh one starts, with --model")
    p.add_argument("--model", default=None)
    p.add_argument("--max-tokens", type=int, default=4000)
    p.add_argument("--n", type=int, default=4)
    p.add_argument("--stops", type=int, default=None, help="stop strings (default: the most the default limits allow)")
    p.add_argument("--stop-length", type=int, default=None, help="characters in each (default: the longest allowed)")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=_command("pathological", "cmd_bench_pathological"))

"""`kvferry bench step`: the engine's step measured in process, one --measure at a time: split (here), breakdown
(breakdown.py), paging (paging.py), roofline (roofline_measure.py), loop (loop.py: the decode worker's whole loop).

The split: 32 sequences with 256-token prompts are prefilled, then decode steps are timed whole (`engine.step()`)
and, inside them, the model's forward and logits alone (the eager forward, or the decode graph's run); the rest is
the step's overhead.
"""

import json
import random
import statistics
import sys
import time

import torch

from kvferry.common.config import EngineConfig
from kvferry.common.errors import ConfigError
from kvferry.common.sampling import SamplingParams
from kvferry.tools.bench import workload


class Clock:
    """Adds up the time spent inside the calls it wraps. On CUDA a call only queues work, so there it reads CUDA
    events recorded around each call once the step has synchronised: the device's time from the call's start to
    its last kernel, a replayed CUDA graph's included. On the CPU, wall time."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.spans: list = []  # (start, end) events or perf_counter seconds

    def reset(self) -> None:
        self.spans = []

    def call(self, fn, *args):
        if self.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            try:
                return fn(*args)
            finally:
                end.record()
                self.spans.append((start, end))
        started = time.perf_counter()
        try:
            return fn(*args)
        finally:
            self.spans.append(time.perf_counter() - started)

    def seconds(self) -> float:
        if not self.cuda:
            return sum(self.spans)
        for _, end in self.spans:
            end.synchronize()
        return sum(start.elapsed_time(end) for start, end in self.spans) / 1000


class TimedModel:
    """The runner's model with the time spent in its forward and logits added up (the eager path)."""

    def __init__(self, model, clock: Clock):
        self.model, self.clock = model, clock

    def __call__(self, *args):
        return self.clock.call(self.model, *args)

    def compute_logits(self, hidden):
        return self.clock.call(self.model.compute_logits, hidden)


def measure(engine, batch: int = 32, context: int = 256, steps: int = 20, constraint=None) -> dict:
    """constraint: one every sequence is held to (bench ab --feature structured-output)."""
    params = SamplingParams(max_tokens=steps + 8, temperature=0, ignore_eos=True, constraint=constraint)
    workload.start_decoding(engine, random.Random(0), batch, context, params)
    runner = engine.runner
    clock = Clock(torch.device(runner.device))
    runner.model = TimedModel(runner.model, clock)
    graphs = runner.decode_graphs
    if graphs is not None:  # a decode step replays a graph (or, uncaptured, runs its buffers) instead of the model
        graph_run = graphs.run
        graphs.run = lambda *args: clock.call(graph_run, *args)
    totals, models = [], []
    try:
        for _ in range(steps + 2):
            clock.reset()
            started = time.perf_counter()
            outputs = engine.step()  # it ends in the sampled tokens' .tolist(): the device is done
            totals.append(time.perf_counter() - started)
            models.append(clock.seconds())
            assert len(outputs) == batch and not engine.last_plan.is_prefill
    finally:
        runner.model = runner.model.model
        if graphs is not None:
            del graphs.run  # the instance attribute: the method again
        workload.abort_all(engine)
    totals, models = totals[2:], models[2:]  # the first steps warm up
    overhead = [t - m for t, m in zip(totals, models)]
    step, outside = statistics.median(totals), statistics.median(overhead)
    return {
        "batch": batch,
        "context": context,
        "steps": steps,
        "step_ms": round(step * 1000, 2),
        "model_ms": round(statistics.median(models) * 1000, 2),
        "outside_model_ms": round(outside * 1000, 2),
        "outside_share": round(outside / step, 4),
    }


def _split(engine, args) -> tuple[dict, str]:
    report = measure(engine, args.batch, args.context, args.steps)
    if args.profile:
        import cProfile
        import pstats

        profiler = cProfile.Profile()
        profiler.enable()
        measure(engine, args.batch, args.context, args.steps)
        profiler.disable()
        pstats.Stats(profiler, stream=sys.stderr).sort_stats("tottime").print_stats(25)
    return report, (
        f"\n== decode step, batch {report['batch']}, context {report['context']}, {torch.get_num_threads()} threads "
        f"(medians of {report['steps']}) ==\n"
        f"step {report['step_ms']} ms: model forward and logits {report['model_ms']} ms, the rest "
        f"{report['outside_model_ms']} ms ({report['outside_share']:.1%} of the step)"
    )


def _breakdown(engine, args) -> tuple[dict, str]:
    from kvferry.tools.bench import breakdown

    report = breakdown.measure(engine, args.batch, args.context, args.chunk, args.steps)
    return report, breakdown.text(report, torch.get_num_threads())


def _paging(engine, args) -> tuple[dict, str]:
    from kvferry.tools.bench import paging

    report = paging.paging_overhead(engine, args.batch, args.context, args.steps)
    return report, paging.text(report)


# --measure -> (what it runs on the engine, its defaults; an option absent here is refused with it). roofline
# builds an engine only with --engine, after measuring the limits; loop builds a decode worker.
MEASURES = {
    "split": (_split, {"batch": 32, "context": 256, "steps": 20, "profile": False}),
    "breakdown": (_breakdown, {"batch": 32, "context": 256, "steps": 6, "chunk": 512}),
    "paging": (_paging, {"batch": 32, "context": 256, "steps": 10}),
    "roofline": (None, {"workload": "std-32", "trials": 3, "measured_tok_s": None, "engine": False}),
    "loop": (
        None,
        {
            "batch": [1, 32, 64, 256],
            "context": 256,
            "steps": 20,
            "profile": False,
            "sampling": ["greedy", "temperature", "sampled"],
        },
    ),
}
OPTIONS = (
    "batch",
    "context",
    "steps",
    "chunk",
    "profile",
    "workload",
    "trials",
    "measured_tok_s",
    "engine",
    "sampling",
)


def _config(args) -> EngineConfig:
    config = EngineConfig.from_args(args)
    config.num_threads = config.num_threads or 2
    return config


def _engine(args):
    from kvferry.common.engine import LLMEngine

    return LLMEngine(_config(args))


def _loop(args) -> tuple[dict, str]:
    from kvferry.tools.bench import loop

    config = _config(args)
    most = max(args.batch)
    config.max_num_seqs = max(config.max_num_seqs, most)  # every batch asked for runs whole
    config.max_num_batched_tokens = max(config.max_num_batched_tokens, config.max_num_seqs)
    reports = loop.measure(config, args.batch, args.sampling, args.context, args.steps, args.profile)
    threads = torch.get_num_threads()
    return {"threads": threads, "context": args.context, "steps": args.steps, "runs": reports}, loop.text(
        reports, threads
    )


def cmd_bench_step(args) -> int:
    if args.bench != "step":  # called by an earlier name, which is its measure
        if args.measure not in (None, args.bench):
            raise ConfigError(f"bench {args.bench} is bench step --measure {args.bench}, not --measure {args.measure}")
        args.measure = args.bench
    args.measure = args.measure or "split"
    run, defaults = MEASURES[args.measure]
    for option in OPTIONS:
        if option in defaults:
            if getattr(args, option) is None:
                setattr(args, option, defaults[option])
        elif getattr(args, option) not in (None, False):
            flag = "--" + option.replace("_", "-")
            users = ", ".join(m for m, (_, d) in MEASURES.items() if option in d)
            raise ConfigError(f"{flag} does not apply to --measure {args.measure} (it goes with --measure {users})")
    if isinstance(args.batch, list) and args.measure != "loop":
        if len(args.batch) > 1:
            raise ConfigError(f"--measure {args.measure} takes one --batch (a list goes with --measure loop)")
        args.batch = args.batch[0]
    if args.measure == "loop":
        report, text = _loop(args)
    elif run is None:
        from kvferry.tools.bench.offline import run_engine
        from kvferry.tools.bench.roofline_measure import measure_workload

        def run_workload(requests: list[dict]) -> dict:
            engine = _engine(args)
            engine.generate([workload.warmup_prompt(engine.vocab_size)], None)
            return run_engine(engine, requests)

        report, text = measure_workload(args, run_workload)
    else:
        engine = _engine(args)
        report, text = run(engine, args)
        report = {"threads": torch.get_num_threads(), **report}
    print(json.dumps({"measure": args.measure, **report}) if args.json else text)
    return 0

"""`kvferry bench step`: one decode step at batch 32 through the engine, and how much of it is not the model.

32 sequences with 256-token prompts are prefilled, then decode steps are timed whole (`engine.step()`:
scheduling, building the step's tensors, the forward, sampling, bookkeeping) and, inside them, the model's
forward and logits alone. What is left is the step's overhead.
"""

import json
import random
import statistics
import sys
import time

import torch

from kvferry.common import settings
from kvferry.common.config import EngineConfig
from kvferry.common.sampling import SamplingParams


class TimedModel:
    """The runner's model with the time spent in its forward and logits added up."""

    def __init__(self, model):
        self.model, self.seconds = model, 0.0

    def _timed(self, fn, *args):
        started = time.perf_counter()
        try:
            return fn(*args)
        finally:
            self.seconds += time.perf_counter() - started

    def __call__(self, *args):
        return self._timed(self.model, *args)

    def compute_logits(self, hidden):
        return self._timed(self.model.compute_logits, hidden)


def measure(engine, batch: int = 32, context: int = 256, steps: int = 20, constraint=None) -> dict:
    """constraint: one every sequence is held to (bench feature --feature structured-output)."""
    rng = random.Random(0)
    params = SamplingParams(max_tokens=steps + 8, temperature=0, ignore_eos=True, constraint=constraint)
    low, high = (256, engine.vocab_size - 256) if engine.vocab_size > 1024 else (3, engine.vocab_size)  # no specials
    for _ in range(batch):
        engine.add_request([rng.randrange(low, high) for _ in range(context)], params)
    while engine.scheduler.waiting or any(s.num_uncomputed_tokens > 1 for s in engine.scheduler.running):
        engine.step()  # the prompts
    timed = engine.runner.model = TimedModel(engine.runner.model)
    totals, models = [], []
    try:
        for _ in range(steps + 2):
            timed.seconds, started = 0.0, time.perf_counter()
            outputs = engine.step()
            totals.append(time.perf_counter() - started)
            models.append(timed.seconds)
            assert len(outputs) == batch and not engine.last_plan.is_prefill
    finally:
        engine.runner.model = timed.model
        for seq in list(engine.scheduler.running):
            engine.abort(seq.request_id)
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


def add_parser(bench) -> None:
    p = bench.add_parser("step", help="one decode step at batch 32: the model's share and the rest")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--context", type=int, default=256)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--profile", action="store_true", help="also print the top functions outside the model (cProfile)")
    p.add_argument("--json", action="store_true")
    settings.add_arguments(p, settings.BENCH)
    p.set_defaults(func=cmd_bench_step)


def cmd_bench_step(args) -> int:
    from kvferry.common.engine import LLMEngine

    config = EngineConfig.from_args(args)
    config.num_threads = config.num_threads or 2
    engine = LLMEngine(config)
    report = {"threads": torch.get_num_threads(), **measure(engine, args.batch, args.context, args.steps)}
    if args.profile:
        import cProfile
        import pstats

        profiler = cProfile.Profile()
        profiler.enable()
        measure(engine, args.batch, args.context, args.steps)
        profiler.disable()
        pstats.Stats(profiler, stream=sys.stderr).sort_stats("tottime").print_stats(25)
    if args.json:
        print(json.dumps(report))
        return 0
    print(
        f"\n== decode step, batch {report['batch']}, context {report['context']}, {report['threads']} threads "
        f"(medians of {report['steps']}) =="
    )
    print(
        f"step {report['step_ms']} ms: model forward and logits {report['model_ms']} ms, the rest "
        f"{report['outside_model_ms']} ms ({report['outside_share']:.1%} of the step)"
    )
    return 0

"""`kvferry bench step --measure breakdown`: where one engine step's time goes, part by part, each against its roofline.

A decode step and a prefill chunk run through `engine.step()` with the model's submodules and the functions it looks
up at call time (RoPE, attention, logits processing, sampling) wrapped from outside. Each wrapper times its call less
the wrapped calls inside it, so parts do not overlap (the residual adds run inside the norms); the wrappers' own cost,
calibrated on a no-op, is a part of its own, and what is left is scheduling and Python. The CPU only: there an op is
done when it returns. The wrapped step goes layer by layer where the unwrapped one runs them in one C call.
"""

import contextlib
import random
import statistics
import time
from collections import defaultdict

import torch

from kvferry.common.errors import ConfigError
from kvferry.common.model import attention, llama
from kvferry.common.model import runner as runner_module
from kvferry.common.sampling import SamplingParams
from kvferry.tools.bench import breakdown_roofline as limits
from kvferry.tools.bench.roofline_measure import best_seconds, read_bandwidth
from kvferry.tools.bench.workload import abort_all, random_prompt, start_decoding

PARTS = (
    *limits.GEMM_PARTS.values(),
    "attention",
    "attention's views",
    "norms, residual adds",
    "RoPE",
    "SiLU·mul",
    "decoder layers' glue",
    "embedding, RoPE tables",
    "sampling",
)
WRAPPERS, REST = "timing wrappers", "scheduling + Python"
MODULE_PARTS = {  # a module class -> its part: what it does outside its wrapped children
    llama.RMSNorm: "norms, residual adds",
    llama.MLP: "SiLU·mul",
    llama.DecoderLayer: "decoder layers' glue",
    llama.Attention: "attention's views",
    llama.LlamaModel: "embedding, RoPE tables",
}


class Spans:
    """Wall time per part of the wrapped calls, each less the wrapped calls inside it."""

    def __init__(self):
        self.reset()

    def reset(self) -> None:
        self.own: dict[str, float] = defaultdict(float)
        self.nested: dict[str, int] = defaultdict(int)  # wrapped calls made inside each part
        self.calls = 0
        self._open: list[list] = []  # [part, seconds of the wrapped calls inside it so far]

    def wrap(self, part: str, fn):
        def timed(*args, **kwargs):
            frame = [part, 0.0]
            self._open.append(frame)
            started = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                elapsed = time.perf_counter() - started
                self._open.pop()
                self.own[part] += elapsed - frame[1]
                self.calls += 1
                if self._open:
                    self._open[-1][1] += elapsed
                    self.nested[self._open[-1][0]] += 1

        return timed

    def parts(self, wrapper_s: float) -> dict[str, float]:
        """Seconds per part, each less the wrappers' cost of the calls it made; that cost as a part."""
        out = {p: max(0.0, self.own.get(p, 0.0) - self.nested.get(p, 0) * wrapper_s) for p in PARTS}
        out[WRAPPERS] = self.calls * wrapper_s
        return out


def wrapper_cost(calls: int = 5000) -> float:
    """Seconds a wrapped call adds to a step beyond a plain call of the same function."""

    def noop():
        pass

    def plain():
        for _ in range(calls):
            noop()

    spans = Spans()
    inner = spans.wrap("inner", noop)

    def wrapped():
        for _ in range(calls):
            inner()

    outer = spans.wrap("outer", wrapped)
    totals = []
    for _ in range(5):
        spans.reset()
        outer()
        totals.append(spans.own["outer"] + spans.own["inner"])
    return max(0.0, (min(totals) - best_seconds(plain, trials=5, min_s=0.005)) / calls)


@contextlib.contextmanager
def wrapped(engine, spans: Spans):
    """The engine's model parts wrapped while inside the block, as they were after it."""
    model = engine.runner.model
    fused_decode, model.fused_decode = model.fused_decode, None  # the parts run one by one, to be timed
    gemms = {id(m): part for part, m in limits.gemm_layers(model)}
    modules = []
    for m in model.modules():
        part = gemms.get(id(m)) or MODULE_PARTS.get(type(m))
        if part is not None:
            m.forward = spans.wrap(part, m.forward)
            modules.append(m)
    functions = [
        (llama, "apply_rope", "RoPE"),
        (attention.PagedBatch, "attend", "attention"),
        (runner_module, "process_logits", "sampling"),
        (runner_module, "sample", "sampling"),
    ]
    originals = [getattr(owner, name) for owner, name, _ in functions]
    for (owner, name, part), original in zip(functions, originals):
        setattr(owner, name, spans.wrap(part, original))
    try:
        yield
    finally:
        model.fused_decode = fused_decode
        for m in modules:
            del m.forward  # the instance attribute: the class's forward again
        for (owner, name, _), original in zip(functions, originals):
            setattr(owner, name, original)


def _shape(plan) -> dict:
    """What a step computes, read as it is planned: a chunk's figures change once the step has run."""
    cached = [c.seq.num_computed_tokens for c in plan.chunks]
    return {
        "sequences": len(plan.chunks),
        "tokens": plan.num_tokens,
        "sampled": sum(c.samples for c in plan.chunks),
        "context_tokens": sum(cached),  # K/V read from the cache, per layer
        "attended": sum(
            n * c.num_new_tokens + c.num_new_tokens * (c.num_new_tokens + 1) // 2 for n, c in zip(cached, plan.chunks)
        ),
    }


def _timed_steps(engine, spans: Spans, wrapper_s: float, steps: int, before_step) -> tuple[list, list, dict]:
    """(step seconds, parts per step, the last step's shape) of `steps` steps, each after before_step()."""
    totals, parts, shapes = [], [], []
    scheduler = engine.scheduler
    schedule = scheduler.schedule

    def planned():
        plan = schedule()
        shapes.append(_shape(plan))
        return plan

    scheduler.schedule = planned
    try:
        for _ in range(steps):
            before_step()
            spans.reset()
            started = time.perf_counter()
            engine.step()
            totals.append(time.perf_counter() - started)
            parts.append(spans.parts(wrapper_s))
    finally:
        del scheduler.schedule  # the instance attribute: the method again
    return totals, parts, shapes[-1]


def _summary(totals: list, parts: list, plain: list, shape: dict, model, machine) -> dict:
    """Medians per part; the rest is the median step less them, so that the parts and the rest add up to it."""
    step = statistics.median(totals)
    medians = {p: statistics.median(s[p] for s in parts) for p in (*PARTS, WRAPPERS)}
    medians[REST] = step - sum(medians.values())
    bounds = limits.rooflines(
        model, machine, shape["tokens"], shape["sampled"], shape["attended"], shape["context_tokens"]
    )
    rows = []
    for part, seconds in medians.items():
        bound = bounds.get(part)
        rows.append(
            {
                "part": part,
                "ms": round(seconds * 1000, 3),
                "share": round(seconds / step, 4),
                "roofline_ms": None if bound is None else round(bound * 1000, 3),
                "of_roofline": None if bound is None or seconds <= 0 else round(bound / seconds, 4),
            }
        )
    return {
        **shape,
        "steps": len(totals),
        "step_ms": round(step * 1000, 3),
        "step_ms_unwrapped": round(statistics.median(plain) * 1000, 3) if plain else None,
        "parts": rows,
    }


def measure(
    engine,
    batch: int = 32,
    context: int = 256,
    chunk: int = 512,
    steps: int = 6,
    warmup: int = 2,
    gemm_budget_s: float = 0.1,
    read_bytes: int = 128 * 2**20,
) -> dict:
    """The breakdown of a decode step (batch sequences of context tokens) and of a chunk-token prefill step.
    gemm_budget_s: the time each GEMM shape's rate is measured for; read_bytes: the buffer the bandwidth reads."""
    runner = engine.runner
    if torch.device(runner.device).type != "cpu":
        raise ConfigError("bench step --measure breakdown times the CPU path only: run it with --device cpu")
    spans = Spans()
    wrapper_s = wrapper_cost()
    dtype = runner.model.embed_tokens.weight.dtype
    quantization = engine.config.quantization  # int8 or int4: the GEMM rates are that path's (gemm_path)
    bandwidth = read_bandwidth(torch.device("cpu"), read_bytes, trials=4)
    machine = limits.Machine(bandwidth, dtype, quantization, budget_s=gemm_budget_s)
    rng = random.Random(0)
    report = {"wrapper_cost_us": round(wrapper_s * 1e6, 3), "read_gb_per_s": round(machine.read_bytes_per_s / 1e9, 2)}

    # Prefill: each step a fresh prompt (nothing of it cached), alone, that ends with the token it samples.
    one = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)

    def add_prompt():
        engine.add_request(random_prompt(rng, engine.vocab_size, chunk), one)

    plain, _, _ = _timed_steps(engine, spans, wrapper_s, warmup + steps, add_prompt)
    with wrapped(engine, spans):
        totals, parts, shape = _timed_steps(engine, spans, wrapper_s, warmup + steps, add_prompt)
    if shape["tokens"] != chunk:
        abort_all(engine)
        raise ConfigError(
            f"a {chunk}-token prompt ran in steps of {shape['tokens']} tokens: raise --long-prefill-threshold and "
            "--max-num-batched-tokens to at least --chunk"
        )
    report["prefill"] = _summary(totals[warmup:], parts[warmup:], plain[warmup:], shape, runner.model, machine)

    params = SamplingParams(max_tokens=2 * (warmup + steps) + 8, temperature=0, ignore_eos=True)
    start_decoding(engine, rng, batch, context, params)
    try:
        plain, _, _ = _timed_steps(engine, spans, wrapper_s, warmup + steps, lambda: None)
        with wrapped(engine, spans):
            totals, parts, shape = _timed_steps(engine, spans, wrapper_s, warmup + steps, lambda: None)
        assert shape["sequences"] == shape["tokens"] == batch, "the decode batch did not stay whole"
    finally:
        abort_all(engine)
    report["decode"] = _summary(totals[warmup:], parts[warmup:], plain[warmup:], shape, runner.model, machine)
    fused = runner.model.fused_decode
    report["decode"]["unwrapped_in_one_call"] = fused is not None and batch <= fused.loop.max_rows
    report["gemm_gflops"] = {f"{m}x{k}x{n}": round(r / 1e9, 1) for (m, k, n), r in machine.gemm_flops_per_s.items()}
    return report


def text(report: dict, threads: int) -> str:
    lines = [
        f"{threads} threads; read bandwidth {report['read_gb_per_s']} GB/s; GEMM GFLOP/s through the "
        f"model's path, by shape (rows x in x out): {report['gemm_gflops']}; "
        f"a timing wrapper costs {report['wrapper_cost_us']} us"
    ]
    for kind in ("decode", "prefill"):
        r = report[kind]
        lines.append(
            f"\n== {kind} step: {r['sequences']} sequences, {r['tokens']} new tokens; median of {r['steps']}: "
            f"{r['step_ms']} ms ({r['step_ms_unwrapped']} ms unwrapped"
            f"{', its layers in one C call' if r.get('unwrapped_in_one_call') else ''}) =="
        )
        lines.append(f"{'part':<24} {'ms':>9} {'share':>7} {'roofline ms':>12} {'of roofline':>12}")
        for row in r["parts"]:
            bound = "-" if row["roofline_ms"] is None else f"{row['roofline_ms']:.3f}"
            ratio = "-" if row["of_roofline"] is None else f"{row['of_roofline']:.0%}"
            lines.append(f"{row['part']:<24} {row['ms']:>9.3f} {row['share']:>7.1%} {bound:>12} {ratio:>12}")
    return "\n".join(lines)

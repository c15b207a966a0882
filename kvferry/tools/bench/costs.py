"""`kvferry bench costs`: fit the simulator's cost model (tools/sim/cost_model.py) on this machine.

At each torch thread count, whole `engine.step()` calls are timed on an engine built from the workers' settings (the
BENCH flags), so its chunking, KV pool and decode graphs are theirs. A prefill point's context comes from a prefix
held in the cache (no compute to set it up) and every chunk ends its prompt, so each samples, as a prefill worker's
last chunk does; a decode point's sequences are admitted as transferred ones are. What a step computed is read
from the scheduler's plan, not assumed. Each StepCost is fitted by non-negative least squares on the relative error,
so a bigger step is never predicted faster. The KV transfer is timed with `bench transfer`'s machinery and fitted as
fixed + per block. What a step's time leaves out, the model's notes say ("not_in_steps").
"""

import dataclasses
import datetime
import itertools
import os
import platform
import random
import statistics
import sys
import time

import numpy as np
import torch

from kvferry.common import received_kv
from kvferry.common.block_hash import block_hashes
from kvferry.common.config import EngineConfig
from kvferry.common.sampling import SamplingParams
from kvferry.tools.bench.contention import measure_contention
from kvferry.tools.bench.workload import random_prompt
from kvferry.tools.sim.cost_model import CostModel, StepCost, ThreadCosts, attention_pairs

WARMUP_BELOW_S = 0.25  # a point's first step warms up (and is dropped) when shorter; a longer one counts


@dataclasses.dataclass(frozen=True)
class Design:
    """The points measured at each thread count, and how long each may take."""

    prefill_tokens: tuple[int, ...] = (16, 64, 128, 256, 512)  # new tokens in the step, over all its prompts
    prefill_offsets: tuple[int, ...] = (0, 256, 1024)  # tokens of context before each prompt's chunk
    prefill_seqs: tuple[int, ...] = (1, 2, 4)  # prompts in the step
    decode_batches: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64)
    decode_contexts: tuple[int, ...] = (64, 256, 512, 1024)
    transfer_blocks: tuple[int, ...] = (4, 16, 64, 256)  # a short prompt's to a 4,000-token one's, in blocks of 16
    repeats: int = 3  # timed prefill steps per point, at most
    decode_repeats: int = 5  # timed decode steps per point, at most
    point_budget_s: float = 1.5  # a point stops repeating once another step would take it past this
    transfer_rounds: int = 5


QUICK = Design(
    prefill_tokens=(8, 32, 128),
    prefill_offsets=(0, 64),
    prefill_seqs=(1, 2),
    decode_batches=(1, 4, 16),
    decode_contexts=(16, 64),
    transfer_blocks=(2, 8),
    decode_repeats=3,
    point_budget_s=0.3,
    transfer_rounds=3,
)


@dataclasses.dataclass
class Point:
    """One measured step: what it computed, its median time, and (after the fit) what the model says."""

    kind: str  # "prefill" or "decode"
    threads: int
    context: int  # prefill: the offset of each chunk; decode: each sequence's context at the first timed step
    tokens: int
    seqs: int
    pairs: int
    seconds: float
    runs: int
    gathered: int = 0  # context tokens the step's attention reads: each chunk's computed and new tokens, summed
    fitted_s: float = 0.0

    @property
    def rel_err(self) -> float:
        return (self.fitted_s - self.seconds) / self.seconds


@dataclasses.dataclass
class Fit:
    model: CostModel
    points: list[Point]
    transfers: list[dict] = dataclasses.field(default_factory=list)  # num_blocks, seconds, fitted_s
    skipped: list[str] = dataclasses.field(default_factory=list)


# -- fitting -------------------------------------------------------------------------------------------------
def nnls(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """min ||a x - b|| over x >= 0, exactly. The optimum is the plain least-squares solution on its own support
    (the columns where it is positive), so with a handful of columns every support is tried and the best one
    with no negative coefficient wins. Columns are scaled to a common size first: tokens and pairs differ by
    orders of magnitude."""
    num_cols = a.shape[1]
    scale = np.abs(a).max(axis=0)
    scale[scale == 0] = 1.0
    scaled = a / scale
    best, best_residual = np.zeros(num_cols), float(b @ b)
    for support in range(1, 2**num_cols):
        cols = [j for j in range(num_cols) if support >> j & 1]
        x, *_ = np.linalg.lstsq(scaled[:, cols], b, rcond=None)
        if (x < 0).any():
            continue
        r = scaled[:, cols] @ x - b
        if float(r @ r) < best_residual:
            best_residual = float(r @ r)
            best = np.zeros(num_cols)
            best[cols] = x
    return best / scale


def fit_relative(columns: list[list[float]], seconds: list[float]) -> np.ndarray:
    """Non-negative coefficients c minimising sum(((columns . c) - t) / t)^2: the relative error, so that a
    2 ms step counts as much as a 2 s one."""
    t = np.asarray(seconds, dtype=float)
    a = np.asarray(columns, dtype=float) / t[:, None]
    return nnls(a, np.ones(len(t)))


def fit_step_cost(points: list[Point]) -> StepCost:
    """The StepCost of one kind at one thread count; sets each point's fitted_s."""
    decode = points[0].kind == "decode"
    if decode:  # tokens == seqs, and the context read is the pairs: one column for each pair of them
        c = fit_relative([[1.0, p.seqs, p.pairs] for p in points], [p.seconds for p in points])
        cost = StepCost(fixed_s=float(c[0]), per_token_s=0.0, per_seq_s=float(c[1]), per_pair_s=float(c[2]))
    else:
        columns = [[1.0, p.tokens, p.seqs, p.pairs, p.gathered] for p in points]
        c = [float(v) for v in fit_relative(columns, [p.seconds for p in points])]
        cost = StepCost(fixed_s=c[0], per_token_s=c[1], per_seq_s=c[2], per_pair_s=c[3], per_context_s=c[4])
    for p in points:
        p.fitted_s = cost.seconds(p.tokens, p.seqs, p.pairs, p.gathered)
    return cost


def residuals(rel_errs: list[float]) -> dict:
    errs = [abs(e) for e in rel_errs]
    return {
        "points": len(errs),
        "median_rel_err": round(statistics.median(errs), 4) if errs else None,
        "max_rel_err": round(max(errs), 4) if errs else None,
    }


# -- measuring ------------------------------------------------------------------------------------------------
def _median_step(run_once, repeats: int, budget_s: float) -> tuple[float, int, tuple]:
    """Run run_once() (-> seconds, what the step computed) until `repeats` timed runs, or until another would
    take the point past budget_s. A short first run is a warm-up and is dropped. Returns the median time, the
    runs timed, and the computed figures (_plan_figures) averaged over them."""
    first, figures = run_once()
    spent, times, seen = first, [], []
    if first >= WARMUP_BELOW_S:
        times, seen = [first], [figures]
    while len(times) < repeats and (not times or spent + statistics.median(times) <= budget_s):
        seconds, figures = run_once()
        times.append(seconds)
        seen.append(figures)
        spent += seconds
    mean = tuple(round(sum(f[i] for f in seen) / len(seen)) for i in range(len(seen[0])))
    return statistics.median(times), len(times), mean


def _plan_figures(plan) -> tuple[int, int, int, int]:
    """(tokens, seqs, pairs, gathered) of the step just run, from its plan: each chunk's sequence has advanced
    past it."""
    pairs = sum(attention_pairs(c.seq.num_computed_tokens - c.num_new_tokens, c.num_new_tokens) for c in plan.chunks)
    return plan.num_tokens, len(plan.chunks), pairs, sum(c.seq.num_computed_tokens for c in plan.chunks)


class StepBench:
    """Times prefill and decode steps of one engine; holds a cached prefix for the prefill points' offsets."""

    def __init__(self, engine, design: Design, seed: int = 0):
        self.engine, self.design = engine, design
        self.rng = random.Random(seed)
        self.greedy = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
        self.held: list[int] = []
        self.prefix: list[int] = []
        self._ids = itertools.count(1)

    def tokens(self, n: int) -> list[int]:
        return random_prompt(self.rng, self.engine.vocab_size, n)

    def hold_prefix(self, num_tokens: int) -> None:
        """Compute a prefix of num_tokens once and keep its blocks referenced: every offset is a slice of it."""
        engine, size = self.engine, self.engine.block_size
        num_tokens = num_tokens // size * size
        if num_tokens <= len(self.prefix):
            return
        self.release()
        self.prefix = self.tokens(num_tokens)
        engine.generate([self.prefix + self.tokens(1)], self.greedy)
        self.held = engine.hold_prefix(block_hashes(self.prefix, size))

    def release(self) -> None:
        if self.held:
            self.engine.free_blocks(self.held)
        self.held = []

    def fits_prefill(self, tokens: int, offset: int, seqs: int) -> bool:
        engine, bm = self.engine, self.engine.block_manager
        own = seqs * (bm.num_blocks_for(offset + tokens // seqs) - offset // engine.block_size)
        return (
            offset + tokens // seqs < engine.max_model_len
            and seqs <= engine.scheduler.max_num_seqs
            and own <= bm.num_free_blocks
        )

    def fits_decode(self, batch: int, context: int) -> bool:
        engine, bm = self.engine, self.engine.block_manager
        longest = context + self.design.decode_repeats + 2
        return (
            longest < engine.max_model_len
            and batch <= engine.scheduler.max_num_seqs
            and batch * bm.num_blocks_for(longest) <= bm.num_free_blocks
        )

    def prefill_once(self, tokens: int, offset: int, seqs: int) -> tuple[float, tuple]:
        """One prefill step of seqs prompts at this offset, tokens // seqs new each; fresh tokens every time, so
        the prefix cache supplies the offset and nothing more."""
        engine = self.engine
        context = self.prefix[: offset // engine.block_size * engine.block_size]
        for _ in range(seqs):
            rid = f"costs-{next(self._ids)}"
            engine.add_request(context + self.tokens(tokens // seqs), self.greedy, request_id=rid)
        started = time.perf_counter()
        engine.step()
        seconds = time.perf_counter() - started
        figures = _plan_figures(engine.last_plan)
        while engine.has_unfinished():  # settings that cut the prompts into more steps: what ran was timed
            engine.step()
        return seconds, figures

    def prefill_point(self, threads: int, tokens: int, offset: int, seqs: int) -> Point:
        d = self.design
        seconds, runs, (t, s, pairs, gathered) = _median_step(
            lambda: self.prefill_once(tokens, offset, seqs), d.repeats, d.point_budget_s
        )
        return Point("prefill", threads, offset, t, s, pairs, seconds, runs, gathered)

    def decode_point(self, threads: int, batch: int, context: int) -> Point:
        """batch sequences admitted at context - 1 prompt tokens plus a first token, as transferred ones are; each
        step then attends over context tokens and more."""
        engine, d = self.engine, self.design
        params = SamplingParams(max_tokens=d.decode_repeats + 8, temperature=0, ignore_eos=True)
        ids = []
        try:
            for _ in range(batch):
                rid, prompt = f"costs-{next(self._ids)}", self.tokens(context - 1)
                blocks = received_kv.reserve(engine, [rid], prompt, [params])
                if blocks is None or not engine.admit_prefilled([rid], prompt, self.tokens(1), [params], blocks):
                    raise RuntimeError(f"no room for {batch} sequences of {context} tokens")
                ids.append(rid)

            def step_once() -> tuple[float, tuple]:
                started = time.perf_counter()
                outputs = engine.step()
                seconds = time.perf_counter() - started
                assert not engine.last_plan.is_prefill and len(outputs) == batch
                return seconds, _plan_figures(engine.last_plan)

            seconds, runs, (t, s, pairs, gathered) = _median_step(step_once, d.decode_repeats, d.point_budget_s)
        finally:
            for rid in ids:
                engine.abort(rid)
        return Point("decode", threads, context, t, s, pairs, seconds, runs, gathered)


def measure_transfer(engine, design: Design, threads: int, progress) -> list[dict]:
    """bench transfer's kv path at each block count, in the workers' layer groups: seconds from the first gather
    to the acknowledgement."""
    from kvferry.tools.bench import transfer

    torch.set_num_threads(threads)
    layout = engine.runner.layout
    shape = (layout.num_layers, layout.num_kv_heads, layout.head_dim, layout.block_size)
    out = []
    for num_blocks in design.transfer_blocks:
        r = transfer.measure(*shape, num_blocks, design.transfer_rounds)
        out.append({"num_blocks": num_blocks, "seconds": r["kv_ms"] / 1000, "mib": r["mib"]})
        progress(f"transfer {num_blocks} blocks ({r['mib']} MiB): {r['kv_ms']} ms")
    return out


def machine_description() -> str:
    cpu = ""
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "")
    except OSError:
        pass
    text = f"{cpu or platform.processor() or platform.machine()}, {os.cpu_count()} cores"
    if torch.cuda.is_available():
        text += f", {torch.cuda.get_device_name()}"
    return text


def fit_costs(
    engine, threads: list[int], design: Design = Design(), transfer: bool = True, progress=None, contention=True
) -> Fit:
    """Measure the design at each thread count and fit the cost model; the engine is left empty. contention: also
    measure the slowdown beside busy processes (contention.py)."""
    from kvferry.common.model_files import served_model_name

    progress = progress or (lambda line: None)
    bench = StepBench(engine, design)
    points, skipped = [], []
    threads_before = torch.get_num_threads()
    try:
        bench.hold_prefix(max((o for o in design.prefill_offsets if o + 1 < engine.max_model_len), default=0))
        for t in threads:
            torch.set_num_threads(t)
            prefill = itertools.product(design.prefill_offsets, design.prefill_seqs, design.prefill_tokens)
            for offset, seqs, tokens in prefill:
                label = f"prefill {tokens} tokens in {seqs} prompts at offset {offset}"
                if tokens < seqs or not bench.fits_prefill(tokens, offset, seqs):
                    if t == threads[0]:
                        skipped.append(label)
                    continue
                points.append(bench.prefill_point(t, tokens, offset, seqs))
                progress(f"[{t} threads] {label}: {_ms(points[-1].seconds)} ({points[-1].runs} runs)")
            for context, batch in itertools.product(design.decode_contexts, design.decode_batches):
                label = f"decode batch {batch} at context {context}"
                if not bench.fits_decode(batch, context):
                    if t == threads[0]:
                        skipped.append(label)
                    continue
                points.append(bench.decode_point(t, batch, context))
                progress(f"[{t} threads] {label}: {_ms(points[-1].seconds)} ({points[-1].runs} steps)")
        slowdowns, contention_rows = {}, []
        if contention:
            slowdowns, contention_rows = measure_contention(bench, threads, os.cpu_count() or 1, progress)
    finally:
        bench.release()
        torch.set_num_threads(threads_before)
    costs, fits = {}, {}
    for t in threads:
        kinds = {}
        for kind in ("prefill", "decode"):
            mine = [p for p in points if p.threads == t and p.kind == kind]
            if not mine:
                raise ValueError(f"no {kind} point fits this engine at {t} threads (see the skipped points)")
            kinds[kind] = fit_step_cost(mine)
            fits.setdefault(str(t), {})[kind] = residuals([p.rel_err for p in mine])
        costs[t] = ThreadCosts(kinds["prefill"], kinds["decode"])
    transfers, transfer_fit = [], [0.0, 0.0]
    transfer_threads = min(threads)
    if transfer and design.transfer_blocks:
        transfers = measure_transfer(engine, design, transfer_threads, progress)
        torch.set_num_threads(threads_before)
        transfer_fit = fit_relative([[1.0, r["num_blocks"]] for r in transfers], [r["seconds"] for r in transfers])
        for r in transfers:
            r["fitted_s"] = float(transfer_fit[0] + transfer_fit[1] * r["num_blocks"])
    notes = {
        "fit": "non-negative least squares on the relative error (weights 1 / measured seconds)",
        "residuals": fits,
        "transfer_residuals": residuals([(r["fitted_s"] - r["seconds"]) / r["seconds"] for r in transfers]),
        "prefill": "engine.step() of prompts whose chunk ends them (each samples); offsets from a held cached prefix",
        "decode": "engine.step() of sequences admitted as transferred ones; tokens == seqs, so per_token_s is 0",
        "sampling": "greedy, as the benchmark workloads",
        "transfer": f"bench transfer's kv path, float32, {transfer_threads} torch thread(s), the workers' layer "
        "groups; from the first gather to the acknowledgement"
        if transfers
        else "not measured",
        "not_in_steps": "the worker loop around a step (polling, sending outputs); a prefill worker's early "
        "layer-group gathers (in the transfer's cost)",
        "design": {
            **{name: list(v) for name, v in dataclasses.asdict(design).items() if isinstance(v, tuple)},
            "transfer_blocks": list(design.transfer_blocks) if transfers else [],
        },
        "skipped": skipped,
        "points": [
            [p.kind, p.threads, p.context, p.tokens, p.seqs, p.pairs, p.gathered, round(p.seconds, 6)] for p in points
        ],
        "points_columns": ["kind", "threads", "context", "tokens", "seqs", "pairs", "gathered", "seconds"],
        "transfers": [[r["num_blocks"], round(r["seconds"], 6)] for r in transfers],
        "contention": contention_rows,
        "engine": {
            "device": str(engine.device),
            "dtype": str(engine.dtype).removeprefix("torch."),
            "num_blocks": engine.num_blocks,
            "max_num_batched_tokens": engine.scheduler.max_num_batched_tokens,
            "long_prefill_threshold": engine.scheduler.long_prefill_threshold,
            "quantization": engine.config.quantization or "none",
        },
        "torch": torch.__version__,
    }
    model = CostModel(
        threads=costs,
        kv_transfer_fixed_s=float(transfer_fit[0]),
        kv_transfer_per_block_s=float(transfer_fit[1]),
        cores=os.cpu_count() or 1,
        block_size=engine.block_size,
        machine=machine_description(),
        model=served_model_name(engine.config.model),
        measured_at=datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        notes=notes,
        contention=slowdowns,
    )
    return Fit(model, points, transfers, skipped)


# -- the command ------------------------------------------------------------------------------------------------
def _ms(seconds: float) -> str:
    return f"{seconds * 1000:.1f} ms"


def cmd_bench_costs(args) -> int:
    from kvferry.common.engine import LLMEngine

    threads = args.threads or ([args.num_threads] if args.num_threads else list(range(1, (os.cpu_count() or 1) + 1)))
    config = EngineConfig.from_args(args)
    config.enable_prefix_caching = True  # the prefill points' offsets come from the prefix cache
    started = time.perf_counter()
    engine = LLMEngine(config)
    progress = lambda line: print(line, file=sys.stderr, flush=True)
    progress(f"engine ready in {time.perf_counter() - started:.1f} s; threads {threads}")
    design = QUICK if args.quick else Design()
    fit = fit_costs(engine, threads, design, not args.no_transfer, progress, not args.no_contention)
    fit.model.notes["run_s"] = round(time.perf_counter() - started, 1)
    fit.model.save(args.out)
    print_table(fit)
    print(f"\nwritten to {args.out} ({fit.model.notes['run_s']} s, the model's load included)")
    return 0


def print_table(fit: Fit) -> None:
    m = fit.model
    print(f"\n== cost model: {m.model} on {m.machine} ({m.measured_at}) ==")
    for t, costs in sorted(m.threads.items()):
        for kind in ("prefill", "decode"):
            cost = getattr(costs, kind)
            r = m.notes["residuals"][str(t)][kind]
            print(
                f"\n{kind}, {t} thread(s): fixed {_ms(cost.fixed_s)} + {cost.per_token_s * 1e3:.4f} ms/token + "
                f"{cost.per_seq_s * 1e3:.4f} ms/seq + {cost.per_pair_s * 1e6:.4f} us/pair + "
                f"{cost.per_context_s * 1e6:.4f} us/context token; |error| median "
                f"{r['median_rel_err']:.1%}, max {r['max_rel_err']:.1%} over {r['points']} points"
            )
            print(
                f"{'context' if kind == 'decode' else 'offset':>8} {'seqs':>5} {'tokens':>6} {'pairs':>9} "
                f"{'measured':>11} {'fitted':>11} {'error':>7}"
            )
            for p in fit.points:
                if p.threads == t and p.kind == kind:
                    print(
                        f"{p.context:>8} {p.seqs:>5} {p.tokens:>6} {p.pairs:>9} {_ms(p.seconds):>11} "
                        f"{_ms(p.fitted_s):>11} {p.rel_err:>+7.1%}"
                    )
    if fit.transfers:
        r = m.notes["transfer_residuals"]
        print(
            f"\nKV transfer: fixed {_ms(m.kv_transfer_fixed_s)} + {m.kv_transfer_per_block_s * 1e3:.4f} ms/block "
            f"(blocks of {m.block_size}); |error| median {r['median_rel_err']:.1%}, max {r['max_rel_err']:.1%}"
        )
        print(f"{'blocks':>8} {'MiB':>7} {'measured':>11} {'fitted':>11} {'error':>7}")
        for r in fit.transfers:
            err = (r["fitted_s"] - r["seconds"]) / r["seconds"]
            print(f"{r['num_blocks']:>8} {r['mib']:>7} {_ms(r['seconds']):>11} {_ms(r['fitted_s']):>11} {err:>+7.1%}")
    if m.contention:
        fitted = "; ".join(
            f"{pair} threads: " + ", ".join(f"x{y:.2f} at {x:.2f}" for x, y in points)
            for pair, points in sorted(m.contention.items())
        )
        print(f"\nbeside busy processes (own/theirs threads: slowdown at busy threads per core): {fitted}")
        for r in m.notes["contention"]:
            print(
                f"  {r['threads']} thread(s), {r['competitors']} busy of {r['competitor_threads']}: "
                f"{r['kind']} x{r['slowdown']:.2f} "
                f"({r['busy_per_core']:.2f} busy per core)"
            )
    if fit.skipped:
        print(f"\nskipped (past the KV pool, max_model_len or max_num_seqs): {'; '.join(fit.skipped)}")

"""Parts that check numbers in process: decode through CUDA graphs against eager, and the int8 matmul kernel
against its reference (then `kvferry bench quantization`)."""

import gc
import random
import time

from kvferry.tools.gpu_check.bench_parts import GRAPHS_FAILED
from kvferry.tools.gpu_check.part import Context, PartFailed

# 8 sequences of equal length and output: each step runs at a captured size, with no padding rows.
UNIFORM = {"prompt_lens": [40] * 8, "max_tokens": [48] * 8}
# Sequences that finish at different steps: the batch shrinks and runs padded up to the captured sizes.
MIXED = {"prompt_lens": [5, 23, 61, 97, 130], "max_tokens": [48, 9, 30, 41, 17]}
DRY_UNIFORM = {"prompt_lens": [12] * 4, "max_tokens": [8] * 4}
DRY_MIXED = {"prompt_lens": [3, 9, 20], "max_tokens": [8, 3, 6]}
GRAPH_MAX_NUM_SEQS = 8  # captured sizes 1, 2, 4, 8: enough for these batches; each size compiles its own kernels
# Graphs and eager do not run the same arithmetic (docs/operations.md, "Graphs against eager"): the split-KV count
# follows the block table's width (the batch's longest context in eager, max_model_len in the graphs), and a padded
# batch may get another cuBLAS kernel. fp32 at max_model_len 256 runs one split on both sides, so its tokens may part
# only at a near tie: a first difference where eager's logprob of its token is over FP32_MARGIN above that of the
# graphs' token (or that token is not in eager's top LOGPROBS) fails. bf16's agreement is measured, not judged.
FP32_MAX_MODEL_LEN = 256
FP32_MARGIN = 1e-3
LOGPROBS = 5


def graphs(ctx: Context) -> None:
    workloads = {"uniform": DRY_UNIFORM, "mixed": DRY_MIXED} if ctx.dry_run else {"uniform": UNIFORM, "mixed": MIXED}
    outputs = {}  # (dtype, mode) -> {workload: {request: (token ids, logprobs)}}
    for dtype in ("float32", "bfloat16"):
        for mode in ("eager", "graphs"):
            outputs[dtype, mode] = _decode(ctx, dtype, mode, workloads)
            tokens = sum(len(t) for w in outputs[dtype, mode].values() for t, _ in w.values())
            ctx.record(f"{dtype}_{mode}_tokens", tokens)
    agreement = {}
    for name in workloads:
        fp32_eager, fp32_graphs = outputs["float32", "eager"][name], outputs["float32", "graphs"][name]
        bf16_eager, bf16_graphs = outputs["bfloat16", "eager"][name], outputs["bfloat16", "graphs"][name]
        agreement[name] = {
            "float32_graphs_vs_eager": _agreement(fp32_eager, fp32_graphs),
            "bfloat16_graphs_vs_eager": _agreement(bf16_eager, bf16_graphs),
            # Not the graphs' doing: how far bf16 arithmetic alone moves greedy decoding, for scale.
            "bfloat16_vs_float32_eager": _agreement(fp32_eager, bf16_eager),
        }
    ctx.record("agreement", agreement)
    ctx.summary = "; ".join(
        f"{name}: fp32 graphs = eager in {a['float32_graphs_vs_eager']['identical_outputs']} outputs"
        + _near_ties(a["float32_graphs_vs_eager"])
        + f", bf16 graphs vs eager {a['bfloat16_graphs_vs_eager']['prefix_agreement']:.1%} of tokens"
        + _near_ties(a["bfloat16_graphs_vs_eager"])
        + f" (bf16 vs fp32 {a['bfloat16_vs_float32_eager']['prefix_agreement']:.1%})"
        for name, a in agreement.items()
    )
    real = {
        f"{name} {request}": where
        for name, a in agreement.items()
        for request, where in a["float32_graphs_vs_eager"]["first_divergence"].items()
        if where["margin"] is None or where["margin"] > FP32_MARGIN
    }
    if real:
        raise PartFailed(
            f"fp32 decode through CUDA graphs differs from eager beyond a near tie (eager's logprob margin to the "
            f"graphs' token over {FP32_MARGIN}, or that token not in eager's top {LOGPROBS}), with one attention "
            "split on both sides: " + "; ".join(f"{key}: {where}" for key, where in real.items())
        )


def _near_ties(a: dict) -> str:
    margins = [w["margin"] for w in a["first_divergence"].values()]
    if not margins:
        return ""
    shown = ", ".join(f"beyond eager's top {LOGPROBS}" if m is None else f"{m:.1e}" for m in margins)
    return f" (parting where eager's logprob margin to the other token is {shown})"


def _decode(ctx: Context, dtype: str, mode: str, workloads: dict) -> dict:
    import torch

    from kvferry.common.config import EngineConfig
    from kvferry.common.engine import LLMEngine
    from kvferry.common.sampling import SamplingParams

    started = time.monotonic()
    # fp32: a width of one split on both sides; bf16: the engine's own (the model's limit), as it serves.
    width = {"max_model_len": FP32_MAX_MODEL_LEN} if dtype == "float32" else {}
    config = EngineConfig(
        model=str(ctx.model_dir),
        dtype=dtype,
        enforce_eager=mode == "eager",
        max_num_seqs=GRAPH_MAX_NUM_SEQS,
        seed=0,
        **width,
    )
    engine = LLMEngine(config)
    if mode == "graphs":
        if engine.device.type == "cuda":
            if engine.runner.decode_graphs is None:
                raise PartFailed(f"{dtype}: the decode CUDA graphs were not captured (the log says why)")
        else:  # the dry run: the graphs' static buffers and padding, run eagerly
            engine.runner.use_decode_graphs(
                config.max_num_seqs, -(-engine.max_model_len // config.block_size), capture=False
            )
    built = time.monotonic() - started
    results = {}
    for name, w in workloads.items():
        rng = random.Random(name)
        prompts = [[rng.randrange(256, engine.vocab_size - 256) for _ in range(n)] for n in w["prompt_lens"]]
        params = [
            SamplingParams(max_tokens=m, temperature=0, ignore_eos=True, logprobs=LOGPROBS) for m in w["max_tokens"]
        ]
        outs = engine.generate(prompts, params)
        results[name] = {f"request {i}": (list(o.output_token_ids), list(o.logprobs or [])) for i, o in enumerate(outs)}
    ctx.record(
        f"{dtype}_{mode}_seconds",
        {
            "engine_built": round(built, 1),
            "total": round(time.monotonic() - started, 1),
            "max_model_len": engine.max_model_len,
        },
    )
    del engine
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return results


def _agreement(reference: dict, other: dict) -> dict:
    """Greedy outputs compared request by request: the share of tokens equal up to each one's first difference,
    how many outputs are identical, and at each first difference its index, the two tokens, and how close a tie
    the reference saw there: its logprob of its own token less its logprob of the other's (None: the other's
    token was not among its top LOGPROBS)."""
    same = total = identical = 0
    divergence = {}
    for key, (ref, ref_logprobs) in reference.items():
        out, _ = other[key]
        n = next((i for i, (a, b) in enumerate(zip(ref, out)) if a != b), min(len(ref), len(out)))
        same, total = same + n, total + len(ref)
        if ref == out:
            identical += 1
            continue
        where = {"index": n, "tokens": [ref[n] if n < len(ref) else None, out[n] if n < len(out) else None]}
        where["margin"] = _margin(ref_logprobs[n], out[n]) if n < min(len(ref), len(out), len(ref_logprobs)) else None
        divergence[key] = where
    return {
        "tokens": total,
        "prefix_agreement": round(same / max(1, total), 4),
        "identical_outputs": f"{identical}/{len(reference)}",
        "first_divergence": divergence,
    }


def _margin(logprobs, token: int) -> float | None:
    """logprobs (a TokenLogprobs): the chosen token's logprob less token's, where token is among its top ones."""
    tops = dict(zip(logprobs.top_ids, logprobs.top_logprobs))
    if token not in tops:
        return None
    return float(f"{logprobs.logprob - tops[token]:.3g}")


# (name, K, N): SmolLM2's MLP projections and its vocabulary head.
INT8_SHAPES = (("mlp_up", 576, 1536), ("mlp_down", 1536, 576), ("lm_head", 576, 49152))
INT8_ROWS = (1, 37)  # a decode row; a partial tile of the widest row block (each count compiles its own kernel)
DRY_INT8_SHAPES = (("small", 64, 96),)
DRY_INT8_ROWS = (1, 5)
# Largest |kernel - reference| / largest |reference|: the weights are exact in every dtype (|int8| <= 127), the
# sum is fp32 in both, so what is left is the rounding of the output to the dtype (and fp32's summation order).
INT8_TOLERANCE = {"float32": 1e-4, "float16": 4e-3, "bfloat16": 2e-2}


def int8(ctx: Context) -> None:
    ctx.record("kernel", _int8_kernel(ctx))
    errors = ctx.findings["kernel"]["errors"]
    worst = {d: max(r["relative_error"] for r in errors if r["dtype"] == d) for d in {r["dtype"] for r in errors}}
    ctx.summary = "kernel worst relative error " + ", ".join(f"{d} {e:.1e}" for d, e in sorted(worst.items()))
    argv = ctx.kvferry("bench", "quantization", "--model", ctx.model_dir, "--repeat", "1", "--no-floor", "--json")
    report, log = ctx.run_json([*argv, "--max-num-seqs", "32"])
    ctx.record("bench_quantization", report)
    failed_captures = [line for line in log.splitlines() if GRAPHS_FAILED.search(line)]
    ctx.record("graph_capture_failures", failed_captures)
    a, s = report["accuracy"], report.get("std32", {})
    ctx.summary += (
        f"; bench quantization ({report['dtype']}, random weights): top-1 agreement {a['top1_agreement']:.1%}, "
        f"int8 speed-up {s.get('speedup')}x"
    )
    over = {d: e for d, e in worst.items() if e > INT8_TOLERANCE[d]}
    if over:
        raise PartFailed(f"int8 matmul off its reference beyond the tolerance {INT8_TOLERANCE}: worst {over}")
    if failed_captures:
        raise PartFailed(f"bench quantization's engines could not capture their decode graphs: {failed_captures[0]}")


def _int8_kernel(ctx: Context) -> dict:
    import torch

    from kvferry.common.model.int8_linear import quantize_weight
    from kvferry.kernels.triton.int8_matmul import int8_matmul

    torch.backends.cuda.matmul.allow_tf32 = False  # the reference in full fp32
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    shapes, rows = (DRY_INT8_SHAPES, DRY_INT8_ROWS) if ctx.dry_run else (INT8_SHAPES, INT8_ROWS)
    # The interpreter cannot do bf16 dots (it multiplies the raw bit patterns): the dry run leaves bf16 out.
    dtypes = [d for d in INT8_TOLERANCE if not (ctx.dry_run and d == "bfloat16")]
    g = torch.Generator(device=device).manual_seed(0)
    errors, timings = [], []
    for name, k, n in shapes:
        weight = torch.randn(n, k, generator=g, device=device) * 0.02
        qweight, scale = quantize_weight(weight)
        dequantized = qweight.float() * scale[:, None]
        for dtype_name in dtypes:
            dtype = getattr(torch, dtype_name)
            for m in rows:
                x = torch.randn(m, k, generator=g, device=device).to(dtype)
                got = int8_matmul(x, qweight, scale).float()
                want = x.float() @ dequantized.t()
                error = ((got - want).abs().max() / want.abs().max().clamp_min(1e-30)).item()
                errors.append({"shape": name, "dtype": dtype_name, "rows": m, "relative_error": float(f"{error:.3g}")})
            if device.type == "cuda" and dtype_name == "bfloat16":
                dense = weight.to(dtype)
                for m in rows:
                    x = torch.randn(m, k, generator=g, device=device).to(dtype)
                    timings.append(
                        {
                            "shape": name,
                            "rows": m,
                            "int8_us": _time_us(lambda: int8_matmul(x, qweight, scale)),
                            "bf16_dense_us": _time_us(lambda: x @ dense.t()),
                        }
                    )
    return {"errors": errors, "timings_bf16": timings}


def _time_us(fn, warmup: int = 5, reps: int = 50) -> float:
    import torch

    for _ in range(warmup):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    end.synchronize()
    return round(start.elapsed_time(end) * 1000 / reps, 1)

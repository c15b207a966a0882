"""`kvferry bench step --measure roofline`: this machine's limits, and a workload's roofline worked out from them.

The GEMM rate goes through the model's own path at its hidden -> intermediate shape, with PREFILL_CHUNK rows and
each decode batch size; the read bandwidth is a sum over a tensor several times the last-level cache. Each is the
best of a few trials (on a shared machine, the least disturbed). A measurement that cannot run here says why.
"""

import time

import torch

from kvferry.tools.bench import roofline, workload
from kvferry.tools.bench.floor import PREFILL_CHUNK

DECODE_SIZES = (1, 2, 4, 8, 16, 32)
FALLBACK_LLC_BYTES = 32 * 2**20


def _device(name: str) -> torch.device:
    # Not engine_setup.resolve_device: a CUDA device this machine lacks is reported as not measured, not refused.
    return torch.device("cuda" if name == "auto" and torch.cuda.is_available() else ("cpu" if name == "auto" else name))


def _sync(device: torch.device):
    return (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)


def best_seconds(run, sync=lambda: None, trials: int = 3, min_s: float = 0.05) -> float:
    """Seconds of one run, best of trials; each trial repeats it for at least min_s, so that a short run is not lost
    in the clock's and the call's own cost."""
    run()
    sync()
    repeats, best = 1, float("inf")
    for _ in range(trials):
        while True:
            start = time.perf_counter()
            for _ in range(repeats):
                run()
            sync()
            elapsed = time.perf_counter() - start
            if elapsed >= min_s:
                break
            repeats *= 2
        best = min(best, elapsed / repeats)
    return best


def quantization_of(args) -> str | None:
    value = getattr(args, "quantization", None)
    return None if value in (None, "", "none") else value


def model_shape(config: dict, dtype: torch.dtype, quantization: str | None, device: torch.device):
    """The model's shape with the bytes its weights take on this path: int8 weights are a byte each, plus each
    output channel's fp32 scale and, on the CPU, its outlier columns (int8_linear.py); int4's five bits."""
    dtype_bytes = torch.finfo(dtype).bits // 8
    if quantization not in ("int8", "int4"):
        return roofline.ModelShape.from_config(config, dtype_bytes)
    from kvferry.common.model.int8_linear import NUM_OUTLIER_CHANNELS, OUTLIER_WEIGHT_DTYPE

    outliers = NUM_OUTLIER_CHANNELS if device.type == "cpu" else 0
    per_output = OUTLIER_WEIGHT_DTYPE.itemsize * outliers
    if quantization == "int4":  # 4 bits and, per 32, two fp16 numbers (int4_linear.py; the lm_head counted so too)
        return roofline.ModelShape.from_config(config, dtype_bytes, 5 / 8, per_output)
    return roofline.ModelShape.from_config(config, dtype_bytes, 1, 4 + per_output)


def gemm_path(device: torch.device, dtype: torch.dtype, k: int, n: int, quantization: str | None = None):
    """A function of x computing x @ W.T through the model's path, or a string saying why there is none."""
    if device.type == "cpu":  # the model's path includes the C products the runner loads (kernels/cpu)
        from kvferry.common.model.runner import enable_cpu_kernels

        enable_cpu_kernels()
    if quantization == "int8":  # the int8 GEMM of dynamically quantized rows on the CPU, Triton's on CUDA
        from kvferry.common.model.int8_linear import NUM_OUTLIER_CHANNELS, Int8Linear

        linear = torch.nn.Linear(k, n, bias=False, device=device, dtype=dtype)
        outliers = torch.randperm(k)[:NUM_OUTLIER_CHANNELS] if device.type == "cpu" else None
        layer = Int8Linear(linear, outliers)
        layer.interleave()  # as the runner lays the weights out
        return layer
    if quantization == "int4":
        from kvferry.common.model.int4_linear import Int4Linear
        from kvferry.common.model.int8_linear import NUM_OUTLIER_CHANNELS

        return Int4Linear(torch.nn.Linear(k, n, bias=False), torch.randperm(k)[:NUM_OUTLIER_CHANNELS])
    if device.type == "cpu":
        from kvferry.common.model.cpu_linear import PackedLinear, can_pack

        if not can_pack(device, dtype):
            why = "torch has no oneDNN" if not torch.backends.mkldnn.is_available() else f"dtype {dtype} is not fp32"
            return f"no packed oneDNN path ({why}), the model's CPU GEMM path"
        return PackedLinear(torch.nn.Linear(k, n, bias=False))
    weight = torch.randn(n, k, device=device, dtype=dtype)
    return lambda x: torch.matmul(x, weight.t())


@torch.inference_mode()
def measure_gemm(
    device: torch.device, dtype: torch.dtype, k: int, n: int, trials: int, quantization: str | None = None
) -> dict:
    """FLOP/s of a rows x k by k x n GEMM at each decode batch size and at PREFILL_CHUNK rows."""
    gemm = gemm_path(device, dtype, k, n, quantization)
    if isinstance(gemm, str):
        return {"not_measured": gemm}
    rates = {}
    try:
        for rows in (*DECODE_SIZES, PREFILL_CHUNK):
            x = torch.randn(rows, k, device=device, dtype=dtype)
            rates[rows] = 2 * rows * k * n / best_seconds(lambda: gemm(x), _sync(device), trials)
    except RuntimeError as exc:  # a GPU without the library the matmul needs (cuBLAS) fails at the first call
        return {"not_measured": f"the GEMM failed: {str(exc).splitlines()[0]}"}
    peak = rates.pop(PREFILL_CHUNK)
    shape = f"rows x {k} -> {n}" + (f", {quantization} weights" if quantization else "")
    return {"shape": shape, "decode_flop_per_s": rates, "peak_flop_per_s": peak}


def _llc_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 0) or 64 * 2**20
    try:
        text = open("/sys/devices/system/cpu/cpu0/cache/index3/size").read().strip()  # e.g. 32768K
        return int(text.rstrip("KMG")) * {"K": 2**10, "M": 2**20, "G": 2**30}.get(text[-1], 1)
    except (OSError, ValueError):
        return FALLBACK_LLC_BYTES


def read_bandwidth(device: torch.device, nbytes: int, trials: int) -> float:
    """Bytes per second of a sum streaming through nbytes: far past the caches, every trial reads memory."""
    data = torch.ones(nbytes // 4, device=device, dtype=torch.float32)
    return nbytes / best_seconds(lambda: data.sum(), _sync(device), max(trials, 5), min_s=0.02)


@torch.inference_mode()
def measure_bandwidth(device: torch.device, trials: int) -> dict:
    size = 8 * _llc_bytes(device)  # far past the cache: every trial reads from memory
    try:
        return {"tensor_bytes": size, "bytes_per_s": read_bandwidth(device, size, trials)}
    except RuntimeError as exc:
        return {"not_measured": f"the read failed: {str(exc).splitlines()[0]}"}


def measure(
    device: torch.device, dtype: torch.dtype, shape: roofline.ModelShape, trials: int, quantization: str | None = None
) -> dict:
    if device.type == "cuda" and not torch.cuda.is_available():
        why = {"not_measured": "CUDA is not available on this machine (torch.cuda.is_available() is False)"}
        return {"gemm": why, "bandwidth": why}
    return {
        "gemm": measure_gemm(device, dtype, shape.hidden, shape.intermediate, trials, quantization),
        "bandwidth": measure_bandwidth(device, trials),
    }


def workload_roofline(shape: roofline.ModelShape, limits: dict, requests: list[dict]) -> dict:
    gemm, bandwidth = limits["gemm"], limits["bandwidth"]
    return roofline.roofline(
        shape,
        roofline.schedule(requests),
        gemm.get("decode_flop_per_s"),
        gemm.get("peak_flop_per_s"),
        bandwidth.get("bytes_per_s"),
    )


def add_quick_roofline(report: dict, args, model_dir, device: torch.device, dtype: torch.dtype, requests) -> None:
    """The roofline beside `bench engine`'s and `bench serve`'s figures, in a few seconds (two trials of each
    limit): the workload's totals, why a limit was not measured where one was not, and kvferry's share of it."""
    from kvferry.common.model_files import read_config
    from kvferry.tools.bench.report import say

    quantization = quantization_of(args)
    shape = model_shape(read_config(model_dir), dtype, quantization, device)
    limits = measure(device, dtype, shape, 2, quantization)
    r = report["roofline"] = rounded(workload_roofline(shape, limits, requests))
    for name, figures in limits.items():
        if "not_measured" in figures:
            r[f"{name}_not_measured"] = figures["not_measured"]
    if "total_s" in r:
        report["kvferry"]["fraction_of_roofline"] = round(r["total_s"] / report["kvferry"]["elapsed_s"], 3)
    say(args, "roofline", r)


def rounded(result: dict) -> dict:
    return {k: round(v, 1 if k.endswith("tok_per_s") else 3) if isinstance(v, float) else v for k, v in result.items()}


def measure_workload(args, run_engine) -> tuple[dict, str]:
    """The limits, the workload's roofline, and with --engine run_engine(requests)'s figures set against it."""
    from kvferry.common.engine_setup import resolve_dtype
    from kvferry.common.model_files import read_config, resolve_model

    torch.set_num_threads(args.num_threads or 2)
    device = _device(args.device)
    dtype = resolve_dtype(args.dtype, device)
    config = read_config(resolve_model(args.model))
    quantization = quantization_of(args)
    shape = model_shape(config, dtype, quantization, device)
    requests = workload.generate(args.workload, shape.vocab)
    report = {"workload": args.workload, "device": str(device), "dtype": str(dtype), "threads": torch.get_num_threads()}
    report["quantization"] = quantization or "none"
    report["model"] = {
        "gemm_flops_per_token": shape.layer_flops_per_token() + shape.lm_head_flops_per_token(),
        "attention_flops_per_context_token": shape.attention_flops_per_pair(),
        "weight_bytes": shape.weight_bytes(),
        "kv_bytes_per_token": shape.kv_bytes_per_token(),
        "family_params": shape.family_params(),
    }
    report["limits"] = measure(device, dtype, shape, args.trials, quantization)
    report["roofline"] = rounded(workload_roofline(shape, report["limits"], requests))
    measured = args.measured_tok_s
    if args.engine:
        measured = report["engine_tok_per_s"] = run_engine(requests)["output_tok_per_s"]
    if measured and "total_s" in report["roofline"]:
        report["fraction_of_roofline"] = measured / report["roofline"]["output_tok_per_s"]
    return report, _text(report, measured)


def _text(report: dict, measured: float | None) -> str:
    m, gemm, bw, r = report["model"], report["limits"]["gemm"], report["limits"]["bandwidth"], report["roofline"]
    lines = [
        f"== roofline of {report['workload']} on {report['device']} ({report['dtype']}"
        + ("" if report["quantization"] == "none" else f", {report['quantization']} weights")
        + f", {report['threads']} threads) ==",
        f"model: {m['gemm_flops_per_token'] / 1e6:.1f} MFLOP of GEMMs per token, "
        f"{m['attention_flops_per_context_token'] / 1e3:.1f} kFLOP of attention per context token, "
        f"{m['weight_bytes'] / 1e6:.1f} MB of weights, {m['kv_bytes_per_token'] / 1e3:.1f} kB of KV per token",
    ]
    if "not_measured" in gemm:
        lines.append(f"GEMM rate: not measured: {gemm['not_measured']}")
    else:
        rates = ", ".join(f"{rows}: {rate / 1e9:.1f}" for rows, rate in gemm["decode_flop_per_s"].items())
        lines.append(
            f"GEMM rate ({gemm['shape']}), GFLOP/s: {PREFILL_CHUNK} rows: {gemm['peak_flop_per_s'] / 1e9:.1f}; "
            f"decode rows {rates}"
        )
    if "not_measured" in bw:
        lines.append(f"read bandwidth: not measured: {bw['not_measured']}")
    else:
        lines.append(
            f"read bandwidth: {bw['bytes_per_s'] / 1e9:.1f} GB/s (sum over {bw['tensor_bytes'] / 2**20:.0f} MiB)"
        )
    if "cannot_compute" in r:
        lines.append(f"roofline: cannot compute: {r['cannot_compute']}")
        return "\n".join(lines)
    lines.append(
        f"roofline ({r['limits_used']}): {r['total_s']:.2f} s (prefill {r['prefill_s']:.2f} s, decode "
        f"{r['decode_s']:.2f} s; {r['memory_bound_steps']} of {r['steps']} steps memory-bound), "
        f"{r['output_tok_per_s']:.1f} output tok/s; {r['gemm_flops'] / 1e12:.2f} TFLOP of GEMMs, "
        f"{r['attention_flops'] / 1e9:.0f} GFLOP of attention, {r['bytes_read'] / 1e9:.1f} GB read"
    )
    if measured and "fraction_of_roofline" in report:
        lines.append(f"measured {measured:.1f} tok/s: {report['fraction_of_roofline']:.0%} of the roofline")
    return "\n".join(lines)

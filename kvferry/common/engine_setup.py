"""What an engine is built from: the device, dtype and KV cache dtype a config names, the tokenizer of a model folder (its EOS ids:
model_files.eos_token_ids), and which errors mean the device itself is broken."""

import logging
import os
import time
from pathlib import Path

import torch

from kvferry.common.errors import ConfigError
from kvferry.common.model import prepared_weights
from kvferry.common.model.gguf_int4 import take_exact
from kvferry.common.model.loader import load_in_parts, load_model
from kvferry.common.model.quantize import quantize_in_parts, quantize_model
from kvferry.common.model.runner import ModelRunner
from kvferry.kernels.cpu.build import cpu_features

log = logging.getLogger("kvferry.engine")


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError:
        raise ConfigError(f"unknown device {name!r}: use auto, cpu, cuda or cuda:N") from None
    if device.type not in ("cpu", "cuda"):
        raise ConfigError(f"device {name!r} is not supported: use auto, cpu, cuda or cuda:N")
    if device.type == "cuda" and (not torch.cuda.is_available() or (device.index or 0) >= torch.cuda.device_count()):
        raise ConfigError(f"device {name!r} asked for, but this machine has {torch.cuda.device_count()} CUDA devices")
    return device


def use_device(device: torch.device) -> None:
    """Make a CUDA device the current one, before anything is allocated or launched on it: Triton launches, CUDA
    graph pools, streams and "cuda" without an index all go to the current device, which is otherwise device 0."""
    if device.type == "cuda" and device.index is not None:
        torch.cuda.set_device(device)


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return getattr(torch, name)


def _converts_float16() -> bool:
    """Whether this CPU converts float16 in hardware (x86's F16C, which every AVX-512 CPU has), as the C attention
    kernels need to read a float16 cache (kernels/cpu/vectors.h); elsewhere bfloat16, which they read anywhere."""
    flags = cpu_features()
    return flags.startswith("flags") and (" f16c" in flags or " avx512f" in flags)


def resolve_kv_dtype(name: str, device: torch.device, model_dtype: torch.dtype) -> torch.dtype:
    """The KV cache's element type: half precision on the CPU by default, where the model computes in float32 (the C
    attention kernels widen each element as they read it); the model's own type on CUDA, the only one its kernels
    read (a ConfigError for any other)."""
    if device.type == "cuda":
        if name not in ("auto", str(model_dtype).removeprefix("torch.")):
            raise ConfigError(
                f"--kv-cache-dtype {name} is not served on CUDA beside --dtype {str(model_dtype).removeprefix('torch.')}"
                ": the Triton kernels read the cache in the model's type; pass --kv-cache-dtype auto"
            )
        return model_dtype
    if name != "auto":
        return getattr(torch, name)
    if model_dtype != torch.float32:
        return model_dtype
    return torch.float16 if _converts_float16() else torch.bfloat16


def check_quantization(name: str | None, device: torch.device) -> None:
    """A ConfigError where the device has no kernel for the quantization: int4 runs on the CPU only."""
    if name == "int4" and device.type != "cpu":
        raise ConfigError(
            f"--quantization int4 is not served on {device}: its kernels are the CPU's (int4_matmul.c); use int8 "
            "there, or --device cpu"
        )


def is_device_failure(exc: Exception) -> bool:
    """An error after which the device cannot be trusted (a CUDA fault poisons the context): the worker must end."""
    accelerator_error = getattr(torch, "AcceleratorError", None)
    return (accelerator_error is not None and isinstance(exc, accelerator_error)) or "CUDA error" in str(exc)


def device_works(device: torch.device) -> bool:
    """Whether the device still runs work: after a CUDA fault every later call fails."""
    if device.type != "cuda":
        return True
    try:
        torch.cuda.synchronize(device)
        torch.zeros(1, device=device).add_(1).item()
    except Exception:
        return False
    return True


def load_tokenizer(model_dir):
    """The folder's tokenizer, or None for a weights-only folder (tests' tiny models): such an engine takes token ids."""
    from transformers import AutoTokenizer

    if not any(os.path.isfile(os.path.join(model_dir, f)) for f in ("tokenizer.json", "tokenizer.model", "vocab.json")):
        return None
    return AutoTokenizer.from_pretrained(model_dir)


def prepared_file(model_dir, dtype: torch.dtype, device: torch.device, config) -> Path | None:
    """The host's prepared file this worker's weights come from (prepared_weights.py: int8 or int4 on the CPU), made or not
    yet; None where the weights load in full."""
    if config.quantization not in ("int8", "int4") or device.type != "cpu":
        return None
    return prepared_weights.prepared_path(model_dir, dtype, config.quantization)


def mapped_weight_bytes(prepared: Path | None) -> int | None:
    """The size of the prepared file this worker will map, where there is one already (a warm start's weights at
    their peak); None where the weights load in full first."""
    return prepared.stat().st_size if prepared is not None and prepared.exists() else None


def load_weights(
    model_dir, dtype: torch.dtype, device: torch.device, config, prepared: Path | None, calibration_ids
) -> tuple:
    """(model, ModelConfig, max_model_len): mapped from the prepared file where there is one for this worker
    (prepared_file), made first where it is missing; otherwise loaded, and quantized, in this process.
    calibration_ids(model_config): int8's calibration text, read only where the model is quantized here."""
    if prepared is not None:

        def quantize(model):  # built without weights: each layer loaded, calibrated and quantized in turn
            outer, load_layer, check_loaded = load_in_parts(model_dir, model)
            quantize_in_parts(model, calibration_ids(model.config), config.quantization, outer, load_layer)
            check_loaded()
            if config.quantization == "int4":
                take_exact(model, model_dir)  # a Q4_0 or Q4_1 GGUF's own numbers, where it came from one

        return prepared_weights.load_or_prepare(model_dir, prepared, dtype, config.max_model_len, quantize)
    model, model_config, max_model_len = load_model(model_dir, dtype, device, config.max_model_len)
    if config.quantization is not None:
        quantize_model(model, device, calibration_ids(model_config), config.quantization)
    return model, model_config, max_model_len


def gpu_kv_cache_memory(device: torch.device, utilization: float) -> int:
    """The KV cache's bytes on a GPU when not given: the utilization's share of its whole memory, less what this
    process holds now (the weights), as vLLM's gpu_memory_utilization. A ConfigError where nothing is left."""
    total = torch.cuda.get_device_properties(device).total_memory
    held = torch.cuda.memory_reserved(device)
    left = int(utilization * total) - held
    if left < 2**20:
        raise ConfigError(
            f"--memory-utilization {utilization:g} of {device}'s {total / 2**30:.2f} GiB leaves no KV cache beside "
            f"the {held / 2**30:.2f} GiB this worker holds: raise it, or set --kv-cache-memory"
        )
    return left


def build_runner(model, layout, num_blocks: int, device, dtype, kv_dtype, config, scheduler):
    """The model runner with its KV cache; a cache that does not fit is a ConfigError naming the setting."""
    try:
        return ModelRunner(
            model,
            layout,
            num_blocks,
            device,
            dtype,
            kv_dtype=kv_dtype,
            seed=config.seed,
            eos_token_ids=scheduler.eos_token_ids,
            kv_huge_pages=config.kv_huge_pages,
        )
    except (torch.OutOfMemoryError, RuntimeError) as exc:
        if "memory" not in str(exc).lower():
            raise
        raise ConfigError(
            f"a KV cache of {layout.bytes_per_block * num_blocks} bytes does not fit on {device}: lower "
            "--kv-cache-memory or --memory-utilization"
        ) from None


def capture_decode_graphs(runner, config, max_model_len: int) -> None:
    """Capture the decode steps' CUDA graphs. Out of memory is the user's to fix (a ConfigError naming the
    settings); any other failure (a kernel that does not compile, an operation that cannot be captured) leaves
    decode eager, slower at small batches but right, with a warning naming the cause."""
    started = time.perf_counter()
    try:
        runner.use_decode_graphs(config.max_num_seqs, -(-max_model_len // config.block_size))
    except torch.OutOfMemoryError:
        raise ConfigError(
            "no memory left to capture the decode CUDA graphs: lower --kv-cache-memory or "
            "--max-num-seqs, or pass --enforce-eager"
        ) from None
    except Exception as exc:
        runner.decode_graphs = None  # DecodeGraphs let go of what it had captured
        if not device_works(runner.device):  # a fault that poisoned the context: eager would fail as well
            raise
        log.warning(
            "capturing the decode CUDA graphs failed, so decode steps run eager (slower at small batches): %s: %s",
            type(exc).__name__,
            exc,
        )
        return
    log.info(
        "decode CUDA graphs for batch sizes %s captured in %.1f s (--enforce-eager skips them)",
        runner.decode_graphs.sizes,
        time.perf_counter() - started,
    )

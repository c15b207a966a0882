"""What an engine is built from: the device and dtype a config names, the tokenizer of a model folder (its EOS ids:
model_files.eos_token_ids), and which errors mean the device itself is broken."""

import logging
import os
import time

import torch

from kvferry.common.errors import ConfigError
from kvferry.common.model.runner import ModelRunner

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


def build_runner(model, layout, num_blocks: int, device, dtype, config, scheduler):
    """The model runner with its KV cache; a cache that does not fit is a ConfigError naming the setting."""
    try:
        return ModelRunner(
            model,
            layout,
            num_blocks,
            device,
            dtype,
            seed=config.seed,
            eos_token_ids=scheduler.eos_token_ids,
            kv_huge_pages=config.kv_huge_pages,
        )
    except (torch.OutOfMemoryError, RuntimeError) as exc:
        if "memory" not in str(exc).lower():
            raise
        raise ConfigError(
            f"--kv-cache-memory {config.kv_cache_memory} bytes does not fit on {device}: lower it"
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

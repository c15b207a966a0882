"""A worker's memory budget on the CPU, checked before its model loads: the weights as loading holds them and the
KV cache, against the memory the machine has available. Linux over-commits memory, so a KV cache or a model that
cannot fit would otherwise start, and be killed later by the kernel's OOM killer, mid-load or mid-request.

Loading holds every weight in the engine's dtype at its peak (int8 quantization happens after), so that is what
counts, whatever --quantization says.

Without --kv-cache-memory the KV cache takes what --memory-utilization leaves after the weights: of MemAvailable at
start, for one worker alone or, under `kvferry serve`, for all its workers together (plan_serve: serve sizes each
worker's cache before any starts, as workers starting together would each count the same free memory).
"""

import math
import os
from dataclasses import dataclass
from pathlib import Path

from kvferry.common.errors import ConfigError
from kvferry.common.model.loader import safetensors_header, weight_files
from kvferry.common.model_files import max_model_len_of, read_config


def parameter_count(model_dir: Path) -> int:
    """The number of weights the model loads, from its safetensors headers alone: the files the loader reads
    (loader.weight_files: not a consolidated.safetensors beside them), and a tied model's stored lm_head once."""
    model_dir = Path(model_dir)
    tied = bool(read_config(model_dir).get("tie_word_embeddings"))
    total = 0
    for path in weight_files(model_dir):
        try:
            header, _ = safetensors_header(path)
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
        for name, entry in header.items():
            if name != "__metadata__" and not (tied and name.startswith("lm_head.")):
                total += math.prod(entry["shape"])
    return total


def available_memory() -> int | None:
    """MemAvailable from /proc/meminfo in bytes: what can be had without swapping; None where there is none."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def kv_cache_ceiling() -> int:
    """More than any KV cache sized from memory here can take: the machine's physical memory (a transfer's frames
    land in it, whatever the device)."""
    return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB"


UTILIZATION = "--memory-utilization (KVFERRY_MEMORY_UTILIZATION)"
KV_CACHE_MEMORY = "--kv-cache-memory (KVFERRY_KV_CACHE_MEMORY)"
FALLBACK_KV_CACHE = 2**30  # where the machine's memory cannot be read (no /proc/meminfo)


def kv_bytes_per_token(model_config: dict, itemsize: int) -> int:
    """K and V of one token in every layer, from the model's config.json (read_config's dict)."""
    heads = model_config["num_attention_heads"]
    kv_heads = model_config.get("num_key_value_heads") or heads
    head_dim = model_config.get("head_dim") or model_config["hidden_size"] // heads
    return 2 * model_config["num_hidden_layers"] * kv_heads * head_dim * itemsize


def sized_kv_cache(weights: int, available: int | None, utilization: float, workers: int = 1, most: int = 0) -> int:
    """Each worker's KV cache when sized from memory: the utilization's share of what is available, less the
    weights (every worker's together, as they are held at once), split evenly, and no more than `most` (when set):
    what the worker could ever fill. A ConfigError naming the numbers where nothing is left."""
    if available is None:
        return min(FALLBACK_KV_CACHE, most or FALLBACK_KV_CACHE)
    left = int(utilization * available) - weights
    if left < workers * 2**20:
        whose = f" ({workers} workers')" if workers > 1 else ""
        raise ConfigError(
            f"not enough memory for a KV cache: the weights{whose} take {gib(weights)} while loading, and "
            f"{UTILIZATION} {utilization:g} of the {gib(available)} available is "
            f"{gib(int(utilization * available))}: raise it, set {KV_CACHE_MEMORY}, or serve a smaller model or --dtype"
        )
    return min(left // workers, most or left)


@dataclass(frozen=True)
class Budget:
    weights: int  # bytes the weights take at the peak of loading
    kv_cache: int  # --kv-cache-memory, or its size from memory
    available: int | None  # bytes available now (None: unknown)
    sized: bool = False  # the KV cache was sized from memory, not given

    @property
    def need(self) -> int:
        return self.weights + self.kv_cache

    def describe(self) -> str:
        have = "unknown" if self.available is None else gib(self.available)
        how = " (sized from memory)" if self.sized else ""
        return f"weights {gib(self.weights)} + KV cache {gib(self.kv_cache)}{how} = {gib(self.need)}; available {have}"

    def check(self) -> None:
        """A ConfigError naming the numbers and the settings to change, where the budget cannot fit."""
        if self.available is None or self.need <= self.available:
            return
        raise ConfigError(
            f"not enough memory: the weights take {gib(self.weights)} while loading and --kv-cache-memory asks "
            f"{gib(self.kv_cache)}, {gib(self.need)} in all, but {gib(self.available)} is available: lower "
            "--kv-cache-memory (KVFERRY_KV_CACHE_MEMORY), or serve a smaller model or --dtype"
        )


def most_kv_cache(model_dir: Path, config, itemsize: int) -> int:
    """The most KV cache an engine with this config could fill: max_num_seqs sequences of max_model_len tokens (the
    model's own limit unless set), with one block of rounding each. A cache sized from memory takes no more."""
    model_config = read_config(model_dir)
    longest = config.max_model_len or max_model_len_of(model_config)
    tokens = config.max_num_seqs * (longest + config.block_size)
    return tokens * kv_bytes_per_token(model_config, itemsize)


def budget_of(
    model_dir: Path,
    itemsize: int,
    kv_cache_memory: int | None,
    utilization: float = 0.9,
    most: int = 0,
    weights: int | None = None,
) -> Budget:
    """One worker's budget; kv_cache_memory None: sized from memory, at most `most` bytes (0: no bound). weights:
    their bytes where known (a prepared file's, mapped), else counted at itemsize from the checkpoint."""
    weights = parameter_count(model_dir) * itemsize if weights is None else weights
    available = available_memory()
    if kv_cache_memory is not None:
        return Budget(weights, kv_cache_memory, available)
    return Budget(weights, sized_kv_cache(weights, available, utilization, most=most), available, sized=True)


# serve's KV memory for its prefill worker when sized from memory: it holds a prompt's KV only until the decode worker
# has it (and its prefix cache), where the decode worker holds every running sequence to its end.
PREFILL_KV_SHARE = 0.25


def plan_serve(
    model_dir: Path,
    itemsize: int,
    kv_cache_memory: int | None,
    utilization: float,
    most: int = 0,
    shared_weights: bool = False,
) -> tuple[int, int]:
    """`kvferry serve`'s check of its prefill and decode worker together on one host, before either starts: the KV
    cache bytes of each (given: the same for both; else sized from memory, PREFILL_KV_SHARE of it the prefill
    worker's, each at most `most`), or a ConfigError naming the numbers. shared_weights: one worker loads the
    weights while the other waits to map what it prepared (prepared_weights.py), so they count once."""
    # Both workers' weights as loading holds them at once
    loading = parameter_count(model_dir) * itemsize * (1 if shared_weights else 2)
    available = available_memory()
    if kv_cache_memory is None:
        total = 2 * sized_kv_cache(loading, available, utilization, workers=2)
        prefill = int(total * PREFILL_KV_SHARE)
        return min(prefill, most or prefill), min(total - prefill, most or total)
    need = loading + 2 * kv_cache_memory
    if available is not None and need > available:
        raise ConfigError(
            f"not enough memory for serve's 2 workers: their weights take {gib(loading)} while "
            f"loading and each KV cache {gib(kv_cache_memory)} ({KV_CACHE_MEMORY}), {gib(need)} in all, but "
            f"{gib(available)} is available: lower it, leave it unset to size it from memory, or serve a smaller "
            "model or --dtype"
        )
    return kv_cache_memory, kv_cache_memory

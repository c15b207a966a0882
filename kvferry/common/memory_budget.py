"""A worker's memory budget on the CPU, checked before its model loads: the weights as loading holds them and the
KV cache, against the memory the machine has available. Linux over-commits memory, so a KV cache or a model that
cannot fit would otherwise start, and be killed later by the kernel's OOM killer, mid-load or mid-request.

Loading holds every weight in the engine's dtype at its peak (int8 quantization happens after), so that is what
counts, whatever --quantization says.
"""

import json
import struct
from dataclasses import dataclass
from pathlib import Path

from kvferry.common.errors import ConfigError
from kvferry.common.model.loader import weight_files
from kvferry.common.model_files import read_config

_HEADER_LIMIT = 100 * 2**20  # a safetensors header longer than this is not one


def parameter_count(model_dir: Path) -> int:
    """The number of weights the model loads, from its safetensors headers alone: the files the loader reads
    (loader.weight_files: not a consolidated.safetensors beside them), and a tied model's stored lm_head once."""
    model_dir = Path(model_dir)
    tied = bool(read_config(model_dir).get("tie_word_embeddings"))
    total = 0
    for path in weight_files(model_dir):
        with open(path, "rb") as f:
            (length,) = struct.unpack("<Q", f.read(8))
            if length > _HEADER_LIMIT:
                raise ConfigError(f"{path} is not a safetensors file (a header of {length} bytes)")
            header = json.loads(f.read(length))
        for name, entry in header.items():
            if name != "__metadata__" and not (tied and name.startswith("lm_head.")):
                count = 1
                for dim in entry["shape"]:
                    count *= dim
                total += count
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


def gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB"


@dataclass(frozen=True)
class Budget:
    weights: int  # bytes the weights take at the peak of loading
    kv_cache: int  # --kv-cache-memory
    available: int | None  # bytes available now (None: unknown)

    @property
    def need(self) -> int:
        return self.weights + self.kv_cache

    def describe(self) -> str:
        have = "unknown" if self.available is None else gib(self.available)
        return f"weights {gib(self.weights)} + KV cache {gib(self.kv_cache)} = {gib(self.need)}; available {have}"

    def check(self) -> None:
        """A ConfigError naming the numbers and the settings to change, where the budget cannot fit."""
        if self.available is None or self.need <= self.available:
            return
        raise ConfigError(
            f"not enough memory: the weights take {gib(self.weights)} while loading and --kv-cache-memory asks "
            f"{gib(self.kv_cache)}, {gib(self.need)} in all, but {gib(self.available)} is available: lower "
            "--kv-cache-memory (KVFERRY_KV_CACHE_MEMORY), or serve a smaller model or --dtype"
        )


def budget_of(model_dir: Path, itemsize: int, kv_cache_memory: int) -> Budget:
    return Budget(parameter_count(model_dir) * itemsize, kv_cache_memory, available_memory())

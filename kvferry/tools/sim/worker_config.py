"""A simulated worker's Scheduler and BlockManager settings, from the EngineConfig a real worker reads (the same
flags and KVFERRY_ variables), and where its threads run. Torch loads only where --kv-cache-memory must become a
block count from the model's block size in bytes (bytes_per_block); --num-blocks skips it.
"""

import os
from dataclasses import dataclass, fields

from kvferry.common.config import EngineConfig
from kvferry.common.errors import ConfigError
from kvferry.common.memory_budget import FALLBACK_KV_CACHE, kv_bytes_per_token
from kvferry.common.model_files import max_model_len_of, read_config, resolve_model
from kvferry.common.serve_config import ServeConfig


@dataclass(frozen=True)
class WorkerConfig:
    """What a simulated worker's Scheduler and BlockManager take; each default is its EngineConfig field's."""

    num_blocks: int
    max_model_len: int
    block_size: int = EngineConfig.block_size
    max_num_seqs: int = EngineConfig.max_num_seqs
    max_num_batched_tokens: int = EngineConfig.max_num_batched_tokens
    enable_prefix_caching: bool = EngineConfig.enable_prefix_caching
    enable_chunked_prefill: bool = EngineConfig.enable_chunked_prefill
    long_prefill_threshold: int = EngineConfig.long_prefill_threshold

    def __post_init__(self):
        if self.num_blocks < 1:
            raise ConfigError(f"a simulated worker needs at least one KV block, got {self.num_blocks}")
        if self.max_model_len > self.num_blocks * self.block_size:
            # As LLMEngine does: the model's limit is lowered to what the pool holds.
            object.__setattr__(self, "max_model_len", self.num_blocks * self.block_size)

    @classmethod
    def from_engine_config(cls, config: EngineConfig, num_blocks: int | None = None) -> "WorkerConfig":
        """The worker a real one with this EngineConfig would be; num_blocks None: from --kv-cache-memory (unset: 1 GiB,
        as a planned deployment's memory is not this machine's)."""
        max_model_len = config.max_model_len
        if num_blocks is None or max_model_len is None:
            model_config = read_config(resolve_model(config.model))
            if num_blocks is None:
                kv_cache_memory = config.kv_cache_memory or FALLBACK_KV_CACHE
                num_blocks = kv_cache_memory // bytes_per_block(model_config, config.block_size, config)
            if max_model_len is None:
                max_model_len = max_model_len_of(model_config)
        same = {f.name: getattr(config, f.name) for f in fields(cls) if f.name not in ("num_blocks", "max_model_len")}
        return cls(num_blocks=num_blocks, max_model_len=max_model_len, **same)


def bytes_per_block(model_config: dict, block_size: int, config: EngineConfig) -> int:
    """K and V of one block in every layer, as runner.KVCacheLayout sizes them with the engine's KV dtype resolution.
    Loads torch. A named --device is taken as named, present or not: a GPU deployment can be planned without one."""
    import torch

    from kvferry.common.engine_setup import resolve_device, resolve_dtype, resolve_kv_dtype

    device = resolve_device(config.device) if config.device == "auto" else torch.device(config.device)
    dtype = resolve_kv_dtype(config.kv_cache_dtype, device, resolve_dtype(config.dtype, device))
    return block_size * kv_bytes_per_token(model_config, dtype.itemsize)


@dataclass(frozen=True)
class Placement:
    """The machine's cores and each process's torch threads, which decide how much the workers slow each other.
    cores 0: each worker has cores of its own (a cluster's pods, a GPU each)."""

    cores: int = os.cpu_count() or 1
    prefill_threads: int = ServeConfig.prefill_threads
    decode_threads: int = ServeConfig.decode_threads
    # Cores' worth of other work on the same cores all along: the gateway and a load generator beside the workers.
    background_threads: float = 0.0

    def __post_init__(self):
        for name, low in (("cores", 0), ("prefill_threads", 1), ("decode_threads", 1), ("background_threads", 0)):
            if getattr(self, name) < low:
                raise ConfigError(f"{name} must be at least {low}, got {getattr(self, name)}")

"""The engine's settings (EngineConfig). Their defaults, bounds, flags and environment variables are in
kvferry/common/settings.py, each defined once."""

import argparse
from dataclasses import dataclass, fields

from kvferry.common import settings

_d = settings.default


@dataclass
class EngineConfig:
    """One engine's settings: the dests of the settings that settings.ENGINE commands take."""

    model: str | None = _d("model")
    device: str = _d("device")  # auto: cuda when present, else cpu
    dtype: str = _d("dtype")  # auto: float32 on cpu, bfloat16 on cuda
    block_size: int = _d("block_size")
    kv_cache_memory: int = _d("kv_cache_memory")  # bytes for K and V of all layers
    max_num_seqs: int = _d("max_num_seqs")
    max_num_batched_tokens: int = _d("max_num_batched_tokens")
    max_model_len: int | None = _d("max_model_len")
    num_threads: int | None = _d("num_threads")  # torch CPU threads for this process
    seed: int | None = _d("seed")
    enable_prefix_caching: bool = _d("no_prefix_caching")  # reuse cached KV blocks of a prompt's longest cached prefix
    kv_huge_pages: bool = _d("no_kv_huge_pages")  # the CPU KV cache on transparent huge pages (model/cpu_memory.py)
    enable_chunked_prefill: bool = _d("no_chunked_prefill")  # split long prompts into chunks beside other prompts
    long_prefill_threshold: int = _d("long_prefill_threshold")  # chunked: a prompt's most tokens in one step
    quantization: str | None = _d("quantization")  # None ("none"): weights in dtype; "int8": see model/int8_linear.py
    enforce_eager: bool = _d("enforce_eager")  # on CUDA: no decode graphs (see model/decode_graphs.py)

    def __post_init__(self):
        if self.quantization in (None, ""):
            self.quantization = "none"
        for setting in _SETTINGS:
            setting.check(getattr(self, setting.attr))  # a ConfigError naming the setting
        if self.quantization == "none":
            self.quantization = None

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> "EngineConfig":
        return cls(**{f.name: getattr(args, f.name) for f in fields(cls)})


_SETTINGS = settings.for_command(settings.GENERATE)  # one per field (a unit test checks)

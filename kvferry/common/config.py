"""Engine settings, from flags or KVFERRY_* environment variables (the flag wins)."""

import argparse
import os
import re
from dataclasses import dataclass, fields

_SIZE_UNITS = {
    "": 1,
    "b": 1,
    "k": 10**3,
    "kb": 10**3,
    "kib": 2**10,
    "m": 10**6,
    "mb": 10**6,
    "mib": 2**20,
    "g": 10**9,
    "gb": 10**9,
    "gib": 2**30,
}


def parse_size(text: str | int) -> int:
    """'1GiB', '512MiB', '2g', '1048576' -> bytes."""
    if isinstance(text, int):
        return text
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(text))
    if not match or match.group(2).lower() not in _SIZE_UNITS:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (try 512MiB or 2GiB)")
    return int(float(match.group(1)) * _SIZE_UNITS[match.group(2).lower()])


@dataclass
class EngineConfig:
    model: str | None = None
    device: str = "auto"  # auto: cuda when present, else cpu
    dtype: str = "auto"  # auto: float32 on cpu, bfloat16 on cuda
    block_size: int = 16
    kv_cache_memory: int = 2**30  # bytes for K and V of all layers
    max_num_seqs: int = 128
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None
    num_threads: int | None = None  # torch CPU threads for this process
    seed: int | None = None
    enable_prefix_caching: bool = True  # reuse cached KV blocks of a prompt's longest cached prefix
    enable_chunked_prefill: bool = True  # split long prompts into chunks, interleaved with other prompts
    long_prefill_threshold: int = 512  # chunked: a prompt's most tokens in one step (0: max_num_batched_tokens)
    quantization: str | None = None  # None: weights in dtype; "int8": int8 weights (see model/int8_linear.py)
    enforce_eager: bool = False  # on CUDA: no decode graphs (see model/decode_graphs.py)

    def __post_init__(self):
        from kvferry.common.errors import ConfigError

        if self.block_size not in (8, 16, 32):
            raise ConfigError(f"block_size must be 8, 16 or 32, got {self.block_size}")
        for name in ("kv_cache_memory", "max_num_seqs", "max_num_batched_tokens"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be positive, got {getattr(self, name)}")
        if self.quantization in ("", "none"):
            self.quantization = None
        if self.quantization not in (None, "int8"):
            raise ConfigError(f"quantization must be int8 or none, got {self.quantization!r}")
        if self.long_prefill_threshold < 0:
            raise ConfigError(
                f"long_prefill_threshold must be 0 (no cap) or positive, got {self.long_prefill_threshold}"
            )

    @classmethod
    def add_args(cls, parser: argparse.ArgumentParser) -> None:
        # Defaults stay strings: argparse then parses an environment value exactly like a flag,
        # and a bad one gets the same one-line usage error.
        env = os.environ.get
        g = parser.add_argument_group("engine (each also read from KVFERRY_<NAME>)")
        g.add_argument(
            "--model",
            default=env("KVFERRY_MODEL"),
            help="Hugging Face folder or .gguf file; default: embedded SmolLM2-135M-Instruct",
        )
        g.add_argument("--device", default=env("KVFERRY_DEVICE", "auto"), help="auto, cpu, cuda or cuda:N")
        g.add_argument(
            "--dtype", default=env("KVFERRY_DTYPE", "auto"), choices=["auto", "float32", "bfloat16", "float16"]
        )
        g.add_argument("--block-size", type=int, default=env("KVFERRY_BLOCK_SIZE", "16"), help="8, 16 or 32")
        g.add_argument(
            "--kv-cache-memory",
            type=parse_size,
            default=env("KVFERRY_KV_CACHE_MEMORY", "1GiB"),
            help="memory budget of the paged KV cache, e.g. 512MiB",
        )
        g.add_argument("--max-num-seqs", type=int, default=env("KVFERRY_MAX_NUM_SEQS", "128"))
        g.add_argument("--max-num-batched-tokens", type=int, default=env("KVFERRY_MAX_NUM_BATCHED_TOKENS", "2048"))
        g.add_argument("--max-model-len", type=int, default=env("KVFERRY_MAX_MODEL_LEN"))
        g.add_argument("--num-threads", type=int, default=env("KVFERRY_NUM_THREADS"))
        g.add_argument(
            "--engine-seed",
            dest="seed",
            type=int,
            default=env("KVFERRY_SEED"),
            help="seed of the shared generator used by requests without a seed",
        )
        g.add_argument(
            "--no-prefix-caching",
            dest="enable_prefix_caching",
            action="store_false",
            default=env("KVFERRY_NO_PREFIX_CACHING", "").lower() not in ("1", "true", "yes"),
            help="compute every prompt in full instead of reusing cached KV blocks of its prefix",
        )
        g.add_argument(
            "--no-chunked-prefill",
            dest="enable_chunked_prefill",
            action="store_false",
            default=env("KVFERRY_NO_CHUNKED_PREFILL", "").lower() not in ("1", "true", "yes"),
            help="compute each prompt in one step, however long, instead of in chunks beside other prompts",
        )
        g.add_argument(
            "--long-prefill-threshold",
            type=int,
            default=env("KVFERRY_LONG_PREFILL_THRESHOLD", "512"),
            help="with chunked prefill, the most tokens of one prompt in a step; the rest of the step's "
            "budget goes to the prompts behind it (0: no cap)",
        )

        g.add_argument(
            "--quantization",
            default=env("KVFERRY_QUANTIZATION", "none"),
            choices=["none", "int8"],
            help="int8: every linear layer's weights in int8 with one scale per output channel (a tied "
            "lm_head gets its own int8 copy; the embedding stays in float); slightly less accurate: "
            "`kvferry bench quantization` measures it",
        )

        g.add_argument(
            "--enforce-eager",
            action="store_true",
            default=env("KVFERRY_ENFORCE_EAGER", "").lower() in ("1", "true", "yes"),
            help="on CUDA, run every decode step eagerly instead of replaying captured CUDA graphs "
            "(saves their capture time and memory; the CPU never uses them)",
        )

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> "EngineConfig":
        return cls(**{f.name: getattr(args, f.name) for f in fields(cls)})

"""The engine's settings (EngineConfig), each declared once as a field: its default, bounds and help. From them come
the flags and KVFERRY_* variables of the commands that run an engine (settings.py walks this class)."""

import argparse

from kvferry.common.setting import (
    COMMANDS,
    ENGINE,
    GATEWAY,
    SERVE,
    SIZE,
    check_settings,
    from_args,
    setting,
    settings_class,
)

# `kvferry serve` takes them too, and hands them to its workers (and the gateway those it takes), but for
# num_threads: serve gives each worker its own (--prefill-threads, --decode-threads).
_ENGINE_AND_SERVE = (*ENGINE, SERVE)
_AND_GATEWAY = (*_ENGINE_AND_SERVE, GATEWAY)


@settings_class(_ENGINE_AND_SERVE, "model and engine")
class EngineConfig:
    model: str | None = setting(
        None,
        "Hugging Face folder or .gguf file; default: the embedded SmolLM2-135M-Instruct",
        commands=COMMANDS,
    )
    device: str = setting("auto", "auto (cuda when present, else cpu), cpu, cuda or cuda:N")
    dtype: str = setting(
        "auto",
        "the weights' type (and the KV cache's, unless --kv-cache-dtype says); auto: float32 on the CPU, bfloat16 on "
        "CUDA",
        choices=("auto", "float32", "bfloat16", "float16"),
    )
    # None ("none"): weights in dtype; "int8": see model/int8_linear.py; "int4": model/int4_linear.py
    quantization: str | None = setting(
        "none",
        "int8: every linear layer's weights in int8 with one scale per output channel (a tied lm_head gets its "
        "own int8 copy; the embedding stays in float); slightly less accurate. int4: GGUF's Q4_1 numbers (groups "
        "of 32 weights, each with a half-precision scale and minimum; the lm_head stays int8), on the CPU; a Q4_0 "
        "or Q4_1 GGUF file's weights load as they are; less accurate again on a full-precision checkpoint. `kvferry bench quantization` measures both. `kvferry "
        "serve` gives it to both workers",
        choices=("int8", "int4", "none"),
    )
    block_size: int = setting(
        16,
        "tokens per KV cache block; the gateway and every worker must have the same",
        choices=(8, 16, 32),
        commands=_AND_GATEWAY,
    )
    kv_cache_memory: int | None = setting(
        None,
        "memory budget of the paged KV cache, e.g. 512MiB; default: sized from the machine's memory "
        "(--memory-utilization), under `kvferry serve` for all its workers together",
        kind=SIZE,
        min=1,
    )
    memory_utilization: float = setting(
        0.9,
        "the share of memory a worker's weights and default-sized KV cache may take: on the CPU of what the "
        "machine has available at start (under `kvferry serve`, for all its workers together), on CUDA of the "
        "GPU's whole memory",
        above=0,
        max=1,
    )
    kv_cache_dtype: str = setting(
        "auto",
        "the KV cache's element type; auto: float16 on the CPU for a float32 model (bfloat16 where the CPU cannot "
        "convert float16: no F16C), else the model's dtype. float32 keeps the CPU's token-exact path; on CUDA only "
        "the model's dtype is served",
        choices=("auto", "float32", "bfloat16", "float16"),
    )
    max_num_seqs: int = setting(128, "the most sequences in one step", min=1)
    max_num_batched_tokens: int = setting(2048, "the most tokens one step computes", min=1)
    max_model_len: int | None = setting(
        None,
        "the longest prompt plus output a request may have; default: the model's own limit",
        min=2,
        commands=_AND_GATEWAY,
    )
    num_threads: int | None = setting(
        None, "torch CPU threads of this process; default: torch's own choice", min=1, commands=ENGINE
    )
    seed: int | None = setting(
        None, "seed of the shared generator used by requests without a seed", flag="--engine-seed"
    )
    enable_prefix_caching: bool = setting(
        True,
        "compute every prompt in full instead of reusing cached KV blocks of its prefix",
        off="no_prefix_caching",
    )
    kv_huge_pages: bool = setting(  # model/cpu_memory.py
        True,
        "on the CPU, back the KV cache with ordinary pages instead of asking Linux for transparent huge pages (huge "
        "pages spare decode attention TLB misses, but the first touch can take a second or more per GiB while the "
        "kernel compacts memory, at every start)",
        off="no_kv_huge_pages",
    )
    enable_chunked_prefill: bool = setting(
        True,
        "compute each prompt in one step, however long, instead of in chunks beside other prompts",
        off="no_chunked_prefill",
    )
    long_prefill_threshold: int = setting(
        512,
        "with chunked prefill, the most tokens of one prompt in a step; the rest of the step's budget goes to "
        "the prompts behind it (0: no cap)",
        min=0,
    )
    enforce_eager: bool = setting(  # model/decode_graphs.py
        False,
        "on CUDA, run every decode step eagerly instead of replaying captured CUDA graphs (saves their capture "
        "time and memory; the CPU never uses them)",
    )

    def __post_init__(self):
        if self.quantization in (None, ""):
            self.quantization = "none"
        check_settings(self)  # a ConfigError naming the setting
        if self.quantization == "none":
            self.quantization = None

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> "EngineConfig":
        return from_args(cls, args)

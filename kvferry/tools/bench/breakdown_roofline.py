"""`--measure breakdown`'s rooflines: the least time each part of a step could take at this machine's GEMM rate and
read bandwidth, measured in the same run with roofline_measure.py's tools.

A GEMM's is the larger of its FLOPs at the rate the model's path reaches at its shape and its bytes at the bandwidth;
an elementwise part's, its bytes moved once (what a fused kernel could reach); attention's, the larger of its FLOPs
at the best GEMM rate measured and its K/V bytes.
"""

from dataclasses import dataclass, field

import torch
from torch import nn

from kvferry.common.model.cpu_linear import PackedLinear
from kvferry.tools.bench.roofline_measure import best_seconds, gemm_path

GEMM_PARTS = {  # the model's module name (its last component) -> the part
    "qkv_proj": "QKV GEMM",
    "o_proj": "O GEMM",
    "gate_up_proj": "gate/up GEMM",
    "down_proj": "down GEMM",
    "lm_head": "lm_head GEMM",
}


@dataclass
class Machine:
    read_bytes_per_s: float
    dtype: torch.dtype
    quantization: str | None = None  # int8, int4: the GEMM rates are that path's
    gemm_flops_per_s: dict = field(default_factory=dict)  # (rows, in, out) -> FLOP/s
    budget_s: float = 0.1  # the time each GEMM shape is given

    @torch.inference_mode()
    def gemm_rate(self, rows: int, in_features: int, out_features: int) -> float:
        """FLOP/s of a GEMM of this shape through the model's path (roofline_measure.gemm_path)."""
        shape = (rows, in_features, out_features)
        if shape not in self.gemm_flops_per_s:
            gemm = gemm_path(torch.device("cpu"), self.dtype, in_features, out_features, self.quantization)
            if isinstance(gemm, str):  # no packed path for this dtype: the model runs plain nn.Linear
                gemm = nn.Linear(in_features, out_features, bias=False, dtype=self.dtype)
            x = torch.randn(rows, in_features, dtype=self.dtype)
            seconds = best_seconds(lambda: gemm(x), trials=2, min_s=self.budget_s / 2)
            self.gemm_flops_per_s[shape] = 2 * rows * in_features * out_features / seconds
        return self.gemm_flops_per_s[shape]

    def gemm_s(self, rows: int, in_features: int, out_features: int, weight_bytes: int, act_bytes: int) -> float:
        flops_s = 2 * rows * in_features * out_features / self.gemm_rate(rows, in_features, out_features)
        moved = weight_bytes + rows * (in_features + out_features) * act_bytes
        return max(flops_s, moved / self.read_bytes_per_s)

    def peak_flops_per_s(self) -> float:
        return max(self.gemm_flops_per_s.values())


def weight_bytes(module: nn.Module, dtype_bytes: int) -> int:
    """What the module's weights take where they are read from: int8 layers hold fewer bytes than fp32 ones; a
    oneDNN-packed weight is opaque, so it counts at the model's dtype."""
    if isinstance(module, PackedLinear):
        return module.in_features * module.out_features * dtype_bytes
    return sum(t.numel() * t.element_size() for t in (*module.parameters(), *module.buffers()) if t is not None)


def gemm_layers(model: nn.Module) -> list[tuple[str, nn.Module]]:
    return [
        (GEMM_PARTS[name.rsplit(".", 1)[-1]], m)
        for name, m in model.named_modules()
        if name.rsplit(".", 1)[-1] in GEMM_PARTS
    ]


def rooflines(model, machine: Machine, tokens: int, sampled: int, attended: int, context_tokens: int) -> dict:
    """Seconds per part at the roofline for a step of `tokens` new tokens, `sampled` rows through the lm_head,
    `attended` (query, key) pairs and `context_tokens` tokens of K/V read per layer."""
    config = model.config
    e = torch.empty((), dtype=machine.dtype).element_size()
    hidden, inter, layers = config.hidden_size, config.intermediate_size, config.num_hidden_layers
    heads, kv_heads, d = config.num_attention_heads, config.num_key_value_heads, config.head_dim
    bw = machine.read_bytes_per_s
    out = dict.fromkeys(GEMM_PARTS.values(), 0.0)
    for part, m in gemm_layers(model):
        rows = sampled if part == "lm_head GEMM" else tokens
        out[part] += machine.gemm_s(rows, m.in_features, m.out_features, weight_bytes(m, e), e)
    qk_norm_bytes = 2 * tokens * (heads + kv_heads) * d * e if config.model_type == "qwen3" else 0
    kv_bytes = (context_tokens + tokens) * 2 * kv_heads * d * e  # read once, this step's written once
    out["attention"] = layers * max(
        4 * attended * heads * d / machine.peak_flops_per_s(), (kv_bytes + 2 * tokens * heads * d * e) / bw
    )
    # The first layer's input norm reads x and writes its output; every later norm, the final one included, also
    # reads the residual stream and writes the sum back: one pass over four rows of hidden.
    out["norms, residual adds"] = ((2 + 2 * layers * 4) * tokens * hidden * e + layers * qk_norm_bytes) / bw
    out["RoPE"] = layers * 2 * tokens * ((heads + kv_heads) * d + d) * e / bw  # q and k in and out, cos and sin
    out["SiLU·mul"] = layers * 3 * tokens * inter * e / bw  # gate and up in, their product out
    out["embedding, RoPE tables"] = (2 * tokens * hidden + 4 * tokens * d) * e / bw
    out["sampling"] = sampled * config.vocab_size * 4 / bw  # the fp32 logits read once
    return out

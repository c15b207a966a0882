"""The Llama family (Llama, Mistral, Qwen2, Qwen3) on a flat token batch ([num_tokens, hidden]); attention goes
through the batch's `attend`, over the paged KV cache. q/k/v and gate/up are fused: fewer, larger GEMMs run faster.
"""

import contextlib

import torch
import torch.nn.functional as F
from torch import nn

from kvferry.common.errors import ModelLoadError
from kvferry.kernels.cpu import layer_ops

STATIC_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """norm(x); with a residual, (norm(x + residual), x + residual): a skip connection's add and the next
        norm as one op, as vLLM has them (the sum may be written into residual in place)."""
        if x.dim() == 2 and layer_ops.handles(x, self.weight, *([] if residual is None else [residual])):
            out, summed = layer_ops.add_rms_norm(x, residual, self.weight, self.eps)
            return out if residual is None else (out, summed)
        if residual is None:
            return self._norm(x)
        summed = x + residual
        return self._norm(summed), summed

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32:  # one fused kernel; the same maths as below
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


@contextlib.contextmanager
def default_dtype(dtype: torch.dtype):
    """Tensors made without a dtype (a layer's parameters) get this one: a model built inside is in it at once."""
    saved = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(saved)


def rope_cos_sin(config, max_positions: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin for every position, [max_positions, head_dim], computed as transformers does: in fp32 on the
    CPU, whatever device and dtype the model is built in."""
    rope = config.rope_parameters
    rope_type = rope["rope_type"]
    if rope_type not in STATIC_ROPE_TYPES:
        raise ModelLoadError(f"RoPE type {rope_type!r} is not supported; supported: {', '.join(STATIC_ROPE_TYPES)}")
    with torch.device("cpu"), default_dtype(torch.float32):
        if rope_type == "default":
            head_dim = config.head_dim
            inv_freq = 1.0 / (rope["rope_theta"] ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim))
            scaling = 1.0
        else:  # transformers' own init, on its own config object: the one place the model's build imports it
            from transformers import AutoConfig
            from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

            inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](AutoConfig.from_pretrained(config.path), "cpu")
        freqs = torch.arange(max_positions, dtype=torch.float)[:, None] * inv_freq[None, :]  # [P, head_dim / 2]
        emb = torch.cat((freqs, freqs), dim=-1)  # [P, head_dim]
        return emb.cos() * scaling, emb.sin() * scaling


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [num_tokens, heads, head_dim]; cos/sin [num_tokens, head_dim]. On the CPU in fp32, x is rotated in place."""
    if layer_ops.rope_handles(x, cos, sin):
        return layer_ops.rope_(x, cos, sin)
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]


class Attention(nn.Module):
    def __init__(self, config, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.scale = self.head_dim**-0.5
        # Qwen2 always biases q/k/v and never o; Llama and Qwen3 follow attention_bias for all four.
        qkv_bias = True if config.model_type == "qwen2" else config.attention_bias
        o_bias = False if config.model_type in ("qwen2", "mistral") else config.attention_bias
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.qkv_proj = nn.Linear(config.hidden_size, self.q_size + 2 * self.kv_size, bias=qkv_bias)
        self.o_proj = nn.Linear(self.q_size, config.hidden_size, bias=o_bias)
        self.qk_norm = config.model_type == "qwen3"
        if self.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)

    def forward(self, x, cos, sin, batch) -> torch.Tensor:
        num_tokens = x.shape[0]
        qkv = self.qkv_proj(x)
        v = qkv[:, self.q_size + self.kv_size :].view(num_tokens, self.num_kv_heads, self.head_dim)  # [T, kvh, d]
        if self.qk_norm:
            q = self.q_norm(qkv[:, : self.q_size].reshape(num_tokens, self.num_heads, self.head_dim))
            k = self.k_norm(qkv[:, self.q_size : self.q_size + self.kv_size].reshape(num_tokens, self.num_kv_heads, -1))
            qk = torch.cat((q, k), dim=1)
        else:
            qk = qkv[:, : self.q_size + self.kv_size].view(num_tokens, self.num_heads + self.num_kv_heads, -1)
        # q and k sit side by side in the fused output: one RoPE pass rotates both.
        qk = apply_rope(qk, cos, sin)  # [T, H + kvh, d]
        q, k = qk[:, : self.num_heads], qk[:, self.num_heads :]  # [T, H, d], [T, kvh, d]
        out = batch.attend(self.layer_idx, q, k, v, self.scale)  # [T, H, d]
        return self.o_proj(out.reshape(num_tokens, self.q_size))


class MLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        if config.hidden_act != "silu":
            raise ModelLoadError(f"activation {config.hidden_act!r} is not supported (only silu)")
        bias = config.mlp_bias
        self.intermediate_size = config.intermediate_size
        self.gate_up_proj = nn.Linear(config.hidden_size, 2 * config.intermediate_size, bias=bias)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        if layer_ops.handles(gate_up):
            return self.down_proj(layer_ops.silu_mul(gate_up))
        gate, up = gate_up.split(self.intermediate_size, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, config, layer_idx: int):
        super().__init__()
        self.self_attn = Attention(config, layer_idx)
        self.mlp = MLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, x, residual, cos, sin, batch) -> tuple[torch.Tensor, torch.Tensor]:
        """x: the previous layer's output; residual: the sum of the outputs before it (None at the first layer).
        -> (this layer's MLP output, the residual stream so far): the skip connections' adds happen in the norms."""
        if residual is None:
            h, residual = self.input_layernorm(x), x
        else:
            h, residual = self.input_layernorm(x, residual)
        h, residual = self.post_attention_layernorm(self.self_attn(h, cos, sin, batch), residual)
        return self.mlp(h), residual


class LlamaModel(nn.Module):
    def __init__(self, config, max_positions: int):
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.fused_decode = None  # the runner's one-call decode loop (fused_decode.py), where it applies
        cos, sin = rope_cos_sin(config, max_positions)
        to = dict(device=self.embed_tokens.weight.device, dtype=self.embed_tokens.weight.dtype)  # the model's
        self.register_buffer("rope_cos", cos.to(**to), persistent=False)  # [max_positions, head_dim]
        self.register_buffer("rope_sin", sin.to(**to), persistent=False)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, batch, after_layer=None) -> torch.Tensor:
        """input_ids, positions [num_tokens] -> final hidden states [num_tokens, hidden]. after_layer(i), when
        given, runs once layer i has stored its K/V: a prefill worker ships finished layers while the rest compute."""
        x, residual = self.embed_tokens(input_ids), None
        cos, sin = self.rope_cos[positions], self.rope_sin[positions]  # [T, head_dim]
        if after_layer is None and self.fused_decode is not None and self.fused_decode.takes(x, batch):
            x, residual = self.fused_decode.run(x, cos, sin, batch)
        else:
            for i, layer in enumerate(self.layers):
                x, residual = layer(x, residual, cos, sin, batch)
                if after_layer is not None:
                    after_layer(i)
        return self.norm(x) if residual is None else self.norm(x, residual)[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)  # [N, vocab]

    def load_hf_state_dict(self, weights, complete: bool = True) -> set[str]:
        """Load transformers-named weights, (name, tensor) pairs, fusing q/k/v and gate/up on the way: each fused
        weight as soon as its parts are in, so that no more than one layer's parts are held at a time. Returns the
        names loaded; complete False: a part of the checkpoint (one layer's), so none missing is an error."""
        own = self.state_dict()
        loaded = set()

        def put(name, tensor):
            if name not in own:
                raise ModelLoadError(f"unexpected weight {name}")
            if own[name].shape != tensor.shape:
                raise ModelLoadError(f"weight {name}: shape {tuple(tensor.shape)}, expected {tuple(own[name].shape)}")
            own[name].copy_(tensor)
            loaded.add(name)

        fused, tied = {}, self.config.tie_word_embeddings
        for name, tensor in weights:
            # Older checkpoints saved inv_freq (the tables are recomputed); a tied lm_head is the embedding.
            if name.endswith("rotary_emb.inv_freq") or (tied and name.startswith("lm_head.")):
                continue
            for part, (target, index) in FUSED_PARTS.items():
                if f".{part}." in name:
                    whole = name.replace(part, target)
                    pieces = fused.setdefault(whole, {})
                    pieces[index] = tensor
                    if len(pieces) == (3 if "qkv_proj" in whole else 2):
                        put(whole.removeprefix("model."), torch.cat([pieces[i] for i in sorted(pieces)], dim=0))
                        del fused[whole]
                    break
            else:
                put(name.removeprefix("model."), tensor)
        if fused:
            raise ModelLoadError(f"incomplete fused weight {next(iter(fused))}")
        if tied:
            loaded.add("lm_head.weight")
        absent = set(own) - loaded
        if absent and complete:
            raise ModelLoadError(f"weights missing from the checkpoint: {', '.join(sorted(absent)[:5])}")
        return loaded


FUSED_PARTS = {  # transformers name -> (our fused name, position in the fused matrix)
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}

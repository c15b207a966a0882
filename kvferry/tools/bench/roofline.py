"""The roofline of a workload: the least time the hardware allows, from measured limits (roofline_measure.py) and
the model's shape, in the floor's schedule (floor.py). Each step takes the larger of its FLOPs at the GEMM rate of its
row count and its bytes (every weight once, plus the KV it attends to) at the read bandwidth.
"""

from dataclasses import dataclass

import numpy as np

from kvferry.tools.bench.floor import PREFILL_CHUNK


@dataclass(frozen=True)
class ModelShape:
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    bytes_per_param: int  # the activations' and the KV cache's dtype; the weights' too unless weight_bytes_per_param
    weight_bytes_per_param: float | None = None  # int8: 1; int4: 5 / 8
    bytes_per_output: int = 0  # read per output channel beside the weights: int8's scale and float outlier columns

    @classmethod
    def from_config(
        cls, config: dict, bytes_per_param: int, weight_bytes_per_param: float | None = None, bytes_per_output: int = 0
    ) -> "ModelShape":
        """config: read_config's dict (a Llama-like decoder; norms and biases are too small to count)."""
        heads = config["num_attention_heads"]
        return cls(
            hidden=config["hidden_size"],
            intermediate=config["intermediate_size"],
            layers=config["num_hidden_layers"],
            heads=heads,
            kv_heads=config.get("num_key_value_heads") or heads,
            head_dim=config.get("head_dim") or config["hidden_size"] // heads,
            vocab=config["vocab_size"],
            bytes_per_param=bytes_per_param,
            weight_bytes_per_param=weight_bytes_per_param,
            bytes_per_output=bytes_per_output,
        )

    def family_params(self) -> dict[str, int]:
        """Weights of each GEMM family, all layers together; lm_head once (tied or not, a step reads it)."""
        q, kv = self.heads * self.head_dim, self.kv_heads * self.head_dim
        return {
            "qkv": self.layers * self.hidden * (q + 2 * kv),
            "o": self.layers * q * self.hidden,
            "gate_up": self.layers * 2 * self.hidden * self.intermediate,
            "down": self.layers * self.intermediate * self.hidden,
            "lm_head": self.hidden * self.vocab,
        }

    def output_channels(self) -> int:
        """Output channels of every GEMM, all layers and the lm_head together."""
        q, kv = self.heads * self.head_dim, self.kv_heads * self.head_dim
        return self.layers * (q + 2 * kv + self.hidden + 2 * self.intermediate + self.hidden) + self.vocab

    def layer_flops_per_token(self) -> int:
        params = self.family_params()
        return 2 * (sum(params.values()) - params["lm_head"])

    def lm_head_flops_per_token(self) -> int:
        return 2 * self.hidden * self.vocab

    def weight_bytes(self) -> int:
        per_param = self.weight_bytes_per_param or self.bytes_per_param
        return sum(self.family_params().values()) * per_param + self.output_channels() * self.bytes_per_output

    def attention_flops_per_pair(self) -> int:
        """One query token against one context token, all layers: q·k and p·v, 2 FLOPs a multiply-add each."""
        return 4 * self.layers * self.heads * self.head_dim

    def kv_bytes_per_token(self) -> int:
        return 2 * self.layers * self.kv_heads * self.head_dim * self.bytes_per_param


@dataclass(frozen=True)
class Step:
    prefill: bool
    rows: int  # tokens through the layers' GEMMs
    lm_head_rows: int  # tokens whose logits are computed
    attention_pairs: int  # (query, context token) pairs
    kv_tokens_read: int  # context tokens whose K and V the step reads


def schedule(requests: list[dict], chunk: int = PREFILL_CHUNK) -> list[Step]:
    """The floor's schedule as steps. A prompt's last token gets its logits (the first output token); prefill
    attention is causal within each prompt."""
    steps: list[Step] = []
    rows = lm_rows = pairs = kv_read = 0
    for r in requests:
        length = len(r["prompt_token_ids"])
        done = 0
        while done < length:
            take = min(length - done, chunk - rows)
            end = done + take
            rows += take
            pairs += end * (end + 1) // 2 - done * (done + 1) // 2  # positions done+1..end attend that many each
            kv_read += end
            lm_rows += end == length
            done = end
            if rows == chunk:
                steps.append(Step(True, rows, lm_rows, pairs, kv_read))
                rows = lm_rows = pairs = kv_read = 0
    if rows:
        steps.append(Step(True, rows, lm_rows, pairs, kv_read))
    longest = max(r["max_tokens"] for r in requests)
    for step in range(1, longest):  # output token 1 came from prefill
        contexts = [len(r["prompt_token_ids"]) + step for r in requests if r["max_tokens"] > step]
        steps.append(Step(False, len(contexts), len(contexts), sum(contexts), sum(contexts)))
    return steps


def gemm_rate(rates: dict[int, float], rows: int) -> float:
    """FLOP/s at a row count, interpolated between the measured ones (held flat beyond them)."""
    sizes = sorted(rates)
    return float(np.interp(rows, sizes, [rates[s] for s in sizes]))


def roofline(
    shape: ModelShape,
    steps: list[Step],
    decode_rates: dict[int, float] | None,
    peak_rate: float | None,
    bandwidth: float | None,
) -> dict:
    """Rates in FLOP/s, bandwidth in bytes/s. A limit not measured (None) is left out, which makes the roofline a
    looser lower bound (the result says which); with neither, there is nothing to compute."""
    compute_known = bool(decode_rates) and peak_rate is not None
    if not compute_known and bandwidth is None:
        return {"cannot_compute": "neither the GEMM rate nor the read bandwidth was measured"}
    rates = dict(decode_rates or {})
    if compute_known:
        rates[PREFILL_CHUNK] = peak_rate  # decode batches past the measured sizes head towards the large shape's rate
    totals = {"prefill_s": 0.0, "decode_s": 0.0, "gemm_flops": 0, "attention_flops": 0, "bytes_read": 0}
    memory_bound_steps = 0
    for s in steps:
        gemm = s.rows * shape.layer_flops_per_token() + s.lm_head_rows * shape.lm_head_flops_per_token()
        attention = s.attention_pairs * shape.attention_flops_per_pair()
        read = shape.weight_bytes() + s.kv_tokens_read * shape.kv_bytes_per_token()
        compute_s = (gemm + attention) / (peak_rate if s.prefill else gemm_rate(rates, s.rows)) if compute_known else 0
        memory_s = read / bandwidth if bandwidth else 0.0
        memory_bound_steps += memory_s > compute_s
        totals["prefill_s" if s.prefill else "decode_s"] += max(compute_s, memory_s)
        totals["gemm_flops"] += gemm
        totals["attention_flops"] += attention
        totals["bytes_read"] += read
    total_s = totals["prefill_s"] + totals["decode_s"]
    output_tokens = sum(s.lm_head_rows for s in steps)
    if compute_known and bandwidth:
        bound = "compute and memory"
    else:
        bound = "read bandwidth only, a looser bound" if bandwidth else "GEMM rate only, a looser bound"
    return {
        **totals,
        "total_s": total_s,
        "output_tokens": output_tokens,
        "output_tok_per_s": output_tokens / total_s,
        "steps": len(steps),
        "memory_bound_steps": memory_bound_steps,
        "limits_used": bound,
    }

"""Which models and steps take the one-call decode loop (kernels/cpu/decode_layers.py), and its weights: a
Llama-family model in fp32 on the CPU whose linear layers are each an Int8Linear, an Int4Linear or a PackedLinear
in panels panel_matmul.c reads, without Qwen3's q/k norms, and a decode step of at most the loop's max_rows.
Anything else runs layer by layer, with the same result.
"""

import torch

from kvferry.common.model.attention import PagedBatch
from kvferry.common.model.cpu_linear import PackedLinear
from kvferry.common.model.int4_linear import Int4Linear
from kvferry.common.model.int8_linear import Int8Linear
from kvferry.kernels.cpu import decode_attention, decode_layers, int4_matmul, layer_ops, panel_matmul


def _weights(linear: Int8Linear | Int4Linear | PackedLinear):
    """The loop's view of one linear layer: Int8Weights, Int4Weights or PanelWeights."""
    if isinstance(linear, Int4Linear):
        return decode_layers.Int4Weights(
            linear.qweight, linear.scales, linear.mins, linear.outliers, linear.outlier_weight, linear.bias
        )
    if isinstance(linear, PackedLinear):
        shape = (linear.out_features, linear.in_features)
        return decode_layers.PanelWeights(linear.packed_weight, linear.panel_width, shape, linear.bias)
    return decode_layers.Int8Weights(
        linear.qweight, linear.qweight_sums, linear.scale, linear.outliers, linear.outlier_weight, linear.bias
    )


def _linears(layer) -> tuple:
    return layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj


def fits(linear) -> bool:
    """Whether the loop takes this linear layer: int8 or int4 on the CPU, or fp32 in panels the C product reads."""
    if isinstance(linear, Int8Linear):
        return linear.qweight.device.type == "cpu" and layer_ops.handles(linear.scale)
    if isinstance(linear, Int4Linear):
        return int4_matmul.handles(torch.empty(1, linear.in_features, dtype=torch.int8), linear.qweight)
    return (
        isinstance(linear, PackedLinear)
        and linear.panel_width is not None
        and panel_matmul.takes_width(linear.panel_width)
        and (linear.bias is None or layer_ops.handles(linear.bias))
    )


class FusedDecode:
    def __init__(self, model, k_caches: list[torch.Tensor], v_caches: list[torch.Tensor]):
        layers = [
            decode_layers.LayerWeights(
                layer.input_layernorm.weight.detach(),
                layer.post_attention_layernorm.weight.detach(),
                *map(_weights, _linears(layer)),
                k_cache,
                v_cache,
            )
            for layer, k_cache, v_cache in zip(model.layers, k_caches, v_caches)
        ]
        attention = model.layers[0].self_attn
        eps = model.layers[0].input_layernorm.eps
        self.loop = decode_layers.DecodeLayers(
            layers, attention.num_heads, attention.num_kv_heads, eps, attention.scale
        )

    @classmethod
    def for_model(cls, model, k_caches: list[torch.Tensor], v_caches: list[torch.Tensor]) -> "FusedDecode | None":
        """The loop for this model and these caches, or None where it does not apply."""
        if not model.layers:
            return None
        norms = [n for layer in model.layers for n in (layer.input_layernorm, layer.post_attention_layernorm)]
        linears = [linear for layer in model.layers for linear in _linears(layer)]
        int8 = any(isinstance(linear, Int8Linear) for linear in linears)
        int4 = any(isinstance(linear, Int4Linear) for linear in linears)
        fp32 = any(isinstance(linear, PackedLinear) for linear in linears)
        takes_model = (
            decode_layers.available(int8, fp32, int4)
            and all(fits(linear) for linear in linears)
            and not any(layer.self_attn.qk_norm for layer in model.layers)
            and len({n.eps for n in norms}) == 1
            and layer_ops.handles(*(n.weight for n in norms))
            and all(decode_attention.handles(torch.empty(0), k, v) for k, v in zip(k_caches, v_caches))
        )
        return cls(model, k_caches, v_caches) if takes_model else None

    def takes(self, x: torch.Tensor, batch) -> bool:
        """Whether this step runs here: a decode step of fp32 rows, as many as the loop takes, laid out as usual."""
        return (
            isinstance(batch, PagedBatch)  # the loop reads the paged cache; a benchmark's other batches do not have one
            and not batch.is_prefill
            and 1 <= x.shape[0] <= self.loop.max_rows
            and self.loop.available()
            and layer_ops.handles(x)
            and batch.block_tables.dtype == batch.context_lens.dtype == torch.int32
            and batch.block_tables.is_contiguous()
            and batch.context_lens.is_contiguous()
            and batch.slot_mapping.dtype == torch.int64
            and batch.slot_mapping.is_contiguous()
        )

    def run(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, batch) -> tuple[torch.Tensor, torch.Tensor]:
        """-> (the last layer's output, the residual stream), as LlamaModel's loop over its layers returns them."""
        return self.loop.run(
            x, cos.contiguous(), sin.contiguous(), batch.slot_mapping, batch.block_tables, batch.context_lens
        )

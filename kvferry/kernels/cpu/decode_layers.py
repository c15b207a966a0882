"""Every decoder layer of a decode step on the CPU, int8, int4 or fp32 weights, in one call to decode_layers.c: at a few
rows a step's hundreds of calls from Python cost about as much as their work (docs/benchmarks.md). It runs the same C
functions in the same order, so the output is bit for bit the layer-by-layer path's, and it takes as many rows as
the layers' own C products do. common/model/fused_decode.py says which models and batches it takes.
"""

import ctypes
from dataclasses import dataclass
from pathlib import Path

import torch

from kvferry.kernels.cpu import build, decode_attention, int4_matmul, layer_ops, panel_matmul, small_matmul

SOURCE = Path(__file__).with_suffix(".c")
# Rows that every loop takes; past them, as many as its products take (DecodeLayers.max_rows)
MAX_ROWS = min(small_matmul.MAX_ROWS, panel_matmul.MAX_ROWS)
ANY_ROWS = 2**31 - 1  # the C loop's row count is an int
_p, _i, _i64, _f = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64, ctypes.c_float


class _Weights(ctypes.Structure):
    _pointers = ("qweight", "group_scales", "group_mins", "sums", "scale", "outliers", "outlier_rows", "bias", "panels")
    _fields_ = [(name, _p) for name in _pointers]
    _fields_ += [("n", _i), ("k", _i), ("count", _i), ("width", _i), ("interleaved", _i)]


class _Layer(ctypes.Structure):
    _fields_ = [("input_norm", _p), ("post_norm", _p)]
    _fields_ += [(name, _Weights) for name in ("qkv", "o", "gate_up", "down")]
    _fields_ += [("k_cache", _p), ("v_cache", _p)]


class _Kernels(ctypes.Structure):
    _fields_ = [
        (name, _p)
        for name in (
            "add_rms_norm",
            "rope",
            "silu_mul",
            "quantize_rows",
            "matmul_i8",
            "matmul_i4",
            "matmul_f32",
            "attention",
        )  # fmt: skip
    ]


class _Shape(ctypes.Structure):
    _fields_ = [(name, _i) for name in ("num_layers", "hidden", "num_heads", "num_kv_heads", "head_dim")]
    _fields_ += [("intermediate", _i), ("block_size", _i), ("eps", _f), ("attention_scale", _f)]
    _fields_ += [(name, _i64) for name in ("block_stride", "token_stride", "head_stride")]


class _Scratch(ctypes.Structure):
    _fields_ = [
        (name, _p)
        for name in (
            "normed", "qkv", "query", "attended", "projected", "gate_up", "activated", "row_scale",
            "outlier_values", "quantized",
        )
    ]  # fmt: skip


SIGNATURES = {"kvferry_decode_layers": ([_p] * 6 + [_i] + [_p] * 4 + [_i64, _p, _i], ctypes.c_int)}
_lib = build.Library(SOURCE, SIGNATURES, "one call per op for CPU decode layers")
enable, disable = _lib.enable, _lib.disable


def available(int8: bool, fp32: bool, int4: bool = False) -> bool:
    """Whether this loop and every function it calls for int8, int4 and/or fp32 weights are loaded."""
    uses = ((small_matmul._lib, int8), (int4_matmul._lib, int4), (panel_matmul._lib, fp32))
    products = [lib for lib, used in uses if used]
    return all(lib.loaded is not None for lib in (_lib, layer_ops._lib, decode_attention._lib, *products))


def _address(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


@dataclass
class Int8Weights:
    """An Int8Linear's buffers (see there), all contiguous on the CPU."""

    qweight: torch.Tensor
    sums: torch.Tensor
    scale: torch.Tensor
    outliers: torch.Tensor | None
    outlier_rows: torch.Tensor | None
    bias: torch.Tensor | None

    @property
    def shape(self) -> tuple[int, int]:
        return small_matmul.shape_of(self.qweight)

    def as_struct(self) -> _Weights:
        n, k = self.shape
        count = 0 if self.outliers is None else len(self.outliers)
        tensors = (self.qweight, self.sums, self.scale, self.outliers, self.outlier_rows, self.bias)
        interleaved = int(small_matmul.is_interleaved(self.qweight))
        return _Weights(
            _address(self.qweight), None, None, *map(_address, tensors[1:]), None, n, k, count, 0, interleaved
        )


@dataclass
class Int4Weights:
    """An Int4Linear's buffers (see there), all contiguous on the CPU."""

    qweight: torch.Tensor  # [n, k / 2] uint8
    scales: torch.Tensor  # [n, k / 32] fp16
    mins: torch.Tensor  # [n, k / 32] fp16
    outliers: torch.Tensor | None
    outlier_rows: torch.Tensor | None  # [count, n] fp16, plain
    bias: torch.Tensor | None

    @property
    def shape(self) -> tuple[int, int]:
        return self.qweight.shape[0], 2 * self.qweight.shape[1]

    def as_struct(self) -> _Weights:
        n, k = self.shape
        count = 0 if self.outliers is None else len(self.outliers)
        tensors = (self.qweight, self.scales, self.mins, None, None, self.outliers, self.outlier_rows, self.bias)
        return _Weights(*map(_address, tensors), None, n, k, count, 0, 0)


@dataclass
class PanelWeights:
    """A PackedLinear's: oneDNN's packed weight, in panels [ceil(n / width)][k][width] fp32, and the bias or None."""

    packed: torch.Tensor
    width: int
    shape: tuple[int, int]  # (n, k)
    bias: torch.Tensor | None

    def as_struct(self) -> _Weights:
        panels = torch.ops.mkldnn.data_ptr(self.packed)
        return _Weights(*[None] * 7, _address(self.bias), panels, *self.shape, 0, self.width, 0)


@dataclass
class LayerWeights:
    input_norm: torch.Tensor  # [hidden] fp32
    post_norm: torch.Tensor
    qkv: Int8Weights | Int4Weights | PanelWeights
    o: Int8Weights | Int4Weights | PanelWeights
    gate_up: Int8Weights | Int4Weights | PanelWeights
    down: Int8Weights | Int4Weights | PanelWeights
    k_cache: torch.Tensor  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor  # the same shape and strides

    def linears(self) -> tuple[Int8Weights | Int4Weights | PanelWeights, ...]:
        return self.qkv, self.o, self.gate_up, self.down


class DecodeLayers:
    """The loop's arguments built once (addresses, shapes; scratch that grows with the batch), then one call a step.
    The tensors must stay in place (a moved model needs a new loop); this holds them alive."""

    def __init__(self, layers: list[LayerWeights], num_heads: int, num_kv_heads: int, eps: float, scale: float):
        self.layers = layers
        first = layers[0]
        hidden = first.input_norm.shape[0]
        head_dim = first.k_cache.shape[-1]
        intermediate = first.down.shape[1]
        cache = first.k_cache
        self.shape = _Shape(
            len(layers), hidden, num_heads, num_kv_heads, head_dim, intermediate, cache.shape[1], eps, scale,
            cache.stride(0), cache.stride(1), cache.stride(2),
        )  # fmt: skip
        structs = [
            _Layer(
                layer.input_norm.data_ptr(), layer.post_norm.data_ptr(),
                *(w.as_struct() for w in layer.linears()),
                layer.k_cache.data_ptr(), layer.v_cache.data_ptr(),
            )
            for layer in layers
        ]  # fmt: skip
        self.structs = (_Layer * len(structs))(*structs)
        linears = [w for layer in layers for w in layer.linears()]
        int8_linears = [w for w in linears if isinstance(w, Int8Weights)]
        quantized = [w for w in linears if not isinstance(w, PanelWeights)]
        self.int8, self.fp32 = bool(int8_linears), len(quantized) < len(linears)  # the products the loop calls
        self.int4 = len(int8_linears) < len(quantized)
        functions = (
            layer_ops._lib.kvferry_add_rms_norm_f32,
            layer_ops._lib.kvferry_rope_f32,
            layer_ops._lib.kvferry_silu_mul_f32,
            layer_ops._lib.kvferry_quantize_rows_f32,
            small_matmul._lib.kvferry_matmul_i8 if self.int8 else None,  # a library not loaded: its kind is not here
            int4_matmul._lib.kvferry_matmul_i4 if self.int4 else None,
            panel_matmul._lib.kvferry_panel_matmul_f32 if self.fp32 else None,
            decode_attention.entry_point(decode_attention._lib, "kvferry_paged_decode_attention", cache.dtype),
        )
        self.kernels = _Kernels(*(None if f is None else ctypes.cast(f, _p).value for f in functions))
        outliers = max((len(w.outliers) for w in quantized if w.outliers is not None), default=0)
        q_size = num_heads * head_dim
        self.widths = {  # of the float scratch, per row
            "normed": hidden, "qkv": first.qkv.shape[0], "query": q_size, "attended": q_size,
            "projected": hidden, "gate_up": 2 * intermediate, "activated": intermediate, "row_scale": 1,
            "outlier_values": max(outliers, 1),
        }  # fmt: skip
        self.widest = max(w.shape[1] for w in linears)  # the int8 activations' row: the widest input
        self.hidden = hidden
        # As many rows as every product the loop calls takes in the layer path too
        int8_rows = ANY_ROWS if small_matmul.takes_every_row_count() else small_matmul.MAX_ROWS
        self.max_rows = min([int8_rows] * self.int8 + [ANY_ROWS] * self.int4 + [panel_matmul.max_rows()] * self.fp32)
        self.rows = 0  # of the scratch: it grows with the largest batch seen
        self._reserve(MAX_ROWS)

    def _reserve(self, rows: int) -> None:
        """Scratch for at least this many rows, doubled when it grows."""
        if rows <= self.rows:
            return
        self.rows = max(rows, 2 * self.rows)
        self.buffers = {name: torch.empty(self.rows, width) for name, width in self.widths.items()}
        self.buffers["quantized"] = torch.empty(self.rows, self.widest, dtype=torch.int8)
        self.residual = torch.empty(self.rows, self.hidden)
        self.scratch = _Scratch(**{name: t.data_ptr() for name, t in self.buffers.items()})

    def available(self) -> bool:
        """Whether the loop and every function it calls are still loaded (a test or benchmark may switch one off)."""
        return available(self.int8, self.fp32, self.int4)

    def run(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        slots: torch.Tensor,
        block_tables: torch.Tensor,
        context_lens: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """x [rows, hidden] (the embeddings, overwritten), cos and sin [rows, head_dim], slots [rows] int64,
        block_tables [rows, width] and context_lens [rows] int32, all contiguous -> (the last layer's output, which
        is x, and the residual stream), as the layers' own loop returns them."""
        rows = x.shape[0]
        self._reserve(rows)
        residual = self.residual[:rows]
        failed = _lib.kvferry_decode_layers(
            ctypes.byref(self.kernels), ctypes.byref(self.shape), self.structs, ctypes.byref(self.scratch),
            x.data_ptr(), residual.data_ptr(), rows, cos.data_ptr(), sin.data_ptr(), slots.data_ptr(),
            block_tables.data_ptr(), block_tables.stride(0), context_lens.data_ptr(), torch.get_num_threads(),
        )  # fmt: skip
        if failed:
            raise MemoryError("CPU decode layers: no memory for attention's scores or a product's scratch")
        return x, residual

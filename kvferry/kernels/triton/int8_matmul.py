"""Triton: weight-only int8 matmul, y = x @ (w_int8 * scale).T (+ bias).

The int8 tile is widened to x's dtype in registers and the per-output-channel scale is
applied once to the fp32 accumulator: the weights cross memory as int8, a quarter of the
fp32 bytes and half of bf16's, which is what bounds decode at small batch.
"""

import torch
import triton
import triton.language as tl

from kvferry.kernels.triton.launch_config import dot_precision


@triton.jit
def _int8_matmul_kernel(
    x_ptr,
    w_ptr,
    scale_ptr,
    bias_ptr,
    y_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_wn,
    stride_ym,
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    # int64: row * stride overflows int32 once a weight or an activation passes 2^31 elements.
    rows = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    cols = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    offs_k = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + offs_k
        x = tl.load(
            x_ptr + rows[:, None] * stride_xm + ks[None, :], mask=(rows[:, None] < M) & (ks[None, :] < K), other=0.0
        )  # [BM, BK]
        w = tl.load(
            w_ptr + cols[None, :] * stride_wn + ks[:, None], mask=(cols[None, :] < N) & (ks[:, None] < K), other=0
        )  # [BK, BN] int8
        acc += tl.dot(x, w.to(x.dtype), input_precision=DOT_PRECISION, out_dtype=tl.float32)
    acc *= tl.load(scale_ptr + cols, mask=cols < N, other=0.0)[None, :]
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)[None, :]
    tl.store(
        y_ptr + rows[:, None] * stride_ym + cols[None, :],
        acc.to(y_ptr.dtype.element_ty),
        mask=(rows[:, None] < M) & (cols[None, :] < N),
    )


def int8_matmul(
    x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """x [..., K] (fp32, fp16 or bf16); qweight [N, K] int8; scale [N] fp32 -> [..., N] in x's dtype."""
    *lead, K = x.shape
    N = qweight.shape[0]
    assert qweight.dtype == torch.int8 and qweight.shape == (N, K) and qweight.stride(1) == 1
    assert scale.shape == (N,) and scale.dtype == torch.float32
    x2 = x.reshape(-1, K)
    if x2.stride(1) != 1:
        x2 = x2.contiguous()
    M = x2.shape[0]
    y = torch.empty(M, N, dtype=x.dtype, device=x.device)
    # Decode batches are short: a narrow M tile wastes less of each weight tile than a square one.
    block_m = 16 if M <= 16 else 32 if M <= 32 else 64
    grid = (triton.cdiv(M, block_m), triton.cdiv(N, 64))
    _int8_matmul_kernel[grid](
        x2,
        qweight,
        scale,
        bias if bias is not None else scale,
        y,
        M,
        N,
        K,
        x2.stride(0),
        qweight.stride(0),
        y.stride(0),
        HAS_BIAS=bias is not None,
        BLOCK_M=block_m,
        BLOCK_N=64,
        BLOCK_K=64,
        DOT_PRECISION=dot_precision(x.dtype),
    )
    return y.reshape(*lead, N)

"""Where the Triton kernel tests run, in which dtypes, and how far a 16-bit result may stray from its fp32
reference: shared by tests/unit/test_kernels.py and tests/unit/test_int8.py."""

import math
import os

import pytest
import torch

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
INTERPRETED = os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")
# The interpreter keeps bf16 as raw uint16 and its tl.dot multiplies those bit patterns (Triton's debugging guide:
# the interpreter does not support bf16 operations), so bf16 is checked compiled, on a GPU.
DTYPES = [
    torch.float32,
    torch.float16,
    pytest.param(
        torch.bfloat16, marks=pytest.mark.skipif(INTERPRETED, reason="the Triton interpreter cannot do bf16 dots")
    ),
]
FP32_EPS = torch.finfo(torch.float32).eps


def rounding_tolerance(bound: float, dtype: torch.dtype, reduction_len: int) -> float:
    """For a result of size at most bound: its rounding to dtype (half an eps), plus fp32 sums over reduction_len
    terms, in the kernel and in the reference, whose rounding grows like the square root of their length."""
    return bound * (torch.finfo(dtype).eps + 2 * FP32_EPS * math.sqrt(reduction_len))

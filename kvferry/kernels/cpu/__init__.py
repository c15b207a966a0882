"""Kernels in C for the CPU, compiled on the machine that runs them (see build.py)."""

from pathlib import Path


def enable(build_dir: Path) -> list[str]:
    """Compile (once per machine) and load every CPU kernel; returns why any could not be, one line each."""
    from kvferry.kernels.cpu import (
        decode_attention,
        decode_layers,
        draw_filtered,
        draw_rows,
        int4_matmul,
        layer_ops,
        panel_matmul,
        prefill_attention,
        small_matmul,
    )

    kernels = (
        decode_attention, prefill_attention, layer_ops, small_matmul, int4_matmul, panel_matmul, decode_layers,
        draw_rows, draw_filtered,
    )  # fmt: skip
    return [why for why in (kernel.enable(build_dir) for kernel in kernels) if why]

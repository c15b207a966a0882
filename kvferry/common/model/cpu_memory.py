"""Memory settings for CPU inference: glibc malloc's, and huge pages for the KV pool.

A step's activations of a few MB are each a fresh mmap above glibc's threshold, every page faulting on first touch,
and freed heap tops are trimmed; raising both thresholds keeps that memory for reuse (`kvferry bench engine`).
Decode attention reads blocks from scattered places in the pool, which on 2 MB pages needs far fewer TLB entries
(docs/benchmarks.md, "Paging overhead").
"""

import contextlib
import ctypes
import functools
import math
import sys

import torch

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_MADV_HUGEPAGE = 14
_HUGE_PAGE = 2 * 2**20  # x86-64's and arm64's (4 KB base pages) transparent huge page


@functools.cache
def _libc() -> ctypes.CDLL | None:
    try:
        return ctypes.CDLL(None)  # the process's own symbols: the C library it runs on
    except OSError:
        return None


def _mallopt(mmap_threshold: int, trim_threshold: int) -> bool:
    try:
        mallopt = _libc().mallopt
    except AttributeError:  # not glibc (musl, macOS): keep the allocator's defaults
        return False
    return mallopt(_M_MMAP_THRESHOLD, mmap_threshold) == 1 and mallopt(_M_TRIM_THRESHOLD, trim_threshold) == 1


@functools.cache
def keep_freed_memory() -> bool:
    """Apply once per process; returns whether glibc took the settings."""
    return _mallopt(32 * 2**20, 2**30)


@contextlib.contextmanager
def returning_freed_memory():
    """While a model is quantized a layer at a time: each allocation of 1 MiB or more its own mapping, unmapped when
    freed, and heap tops trimmed, so that each float layer's memory goes back to the system as soon as it is freed
    (glibc's own threshold grows with what was freed, and freed heap memory between live buffers stays resident:
    the peak of preparing varied between runs by a whole copy of the weights, docs/benchmarks.md). Afterwards
    keep_freed_memory's settings, which the runner that follows would apply anyway."""
    _mallopt(2**20, 2**20)
    try:
        yield
    finally:
        if keep_freed_memory.cache_info().currsize:
            _mallopt(32 * 2**20, 2**30)
        else:
            keep_freed_memory()


def huge_page_zeros(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A zeroed CPU tensor that starts on a 2 MB boundary and that Linux is asked (madvise) to back with
    transparent huge pages, where the THP mode allows. Every page is touched here, so none faults inside a step."""
    itemsize = dtype.itemsize
    numel = math.prod(shape)
    # Over-allocate by one huge page so that the tensor can start on a huge-page boundary.
    raw = torch.empty(numel + _HUGE_PAGE // itemsize, dtype=dtype)
    skip = (-raw.data_ptr() % _HUGE_PAGE) // itemsize
    tensor = raw[skip : skip + numel].view(shape)
    length = numel * itemsize // _HUGE_PAGE * _HUGE_PAGE  # whole huge pages inside the tensor, never past it
    if sys.platform.startswith("linux") and length and _libc() is not None:
        _libc().madvise(ctypes.c_void_p(tensor.data_ptr()), ctypes.c_size_t(length), _MADV_HUGEPAGE)
    tensor.zero_()  # after the advice: the first touch is what picks the page size
    return tensor

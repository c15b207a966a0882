"""Memory settings for CPU inference: glibc malloc's, and huge pages for the KV cache.

Every step allocates activations of a few MB. Above glibc's mmap threshold each one is a
fresh mmap, and every page of it faults on first touch; freed heap tops are trimmed and
faulted in again next step. Raising both thresholds keeps that memory in the heap for
reuse, which makes a decode step markedly cheaper (see `kvferry bench engine`).
"""
import ctypes
import ctypes.util
import sys

import torch

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_done = False


def keep_freed_memory() -> bool:
    """Apply once per process; returns whether glibc took the settings."""
    global _done
    if _done:
        return True
    name = ctypes.util.find_library("c")
    if not name:
        return False
    try:
        libc = ctypes.CDLL(name)
        ok = libc.mallopt(_M_MMAP_THRESHOLD, 32 * 2**20) == 1 and libc.mallopt(_M_TRIM_THRESHOLD, 2**30) == 1
    except (OSError, AttributeError):  # not glibc (musl, macOS): keep the allocator's defaults
        return False
    _done = ok
    return ok


_HUGE_PAGE = 2 * 2**20
_MADV_HUGEPAGE = 14


def huge_page_zeros(shape: tuple[int, ...], dtype: torch.dtype) -> tuple[torch.Tensor, bool]:
    """A zeroed CPU tensor that Linux is asked to back with 2 MB pages (transparent huge pages, madvise).

    Decode attention reads each sequence's blocks from scattered places in the KV pool, so with 4 KB pages
    most block reads miss the TLB and walk the page tables. With 2 MB pages a decode step at batch 32 ran
    1.10x a contiguous cache's instead of 1.135x (mean of 5 alternated rounds). Returns the tensor and
    whether the kernel took the advice; every page is touched here, so none faults inside a step."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    numel = 1
    for n in shape:
        numel *= n
    # Over-allocate by one huge page so that the tensor can start on a huge-page boundary.
    raw = torch.empty(numel + _HUGE_PAGE // itemsize, dtype=dtype)
    skip = (-raw.data_ptr() % _HUGE_PAGE) // itemsize
    tensor = raw[skip:skip + numel].view(shape)
    advised = False
    if sys.platform.startswith("linux"):
        name = ctypes.util.find_library("c")
        try:
            length = numel * itemsize // _HUGE_PAGE * _HUGE_PAGE  # whole huge pages inside the tensor only
            advised = name is not None and length > 0 and ctypes.CDLL(name).madvise(
                ctypes.c_void_p(tensor.data_ptr()), ctypes.c_size_t(length), _MADV_HUGEPAGE) == 0
        except (OSError, AttributeError):
            advised = False
    tensor.zero_()  # after the advice: the first touch is what picks the page size
    return tensor, advised

"""glibc malloc settings for CPU inference.

Every step allocates activations of a few MB. Above glibc's mmap threshold each one is a
fresh mmap, and every page of it faults on first touch; freed heap tops are trimmed and
faulted in again next step. Raising both thresholds keeps that memory in the heap for
reuse, which makes a decode step markedly cheaper (see `kvferry bench engine`).
"""
import ctypes
import ctypes.util

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

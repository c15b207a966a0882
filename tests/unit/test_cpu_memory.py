"""The KV pool's memory: zeroed, on a huge-page boundary, and advised to Linux for huge pages without the
advice reaching past it."""

import re
from pathlib import Path

import pytest
import torch

from kvferry.common.model.cpu_memory import huge_page_zeros

HUGE_PAGE = 2 * 2**20


def _mapping_of(address: int) -> tuple[int, int, dict[str, str]]:
    """The start, end and /proc/self/smaps fields of the mapping that holds address."""
    fields, span = {}, None
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = re.match(r"^([0-9a-f]+)-([0-9a-f]+) ", line)
        if head:
            if span:
                break
            start, end = int(head[1], 16), int(head[2], 16)
            span = (start, end) if start <= address < end else None
        elif span and ":" in line:
            key, value = line.split(":", 1)
            fields[key] = value.strip()
    return (*span, fields)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_pool_is_zeroed_aligned_and_writable(dtype):
    shape = (3, 5, 16, 2, 3, 8)
    pool = huge_page_zeros(shape, dtype)
    assert pool.shape == shape and pool.dtype == dtype and pool.is_contiguous()
    assert pool.data_ptr() % HUGE_PAGE == 0
    assert torch.count_nonzero(pool) == 0
    pool[1, 2] = 1.0
    assert torch.count_nonzero(pool) == pool[1, 2].numel()


@pytest.mark.skipif(
    not Path("/sys/kernel/mm/transparent_hugepage").exists(),
    reason="no transparent huge pages in this kernel (or not Linux)",
)
def test_the_advice_covers_the_pools_whole_huge_pages_and_nothing_past_them():
    numel = 16 * 2**20 + 3  # 64 MB and a 12-byte tail that no huge page can hold
    pool = huge_page_zeros((numel,), torch.float32)
    start, end, fields = _mapping_of(pool.data_ptr())
    # The kernel splits a mapping where the advice starts and ends: the advised part is a mapping of its own.
    assert "hg" in fields["VmFlags"].split(), fields["VmFlags"]  # hg: MADV_HUGEPAGE, whatever the THP mode
    assert start == pool.data_ptr() and end == pool.data_ptr() + numel * 4 // HUGE_PAGE * HUGE_PAGE

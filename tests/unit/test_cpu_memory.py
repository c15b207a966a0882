"""The KV pool's memory: huge-page backed where Linux offers transparent huge pages, zeroed, and aligned."""
import re
import sys
from pathlib import Path

import pytest
import torch

from kvferry.common.model.cpu_memory import huge_page_zeros

THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def _mapping_of(address: int) -> dict[str, str]:
    """The /proc/self/smaps fields of the mapping that holds address."""
    fields, inside = {}, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        span = re.match(r"^([0-9a-f]+)-([0-9a-f]+) ", line)
        if span:
            if inside:
                break
            inside = int(span[1], 16) <= address < int(span[2], 16)
        elif inside and ":" in line:
            key, value = line.split(":", 1)
            fields[key] = value.strip()
    return fields


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_pool_is_zeroed_aligned_and_writable_with_its_own_storage(dtype):
    shape = (3, 5, 16, 2, 3, 8)  # small: under one huge page, so no advice is needed
    pool, _ = huge_page_zeros(shape, dtype)
    assert pool.shape == shape and pool.dtype == dtype and pool.is_contiguous()
    assert pool.data_ptr() % (2 * 2**20) == 0
    assert torch.count_nonzero(pool) == 0
    pool[1, 2] = 1.0
    assert torch.count_nonzero(pool) == pool[1, 2].numel()


@pytest.mark.skipif(not sys.platform.startswith("linux") or not THP.exists() or "[never]" in THP.read_text(),
                    reason="transparent huge pages are off or absent here")
def test_linux_is_asked_for_huge_pages_for_a_large_pool():
    pool, advised = huge_page_zeros((16, 2**20), torch.float32)  # 64 MB
    assert advised
    fields = _mapping_of(pool.data_ptr())
    assert fields.get("THPeligible") == "1", fields
    plain = torch.zeros(16, 2**20)  # the control: in madvise mode, memory nobody advised stays on 4 KB pages
    assert _mapping_of(plain.data_ptr()).get("THPeligible") == ("1" if "[always]" in THP.read_text() else "0")

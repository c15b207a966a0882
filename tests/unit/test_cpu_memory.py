"""The KV pool's memory: zeroed, on a huge-page boundary, and advised to Linux for huge pages without the
advice reaching past it."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kvferry.common.model.cpu_memory import huge_page_zeros

pytestmark = pytest.mark.slow  # seconds of work: `make check` leaves it to `make test`

HUGE_PAGE = 2 * 2**20


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_pool_is_zeroed_aligned_and_writable(dtype):
    shape = (3, 5, 16, 2, 3, 8)
    pool = huge_page_zeros(shape, dtype)
    assert pool.shape == shape and pool.dtype == dtype and pool.is_contiguous()
    assert pool.data_ptr() % HUGE_PAGE == 0
    assert torch.count_nonzero(pool) == 0
    pool[1, 2] = 1.0
    assert torch.count_nonzero(pool) == pool[1, 2].numel()


# Run in a fresh interpreter: in a long test process, memory a freed pool left advised can lie next to the new pool,
# and Linux merges neighbouring mappings with the same flags, so the advised mapping would reach past this pool.
_ADVICE_PROBE = """
import json, re, sys
from pathlib import Path
import torch
from kvferry.common.model.cpu_memory import huge_page_zeros
numel = int(sys.argv[1])
pool = huge_page_zeros((numel,), torch.float32)
address, span, fields = pool.data_ptr(), None, {}
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
print(json.dumps({"address": address, "span": span, "flags": fields["VmFlags"].split()}))
"""
# The engine's KV cache with --no-kv-huge-pages (argv[2] == "off") or without: the flags of its mapping.
_ENGINE_PROBE = """
import json, re, sys
from pathlib import Path
from kvferry.common.config import EngineConfig
from kvferry.common.engine import LLMEngine

engine = LLMEngine(EngineConfig(model=sys.argv[1], kv_cache_memory=8 * 2**20, kv_huge_pages=sys.argv[2] == "on"))
address, flags = engine.runner.kv_cache.data_ptr(), None
for line in Path("/proc/self/smaps").read_text().splitlines():
    head = re.match(r"^([0-9a-f]+)-([0-9a-f]+) ", line)
    if head:
        if flags is not None:
            break
        inside = int(head[1], 16) <= address < int(head[2], 16)
    elif inside and line.startswith("VmFlags:"):
        flags = line.split(":", 1)[1].split()
print(json.dumps(flags))
"""


@pytest.mark.skipif(
    not Path("/sys/kernel/mm/transparent_hugepage").exists(),
    reason="no transparent huge pages in this kernel (or not Linux)",
)
def test_the_advice_covers_the_pools_whole_huge_pages_and_nothing_past_them():
    numel = 16 * 2**20 + 3  # 64 MB and a 12-byte tail that no huge page can hold
    probe = subprocess.run(
        [sys.executable, "-c", _ADVICE_PROBE, str(numel)], capture_output=True, text=True, timeout=120, check=True
    )
    found = json.loads(probe.stdout)
    # The kernel splits a mapping where the advice starts and ends: the advised part is a mapping of its own.
    assert "hg" in found["flags"], found["flags"]  # hg: MADV_HUGEPAGE, whatever the THP mode
    address, (start, end) = found["address"], found["span"]
    assert start == address and end == address + numel * 4 // HUGE_PAGE * HUGE_PAGE


@pytest.mark.skipif(
    not Path("/sys/kernel/mm/transparent_hugepage").exists(),
    reason="no transparent huge pages in this kernel (or not Linux)",
)
@pytest.mark.parametrize("huge_pages", ["on", "off"])
def test_the_engine_asks_for_huge_pages_unless_told_not_to(tmp_path, huge_pages):
    from tests.tiny_models import save_tiny_model

    save_tiny_model("llama", tmp_path)
    probe = subprocess.run(
        [sys.executable, "-c", _ENGINE_PROBE, str(tmp_path), huge_pages],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
        cwd=Path(__file__).parents[2],
    )
    flags = json.loads(probe.stdout.strip().splitlines()[-1])
    assert ("hg" in flags) == (huge_pages == "on"), flags


RETURNING = """
import contextlib, json, sys, torch
from kvferry.common.model.cpu_memory import keep_freed_memory, returning_freed_memory

def rss():
    return int(open("/proc/self/statm").read().split()[1]) * 4096

keep_freed_memory()  # as in a process whose runner started already
with returning_freed_memory() if sys.argv[1] == "returning" else contextlib.nullcontext():
    before = rss()
    blocks = [torch.ones(3 * 2**20 // 4) for _ in range(8)]  # 3 MiB each: the runner's settings keep them
    held = rss()
    del blocks
    after = rss()
print(json.dumps({"before": before, "held": held, "after": after}))
"""


@pytest.mark.parametrize("returning", [True, False])
def test_memory_freed_while_preparing_goes_back_to_the_system(returning):
    # A fresh interpreter: the allocator's state is the process's own
    mode = "returning" if returning else "keeping"
    done = subprocess.run([sys.executable, "-c", RETURNING, mode], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    rss = json.loads(done.stdout)
    assert rss["held"] - rss["before"] >= 20 * 2**20  # the blocks were resident
    kept = rss["after"] - rss["before"]
    assert kept < 4 * 2**20 if returning else kept >= 20 * 2**20  # and the runner's own settings keep them

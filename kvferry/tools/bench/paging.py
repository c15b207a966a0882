"""Paging overhead (`bench step --measure paging`, and a line of `bench engine`): one decode step of the same model
on the paged cache against contiguous ones: plain, a cache grown by concatenation every step as transformers' default
cache is (the overhead figure), and preallocated, attended through a view with no copy: an idealised best case that
works only because every sequence sits at the same position, which a continuous batch never guarantees. On the CPU
the paged step gathers each layer's blocks once, which is what separates it from the preallocated case.
"""

import random
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kvferry.common.errors import ConfigError
from kvferry.common.model.attention import PagedBatch


@dataclass
class ContiguousBatch:
    k_caches: list[torch.Tensor]  # per layer [batch, kvh, max_len, d]
    v_caches: list[torch.Tensor]
    position: int  # every sequence decodes at this position

    def attend(self, layer, q, k, v, scale):
        k_cache, v_cache = self.k_caches[layer], self.v_caches[layer]
        k_cache[:, :, self.position] = k  # [B, kvh, d]
        v_cache[:, :, self.position] = v
        ctx = self.position + 1
        out = F.scaled_dot_product_attention(
            q[:, :, None, :], k_cache[:, :, :ctx], v_cache[:, :, :ctx], scale=scale, enable_gqa=True
        )  # [B, H, 1, d]
        return out[:, :, 0, :]


@dataclass
class GrowingBatch:
    k_caches: list[torch.Tensor]  # per layer [batch, kvh, context, d]
    v_caches: list[torch.Tensor]

    def attend(self, layer, q, k, v, scale):
        # Not stored back: every timed step appends to the same context length.
        keys = torch.cat((self.k_caches[layer], k[:, :, None, :]), dim=2)  # [B, kvh, ctx + 1, d]
        values = torch.cat((self.v_caches[layer], v[:, :, None, :]), dim=2)
        return F.scaled_dot_product_attention(q[:, :, None, :], keys, values, scale=scale, enable_gqa=True)[:, :, 0, :]


def _best_times(fns: list, reps: int) -> list[float]:
    """Best-of-reps seconds for each fn, run interleaved so that drift on a shared machine hits all alike."""
    for fn in fns:
        fn()
    best = [float("inf")] * len(fns)
    for _ in range(reps):
        for i, fn in enumerate(fns):
            start = time.perf_counter()
            fn()
            best[i] = min(best[i], time.perf_counter() - start)
    return best


@torch.inference_mode()
def paging_overhead(engine, batch: int = 32, context: int = 256, reps: int = 10) -> dict:
    model, layout, runner = engine.model, engine.runner.layout, engine.runner
    bs = layout.block_size
    blocks_per_seq = -(-(context + 1) // bs)
    if batch * blocks_per_seq > runner.num_blocks:
        raise ConfigError(
            f"the paging benchmark needs {batch * blocks_per_seq} KV blocks, the cache has "
            f"{runner.num_blocks}: raise --kv-cache-memory"
        )
    # Shuffled block ids: a long-running server's tables are scattered, not contiguous.
    ids = list(range(runner.num_blocks))
    random.Random(0).shuffle(ids)
    tables = [ids[i * blocks_per_seq : (i + 1) * blocks_per_seq] for i in range(batch)]
    device = runner.device
    high = min(2000, engine.vocab_size)  # a small test model's vocabulary ends below 2000
    input_ids = torch.randint(min(1000, high // 2), high, (batch,), device=device)
    positions = torch.full((batch,), context, device=device)
    paged = PagedBatch(
        runner.k_caches,
        runner.v_caches,
        is_prefill=False,
        slot_mapping=torch.tensor([t[context // bs] * bs + context % bs for t in tables], device=device),
        block_tables=torch.tensor(tables, dtype=torch.int32, device=device),
        context_lens=torch.full((batch,), context + 1, dtype=torch.int32, device=device),
        cu_seqlens_q=torch.arange(batch + 1, dtype=torch.int32, device=device),
    )
    shape = (batch, layout.num_kv_heads, context + 1, layout.head_dim)
    contiguous = ContiguousBatch(
        [torch.randn(shape, device=device, dtype=engine.dtype) for _ in range(layout.num_layers)],
        [torch.randn(shape, device=device, dtype=engine.dtype) for _ in range(layout.num_layers)],
        position=context,
    )

    growing = GrowingBatch(
        [c[:, :, :context] for c in contiguous.k_caches], [c[:, :, :context] for c in contiguous.v_caches]
    )

    def step(attention_batch):
        return lambda: model.compute_logits(model(input_ids, positions, attention_batch))

    paged_s, contiguous_s, growing_s = _best_times([step(paged), step(contiguous), step(growing)], reps)
    return {
        "batch": batch,
        "context": context,
        "paged_step_ms": round(paged_s * 1000, 1),
        "plain_step_ms": round(growing_s * 1000, 1),
        "overhead": round(paged_s / growing_s, 3),
        "preallocated_step_ms": round(contiguous_s * 1000, 1),
        "overhead_vs_preallocated": round(paged_s / contiguous_s, 3),
    }


def text(p: dict) -> str:
    return (
        f"paging overhead             {p['overhead']:>10}x  (decode step, batch {p['batch']}, context "
        f"{p['context']}: paged {p['paged_step_ms']} ms, plain contiguous cache {p['plain_step_ms']} ms)\n"
        f"  vs a preallocated buffer  {p['overhead_vs_preallocated']:>10}x  (idealised: all sequences at one "
        f"position, attended through a view: {p['preallocated_step_ms']} ms)"
    )

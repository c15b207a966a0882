"""What one step's attention needs: the paged KV caches and the batch layout over them."""

from dataclasses import dataclass, field

import torch

from kvferry import kernels
from kvferry.kernels import reference


@dataclass
class PagedBatch:
    k_caches: list[torch.Tensor]  # per layer [num_blocks, block_size, num_kv_heads, head_dim]
    v_caches: list[torch.Tensor]
    is_prefill: bool
    slot_mapping: torch.Tensor  # [num_tokens] cache slot of each new token
    block_tables: torch.Tensor  # [num_seqs, max_blocks] int32, padded with 0
    context_lens: torch.Tensor  # [num_seqs] int32, cached + new tokens
    cu_seqlens_q: torch.Tensor  # [num_seqs + 1] int32, new-token offsets (prefill only)
    max_q_len: int = 1  # the longest run of new tokens of one sequence
    _reference_plan: list | None = field(default=None, repr=False)

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
        """Store this step's k/v [T, kvh, d], then attend q [T, H, d] over the cache -> [T, H, d]."""
        k_cache, v_cache = self.k_caches[layer], self.v_caches[layer]
        if self.is_prefill:
            kernels.store_kv(k, v, k_cache, v_cache, self.slot_mapping)
            return kernels.paged_prefill_attention(
                q,
                k_cache,
                v_cache,
                self.block_tables,
                self.cu_seqlens_q,
                self.context_lens,
                scale,
                max_q_len=self.max_q_len,
            )
        if self._reference_plan is None and kernels.needs_decode_plan(q, k_cache, v_cache):  # one for all layers
            self._reference_plan = reference.plan_decode(self.block_tables, self.context_lens, k_cache)
        return kernels.paged_decode_attention(
            q,
            k_cache,
            v_cache,
            self.block_tables,
            self.context_lens,
            scale,
            reference_plan=self._reference_plan,
            new=(k, v, self.slot_mapping),
        )

"""CUDA graphs for the decode step: at small batch, the launch cost of its few hundred short kernels rivals the
compute, and a graph replays the whole forward and the vocabulary projection as one launch.

A graph is frozen to its tensors' addresses and shapes, so the inputs live in static buffers sized for the largest
batch, with a graph per size in `capture_sizes`. A batch runs in the smallest size that holds it; the rows past it
are padding: token 0 at position 0, slot -1 (store_kv writes nothing for it), a context of one token in block 0.
With capture=False the same buffers and padding run eagerly: how the CPU tests exercise all but the capture.
"""

import torch

from kvferry.common.model.attention import PagedBatch

LARGEST_CAPTURED_BATCH = 256


def capture_sizes(max_num_seqs: int) -> list[int]:
    """1, 2, 4, 8, then every multiple of 16, up to max_num_seqs (capped): padding wastes at most 15 rows."""
    top = min(max_num_seqs, LARGEST_CAPTURED_BATCH)
    sizes = [s for s in (1, 2, 4, 8) if s < top] + list(range(16, top, 16))
    return sizes + [top]


class DecodeGraphs:
    def __init__(
        self,
        model,
        k_caches: list[torch.Tensor],
        v_caches: list[torch.Tensor],
        max_num_seqs: int,
        max_blocks_per_seq: int,
        device: torch.device,
        capture: bool,
    ):
        self.model = model
        self.k_caches, self.v_caches = k_caches, v_caches
        self.sizes = capture_sizes(max_num_seqs)
        self.max_blocks_per_seq = max_blocks_per_seq
        self.capture = capture
        self._pool = None
        top = self.sizes[-1]
        to = dict(device=device)
        self.input_ids = torch.zeros(top, dtype=torch.long, **to)
        self.positions = torch.zeros(top, dtype=torch.long, **to)
        self.slot_mapping = torch.full((top,), -1, dtype=torch.long, **to)
        self.block_tables = torch.zeros(top, max_blocks_per_seq, dtype=torch.int32, **to)
        self.context_lens = torch.ones(top, dtype=torch.int32, **to)
        self.cu_seqlens_q = torch.arange(top + 1, dtype=torch.int32, **to)
        # One output, each size's logits a slice: a graph's own [size, vocab] output would stay in the pool.
        dtype = model.embed_tokens.weight.dtype  # the dtype of the hidden states, and of the logits of every head
        self.logits = torch.empty(top, model.config.vocab_size, dtype=dtype, **to)
        self._replays: dict[int, torch.cuda.CUDAGraph] = {}  # size -> its graph, once captured
        if capture:
            try:
                self._capture_all()
            except BaseException:
                self.release()
                raise

    def fits(self, batch: PagedBatch) -> bool:
        return batch.context_lens.shape[0] <= self.sizes[-1] and batch.block_tables.shape[1] <= self.max_blocks_per_seq

    def _batch(self, size: int) -> PagedBatch:
        return PagedBatch(
            self.k_caches,
            self.v_caches,
            is_prefill=False,
            slot_mapping=self.slot_mapping[:size],
            block_tables=self.block_tables[:size],
            context_lens=self.context_lens[:size],
            cu_seqlens_q=self.cu_seqlens_q[: size + 1],
        )

    def _forward(self, size: int) -> torch.Tensor:
        hidden = self.model(self.input_ids[:size], self.positions[:size], self._batch(size))
        return self.logits[:size].copy_(self.model.compute_logits(hidden))

    @torch.inference_mode()
    def _capture_all(self) -> None:
        self._pool = torch.cuda.graph_pool_handle()
        for size in reversed(self.sizes):  # largest first: the smaller graphs reuse its memory from the pool
            # Warm up on a side stream first: Triton compiles each kernel's specialisation on its first launch,
            # and nothing may compile or allocate from the default allocator during capture.
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                self._forward(size)
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self._pool):
                self._forward(size)
            self._replays[size] = graph
        torch.cuda.synchronize()

    def release(self) -> None:
        """Let go of the graphs captured so far and their memory pool (a capture that failed part way)."""
        for graph in self._replays.values():
            graph.reset()
        self._replays.clear()
        self._pool = None
        self.capture = False
        if torch.cuda.is_available():
            torch.cuda.empty_cache()  # the pool's blocks go back to the device once nothing holds them

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, batch: PagedBatch) -> torch.Tensor:
        """The logits [n, vocab] of a decode batch of n sequences (one new token each), through the smallest
        captured size that holds it."""
        n, width = input_ids.shape[0], batch.block_tables.shape[1]
        size = next(s for s in self.sizes if s >= n)
        self.input_ids[:n] = input_ids
        self.positions[:n] = positions
        self.slot_mapping[:n] = batch.slot_mapping
        self.block_tables[:n, :width] = batch.block_tables  # entries past a row's context are never read
        self.context_lens[:n] = batch.context_lens
        # Rows past n are reset to padding: a row that held a sequence last step must not store into its slot.
        self.input_ids[n:size] = 0
        self.positions[n:size] = 0
        self.slot_mapping[n:size] = -1
        self.block_tables[n:size] = 0
        self.context_lens[n:size] = 1
        if self.capture:
            self._replays[size].replay()
        else:
            self._forward(size)
        return self.logits[:n]

"""The model runner: the only part of the engine that knows about devices. It owns the model and the paged KV
cache, turns a scheduler plan into tensors, runs the forward pass and samples. It keeps nothing per request: what a
sequence needs from step to step (its prompt's logprobs) lives on the Sequence; a seeded row's randomness is keyed
by its seed and output position alone (sampler.py).
"""

import random
from dataclasses import dataclass

import torch

from kvferry.common import model_files
from kvferry.common.model.attention import PagedBatch
from kvferry.common.model.cpu_linear import can_pack, pack_linears
from kvferry.common.model.cpu_memory import huge_page_zeros, keep_freed_memory
from kvferry.common.model.decode_graphs import DecodeGraphs
from kvferry.common.model.fused_decode import FusedDecode
from kvferry.common.model.host_staging import HostStaging
from kvferry.common.model.int8_linear import interleave_linears
from kvferry.common.model.kv_blocks import gather_blocks, scatter_blocks
from kvferry.common.model.kv_gather import DeviceGather
from kvferry.common.model.logits_processors import process_logits
from kvferry.common.model.sampler import SamplingTensors, sample, stage_sampling, token_logprobs, uniform
from kvferry.common.scheduler import StepPlan
from kvferry.common.sequence import Sequence
from kvferry.kernels import cpu as cpu_kernels


@dataclass(frozen=True)
class KVCacheLayout:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype_bytes: int

    @property
    def bytes_per_block(self) -> int:
        return 2 * self.num_layers * self.block_size * self.num_kv_heads * self.head_dim * self.dtype_bytes

    def num_blocks_for_budget(self, budget_bytes: int) -> int:
        return budget_bytes // self.bytes_per_block


def kv_cache_layout(model_config, block_size: int, dtype: torch.dtype) -> KVCacheLayout:
    return KVCacheLayout(
        model_config.num_hidden_layers,
        model_config.num_key_value_heads,
        model_config.head_dim,
        block_size,
        torch.empty((), dtype=dtype).element_size(),
    )


@dataclass
class StepInputs:
    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    batch: PagedBatch
    cu_seqlens: list[int]  # batch.cu_seqlens_q on the host: reading the device's would wait for it
    sampling: list[int]  # the chunks that sample, in order
    last_tokens: torch.Tensor  # [len(sampling)] each one's last token in the flat batch
    sampling_tensors: SamplingTensors | None  # their sampling parameters; None when all are greedy


def _padded(tables: list[list[int]], width: int) -> list[int]:
    """Block tables as one flat row-major list, each padded with 0 to width."""
    flat = []
    for table in tables:
        flat += table
        flat += [0] * (width - len(table))
    return flat


def enable_cpu_kernels() -> list[str]:
    """kernels.cpu.enable in the cache folder (this user's alone, as each library in it)."""
    build_dir = model_files.cache_folder("kernels")  # the cache root and it: this user's alone, or a ConfigError
    with model_files.trusted_cache():  # and each library in it
        return cpu_kernels.enable(build_dir)


class ModelRunner:
    def __init__(
        self,
        model,
        layout: KVCacheLayout,
        num_blocks: int,
        device: torch.device,
        dtype: torch.dtype,
        kv_dtype: torch.dtype | None = None,
        seed: int | None = None,
        eos_token_ids: tuple[int, ...] = (),
        kv_huge_pages: bool = True,
    ):
        self.model = model
        self.eos_token_ids = eos_token_ids
        self.layout = layout
        self.device = device
        self.num_blocks = num_blocks
        if device.type == "cpu":
            keep_freed_memory()
            enable_cpu_kernels()
            interleave_linears(model)  # --quantization int8: into the layout the C product streams fastest, if any
        if can_pack(device, dtype):
            pack_linears(model)  # the float nn.Linear layers: none are left after --quantization int8
        # K and V of a token side by side: a block's K and V are one run of memory, which the CPU's decode attention
        # gathers with one copy (kernels/reference.py; docs/benchmarks.md, paging overhead).
        shape = (layout.num_layers, num_blocks, layout.block_size, 2, layout.num_kv_heads, layout.head_dim)
        # Zeroed here, so every page is touched now: else the resident size creeps up as blocks get their first use
        # (it looks like a leak), each first touch a page fault inside a step. On the CPU, huge pages unless
        # --no-kv-huge-pages: the kernel may compact memory to find them.
        kv_dtype = kv_dtype or dtype  # --kv-cache-dtype: the model's, or half precision on the CPU
        if device.type == "cpu" and kv_huge_pages:
            self.kv_cache = huge_page_zeros(shape, dtype=kv_dtype)  # [L, num_blocks, block_size, 2, kvh, d]
        else:
            self.kv_cache = torch.zeros(shape, dtype=kv_dtype, device=device)
        self.k_cache, self.v_cache = self.kv_cache[:, :, :, 0], self.kv_cache[:, :, :, 1]  # [L, nb, bs, kvh, d] views
        self.k_caches, self.v_caches = list(self.k_cache.unbind(0)), list(self.v_cache.unbind(0))
        if device.type == "cpu":  # decode: every layer in one call, where the model and the batch allow
            model.fused_decode = FusedDecode.for_model(model, self.k_caches, self.v_caches)
        self.device_gather = DeviceGather(device) if device.type == "cuda" else None  # KV going out to the host
        # Unseeded random rows take their uniforms from this one, on the host; seeded rows from (seed, position).
        self.shared_random = random.Random(seed)
        self.last_logits: torch.Tensor | None = None  # the latest step's sampled rows, for tests and logprobs
        self.last_sampled: list[Sequence] = []  # the sequences of last_logits' rows, in order
        self.last_logprobs: list = []  # per chunk of the latest step: TokenLogprobs where asked for, else None
        self.decode_graphs: DecodeGraphs | None = None  # see use_decode_graphs
        # A step's inputs go to the device as one packed copy on CUDA; a CPU test packs them too, to run that layout.
        self.pack_inputs = device.type == "cuda"

    def use_decode_graphs(self, max_num_seqs: int, max_blocks_per_seq: int, capture: bool = True) -> None:
        """Run decode steps through DecodeGraphs (capture=False: their buffers and padding, eagerly, as tests do)."""
        self.decode_graphs = DecodeGraphs(
            self.model, self.k_caches, self.v_caches, max_num_seqs, max_blocks_per_seq, self.device, capture
        )

    def read_blocks(self, block_table: list[int], layers: tuple[int, int] | None = None) -> torch.Tensor:
        """A sequence's K and V in these layers (default all), [layers, num_blocks, block_size, 2, kv_heads,
        head_dim], contiguous on the CPU. On CUDA the copy may still be running (kv_gather.py)."""
        if self.device_gather is None:
            return gather_blocks(self.kv_cache, block_table, layers)
        return self.device_gather.gather(self.kv_cache, block_table, layers or (0, self.layout.num_layers))

    def write_blocks(self, block_table: list[int], kv: torch.Tensor, layers: tuple[int, int] | None = None) -> None:
        """Place received K and V ([layers, n, block_size, 2, kv_heads, head_dim]) into these blocks."""
        lo, hi = layers or (0, self.layout.num_layers)
        expected = (hi - lo, len(block_table), *self.kv_cache.shape[2:])
        assert tuple(kv.shape) == expected, (kv.shape, expected)
        scatter_blocks(self.kv_cache, block_table, kv, layers)

    def copy_block(self, src: int, dst: int) -> None:
        """One block's K and V, in every layer, into another block (a choice's own copy of a shared one)."""
        self.kv_cache[:, dst] = self.kv_cache[:, src]

    def _uniform(self, params, position: int) -> float | None:
        """A row's uniform for sampling output `position` (sampler.py): None for greedy, (seed, position)'s for a
        seeded row, else the next of the shared host generator's."""
        if params.greedy:
            return None
        if params.seed is None:
            return self.shared_random.random()
        return uniform(params.seed, position)

    def prepare(self, plan: StepPlan) -> StepInputs:
        """The step's inputs on the device, sent as one copy (host_staging.py)."""
        block_size = self.layout.block_size
        if plan.is_prefill:
            input_ids, positions, slots, tables, context_lens, cu = [], [], [], [], [], [0]
            for chunk in plan.chunks:
                seq = chunk.seq
                start, end = seq.num_computed_tokens, seq.num_computed_tokens + chunk.num_new_tokens
                input_ids.extend(seq.token_ids[start:end])
                positions.extend(range(start, end))
                table = seq.block_table
                slots.extend(table[p // block_size] * block_size + p % block_size for p in range(start, end))
                tables.append(table[: -(-end // block_size)])
                context_lens.append(end)
                cu.append(cu[-1] + chunk.num_new_tokens)
            width = max(len(t) for t in tables)
            flat_tables = _padded(tables, width)
            sampling = [i for i, c in enumerate(plan.chunks) if c.samples]
            last_tokens = [cu[i + 1] - 1 for i in sampling]  # each sampling chunk's last token
            seqs = [plan.chunks[i].seq for i in sampling]
        else:  # one token a sequence: the same arrays, built a whole list at a time
            seqs = [chunk.seq for chunk in plan.chunks]
            input_ids = [seq.last_token_id for seq in seqs]
            positions = [seq.num_computed_tokens for seq in seqs]
            num_blocks = [p // block_size + 1 for p in positions]  # each table as far as its new token
            slots = [
                seq.block_table[n - 1] * block_size + p % block_size for seq, p, n in zip(seqs, positions, num_blocks)
            ]
            width = max(num_blocks)
            flat_tables = _padded([seq.block_table[:n] for seq, n in zip(seqs, num_blocks)], width)
            context_lens = [p + 1 for p in positions]
            cu = list(range(len(seqs) + 1))
            # Every sequence of a decode step samples: the scheduler runs one only when no prompt is left to compute
            # (Scheduler.update asserts it of each).
            sampling = last_tokens = list(range(len(seqs)))
        staging = HostStaging(self.device, self.pack_inputs)
        staged = [
            staging.add(input_ids, torch.long),
            staging.add(positions, torch.long),
            staging.add(slots, torch.long),
            staging.add(flat_tables, torch.int32, (len(cu) - 1, width)),
            staging.add(context_lens, torch.int32),
            staging.add(cu, torch.int32),
            staging.add(last_tokens, torch.long),
        ]
        uniforms = [self._uniform(s.params, len(s.output_token_ids)) for s in seqs]
        sampling_tensors = stage_sampling([s.params for s in seqs], uniforms, staging)
        staging.upload()
        ids, pos, slot_mapping, block_tables, lens, cu_seqlens, last_tokens = (part.tensor for part in staged)
        batch = PagedBatch(
            k_caches=self.k_caches,
            v_caches=self.v_caches,
            is_prefill=plan.is_prefill,
            slot_mapping=slot_mapping,
            block_tables=block_tables,
            context_lens=lens,
            cu_seqlens_q=cu_seqlens,
            max_q_len=max(c.num_new_tokens for c in plan.chunks),
        )
        return StepInputs(ids, pos, batch, cu, sampling, last_tokens, sampling_tensors)

    @torch.inference_mode()
    def execute(self, plan: StepPlan, after_layer=None) -> list[int | None]:
        """Run one step: the sampled token per chunk (None: a prompt chunk not at its end). after_layer: the model's."""
        inputs = self.prepare(plan)
        input_ids, positions, batch, sampling = inputs.input_ids, inputs.positions, inputs.batch, inputs.sampling
        self.last_logprobs = [None] * len(plan.chunks)
        graphs = self.decode_graphs
        if not plan.is_prefill and graphs is not None and graphs.fits(batch):
            logits = graphs.run(input_ids, positions, batch)  # every decode row samples
        else:
            hidden = self.model(input_ids, positions, batch, after_layer)  # [T, hidden]
            if plan.is_prefill:
                self._record_prompt_logprobs(plan, hidden, inputs.cu_seqlens)
            if not sampling:
                return [None] * len(plan.chunks)
            # Only the last token of each finished prompt needs logits: the vocabulary projection is large.
            logits = self.model.compute_logits(hidden[inputs.last_tokens])  # [num_sampling, vocab]
        self.last_logits = logits
        seqs = [plan.chunks[i].seq for i in sampling]
        self.last_sampled = seqs
        processed = process_logits(logits, seqs, self.eos_token_ids)
        constraints = [s.constraint_state for s in seqs]
        token_ids = sample(processed, [s.params for s in seqs], None, constraints, inputs.sampling_tensors)
        result: list[int | None] = [None] * len(plan.chunks)
        for i, token_id in zip(sampling, token_ids):
            result[i] = token_id
        asking = [j for j, s in enumerate(seqs) if s.params.logprobs is not None]
        if asking:
            found = token_logprobs(
                logits[asking], [token_ids[j] for j in asking], [seqs[j].params.logprobs for j in asking]
            )
            for j, entry in zip(asking, found):
                self.last_logprobs[sampling[j]] = entry
        return result

    @torch.inference_mode()
    def sample_choices(
        self, seq: Sequence, choice_params: list, constraints: list, position: int
    ) -> list[tuple[int, object]]:
        """More first tokens from the prompt sampled in the latest step, one per extra choice, each with its own
        parameters and constraint state (or None): (token id, TokenLogprobs or None) each. position: the output
        position of the parent's token sampled there, which the choices draw at too (their seeds are their own)."""
        # By identity: a batch is short, and a dict of rows built for every step would cost each decode step.
        row = next(row for row, sampled in enumerate(self.last_sampled) if sampled is seq)
        logits = self.last_logits[row][None]  # [1, vocab]
        out = []
        for params, state in zip(choice_params, constraints):
            choice = Sequence(seq.request_id, seq.prompt_token_ids, params)
            [token_id] = sample(
                process_logits(logits, [choice], self.eos_token_ids),
                [params],
                [self._uniform(params, position)],
                [state],
            )
            found = token_logprobs(logits, [token_id], [params.logprobs])[0] if params.logprobs is not None else None
            out.append((token_id, found))
        return out

    def _record_prompt_logprobs(self, plan: StepPlan, hidden: torch.Tensor, cu: list[int]) -> None:
        """Prompt tokens' logprobs for the sequences that asked (echo): each position's logits score the next
        prompt token. Done in slices: a whole chunk's logits would be [tokens, vocab]."""
        for i, chunk in enumerate(plan.chunks):
            seq = chunk.seq
            if seq.params.prompt_logprobs is None:
                continue
            prompt = seq.prompt_token_ids
            if seq.prompt_logprobs is None:  # else a recompute after preemption: the same entries again
                seq.prompt_logprobs = [None] * len(prompt)
            entries = seq.prompt_logprobs
            start = seq.num_computed_tokens
            # Position p scores prompt token p + 1; the prompt's last position scores the first output instead.
            end = min(start + chunk.num_new_tokens, len(prompt) - 1)
            for lo in range(start, end, 256):
                hi = min(lo + 256, end)
                logits = self.model.compute_logits(hidden[cu[i] + lo - start : cu[i] + hi - start])  # [n, vocab]
                found = token_logprobs(logits, prompt[lo + 1 : hi + 1], [seq.params.prompt_logprobs] * (hi - lo))
                entries[lo + 1 : hi + 1] = found

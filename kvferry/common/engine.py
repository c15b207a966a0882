"""The offline engine: prefill and decode in one loop, in one process.

It is also the oracle for the distributed pipeline: the same request with greedy sampling
gives the same tokens through both.
"""

import itertools
import logging
import os
import time
from dataclasses import dataclass, field

import torch

from kvferry.common.block_hash import block_hashes
from kvferry.common.block_manager import BlockManager
from kvferry.common.config import EngineConfig
from kvferry.common.errors import ConfigError, InvalidRequest
from kvferry.common.model.int8_linear import quantize_model
from kvferry.common.model.loader import load_model, resolve_model
from kvferry.common.model.quant_calibration import calibration_token_ids
from kvferry.common.model.runner import ModelRunner, kv_cache_layout
from kvferry.common.sampling import SamplingParams, TokenLogprobs
from kvferry.common.scheduler import Scheduler, StepPlan
from kvferry.common.sequence import FinishReason, Sequence

log = logging.getLogger("kvferry.engine")


@dataclass
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    new_token_ids: list[int]
    finished: bool
    finish_reason: FinishReason | None
    text: str = ""
    new_logprobs: list[TokenLogprobs] = field(default_factory=list)  # the new token's, when asked for
    logprobs: list[TokenLogprobs] | None = None  # every output token's so far, when asked for
    prompt_logprobs: list[TokenLogprobs | None] | None = None  # with the first token, when asked for (echo)


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError:
        raise ConfigError(f"unknown device {name!r}: use auto, cpu, cuda or cuda:N") from None
    if device.type not in ("cpu", "cuda"):
        raise ConfigError(f"device {name!r} is not supported: use auto, cpu, cuda or cuda:N")
    if device.type == "cuda" and (not torch.cuda.is_available() or (device.index or 0) >= torch.cuda.device_count()):
        raise ConfigError(f"device {name!r} asked for, but this machine has {torch.cuda.device_count()} CUDA devices")
    return device


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return getattr(torch, name)


class LLMEngine:
    def __init__(self, config: EngineConfig | None = None, keep_finished_blocks: bool = False):
        self.config = config = config or EngineConfig()
        if config.num_threads is not None:
            if config.num_threads < 1:
                raise ConfigError(f"num_threads must be at least 1, got {config.num_threads}")
            torch.set_num_threads(config.num_threads)
        self.device = resolve_device(config.device)
        self.dtype = resolve_dtype(config.dtype, self.device)
        model_dir = resolve_model(config.model)
        self.tokenizer = load_tokenizer(model_dir)
        self.model, self.hf_config, max_model_len = load_model(model_dir, self.dtype, self.device, config.max_model_len)
        layout = kv_cache_layout(self.hf_config, config.block_size, self.dtype)
        num_blocks = layout.num_blocks_for_budget(config.kv_cache_memory)
        if num_blocks < 1:
            raise ConfigError(
                f"--kv-cache-memory {config.kv_cache_memory} bytes holds no block ({layout.bytes_per_block} bytes each)"
            )
        if num_blocks * config.block_size < max_model_len:
            max_model_len = num_blocks * config.block_size
            log.warning("max_model_len lowered to %d, all the KV cache holds", max_model_len)
        self.max_model_len = max_model_len
        log.info(
            "KV cache %d blocks x %d tokens = %d tokens, %.1f MiB (%s, %s, weights %s)",
            num_blocks,
            config.block_size,
            num_blocks * config.block_size,
            num_blocks * layout.bytes_per_block / 2**20,
            self.dtype,
            self.device,
            config.quantization or self.dtype,
        )
        self.block_manager = BlockManager(num_blocks, config.block_size, config.enable_prefix_caching)
        self.scheduler = Scheduler(
            self.block_manager,
            config.max_num_seqs,
            config.max_num_batched_tokens,
            max_model_len,
            eos_token_ids=eos_token_ids(model_dir, self.hf_config),
            keep_finished_blocks=keep_finished_blocks,
            enable_chunked_prefill=config.enable_chunked_prefill,
            long_prefill_threshold=config.long_prefill_threshold,
        )
        if config.quantization == "int8":  # before the cache: its errors are not the cache's
            quantize_model(self.model, self.device, calibration_token_ids(self.tokenizer, self.hf_config.vocab_size))
        try:
            self.runner = ModelRunner(
                self.model,
                layout,
                num_blocks,
                self.device,
                self.dtype,
                seed=config.seed,
                eos_token_ids=self.scheduler.eos_token_ids,
            )
        except (torch.OutOfMemoryError, RuntimeError) as exc:
            if "memory" not in str(exc).lower():
                raise
            raise ConfigError(
                f"--kv-cache-memory {config.kv_cache_memory} bytes does not fit on {self.device}: lower it"
            ) from None
        # A prefill worker's engine (keep_finished_blocks) never runs a decode step: no graphs to keep for it.
        if self.device.type == "cuda" and not config.enforce_eager and not keep_finished_blocks:
            started = time.perf_counter()
            try:
                self.runner.use_decode_graphs(config.max_num_seqs, -(-max_model_len // config.block_size))
            except torch.OutOfMemoryError:
                raise ConfigError(
                    "no memory left to capture the decode CUDA graphs: lower --kv-cache-memory or "
                    "--max-num-seqs, or pass --enforce-eager"
                ) from None
            log.info(
                "decode CUDA graphs for batch sizes %s captured in %.1f s (--enforce-eager skips them)",
                self.runner.decode_graphs.sizes,
                time.perf_counter() - started,
            )
        self.vocab_size = self.hf_config.vocab_size
        self._ids = itertools.count()
        self._live: dict[str, Sequence] = {}
        self._logprobs: dict[str, list[TokenLogprobs]] = {}
        self.last_plan: StepPlan | None = None

    # -- requests -----------------------------------------------------------------------------------------
    def encode(self, prompt: str, chat: bool = False) -> list[int]:
        if self.tokenizer is None:
            raise InvalidRequest("this model folder has no tokenizer: pass token ids, not text")
        if chat:
            if not self.tokenizer.chat_template:
                raise InvalidRequest("this model's tokenizer has no chat template: send the prompt without --chat")
            return list(
                self.tokenizer.apply_chat_template(
                    [{"role": "user", "content": prompt}], tokenize=True, add_generation_prompt=True, return_dict=False
                )
            )
        return self.tokenizer.encode(prompt)

    def add_request(
        self,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        request_id: str | None = None,
        chat: bool = False,
        resume_token_ids: list[int] = (),
    ) -> str:
        """resume_token_ids: outputs generated elsewhere before (a request moved off a failed worker). They are
        computed with the prompt, and count as outputs: for max_tokens, penalties and the finish rules."""
        params = params or SamplingParams()
        token_ids = self.encode(prompt, chat) if isinstance(prompt, str) else list(prompt)
        self.validate_prompt(token_ids + list(resume_token_ids))
        self.validate_params(params)
        return self._queue(token_ids, params, request_id, resume_token_ids)

    def _queue(
        self,
        token_ids: list[int],
        params: SamplingParams,
        request_id: str | None = None,
        resume_token_ids: list[int] = (),
    ) -> str:
        """Queue a validated prompt."""
        request_id = request_id or f"req-{next(self._ids)}"
        if request_id in self._live:
            raise InvalidRequest(f"request id {request_id!r} is already in use")
        # Outputs with nothing computed: the scheduler runs it like a preempted sequence, all tokens as one prompt.
        seq = Sequence(request_id, token_ids, params, output_token_ids=list(resume_token_ids))
        self._live[request_id] = seq
        self.scheduler.add(seq)
        return request_id

    def validate_prompt(self, token_ids: list[int]) -> None:
        if not token_ids:
            raise InvalidRequest("the prompt is empty")
        if len(token_ids) >= self.max_model_len:
            raise InvalidRequest(
                f"the prompt has {len(token_ids)} tokens, more than this model's maximum of "
                f"{self.max_model_len - 1} (max_model_len {self.max_model_len}, one left to generate)"
            )
        bad = next((t for t in token_ids if not isinstance(t, int) or not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise InvalidRequest(f"token id {bad!r} is outside the vocabulary [0, {self.vocab_size})")

    def validate_params(self, params: SamplingParams) -> None:
        """What SamplingParams cannot check alone: token ids against this model's vocabulary."""
        for name, ids in (("logit_bias", [t for t, _ in params.logit_bias]), ("stop_token_ids", params.stop_token_ids)):
            bad = next((t for t in ids if t >= self.vocab_size), None)
            if bad is not None:
                raise InvalidRequest(f"{name}: token id {bad} is outside the vocabulary [0, {self.vocab_size})")

    def add_prefilled(
        self,
        request_ids: list[str],
        prompt_token_ids: list[int],
        first_token_ids: list[int],
        params: list[SamplingParams],
        kv,
        resume_token_ids: list[int] = (),
        held_blocks: list[int] = (),
    ) -> bool:
        """A whole transfer in one go (begin_prefilled, write_prefilled, finish_prefilled): kv holds every layer
        of the prompt's blocks after the held ones. False when there is no room now."""
        blocks = self.begin_prefilled(request_ids, prompt_token_ids, params, resume_token_ids, held_blocks)
        if blocks is None:
            return False
        placed = False
        try:
            if kv.dim() != 6 or kv.shape[0] != self.runner.layout.num_layers:
                raise InvalidRequest(f"KV of shape {tuple(kv.shape)}: one message must carry every layer here")
            self.write_prefilled(blocks, kv)
            placed = self.finish_prefilled(
                request_ids, prompt_token_ids, first_token_ids, params, blocks, resume_token_ids, held_blocks
            )
            return placed
        finally:
            if not placed:
                self.block_manager.free(blocks)

    def begin_prefilled(
        self,
        request_ids: list[str],
        prompt_token_ids: list[int],
        params: list[SamplingParams],
        resume_token_ids: list[int] = (),
        held_blocks: list[int] = (),
    ) -> list[int] | None:
        """Check a transfer of sequences (one per choice) whose prompt KV was computed elsewhere, and allocate
        the blocks its KV fills: the prompt's blocks after held_blocks (cached blocks holding the first full
        blocks' KV, referenced by the caller for this transfer). None when there is no room now. The caller owns
        the blocks until finish_prefilled admits the sequences. resume_token_ids: outputs from before a move,
        whose KV comes with the prompt's (one choice only). The first tokens are not needed yet: the sender may
        still be computing them."""
        if resume_token_ids and len(request_ids) != 1:
            raise InvalidRequest("a resumed request continues exactly one choice")
        if not request_ids or len(request_ids) != len(params):
            raise InvalidRequest("a KV transfer needs one set of parameters per choice")
        tokens = list(prompt_token_ids) + list(resume_token_ids)  # those whose KV comes
        self.validate_prompt(tokens)
        for request_id, choice_params in zip(request_ids, params):
            self.validate_params(choice_params)
            if request_id in self._live:
                raise InvalidRequest(f"request id {request_id!r} is already in use")
        num_prompt, bm = len(tokens), self.block_manager
        num_held = len(held_blocks)
        if num_held > bm.num_cacheable_blocks(num_prompt):
            raise InvalidRequest(
                f"{num_held} held blocks for {num_prompt} prompt tokens: only full blocks before "
                f"the last token's can be left out"
            )
        if [bm.hash_of.get(b) for b in held_blocks] != block_hashes(tokens[: num_held * bm.block_size], bm.block_size):
            raise InvalidRequest("the held blocks do not hold this prompt's first tokens")
        if not self.scheduler.could_ever_admit_prefilled(num_prompt + 1, len(request_ids)):
            raise InvalidRequest(
                f"{len(request_ids)} choices of {num_prompt + 1} tokens exceed what this worker can "
                f"run at once (max_num_seqs {self.scheduler.max_num_seqs}, {bm.num_blocks} blocks)"
            )
        if not self.scheduler.can_admit_prefilled(num_prompt + 1, len(request_ids), num_held):
            return None
        return bm.allocate(bm.num_blocks_for(num_prompt) - num_held)

    def write_prefilled(self, blocks: list[int], kv, layer_start: int = 0) -> None:
        """Place received K and V ([layers, blocks, block_size, 2, kvh, d]) of layers [layer_start, layer_start +
        kv.shape[0]) into a transfer's blocks."""
        layout = self.runner.layout
        num_layers = kv.shape[0] if kv.dim() == 6 else 0
        expected = (num_layers, len(blocks), layout.block_size, 2, layout.num_kv_heads, layout.head_dim)
        if (
            num_layers < 1
            or layer_start < 0
            or layer_start + num_layers > layout.num_layers
            or tuple(kv.shape) != expected
        ):
            raise InvalidRequest(
                f"KV of shape {tuple(kv.shape)} from layer {layer_start} into {len(blocks)} "
                f"blocks; this worker has {layout.num_layers} layers of "
                f"{expected[2:]} per block"
            )
        self.runner.write_blocks(blocks, kv, (layer_start, layer_start + num_layers))

    def finish_prefilled(
        self,
        request_ids: list[str],
        prompt_token_ids: list[int],
        first_token_ids: list[int],
        params: list[SamplingParams],
        blocks: list[int],
        resume_token_ids: list[int] = (),
        held_blocks: list[int] = (),
    ) -> bool:
        """Admit a transfer's sequences once every layer of its blocks is written. The first choice takes over the
        references to held_blocks and blocks; the choices share the prompt's full blocks (ref counts), and each
        gets its own copy of a partly filled last block, since each appends its own tokens there. False when
        there is no room now (the caller still owns the blocks). request_ids may be fewer than begin_prefilled's:
        the choices that ended at their first token are left out."""
        if not request_ids or not len(request_ids) == len(first_token_ids) == len(params):
            raise InvalidRequest("a KV transfer needs one first token and one set of parameters per choice")
        for first_token_id in first_token_ids:
            if not 0 <= first_token_id < self.vocab_size:
                raise InvalidRequest(f"token id {first_token_id} is outside the vocabulary [0, {self.vocab_size})")
        num_prompt = len(prompt_token_ids) + len(resume_token_ids)
        size = self.block_manager.block_size
        if not self.scheduler.can_admit_prefilled(num_prompt + 1, len(request_ids), len(held_blocks) + len(blocks)):
            return False
        num_full = num_prompt // size
        first = None
        for request_id, first_token_id, choice_params in zip(request_ids, first_token_ids, params):
            seq = Sequence(
                request_id,
                list(prompt_token_ids),
                choice_params,
                output_token_ids=[*resume_token_ids, first_token_id],
                num_computed_tokens=num_prompt,
            )
            if first is None:
                self.scheduler.admit_prefilled(seq, [*held_blocks, *blocks])
                first = seq
            else:
                self.block_manager.share(first.block_table[:num_full])
                self.scheduler.admit_prefilled(seq, first.block_table[:num_full])
                if num_prompt % size:
                    self.runner.copy_block(first.block_table[num_full], seq.block_table[num_full])
            self._live[request_id] = seq
        return True

    def abort(self, request_id: str) -> bool:
        seq = self.scheduler.abort(request_id)
        self.forget(request_id)
        return seq is not None

    def forget(self, request_id: str) -> None:
        self._live.pop(request_id, None)
        self._logprobs.pop(request_id, None)
        self.runner.release(request_id)

    # -- the loop -----------------------------------------------------------------------------------------
    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished

    def step(self) -> list[RequestOutput]:
        """Run one scheduler step; returns an output for every sequence that got a token in it."""
        self.last_plan = plan = self.scheduler.schedule()  # what ran, for a worker's trace of the step
        if not plan.chunks:
            return []
        sampled = self.runner.execute(plan)
        finished = {id(s) for s in self.scheduler.update(plan, sampled)}
        outputs = []
        for chunk, token_id, logprobs in zip(plan.chunks, sampled, self.runner.last_logprobs):
            if token_id is None:
                continue
            seq = chunk.seq
            done = id(seq) in finished
            out = RequestOutput(
                seq.request_id, seq.prompt_token_ids, list(seq.output_token_ids), [token_id], done, seq.finish_reason
            )
            if logprobs is not None:
                out.new_logprobs = [logprobs]
                out.logprobs = self._logprobs.setdefault(seq.request_id, [])
                out.logprobs.append(logprobs)
            if (plan.is_prefill or done) and seq.params.prompt_logprobs is not None:  # first and last output
                out.prompt_logprobs = self.runner.prompt_logprobs.get(seq.request_id)
            outputs.append(out)
            if done:
                self.forget(seq.request_id)
        return outputs

    def generate(
        self,
        prompts: list[str | list[int]],
        params: SamplingParams | list[SamplingParams] | None = None,
        chat: bool = False,
    ) -> list[RequestOutput]:
        """Run prompts to completion together; outputs in the order of the prompts."""
        params_list = params if isinstance(params, list) else [params or SamplingParams()] * len(prompts)
        if len(params_list) != len(prompts):
            raise InvalidRequest(f"{len(prompts)} prompts but {len(params_list)} sampling parameters")
        # Every prompt is checked before any is queued: a bad one must not leave the others behind.
        token_lists = [self.encode(p, chat) if isinstance(p, str) else list(p) for p in prompts]
        for token_ids in token_lists:
            self.validate_prompt(token_ids)
        ids = [self._queue(t, sp or SamplingParams()) for t, sp in zip(token_lists, params_list)]
        done: dict[str, RequestOutput] = {}
        while self.has_unfinished():
            for out in self.step():
                if out.finished:
                    if self.tokenizer is not None:
                        out.text = self.tokenizer.decode(out.output_token_ids, skip_special_tokens=True)
                    done[out.request_id] = out
        return [done[i] for i in ids]


def load_tokenizer(model_dir):
    """The folder's tokenizer, or None for a weights-only folder (tests' tiny models): such an engine takes token ids."""
    from transformers import AutoTokenizer

    if not any(os.path.isfile(os.path.join(model_dir, f)) for f in ("tokenizer.json", "tokenizer.model", "vocab.json")):
        return None
    return AutoTokenizer.from_pretrained(model_dir)


def eos_token_ids(model_dir, hf_config) -> tuple[int, ...]:
    """EOS ids as transformers' generate uses them: generation_config.json first, then config.json."""
    from transformers import GenerationConfig

    eos = None
    if os.path.isfile(os.path.join(model_dir, "generation_config.json")):
        eos = GenerationConfig.from_pretrained(model_dir).eos_token_id
    if eos is None:
        eos = hf_config.eos_token_id
    if eos is None:
        return ()
    return tuple(eos) if isinstance(eos, (list, tuple)) else (eos,)

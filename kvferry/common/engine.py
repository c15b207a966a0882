"""The engine core: one `step()` (schedule, run the model, record the sampled tokens) for every role.

Offline, with the null connector, it runs prefill and decode in one process and is the oracle for the distributed
pipeline: greedy sampling gives the same tokens through both. A prefill or decode worker plugs in its own KV connector
(common/kv_connector.py) and reaches the engine only through its public methods.

`_live` (request id -> Sequence) indexes every sequence: waiting, running, or finished with its blocks kept for the
connector (Sequence.kept) until release(). All that is kept for a request is on its Sequence, so dropping it from the
index forgets the request.

A step's failure ends only that step's requests, each with an error output; only a FatalError (a broken device) ends
the caller.
"""

import functools
import itertools
import logging

import torch

from kvferry.common import faults, received_kv
from kvferry.common.block_manager import BlockManager
from kvferry.common.config import EngineConfig
from kvferry.common.engine_setup import (
    build_runner,
    capture_decode_graphs,
    check_quantization,
    gpu_kv_cache_memory,
    is_device_failure,
    load_tokenizer,
    load_weights,
    mapped_weight_bytes,
    prepared_file,
    resolve_device,
    resolve_dtype,
    resolve_kv_dtype,
    use_device,
)
from kvferry.common.errors import ConfigError, FatalError, InvalidRequest
from kvferry.common.kv_connector import KVConnector
from kvferry.common.memory_budget import budget_of, most_kv_cache
from kvferry.common.model.kv_blocks import layer_groups
from kvferry.common.model.loader import resolve_model
from kvferry.common.model.quant_calibration import calibration_token_ids
from kvferry.common.model.runner import kv_cache_layout
from kvferry.common.model_files import eos_token_ids
from kvferry.common.request_failure import failure_text
from kvferry.common.request_output import EngineStats, RequestOutput
from kvferry.common.sampling import SamplingParams, TokenLogprobs
from kvferry.common.scheduler import Scheduler, StepPlan
from kvferry.common.sequence import FinishReason, Sequence, SequenceStatus
from kvferry.common.structured.grammars import GrammarCache
from kvferry.common.structured.matcher import ConstraintState

log = logging.getLogger("kvferry.engine")


class LLMEngine:
    def __init__(self, config: EngineConfig | None = None, connector: KVConnector | None = None):
        self.config = config = config or EngineConfig()
        self.connector = connector = connector or KVConnector()
        keep_finished_blocks = connector.keeps_finished_blocks
        if config.num_threads is not None:  # EngineConfig checked its bound
            torch.set_num_threads(config.num_threads)
        self.device = resolve_device(config.device)
        use_device(self.device)
        self.dtype = resolve_dtype(config.dtype, self.device)
        self.kv_dtype = resolve_kv_dtype(config.kv_cache_dtype, self.device, self.dtype)
        check_quantization(config.quantization, self.device)
        self.model_dir = model_dir = resolve_model(config.model)
        kv_cache_memory = config.kv_cache_memory
        most = most_kv_cache(model_dir, config, self.kv_dtype.itemsize)  # a cache sized from memory takes no more
        prepared = prepared_file(model_dir, self.dtype, self.device, config)
        if self.device.type == "cpu":  # a GPU's own memory fails as the cache is allocated (build_runner)
            budget = budget_of(
                model_dir, self.dtype.itemsize, kv_cache_memory, config.memory_utilization, most,
                weights=mapped_weight_bytes(prepared),
            )  # fmt: skip
            log.info("memory budget: %s", budget.describe())
            budget.check()  # before loading: Linux would start what cannot fit, and kill it later
            kv_cache_memory = budget.kv_cache
        # Quantized before the cache: its errors are not the cache's
        self.model, self.model_config, max_model_len = load_weights(
            model_dir,
            self.dtype,
            self.device,
            config,
            prepared,
            lambda model_config: calibration_token_ids(self.tokenizer, model_config.vocab_size),
        )
        if kv_cache_memory is None:  # CUDA: what the utilization leaves of the GPU beside the weights now loaded
            kv_cache_memory = min(gpu_kv_cache_memory(self.device, config.memory_utilization), most)
        self.kv_cache_memory = kv_cache_memory
        layout = kv_cache_layout(self.model_config, config.block_size, self.kv_dtype)
        num_blocks = layout.num_blocks_for_budget(kv_cache_memory)
        if num_blocks < 1:
            raise ConfigError(
                f"--kv-cache-memory {kv_cache_memory} bytes holds no block ({layout.bytes_per_block} bytes each)"
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
            self.kv_dtype,
            self.device,
            config.quantization or self.dtype,
        )
        self.block_manager = BlockManager(num_blocks, config.block_size, config.enable_prefix_caching)
        self.scheduler = Scheduler(
            self.block_manager,
            config.max_num_seqs,
            config.max_num_batched_tokens,
            max_model_len,
            eos_token_ids=eos_token_ids(model_dir, self.model_config),
            keep_finished_blocks=keep_finished_blocks,
            enable_chunked_prefill=config.enable_chunked_prefill,
            long_prefill_threshold=config.long_prefill_threshold,
        )
        self.runner = build_runner(
            self.model, layout, num_blocks, self.device, self.dtype, self.kv_dtype, config, self.scheduler
        )
        # A prefill worker's engine (keep_finished_blocks) never runs a decode step: no graphs to keep for it.
        if self.device.type == "cuda" and not config.enforce_eager and not keep_finished_blocks:
            capture_decode_graphs(self.runner, config, max_model_len)
        self.vocab_size = self.model_config.vocab_size
        self.grammars = GrammarCache(lambda: self.tokenizer, self.vocab_size, self.scheduler.eos_token_ids)
        self._ids = itertools.count()
        # Every sequence held here, kept ones too. The name is read by received_kv.admit_choices, on this engine or
        # on the simulator's stand-in.
        self._live: dict[str, Sequence] = {}
        self.last_plan: StepPlan | None = None
        self.layer_groups = layer_groups(layout.num_layers)
        self._group_ending_at = {hi: (lo, hi) for lo, hi in self.layer_groups}  # a group's last layer + 1 -> it
        spec = faults.from_env()
        self._injected_failing_step = spec.fail_step if spec else 0  # a test's injected step failure (common/faults.py)
        self.num_steps = 0
        connector.bind(self)

    @functools.cached_property
    def tokenizer(self):
        """transformers' tokenizer of the model, loaded when first used (None for a weights-only folder). A worker
        needs it only for structured output and int8's calibration, and importing transformers would be most of
        its start."""
        return load_tokenizer(self.model_dir)

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
        grammar=None,
    ) -> str:
        """resume_token_ids: outputs generated elsewhere before (a request moved off a failed worker). They are
        computed with the prompt, and count as outputs: for max_tokens, penalties and the finish rules.
        grammar: params.constraint compiled (a worker compiles it off its loop); None: compiled here."""
        params = params or SamplingParams()
        token_ids = self.encode(prompt, chat) if isinstance(prompt, str) else list(prompt)
        self.validate_prompt(token_ids + list(resume_token_ids))
        self.validate_params(params)
        return self._queue(token_ids, params, request_id, resume_token_ids, grammar)

    def _queue(
        self,
        token_ids: list[int],
        params: SamplingParams,
        request_id: str | None = None,
        resume_token_ids: list[int] = (),
        grammar=None,
    ) -> str:
        """Queue a validated prompt."""
        request_id = request_id or f"req-{next(self._ids)}"
        if request_id in self._live:
            raise InvalidRequest(f"request id {request_id!r} is already in use")
        # Outputs with nothing computed: the scheduler runs it like a preempted sequence, all tokens as one prompt.
        seq = Sequence(request_id, token_ids, params, output_token_ids=list(resume_token_ids))
        seq.constraint_state = self.constraint_state(params, resume_token_ids, grammar)
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

    def constraint_state(self, params: SamplingParams, token_ids: list[int], grammar=None) -> ConstraintState | None:
        """A matcher for params' constraint that has seen token_ids (the outputs so far); None without one.
        grammar: the constraint compiled; a worker passes the one it compiled off its loop (the cache may have let
        it go since), and only the offline engine compiles here."""
        if params.constraint is None:
            return None
        return ConstraintState(grammar or self.grammars.compile(params.constraint), token_ids)

    def validate_params(self, params: SamplingParams) -> None:
        """What SamplingParams cannot check alone: token ids against this model's vocabulary."""
        for name, ids in (("logit_bias", [t for t, _ in params.logit_bias]), ("stop_token_ids", params.stop_token_ids)):
            bad = next((t for t in ids if t >= self.vocab_size), None)
            if bad is not None:
                raise InvalidRequest(f"{name}: token id {bad} is outside the vocabulary [0, {self.vocab_size})")

    def abort(self, request_id: str) -> bool:
        """End a request wherever it is: waiting, running, or finished with its blocks kept."""
        seq = self.scheduler.abort(request_id)
        held = self._live.get(request_id)
        kept = held is not None and held.kept
        self.release(request_id)
        return seq is not None or kept

    def has_request(self, request_id: str) -> bool:
        return request_id in self._live

    # The one way in for sequences whose prompt KV was computed elsewhere and placed into blocks (a decode
    # connector reserved them with received_kv.reserve): all of a transfer's choices join the running batch, or none
    # does (False: no room now; the caller still owns the blocks).
    admit_prefilled = received_kv.admit_choices

    def forget(self, request_id: str) -> None:
        """Drop a sequence from the index, and with it all the engine kept for it; its blocks are not touched."""
        self._live.pop(request_id, None)

    # -- the loop -----------------------------------------------------------------------------------------
    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished

    def step(self) -> list[RequestOutput]:
        """Run one scheduler step; returns an output for every sequence that got a token in it, or that the step's
        failure ended."""
        released, failed = self.connector.get_finished()
        for request_id in released:
            self.release(request_id)
        for request_id in failed:
            self.abort(request_id)
        self.last_plan = plan = self.scheduler.schedule()  # what ran, for a worker's trace of the step
        if not plan.chunks:
            return []
        self.num_steps += 1
        try:
            if self.num_steps == self._injected_failing_step:
                raise RuntimeError(f"{faults.ENV}: step {self.num_steps} fails, as a kernel error would")
            self.connector.on_scheduled(plan)
            sampled = self.runner.execute(plan, after_layer=self._layer_hook(plan))
            finished_seqs = self.scheduler.update(plan, sampled)
            finished = {id(s) for s in finished_seqs}
            for s in finished_seqs:  # at once: a failure below must not lose their blocks
                s.kept = self.connector.request_finished(s)
        except FatalError:
            raise
        except Exception as exc:
            if is_device_failure(exc):
                raise FatalError(f"the device failed: {exc}") from exc
            return self._fail_step(plan, exc)
        outputs = []
        ended = SequenceStatus.FINISHED
        for chunk, token_id, logprobs in zip(plan.chunks, sampled, self.runner.last_logprobs):
            if token_id is None:
                continue
            seq = chunk.seq
            done = False
            if seq.status is ended:  # the ones still running (most of a decode step's) skip the rest
                done = id(seq) in finished
                if not done:
                    continue  # ended while the step ran: not an output of it
                if seq.finish_reason == FinishReason.DEAD_END:  # the token it drew was not allowed: not an output
                    token_id, logprobs = None, None
            out = RequestOutput(
                seq.request_id,
                seq.prompt_token_ids,
                list(seq.output_token_ids),
                [] if token_id is None else [token_id],
                done,
                seq.finish_reason,
            )
            if logprobs is not None:
                out.new_logprobs = [logprobs]
                seq.logprobs.append(logprobs)
                out.logprobs = seq.logprobs
            if (plan.is_prefill or done) and seq.params.prompt_logprobs is not None:  # first and last output
                out.prompt_logprobs = seq.prompt_logprobs
            outputs.append(out)
            if done and not seq.kept:  # a kept one stays in the index, logprobs and all, until release()
                self.forget(seq.request_id)
        return outputs

    def _layer_hook(self, plan: StepPlan):
        """The runner's after_layer callback: tells the connector as each group of layers lands in the cache."""
        if not self.connector.wants_layer_events:
            return None

        def after_layer(layer: int) -> None:
            group = self._group_ending_at.get(layer + 1)
            if group is not None:
                self.connector.save_layers(plan, group)

        return after_layer

    def _fail_step(self, plan: StepPlan, exc: Exception) -> list[RequestOutput]:
        """A step that raised belongs to no single request: each of its requests ends with the error, their blocks
        are freed, and the engine stays usable for the others."""
        log.exception("a step of %d sequences failed; ending them", len(plan.chunks))
        outputs = []
        for seq in {id(c.seq): c.seq for c in plan.chunks}.values():
            self.abort(seq.request_id)  # waiting, running, or finished with its blocks kept
            if seq.is_finished and seq.block_table:  # finished by the step before it failed: blocks not kept
                self.scheduler.release(seq)
            outputs.append(
                RequestOutput(
                    seq.request_id,
                    seq.prompt_token_ids,
                    list(seq.output_token_ids),
                    [],
                    True,
                    FinishReason.ABORT,
                    error=failure_text(exc),
                )
            )
        return outputs

    # -- what a connector's role reads and releases ---------------------------------------------------------
    def release(self, request_id: str) -> None:
        """Let go of a request's sequence; a kept one (keeps_finished_blocks) frees its blocks too."""
        seq = self._live.pop(request_id, None)
        if seq is not None and seq.kept:
            self.scheduler.release(seq)
            seq.kept = False

    def kept_block_ids(self, request_id: str) -> list[int]:
        seq = self._live[request_id]
        assert seq.kept, f"{request_id} has no kept blocks"
        return list(seq.block_table)

    def read_kv(self, block_ids: list[int], layers: tuple[int, int]):
        """K and V of these blocks in layers [lo, hi): [layers, blocks, block_size, 2, kvh, d], contiguous on the
        CPU, ready to go out as one raw frame. From a CUDA cache the copy may still be running, overlapping the
        compute queued after it: as_frames (the KV sender waits) and kv_blocks.wait_copied wait for it."""
        return self.runner.read_blocks(block_ids, layers)

    def first_tokens(
        self, out: RequestOutput, params: SamplingParams, extra: list[SamplingParams]
    ) -> list[tuple[int, TokenLogprobs | None, FinishReason | None]]:
        """A prompt that finished in the latest step (out): each choice's first token, its logprobs, and how that
        token ends the choice (None: it goes on), judged by params (the request's own, not the one-token
        parameters the engine ran it with). Choice 0 is out's token; the extra choices draw from the same logits,
        each with its own parameters and its own constraint state. A choice whose constraint allowed no token
        has token -1 and FinishReason.DEAD_END."""
        seq = self._live[out.request_id]
        num_outputs, num_tokens = len(seq.output_token_ids), seq.num_tokens
        if out.finish_reason == FinishReason.DEAD_END:  # its token was not appended
            before = seq.output_token_ids  # what each choice's constraint had seen before its first token
            firsts = [(-1, None, FinishReason.DEAD_END)]
        else:
            before = seq.output_token_ids[:-1]
            token, logprobs = out.new_token_ids[0], out.new_logprobs[0] if out.new_logprobs else None
            reason = self.scheduler.finish_reason(params, token, num_outputs, num_tokens, seq.constraint_state)
            firsts = [(token, logprobs, reason)]
        state = seq.constraint_state  # each choice's own, of the same grammar
        states = [state.again(before) if state is not None else None for _ in extra]
        for (token, logprobs), choice_params, state in zip(
            self.runner.sample_choices(seq, extra, states, len(before)), extra, states
        ):
            if state is not None and not state.accept(token):
                firsts.append((-1, None, FinishReason.DEAD_END))
            else:
                reason = self.scheduler.finish_reason(choice_params, token, num_outputs, num_tokens, state)
                firsts.append((token, logprobs, reason))
        return firsts

    def prompt_logprobs_of(self, request_id: str) -> list[TokenLogprobs | None]:
        seq = self._live.get(request_id)
        return list(seq.prompt_logprobs or ()) if seq is not None else []

    def hold_prefix(self, block_hashes: list[bytes]) -> list[int]:
        """The ids of the leading cached blocks that hold these hashes, referenced for the caller (free_blocks
        lets go of them)."""
        bm = self.block_manager
        ids = bm.match_prefix(block_hashes[: bm.num_blocks_for(self.max_model_len)])
        bm.take_cached(ids)
        return ids

    def free_blocks(self, block_ids: list[int]) -> None:
        self.block_manager.free(block_ids)

    def num_cacheable_blocks(self, num_tokens: int) -> int:
        return self.block_manager.num_cacheable_blocks(num_tokens)

    @property
    def block_size(self) -> int:
        return self.block_manager.block_size

    @property
    def num_blocks(self) -> int:
        return self.block_manager.num_blocks

    @property
    def num_layers(self) -> int:
        return self.runner.layout.num_layers

    @property
    def bytes_per_block(self) -> int:
        return self.runner.layout.bytes_per_block

    @property
    def caching_enabled(self) -> bool:
        return self.block_manager.enable_caching

    def cached_block_hashes(self) -> list[bytes]:
        return list(self.block_manager.cached)

    def take_cache_events(self) -> tuple[list[bytes], list[bytes]]:
        """Hashes the prefix cache stored and evicted since the last call."""
        return self.block_manager.take_cache_events()

    def stats(self) -> EngineStats:
        sch, bm = self.scheduler, self.block_manager
        return EngineStats(
            num_free_blocks=bm.num_free_blocks,
            num_total_blocks=bm.num_blocks,
            num_running=len(sch.running),
            num_waiting=len(sch.waiting),
            queued_prompt_tokens=sch.queued_prompt_tokens(),
            num_preemptions=sch.num_preemptions,
            num_prompt_tokens_computed=sch.num_computed_prompt_tokens,
            num_prompt_tokens_cached=sch.num_cached_prompt_tokens,
            num_cached_blocks=bm.num_cached_blocks,
        )

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

"""Tiny Llama, Mistral, Qwen2 and Qwen3 models through the engine (chunked, paged prefill and paged
decode in one continuous batch) against the transformers model on the same weights."""

import random

import pytest
import torch

from kvferry.common.config import EngineConfig
from kvferry.common.engine import LLMEngine
from kvferry.common.sampling import SamplingParams
from kvferry.kernels.cpu import decode_attention as cpu_decode
from tests.tiny_models import VOCAB, save_tiny_model


@pytest.mark.parametrize("block_size", [8, 16])
@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen2", "qwen3"])
def test_logits_match_transformers(tmp_path, arch, block_size):
    # The exact path: a float32 KV cache, as transformers keeps its own.
    worst = _worst_logit_error(tmp_path, arch, block_size, "float32")
    assert worst <= 1e-4, f"max abs logit error {worst}"


@pytest.mark.parametrize("kv_cache_dtype, bound", [("float16", 1e-2), ("bfloat16", 6e-2)])
def test_a_half_precision_kv_cache_stays_close_to_transformers(tmp_path, kv_cache_dtype, bound):
    # The CPU's default caches (float16; bfloat16 without F16C): each K and V rounded once, where it is stored.
    # Measured here: about 0.004 and 0.03 (float16 keeps 11 significant bits, bfloat16 8, float32 24).
    worst = _worst_logit_error(tmp_path, "llama", 16, kv_cache_dtype)
    assert 0 < worst <= bound, f"max abs logit error {worst}"


def _worst_logit_error(tmp_path, arch, block_size, kv_cache_dtype) -> float:
    """Greedy outputs through the engine, each equal to transformers' argmax; the largest logit difference."""
    hf = save_tiny_model(arch, tmp_path)
    engine = LLMEngine(
        EngineConfig(
            model=str(tmp_path),
            block_size=block_size,
            kv_cache_memory=2**20,
            max_num_seqs=8,
            max_num_batched_tokens=24,
            kv_cache_dtype=kv_cache_dtype,
        )
    )  # prompts get prefilled in chunks
    # Decode attention runs in the C kernel where it takes the head size (16), else in the reference (Qwen3's 24).
    k_cache, v_cache = engine.runner.k_caches[0], engine.runner.v_caches[0]
    assert (k_cache.dtype == torch.float32) == (kv_cache_dtype == "float32")
    assert cpu_decode.handles(k_cache.float(), k_cache, v_cache) == (arch != "qwen3")
    rng = random.Random(arch)
    prompts = {f"p{n}": [rng.randrange(3, VOCAB) for _ in range(n)] for n in (5, 17, 40, 9, 1)}
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    for rid, ids in prompts.items():
        engine.add_request(ids, params, request_id=rid)
    ours: dict[str, list[torch.Tensor]] = {rid: [] for rid in prompts}
    outputs = {}
    late_joiner_added = False
    while engine.has_unfinished():
        step_outputs = engine.step()
        # The step's sampled rows come in the order of its outputs.
        for out, row in zip(step_outputs, engine.runner.last_logits):
            ours[out.request_id].append(row.clone())
            if out.finished:
                outputs[out.request_id] = out.output_token_ids
        if not late_joiner_added and len(outputs) == 0 and any(ours.values()):
            prompts["late"] = [rng.randrange(3, VOCAB) for _ in range(11)]
            ours["late"] = []
            engine.add_request(prompts["late"], params, request_id="late")  # joins a running batch
            late_joiner_added = True
    assert late_joiner_added and set(outputs) == set(prompts)
    worst = 0.0
    with torch.no_grad():
        for rid, prompt in prompts.items():
            full = prompt + outputs[rid]
            ref = hf(torch.tensor([full[:-1]])).logits[0, len(prompt) - 1 :]  # [num_generated, vocab]
            got = torch.stack(ours[rid])
            assert got.shape == ref.shape
            assert got.abs().max() > 1.0, "logits too small for the comparison to mean anything"
            worst = max(worst, (got - ref).abs().max().item())
            assert outputs[rid] == ref.argmax(-1).tolist()
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    return worst

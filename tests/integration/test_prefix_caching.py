"""Prefix caching and chunked prefill through the real engine: prompts sharing prefixes of every length around a
block boundary give the same greedy tokens, and logits within float error of transformers, with each feature on and
off."""
import random

import torch

from kvferry.common.config import EngineConfig
from kvferry.common.engine import LLMEngine
from kvferry.common.sampling import SamplingParams
from tests.tiny_models import VOCAB, save_tiny_model

BLOCK = 8


def run(engine, waves):
    """Each wave's prompts run together, after the previous wave finished (its blocks then sit in the cache).
    Returns request id -> (output ids, the sampled logits rows)."""
    params = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)
    results = {}
    for wave in waves:
        for rid, ids in wave.items():
            engine.add_request(ids, params, request_id=rid)
            results[rid] = ([], [])
        while engine.has_unfinished():
            outputs = engine.step()  # a step of chunks that all stop short of their prompt's end samples nothing
            for out, row in zip(outputs, engine.runner.last_logits if outputs else ()):
                results[out.request_id][1].append(row.clone())
                if out.finished:
                    results[out.request_id][0].extend(out.output_token_ids)
    return results


def test_shared_prefixes_of_every_length_match_caching_off_and_transformers(tmp_path):
    hf = save_tiny_model("llama", tmp_path)
    rng = random.Random(7)
    base = [rng.randrange(3, VOCAB) for _ in range(5 * BLOCK)]
    first = {"warm": base + [5, 6, 7]}
    lengths = [BLOCK - 1, BLOCK, BLOCK + 1, 2 * BLOCK - 1, 2 * BLOCK, 2 * BLOCK + 1, 4 * BLOCK, 5 * BLOCK]
    second = {f"share{n}": base[:n] + [rng.randrange(3, VOCAB) for _ in range(rng.randrange(1, 12))]
              for n in lengths}
    second["same"] = list(base)             # exactly the cached blocks: the last one is recomputed
    second["same_plus_one"] = base + [9]
    waves = [first, second]
    outcomes = {}
    settings = {"cached": {}, "cached_in_chunks_of_5": {"long_prefill_threshold": 5},
                "not_cached_not_chunked": {"enable_prefix_caching": False, "enable_chunked_prefill": False}}
    for name, overrides in settings.items():
        engine = LLMEngine(EngineConfig(model=str(tmp_path), block_size=BLOCK, kv_cache_memory=2**20, max_num_seqs=16,
                                        max_num_batched_tokens=64, **overrides))
        outcomes[name] = run(engine, waves)
        scheduler = engine.scheduler
        if engine.config.enable_prefix_caching:
            assert scheduler.num_cached_prompt_tokens >= sum(n // BLOCK * BLOCK for n in lengths) - BLOCK
        else:
            assert scheduler.num_cached_prompt_tokens == 0
        assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    prompts = {**first, **second}
    with torch.no_grad():
        for rid, prompt in prompts.items():
            tokens = outcomes["not_cached_not_chunked"][rid][0]
            ref = hf(torch.tensor([(prompt + tokens)[:-1]])).logits[0, len(prompt) - 1:]
            assert tokens == ref.argmax(-1).tolist(), rid
            for name, results in outcomes.items():
                other_tokens, rows = results[rid]
                assert other_tokens == tokens, (name, rid)
                assert (torch.stack(rows) - ref).abs().max().item() <= 1e-4, (name, rid)

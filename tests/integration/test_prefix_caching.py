"""Prefix caching through the real engine: prompts sharing prefixes of every length around a block boundary give
the same greedy tokens, and logits within float error of transformers, as with caching off."""
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
            for out, row in zip(engine.step(), engine.runner.last_logits):
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
    for caching in (True, False):
        engine = LLMEngine(EngineConfig(model=str(tmp_path), block_size=BLOCK, kv_cache_memory=2**20, max_num_seqs=16,
                                        max_num_batched_tokens=64, enable_prefix_caching=caching))
        outcomes[caching] = run(engine, waves)
        scheduler = engine.scheduler
        if caching:
            assert scheduler.num_cached_prompt_tokens >= sum(n // BLOCK * BLOCK for n in lengths) - BLOCK
        else:
            assert scheduler.num_cached_prompt_tokens == 0
        assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    prompts = {**first, **second}
    with torch.no_grad():
        for rid, prompt in prompts.items():
            tokens, rows = outcomes[True][rid]
            assert tokens == outcomes[False][rid][0], rid
            full = prompt + tokens
            ref = hf(torch.tensor([full[:-1]])).logits[0, len(prompt) - 1:]
            assert tokens == ref.argmax(-1).tolist(), rid
            assert (torch.stack(rows) - ref).abs().max().item() <= 1e-4, rid

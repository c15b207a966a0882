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
    second = {f"share{n}": base[:n] + [rng.randrange(3, VOCAB) for _ in range(rng.randrange(1, 12))] for n in lengths}
    second["same"] = list(base)  # exactly the cached blocks: the last one is recomputed
    second["same_plus_one"] = base + [9]
    waves = [first, second]
    outcomes = {}
    settings = {
        "cached": {},
        "cached_in_chunks_of_5": {"long_prefill_threshold": 5},
        "not_cached_not_chunked": {"enable_prefix_caching": False, "enable_chunked_prefill": False},
    }
    for name, overrides in settings.items():
        engine = LLMEngine(
            EngineConfig(
                model=str(tmp_path),
                block_size=BLOCK,
                kv_cache_memory=2**20,
                max_num_seqs=16,
                max_num_batched_tokens=64,
                kv_cache_dtype="float32",  # transformers' own cache: compared token for token
                **overrides,
            )
        )
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
            ref = hf(torch.tensor([(prompt + tokens)[:-1]])).logits[0, len(prompt) - 1 :]
            assert tokens == ref.argmax(-1).tolist(), rid
            for name, results in outcomes.items():
                other_tokens, rows = results[rid]
                assert other_tokens == tokens, (name, rid)
                assert (torch.stack(rows) - ref).abs().max().item() <= 1e-4, (name, rid)


def test_a_transfer_that_leaves_out_blocks_the_decoder_holds_decodes_as_a_whole_one(tmp_path):
    """The second turn of a chat: the decoder's cache holds the first turn's blocks, so the prefill side ships
    only the rest, and the greedy tokens are those of one engine running the second turn alone."""
    import pytest

    from kvferry.common import received_kv
    from kvferry.common.block_hash import block_hashes
    from kvferry.common.errors import InvalidRequest
    from kvferry.common.kv_connector import KVConnector

    class KeepingConnector(KVConnector):
        keeps_finished_blocks = True  # as the prefill worker's: blocks stay until released

    save_tiny_model("llama", tmp_path)
    config = EngineConfig(
        model=str(tmp_path), block_size=BLOCK, kv_cache_memory=2**20, max_num_seqs=4, max_num_batched_tokens=64
    )
    prefill, decode = LLMEngine(config, KeepingConnector()), LLMEngine(config)
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    rng = random.Random(3)
    first = [rng.randrange(3, VOCAB) for _ in range(3 * BLOCK + 2)]
    second = first + [rng.randrange(3, VOCAB) for _ in range(BLOCK + 3)]
    all_layers = (0, prefill.num_layers)

    def prefill_prompt(rid, prompt):
        """The prompt's first token, as a prefill worker's engine computes it; its blocks stay kept."""
        prefill.add_request(prompt, SamplingParams(max_tokens=1, temperature=0, ignore_eos=True), request_id=rid)
        while True:
            for out in prefill.step():
                assert out.finished and not out.error
                return out.new_token_ids[0]

    def place(rid, prompt, first_token, kv, held=()):
        """What a decode worker does with a transfer: allocate, write every layer, admit."""
        blocks = received_kv.reserve(decode, [rid], prompt, [params], held_blocks=held)
        assert blocks is not None
        received_kv.check_layers(decode.runner.layout, blocks, kv, 0)
        decode.connector.load_blocks(blocks, kv, 0)
        assert decode.admit_prefilled([rid], prompt, [first_token], [params], blocks, held_blocks=held)

    def decode_all():
        outputs = {}
        while decode.has_unfinished():
            for out in decode.step():
                if out.finished:
                    outputs[out.request_id] = out.output_token_ids
        return outputs

    token = prefill_prompt("turn-1", first)
    place("turn-1", first, token, prefill.read_kv(prefill.kept_block_ids("turn-1"), all_layers))
    prefill.release("turn-1")
    assert decode_all()["turn-1"] == LLMEngine(config).generate([first], params)[0].output_token_ids

    token = prefill_prompt("turn-2", second)
    kept = prefill.kept_block_ids("turn-2")
    held = decode.hold_prefix(block_hashes(second[: (len(second) - 1) // BLOCK * BLOCK], BLOCK))
    assert len(held) == 3  # the first turn's prompt blocks (its answer differs from the second turn's text)
    # Held blocks that do not hold this prompt's start, or more than may be left out, are refused.
    other = [t + 1 for t in second]
    with pytest.raises(InvalidRequest, match="do not hold this prompt"):
        received_kv.reserve(decode, ["x"], other, [params], held_blocks=held)
    with pytest.raises(InvalidRequest, match="can be left out"):
        received_kv.reserve(decode, ["x"], first[: 3 * BLOCK], [params], held_blocks=held)
    kv = prefill.read_kv(kept[3:], all_layers)
    assert kv.shape[1] == len(kept) - 3
    place("turn-2", second, token, kv, held)
    prefill.release("turn-2")
    assert decode_all()["turn-2"] == LLMEngine(config).generate([second], params)[0].output_token_ids
    assert decode.stats().num_free_blocks == decode.num_blocks
    assert prefill.stats().num_free_blocks == prefill.num_blocks

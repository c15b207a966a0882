"""Decode graphs' static buffers and padding, run eagerly on the CPU (capture=False): a continuous batch whose size
moves up and down gives the eager engine's tokens and logits, and a padding row never writes the KV cache.
The capture itself needs CUDA; everything around it is what runs here."""

import torch

from kvferry.common.config import EngineConfig
from kvferry.common.engine import LLMEngine
from kvferry.common.model.decode_graphs import LARGEST_CAPTURED_BATCH, capture_sizes
from kvferry.common.sampling import SamplingParams
from tests.tiny_models import save_tiny_model

BLOCK = 8
# Different lengths and budgets: sequences leave the batch one by one, so it runs at 6, 5, 4, 3, 2 and 1 rows,
# padded to 8, 8, 4, 4, 2 and 1.
PROMPTS = [[5 + i] * (3 + 5 * i) for i in range(6)]
MAX_TOKENS = [4, 7, 9, 12, 15, 18]


def test_capture_sizes_cover_every_batch_up_to_the_cap():
    assert capture_sizes(1) == [1]
    assert capture_sizes(5) == [1, 2, 4, 5]
    assert capture_sizes(40) == [1, 2, 4, 8, 16, 32, 40]
    assert capture_sizes(128) == [1, 2, 4, 8] + list(range(16, 129, 16))
    assert capture_sizes(10_000)[-1] == LARGEST_CAPTURED_BATCH


def generate(engine, check_cache_writes: bool = False):
    """Greedy tokens and each sampled row's logits per request; with check_cache_writes, asserts after every
    decode step that only the slots of the step's real rows changed in the KV cache."""
    params = [SamplingParams(max_tokens=m, temperature=0, ignore_eos=True) for m in MAX_TOKENS]
    for i, (prompt, p) in enumerate(zip(PROMPTS, params)):
        engine.add_request(prompt, p, request_id=f"r{i}")
    tokens, logits, batch_sizes = {}, {}, []
    runner = engine.runner
    step_slots = []  # the real rows' slots of each step, as the runner's (eager) prepare laid them out
    prepare = runner.prepare
    runner.prepare = lambda plan: step_slots.append(prepare(plan)) or step_slots[-1]
    while engine.has_unfinished():
        before = runner.k_cache.clone() if check_cache_writes else None
        outputs = engine.step()
        plan = engine.last_plan
        if not plan.is_prefill:
            batch_sizes.append(len(plan.chunks))
            if check_cache_writes:
                # Only the real rows' slots change: a padding row that kept the slot of a sequence gone from the
                # batch would write into its freed block.
                changed = (runner.k_cache != before).any(dim=(0, 3, 4)).nonzero().tolist()  # [(block, offset)]
                real = set(step_slots[-1].batch.slot_mapping.tolist())
                assert changed and {block * BLOCK + offset for block, offset in changed} <= real
        for out, row in zip(outputs, runner.last_logits if outputs else ()):
            logits.setdefault(out.request_id, []).append(row.clone())
            tokens[out.request_id] = out.output_token_ids
    return tokens, logits, batch_sizes


def test_static_buffers_and_padding_match_the_eager_step(tmp_path):
    save_tiny_model("llama", tmp_path)
    config = EngineConfig(model=str(tmp_path), kv_cache_memory=2**20, block_size=BLOCK, max_num_seqs=16)
    eager = generate(LLMEngine(config))
    padded_engine = LLMEngine(config)
    padded_engine.runner.use_decode_graphs(config.max_num_seqs, -(-padded_engine.max_model_len // BLOCK), capture=False)
    padded = generate(padded_engine, check_cache_writes=True)
    assert sorted(set(padded[2])) == [1, 2, 3, 4, 5, 6]  # the batch really moved through padded sizes
    assert padded[0] == eager[0]
    assert all(len(padded[0][f"r{i}"]) == m for i, m in enumerate(MAX_TOKENS))
    for rid, rows in eager[1].items():
        torch.testing.assert_close(torch.stack(padded[1][rid]), torch.stack(rows), rtol=1e-5, atol=1e-5)

"""SmolLM2-135M-Instruct, greedy: prompts of 5 to 400 tokens decoded together in one continuous batch
give exactly the token ids of transformers' generate on each prompt alone, with or without preemption."""

import pytest
import torch

from kvferry.common.config import EngineConfig
from kvferry.common.engine import LLMEngine
from kvferry.common.model_files import resolve_model
from kvferry.common.sampling import SamplingParams

pytestmark = pytest.mark.slow
MAX_NEW = 48

FACTS = [
    "The river Danube flows through ten countries before it reaches the Black Sea.",
    "Paged attention stores the key and value cache in fixed-size blocks.",
    "A lighthouse keeper once logged every ship that passed for forty years.",
    "Bread rises because yeast turns sugar into carbon dioxide and alcohol.",
    "The first programmable computers filled entire rooms and used vacuum tubes.",
    "Octopuses have three hearts and blue blood rich in copper.",
    "Continuous batching lets new requests join a running batch at every step.",
    "Mount Everest grows a few millimetres each year as the plates collide.",
]


def long_text(num_sentences: int) -> str:
    return " ".join(FACTS[i % len(FACTS)] + f" (note {i})" for i in range(num_sentences))


@pytest.fixture(scope="module")
def model_dir():
    return resolve_model(None)


@pytest.fixture(scope="module")
def prompts(model_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    chat = lambda text: tok.apply_chat_template(
        [{"role": "user", "content": text}], tokenize=True, add_generation_prompt=True, return_dict=False
    )
    ids = [
        tok.encode("Hello, my name is"),
        tok.encode("The capital of France is"),
        chat("What is paged attention?"),
        chat("Write a haiku about the sea."),
        tok.encode(long_text(3)),
        chat("Summarise this: " + long_text(6)),
        tok.encode("Once upon a time, " + long_text(12)),
        chat("List three facts from this text. " + long_text(16)),
        tok.encode(long_text(21)),
    ]
    ids = [list(p) for p in ids]
    lengths = sorted(len(p) for p in ids)
    assert lengths[0] >= 5 and lengths[0] <= 8 and 330 <= lengths[-1] <= 400, lengths
    return ids


@pytest.fixture(scope="module")
def reference(model_dir, prompts):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    outs = []
    with torch.inference_mode():
        for p in prompts:  # each prompt alone
            out = hf.generate(torch.tensor([p]), max_new_tokens=MAX_NEW, do_sample=False)
            outs.append(out[0, len(p) :].tolist())
    return outs


def run_together(model_dir, prompts, **engine_kwargs):
    # The exact path: a float32 KV cache, as transformers' own (the CPU's default is half precision)
    engine = LLMEngine(EngineConfig(model=str(model_dir), kv_cache_dtype="float32", **engine_kwargs))
    results = engine.generate(prompts, SamplingParams(max_tokens=MAX_NEW, temperature=0))
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    return [r.output_token_ids for r in results], engine


def test_continuous_batch_matches_transformers_token_for_token(model_dir, prompts, reference):
    outputs, engine = run_together(model_dir, prompts)
    assert engine.scheduler.num_preemptions == 0
    for i, (ours, ref) in enumerate(zip(outputs, reference)):
        assert ours == ref, f"prompt {i} ({len(prompts[i])} tokens) diverged"
    assert sum(len(r) for r in reference) > 5 * MAX_NEW  # real generations, not early EOS everywhere


def test_same_tokens_when_the_pool_forces_preemption(model_dir, prompts, reference):
    # 44 blocks of 16 tokens (~700 tokens) for ~1,500 prompt tokens: sequences must be preempted.
    outputs, engine = run_together(model_dir, prompts, kv_cache_memory=44 * 737280, max_num_batched_tokens=512)
    assert engine.block_manager.num_blocks == 44
    assert engine.scheduler.num_preemptions > 0
    assert outputs == reference

"""Prefix caching across the stack: prompts sharing a system prompt go to the prefill worker that holds it, reuse
its blocks there, and give the same greedy text as the in-process engine with caching off."""
import concurrent.futures

import pytest

from kvferry.common.config import EngineConfig
from kvferry.common.engine import LLMEngine
from kvferry.common.sampling import SamplingParams

pytestmark = pytest.mark.slow
SYSTEM = ("You are a careful assistant. Answer in one short sentence, without lists, and say when you are not "
          "sure. ") * 6
QUESTIONS = ["What is the capital of Italy?", "Name a large ocean.", "What do bees make?", "How many legs has a spider?",
             "What colour is grass?", "Who wrote Hamlet?", "What is ice made of?"]


def test_shared_prefix_routes_to_its_cache_and_matches_the_engine(make_stack):
    engine = LLMEngine(EngineConfig(kv_cache_memory=64 * 2**20, enable_prefix_caching=False))
    prompts = [engine.encode(SYSTEM + q) for q in QUESTIONS]
    params = SamplingParams(max_tokens=12, temperature=0)
    expected = [out.text for out in engine.generate(prompts, params)]
    system_blocks = len(engine.encode(SYSTEM)) // 16
    assert system_blocks >= 8

    stack = make_stack()
    stack.start_gateway()
    for name, role in (("prefill-a", "prefill"), ("prefill-b", "prefill"), ("decode-a", "decode")):
        stack.start_worker(name, role)
    stack.wait_workers({"prefill-a", "prefill-b", "decode-a"})

    def complete(ids):
        status, reply = stack.post("/v1/completions", {"prompt": ids, "max_tokens": 12, "temperature": 0})
        assert status == 200, reply
        return reply["choices"][0]["text"]

    assert complete(prompts[0]) == expected[0]
    holder = max(stack.workers().values(), key=lambda w: w.get("prompts_prefilled", 0))["id"]
    other = ({"prefill-a", "prefill-b"} - {holder}).pop()
    with concurrent.futures.ThreadPoolExecutor(len(prompts) - 1) as pool:
        answers = list(pool.map(complete, prompts[1:]))
    assert answers == expected[1:]
    stack.wait_for(lambda: stack.workers()[holder]["prompts_prefilled"] == len(prompts), 10, "heartbeats")
    workers = stack.workers()
    # Every later prompt went where the system prompt was cached, and computed only its own question there.
    assert workers[other]["prompts_prefilled"] == 0, workers
    assert workers[holder]["prompt_tokens_cached"] >= (len(prompts) - 1) * system_blocks * 16, workers[holder]
    assert workers[holder]["prompt_tokens_computed"] <= sum(map(len, prompts)) - (len(prompts) - 1) * system_blocks * 16
    assert workers[holder]["cached_blocks"] >= system_blocks


def test_benchmark_replay_reports_groups_and_the_prefill_counters(make_stack):
    """What `kvferry bench serve/feature` read: the replay's per-group latencies and token counts over real HTTP,
    and the prefill workers' computed and cached prompt tokens from /v1/workers."""
    import asyncio

    from kvferry.services.bench.serve import counters_delta, prefill_counters, replay
    from kvferry.services.bench.stack import served_model

    stack = make_stack().start_pair()
    shared = list(range(1000, 1064))  # 4 blocks
    requests = [{"id": f"r{i}", "prompt_token_ids": shared + [2000 + i] * (5 + i), "max_tokens": 3 + i,
                 "arrival_s": 0.1 * i, "group": "first" if i == 0 else "later"} for i in range(4)]
    before = prefill_counters(stack.url)
    assert before == {"prompts_prefilled": 0, "prompt_tokens_computed": 0, "prompt_tokens_cached": 0}
    model = served_model(stack.url)
    asyncio.run(replay(stack.url, model, requests[:1]))  # the first one caches the shared blocks
    report = asyncio.run(replay(stack.url, model, requests[1:]))
    assert report["output_tokens"] == 4 + 5 + 6 and set(report["groups"]) == {"later"}
    assert report["groups"]["later"]["ttft_p99_s"] >= report["groups"]["later"]["ttft_p50_s"] > 0
    delta = counters_delta(before, prefill_counters(stack.url, 4))
    assert delta["prompts_prefilled"] == 4
    assert delta["prompt_tokens_cached"] == 3 * 64
    assert delta["prompt_tokens_computed"] == sum(len(r["prompt_token_ids"]) for r in requests) - 3 * 64

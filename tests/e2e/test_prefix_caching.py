"""Prefix caching across the stack: prompts sharing a system prompt go to the prefill worker that holds it, reuse
its blocks there, and give the same greedy text as the in-process engine with caching off."""

import concurrent.futures

import pytest

from kvferry.common.config import EngineConfig
from kvferry.common.engine import LLMEngine
from kvferry.common.sampling import SamplingParams

pytestmark = pytest.mark.slow
SYSTEM = (
    "You are a careful assistant. Answer in one short sentence, without lists, and say when you are not sure. "
) * 6
QUESTIONS = [
    "What is the capital of Italy?",
    "Name a large ocean.",
    "What do bees make?",
    "How many legs has a spider?",
    "What colour is grass?",
    "Who wrote Hamlet?",
    "What is ice made of?",
]


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
    stack.wait_for(
        lambda: sum(w.get("prompts_prefilled", 0) for w in stack.workers().values()) == 1,
        10,
        "the first prompt in the heartbeats",
    )  # stats ride on heartbeats: they lag
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
    """What `kvferry bench serve` and `bench ab` read: the replay's per-group latencies and token counts over real HTTP,
    and the prefill workers' computed and cached prompt tokens from /v1/workers."""
    import asyncio

    from kvferry.tools.bench.serve import counters_delta, prefill_counters, replay
    from kvferry.tools.bench.stack import served_model

    stack = make_stack().start_pair()
    shared = list(range(1000, 1064))  # 4 blocks
    requests = [
        {
            "id": f"r{i}",
            "prompt_token_ids": shared + [2000 + i] * (5 + i),
            "max_tokens": 3 + i,
            "arrival_s": 0.1 * i,
            "group": "first" if i == 0 else "later",
        }
        for i in range(4)
    ]
    before = prefill_counters(stack.url)
    assert before == {
        "prompts_prefilled": 0,
        "prompt_tokens_computed": 0,
        "prompt_tokens_cached": 0,
        "kv_bytes_sent": 0,
        "kv_bytes_skipped": 0,
    }
    model = served_model(stack.url)
    asyncio.run(replay(stack.url, model, requests[:1]))  # the first one caches the shared blocks
    report = asyncio.run(replay(stack.url, model, requests[1:]))
    assert report["output_tokens"] == 4 + 5 + 6 and set(report["groups"]) == {"later"}
    assert report["groups"]["later"]["ttft_p99_s"] >= report["groups"]["later"]["ttft_p50_s"] > 0
    delta = counters_delta(before, prefill_counters(stack.url, 4))
    assert delta["prompts_prefilled"] == 4
    assert delta["prompt_tokens_cached"] == 3 * 64
    assert delta["prompt_tokens_computed"] == sum(len(r["prompt_token_ids"]) for r in requests) - 3 * 64


BLOCK_BYTES = 2 * 30 * 16 * 3 * 64 * 2  # K and V of one 16-token block of SmolLM2-135M in the CPU's half precision


def test_a_second_chat_turn_ships_only_its_new_blocks(make_stack):
    engine = LLMEngine(EngineConfig(kv_cache_memory=64 * 2**20, enable_prefix_caching=False))
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)  # this model ends at once otherwise
    first_turn = engine.encode(SYSTEM + QUESTIONS[0])
    stack = make_stack().start_pair()

    def complete(ids):
        status, reply = stack.post(
            "/v1/completions", {"prompt": ids, "max_tokens": 12, "temperature": 0, "ignore_eos": True}
        )
        assert status == 200, reply
        return reply["choices"][0]["text"]

    answer = complete(first_turn)
    assert answer == engine.generate([first_turn], params)[0].text
    stack.wait_for(lambda: stack.workers()["prefill-a"]["kv_bytes_sent"] > 0, 10, "heartbeats")
    sent_first = stack.workers()["prefill-a"]["kv_bytes_sent"]
    assert sent_first == -(-len(first_turn) // 16) * BLOCK_BYTES
    assert stack.workers()["prefill-a"]["kv_bytes_skipped"] == 0
    # The decode worker keeps the finished turn's full blocks in its cache: the second turn leaves them out.
    second_turn = first_turn + engine.encode(answer + " " + QUESTIONS[1])
    assert complete(second_turn) == engine.generate([second_turn], params)[0].text
    held = (len(first_turn) + 12 - 1) // 16  # the first turn's full blocks, its answer's included
    stack.wait_for(lambda: stack.workers()["prefill-a"]["kv_bytes_skipped"] > 0, 10, "heartbeats")
    prefill = stack.workers()["prefill-a"]
    assert prefill["kv_bytes_skipped"] >= (len(first_turn) // 16) * BLOCK_BYTES
    assert (
        prefill["kv_bytes_sent"] - sent_first == -(-len(second_turn) // 16) * BLOCK_BYTES - prefill["kv_bytes_skipped"]
    )
    assert prefill["kv_bytes_skipped"] <= held * BLOCK_BYTES
    # Nothing held or leaked once both turns are done.
    stack.wait_for(
        lambda: stack.workers()["decode-a"]["free_blocks"] == stack.workers()["decode-a"]["num_blocks"],
        10,
        "every decode block free",
    )


def test_decode_worker_holds_queried_blocks_until_the_transfer_and_asks_for_all_when_it_cannot(make_stack):
    """Speaking the KV protocol to a real decode worker over its ingress socket, as a prefill worker does."""
    import zmq

    from kvferry.common import protocol as p
    from kvferry.common.block_hash import block_hashes

    engine = LLMEngine(EngineConfig(kv_cache_memory=16 * 2**20))
    prompt = engine.encode(SYSTEM)
    stack = make_stack().start_pair()
    status, _ = stack.post("/v1/completions", {"prompt": prompt, "max_tokens": 2, "temperature": 0})
    assert status == 200
    decode = stack.workers()["decode-a"]
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVTIMEO, 10_000)
    sock.connect(decode["kv_address"])
    hashes = block_hashes(prompt[: (len(prompt) - 1) // 16 * 16], 16)
    unknown = block_hashes(list(range(5, 5 + 16 * 3)), 16)

    def ask(rid, message, frames=()):
        sock.send_multipart(p.encode(message, rid, frames=list(frames)))
        return p.decode(sock.recv_multipart()).message

    assert ask("probe", p.KVQuery(unknown)) == p.KVHeld(0)
    assert ask("probe", p.KVQuery(hashes + unknown)) == p.KVHeld(len(hashes))
    stack.wait_for(
        lambda: stack.workers()["decode-a"]["free_blocks"] == decode["num_blocks"] - len(hashes),
        10,
        "the held blocks in the heartbeats",
    )

    def transfer(num_blocks, skipped, layers=(0, 30), tokens=prompt + [7] * 40, first_tokens=(9,), max_tokens=4):
        sampling = SamplingParams(max_tokens=max_tokens, temperature=0, top_p=1.0, top_k=0, seed=None, ignore_eos=True)
        shape = [layers[1] - layers[0], num_blocks, 16, 2, 3, 64]
        message = p.KVTransfer(
            "test",
            tokens,
            list(first_tokens),
            [0],
            sampling,
            len(tokens),
            "float32",
            shape,
            deadline_s=1e12,
            num_skipped_blocks=skipped,
            gateway_id="any",
            layer_start=layers[0],
        )
        return message, [bytes(p.kv_frame_bytes(message))]

    # More blocks left out than are held: the decode worker lets go of them and asks for every block.
    ack = ask("probe", *transfer(2, len(hashes) + 1))
    assert not ack.accepted and ack.retry and ack.resend_all
    stack.wait_for(lambda: stack.workers()["decode-a"]["free_blocks"] == decode["num_blocks"], 10, "released")
    # Left out without a query: nothing is held for it.
    ack = ask("other", *transfer(2, 1))
    assert not ack.accepted and ack.resend_all

    # A transfer comes in layer groups: the first allocates its blocks, a gap drops them again ...
    tokens = list(range(1000, 1070))  # 5 blocks

    def send(rid, layers, first_tokens=(9,), max_tokens=4):
        message, frames = transfer(5, 0, layers, tokens, first_tokens, max_tokens)
        sock.send_multipart(p.encode(message, rid, frames=frames))

    def free_blocks():
        return stack.workers()["decode-a"]["free_blocks"]

    send("gap", (0, 10))
    stack.wait_for(lambda: free_blocks() == decode["num_blocks"] - 5, 10, "blocks for the first group")
    ack = ask("gap", *transfer(5, 0, (20, 30), tokens))  # layers 10 to 20 never came: asked to send again
    assert not ack.accepted and ack.retry
    stack.wait_for(lambda: free_blocks() == decode["num_blocks"], 10, "blocks freed at the gap")
    # ... and every group in order is placed, acknowledged, decoded and freed.
    for layers in ((0, 10), (10, 20)):
        send("whole", layers)
    assert ask("whole", *transfer(5, 0, (20, 30), tokens)) == p.KVAck(True)
    stack.wait_for(lambda: free_blocks() == decode["num_blocks"], 30, "the transferred sequence to finish")
    # Groups sent while the prompt still computes carry no first token; the last brings it.
    for layers in ((0, 10), (10, 20)):
        send("early", layers, first_tokens=())
    assert ask("early", *transfer(5, 0, (20, 30), tokens)) == p.KVAck(True)
    stack.wait_for(lambda: free_blocks() == decode["num_blocks"], 30, "the early-sent sequence to finish")
    # A last group without its first token is refused; so is one naming a choice the first group did not.
    send("tokenless", (0, 10), first_tokens=())
    ack = ask("tokenless", *transfer(5, 0, (10, 30), tokens, first_tokens=()))
    assert not ack.accepted and not ack.retry and "first token" in ack.reason
    # Early groups of a prompt whose first token ended it: the sender's Abort frees their blocks.
    send("ended", (0, 10), first_tokens=())
    stack.wait_for(lambda: free_blocks() == decode["num_blocks"] - 5, 10, "blocks for the early group")
    sock.send_multipart(p.encode(p.Abort(), "ended"))
    stack.wait_for(lambda: free_blocks() == decode["num_blocks"], 10, "blocks freed on the Abort")
    # A choice the gateway ended between the first group and the last (a stop string in its first token) is not
    # admitted: nothing runs, though it asked for 4,000 tokens.
    send("cut", (0, 10), first_tokens=(), max_tokens=4000)
    stack.wait_for(lambda: free_blocks() == decode["num_blocks"] - 5, 10, "blocks for the first group")
    sock.send_multipart(p.encode(p.Abort(choice=0), "cut"))
    send("cut", (10, 20), first_tokens=(), max_tokens=4000)
    message, frames = transfer(5, 0, (20, 30), tokens, max_tokens=4000)
    assert ask("cut", message, frames) == p.KVAck(True)
    stack.wait_for(
        lambda: stack.workers()["decode-a"]["running"] == 0 and free_blocks() == decode["num_blocks"],
        10,
        "nothing running for the ended choice",
    )
    sock.close()

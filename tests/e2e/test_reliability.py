"""Failures on purpose: workers killed mid-request, stuck, shut down; messages dropped, repeated and delayed;
overload; garbage on the sockets. Real processes, real sockets, real HTTP. The worker under test is started and
killed by the test itself (not by honcho, which stops everything when one child exits)."""

import concurrent.futures
import math
import os
import random
import signal
import time

import msgpack
import pytest
import zmq

from kvferry.common import protocol as p
from kvferry.common.model.kv_blocks import LAYER_GROUPS
from kvferry.common.sampling import SamplingParams
from tests.e2e.stack import Stack, engine_texts
from tests.tiny_models import save_tiny_chat_model

pytestmark = pytest.mark.slow
PROMPTS = [
    f"Story {i}: once upon a time, in a land of {thing},"
    for i, thing in enumerate(
        [
            "rivers",
            "mountains",
            "clocks",
            "glass",
            "salt",
            "paper",
            "owls",
            "bells",
            "ice",
            "sand",
            "wool",
            "ink",
            "lamps",
            "moss",
            "iron",
            "silk",
        ]
    )
]
BODY = {"max_tokens": 40, "temperature": 0, "ignore_eos": True}
FAST_FAILOVER = {"KVFERRY_STEP_TIMEOUT": "10", "KVFERRY_FIRST_TOKEN_TIMEOUT": "30"}
# The gateway routes to the decode worker with the most free blocks: one with a smaller cache gets nothing
# while a bigger one is live, so the test knows where every stream is until it kills the bigger one.
SMALL_CACHE = {"KVFERRY_KV_CACHE_MEMORY": "128MiB"}


def completion(stack: Stack, prompt: str, **extra) -> str:
    status, reply = stack.post("/v1/completions", {**BODY, "prompt": prompt, **extra}, timeout=180)
    assert status == 200, reply
    return reply["choices"][0]["text"]


def streamed(stack: Stack, prompt: str, **extra) -> str:
    events = stack.stream("/v1/completions", {**BODY, "prompt": prompt, **extra}, timeout=180)
    assert events[-1] == "[DONE]", events[-3:]
    errors = [e for e in events[:-1] if "error" in e]
    assert not errors, errors
    return "".join(c["text"] for e in events[:-1] for c in e["choices"])


def in_flight_on(stack: Stack, name: str) -> int:
    return stack.workers().get(name, {}).get("requests_in_flight", 0)


def wait_blocks_free(stack: Stack, timeout: float = 30) -> None:
    """Every live worker's heartbeat says all its blocks are free: nothing leaked."""

    def all_free():
        workers = stack.workers()
        return workers and all(w["free_blocks"] == w["num_blocks"] for w in workers.values())

    stack.wait_for(all_free, timeout, f"every block free: {stack.workers()}")


@pytest.fixture(scope="module")
def slow_tiny_model(tmp_path_factory) -> str:
    """The tiny random chat model, for tests that kill or stop a worker mid-stream: the text is not what they test,
    and with the pace set by a step delay (slow_tiny_env) a worker starts in a fraction of the real model's time."""
    folder = tmp_path_factory.mktemp("slow") / "tiny-chat"
    save_tiny_chat_model(folder)
    return str(folder)


# Each step about as long as the default model's at a few rows on this machine: a 64-token stream lasts a few seconds
SLOW_STEPS = {"KVFERRY_FAULTS": "step_delay_ms=30"}


def test_decode_workers_killed_mid_stream_lose_no_stream(make_stack, slow_tiny_model):
    """Five rounds, each SIGKILLs the decode worker holding 8 streams at a different moment; every stream
    completes with the text it has without a failure, and nothing leaks."""
    stack = make_stack(model=slow_tiny_model, extra_env={**FAST_FAILOVER, **SLOW_STEPS}).start_pair(decode="decode-0")
    stack.start_worker("survivor", "decode", env=SMALL_CACHE)
    stack.wait_workers({"survivor"})
    prompts, moves = PROMPTS[:8], 0
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        reference = list(pool.map(lambda prompt: completion(stack, prompt, max_tokens=64), prompts))
        for round, delay in enumerate([0.0, 0.3, 0.6, 0.9, 1.2]):  # from mid-transfer to late in the streams
            victim = f"decode-{round}"
            streams = [pool.submit(streamed, stack, prompt, max_tokens=64) for prompt in prompts]
            stack.wait_for(lambda: in_flight_on(stack, victim) == 8, 30, f"8 streams on {victim}")
            time.sleep(delay)
            stack.stop(victim)  # SIGKILL
            stack.start_worker(f"decode-{round + 1}", "decode")  # the next victim loads while the streams move
            assert [s.result(timeout=240) for s in streams] == reference, f"round {round}"
            moved, moves = stack.get("/v1/workers")[1]["gateway"]["moves"] - moves, moves
            moves += moved
            assert moved >= 1, f"round {round}: the streams ended before the kill; nothing was tested"
            stack.wait_workers({f"decode-{round + 1}"})
    wait_blocks_free(stack)


def test_a_stopped_decode_worker_holds_up_nobody_and_rejoins_intact(make_stack, slow_tiny_model):
    """SIGSTOP, not a kill: the stopped worker's connections stay open and its queues fill. Streams started on the
    other decode worker meanwhile complete; the stopped worker's streams move (its heartbeats stop) and complete
    with the text they would have had; after SIGCONT it rejoins, nothing leaks, and it serves the same text."""
    stack = make_stack(model=slow_tiny_model, extra_env={**FAST_FAILOVER, **SLOW_STEPS}).start_pair(decode="victim")
    stack.start_worker("survivor", "decode", env=SMALL_CACHE)
    stack.wait_workers({"survivor"})
    prompts = PROMPTS[:6]
    with concurrent.futures.ThreadPoolExecutor(12) as pool:
        reference = list(pool.map(lambda prompt: completion(stack, prompt, max_tokens=48), prompts))
        stopped = [pool.submit(streamed, stack, prompt, max_tokens=48) for prompt in prompts]
        stack.wait_for(lambda: in_flight_on(stack, "victim") == 6, 30, "6 streams on the victim")
        victim = stack.procs["victim"]
        os.killpg(victim.pid, signal.SIGSTOP)
        try:
            stack.wait_for(lambda: "victim" not in stack.workers(), 30, "the stopped worker dropped")
            others = [pool.submit(streamed, stack, prompt, max_tokens=48) for prompt in prompts]
            assert [s.result(timeout=120) for s in others] == reference
            assert [s.result(timeout=120) for s in stopped] == reference
        finally:
            os.killpg(victim.pid, signal.SIGCONT)
        stack.wait_workers({"victim"})  # it registers again
        wait_blocks_free(stack)
        assert victim.poll() is None
        # The victim, the roomiest again, takes new work, and computes it as before.
        assert list(pool.map(lambda prompt: streamed(stack, prompt, max_tokens=48), prompts)) == reference
        assert stack.workers()["victim"]["requests_served"] >= 6
    wait_blocks_free(stack)


def test_a_prefill_worker_killed_with_requests_queued_hands_them_to_the_other(make_stack, slow_tiny_model):
    # Without prefix caching: the reference run would cache these very prompts, and no queue would build up.
    # Prefill steps of the tiny model as slow as the default model's, and about one prompt each: a queue of
    # seconds builds up on each prefill worker. (With the default 2,048 tokens a step, one step took a worker's
    # whole share, and the kill could come after its last prefill: nothing to move.)
    env = {
        **FAST_FAILOVER,
        "KVFERRY_FAULTS": "step_delay_ms=300",
        "KVFERRY_NO_PREFIX_CACHING": "1",
        "KVFERRY_MAX_NUM_BATCHED_TOKENS": "256",
    }
    stack = make_stack(model=slow_tiny_model, extra_env=env).start_pair()
    stack.start_worker("prefill-b", "prefill")
    stack.wait_workers({"prefill-b"})
    long_prompts = [prompt * 12 for prompt in PROMPTS]  # about 200 tokens each: a queue builds up
    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        reference = list(pool.map(lambda prompt: completion(stack, prompt, max_tokens=8), long_prompts))
        calls = [pool.submit(completion, stack, prompt, max_tokens=8) for prompt in long_prompts]
        stack.wait_for(lambda: in_flight_on(stack, "prefill-a") >= 4, 30, "requests queued on prefill-a")
        stack.stop("prefill-a")
        assert [c.result(timeout=240) for c in calls] == reference
    status, info = stack.get("/v1/workers")
    assert info["gateway"]["moves"] >= 1 and "prefill-a" not in stack.workers()
    wait_blocks_free(stack)


def test_with_no_prefill_worker_left_requests_fail_with_503_after_a_bounded_wait(make_stack):
    stack = make_stack(extra_env=FAST_FAILOVER).start_pair()
    long_prompts = [prompt * 12 for prompt in PROMPTS[:6]]

    def ask(prompt):
        started = time.monotonic()
        status, reply = stack.post("/v1/completions", {**BODY, "prompt": prompt, "max_tokens": 8}, timeout=120)
        return status, reply, time.monotonic() - started

    with concurrent.futures.ThreadPoolExecutor(6) as pool:
        calls = [pool.submit(ask, prompt) for prompt in long_prompts]
        stack.wait_for(lambda: in_flight_on(stack, "prefill-a") >= 3, 30, "requests on prefill-a")
        stack.stop("prefill-a")
        results = [c.result(timeout=120) for c in calls]
    failed = [r for r in results if r[0] != 200]
    assert failed, "every request finished before the kill: nothing was tested"
    for status, reply, took in failed:
        assert status == 503 and "no live workers to move the request to within 10 s" in reply["error"]["message"]
        assert took < 40
    assert stack.post("/v1/completions", {**BODY, "prompt": "x"})[0] == 503  # none to route to: at once


@pytest.fixture(scope="module")
def chaos_model(tmp_path_factory) -> tuple[str, dict[str, str]]:
    """The tiny random chat model (the chaos is about the serving system, not the text) and what the in-process
    engine generates with it for each prompt."""
    folder = tmp_path_factory.mktemp("chaos") / "tiny-chat"
    save_tiny_chat_model(folder)
    texts = engine_texts(PROMPTS, model=str(folder), max_tokens=12, temperature=0, ignore_eos=True)
    return str(folder), dict(zip(PROMPTS, texts))


def fewest_completed(num_requests: int, drop: float, messages: int, attempts: int, tail: float = 1e-6) -> int:
    """The fewest requests that complete, but with a chance below tail, when an attempt fails only if one of its
    messages is lost (each with chance drop, independently: each channel draws its own seeded stream) and a request
    fails only if every attempt it may make fails. Duplicates are dropped by the receiver and delays are short of
    every deadline: neither fails an attempt."""
    q = 1 - (1 - drop) ** messages  # one attempt fails
    p = q**attempts  # one request fails
    failed, below = 0, 0.0  # below: the chance that fewer than `failed` requests fail
    while True:
        below += math.comb(num_requests, failed) * p**failed * (1 - p) ** (num_requests - failed)
        if 1 - below < tail:  # more than `failed` fail only with a chance below tail
            return num_requests - failed
        failed += 1


def test_chaos_every_request_completes_correctly_or_fails_clearly(make_stack, chaos_model):
    """200 requests while every process drops, repeats and delays its messages. How many must complete follows
    from the drop rate, the messages an attempt needs and the attempts the retry policy allows (fewest_completed).
    The tiny model answers in milliseconds, so the timeouts are short: most of the test's time is waiting them out."""
    model, chaos_reference = chaos_model
    drop, max_moves, first_token_s, request_s, max_tokens = 0.02, 5, 3, 30, 12
    faults = {
        "KVFERRY_FAULTS": f"drop={drop},dup=0.02,delay_ms=5,seed=7",
        "KVFERRY_STEP_TIMEOUT": "2",
        "KVFERRY_FIRST_TOKEN_TIMEOUT": str(first_token_s),
        "KVFERRY_REQUEST_TIMEOUT": str(request_s),
        "KVFERRY_MAX_MOVES": str(max_moves),
    }
    # An attempt's messages: its PrefillRequest; a KVQuery and its KVHeld (a prefix cache hit); a KVTransfer per
    # layer group and their KVAck; the FirstToken; then at most one Tokens per decode step.
    messages = 1 + 2 + LAYER_GROUPS + 1 + 1 + (max_tokens - 1)
    # A failed attempt is given up after at most first_token_s (the longest wait: for the first token; later a step
    # waits step_s, a gap gap_s), so the deadline leaves room for this many attempts, as do the moves.
    attempts = min(max_moves + 1, request_s // first_token_s)
    at_least = fewest_completed(200, drop, messages, attempts)
    assert (messages, attempts, at_least) == (22, 6, 194)
    stack = make_stack(model=model, extra_env=faults).start_pair()
    stack.start_worker("decode-b", "decode")
    stack.wait_workers({"decode-b"})
    rng = random.Random(1)
    prompts = [rng.choice(PROMPTS) for _ in range(200)]

    def ask(prompt):
        started = time.monotonic()
        status, reply = stack.post(
            "/v1/completions", {**BODY, "max_tokens": max_tokens, "prompt": prompt}, timeout=request_s + 60
        )
        return prompt, status, reply, time.monotonic() - started

    with concurrent.futures.ThreadPoolExecutor(12) as pool:
        results = list(pool.map(ask, prompts))
    completed = [r for r in results if r[1] == 200]
    failed = [r for r in results if r[1] != 200]
    wrong = [
        (prompt, reply["choices"][0]["text"])
        for prompt, _, reply, _ in completed
        if reply["choices"][0]["text"] != chaos_reference[prompt]
    ]
    assert not wrong, wrong[:3]
    for _, status, reply, _ in failed:  # a clear error: a server status with a message saying what happened
        assert status in (503, 504) and reply["error"]["message"], reply
    assert max(r[3] for r in results) < request_s + 10, "a request outlived its deadline"
    assert len(completed) >= at_least, [r[2] for r in failed][:5]
    wait_blocks_free(stack, 60)
    status, info = stack.get("/v1/workers")
    print(
        f"\nchaos: {len(completed)} completed, {len(failed)} failed "
        f"({sorted({r[2]['error']['message'][:60] for r in failed})}), gateway {info['gateway']}"
    )


def test_a_stuck_step_loop_is_reported_and_its_requests_move(make_stack):
    stack = make_stack(extra_env=FAST_FAILOVER)
    stack.start_gateway()
    stack.start_worker("prefill-a", "prefill")
    stack.start_worker("decode-b", "decode", env=SMALL_CACHE)
    # Its loop sleeps 60 s at its 10th step: alive, heartbeating from its own thread, but stuck.
    stack.start_worker(
        "decode-stalls", "decode", "--stall-timeout", "2", env={"KVFERRY_FAULTS": "stall_after_steps=10,stall_s=60"}
    )
    stack.wait_workers({"prefill-a", "decode-b", "decode-stalls"})
    prompts = PROMPTS[:8]
    with concurrent.futures.ThreadPoolExecutor(8) as pool:  # all 8 go to decode-stalls, the bigger cache
        texts = list(pool.map(lambda prompt: streamed(stack, prompt), prompts))
        assert "decode-stalls dropped: its step loop is stuck" in stack.log("gateway")
        assert "moving request" in stack.log("gateway") and "reporting unhealthy" in stack.log("decode-stalls")
        assert stack.procs["decode-stalls"].poll() is None, "the stuck worker is alive: only its loop stopped"
        assert "decode-stalls" not in stack.workers()
        # The same requests again, served by decode-b alone from the start.
        assert list(pool.map(lambda prompt: completion(stack, prompt), prompts)) == texts


def test_sigterm_drains_the_gateway(make_stack):
    stack = make_stack().start_pair()
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        streams = [pool.submit(streamed, stack, prompt) for prompt in PROMPTS[:4]]
        stack.wait_for(lambda: stack.get("/v1/workers")[1]["gateway"]["requests_in_flight"] == 4, 30, "4 in flight")
        os.killpg(stack.procs["gateway"].pid, signal.SIGTERM)
        stack.wait_for(lambda: stack.get("/health")[0] == 503, 10, "health 503 while draining")
        status, reply = stack.post("/v1/completions", {**BODY, "prompt": "late"})
        assert status == 503 and "shutting down" in reply["error"]["message"]
        texts = [s.result(timeout=120) for s in streams]
    assert all(texts) and stack.stop("gateway", sig=0, timeout=30) == 0


def test_sigterm_drains_a_worker_without_losing_its_requests(make_stack):
    stack = make_stack(extra_env=FAST_FAILOVER).start_pair()
    stack.start_worker("decode-b", "decode", env=SMALL_CACHE)
    stack.wait_workers({"decode-b"})
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        reference = list(pool.map(lambda prompt: completion(stack, prompt), PROMPTS[:8]))
        streams = [pool.submit(streamed, stack, prompt) for prompt in PROMPTS[:8]]
        stack.wait_for(lambda: in_flight_on(stack, "decode-a") == 8, 30, "8 streams on decode-a")
        assert stack.stop("decode-a", sig=signal.SIGTERM, timeout=60) == 0
        assert [s.result(timeout=120) for s in streams] == reference
    assert "decode-a" not in stack.workers() and "draining" in stack.log("decode-a")


def test_past_max_waiting_requests_get_429_and_the_accepted_ones_complete(make_stack):
    stack = make_stack(extra_env={"KVFERRY_MAX_WAITING": "3"}).start_pair()
    reference = completion(stack, PROMPTS[0], max_tokens=16)

    def ask(_):
        status, headers, reply = stack.exchange("/v1/completions", {**BODY, "prompt": PROMPTS[0], "max_tokens": 16})
        return status, headers, reply

    with concurrent.futures.ThreadPoolExecutor(24) as pool:
        results = list(pool.map(ask, range(24)))
    refused = [r for r in results if r[0] == 429]
    accepted = [r for r in results if r[0] == 200]
    assert refused and accepted and len(refused) + len(accepted) == 24
    assert all(r[1].get("retry-after") == "1" and r[2]["error"]["type"] == "rate_limit_error" for r in refused)
    assert all(r[2]["choices"][0]["text"] == reference for r in accepted)


def test_garbage_on_every_socket_is_counted_and_serving_goes_on(make_stack):
    stack = make_stack().start_pair()
    reference = completion(stack, PROMPTS[0], max_tokens=8)
    kv_address = stack.workers()["decode-a"]["kv_address"]
    rng = random.Random(5)
    valid = p.encode(p.Tokens([1], start=0), "x")[0]
    ctx = zmq.Context.instance()
    sent = 0
    for address in (stack.control, kv_address):
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 1000)
        sock.connect(address)
        for i in range(5000):
            kind = i % 5
            if kind == 0:  # random bytes
                frames = [rng.randbytes(rng.randint(0, 64)) for _ in range(rng.randint(1, 3))]
            elif kind == 1:  # truncated
                frames = [valid[: rng.randint(0, len(valid) - 1)]]
            elif kind == 2:  # wrong version
                frames = [msgpack.packb([int(p.Kind.TOKENS), 99, "x", {}, {"token_ids": [1]}])]
            elif kind == 3:  # a KV transfer whose frames do not match its header
                frames = [
                    p.encode(
                        p.KVTransfer(
                            "p",
                            [1],
                            [2],
                            [0],
                            SamplingParams(
                                max_tokens=1, temperature=0.0, top_p=1.0, top_k=0, seed=None, ignore_eos=False
                            ),
                            1,
                            "float32",
                            [1, 1, 16, 2, 1, 64],
                            1e12,
                        ),
                        "x",
                        frames=[b""],
                    )[0],
                    b"\0" * 10,
                ]
            elif i % 1000 == 4 and address == stack.control:  # an oversized header (a few: each is 90 MB)
                # Not to the KV ingress: past its size cap (one layer group of its pool) a frame is not counted but
                # dropped with its connection (tests/e2e/test_oversized_frames.py).
                frames = [b"\x95" + b"\0" * (p.MAX_HEADER_BYTES + 1)]
            else:  # an unknown kind
                frames = [msgpack.packb([77, p.PROTOCOL_VERSION, "x", {}, {}])]
            sock.send_multipart(frames)
            sent += 1
        sock.close()
    assert sent == 10_000

    def counted():
        workers, gateway = stack.workers(), stack.get("/v1/workers")[1]["gateway"]
        return gateway["protocol_errors"] >= 5000 and workers["decode-a"]["protocol_errors"] >= 5000

    stack.wait_for(counted, 60, "protocol errors counted")
    assert completion(stack, PROMPTS[0], max_tokens=8) == reference
    assert all(proc.poll() is None for proc in stack.procs.values())


def test_two_gateways_share_one_pool_of_workers(make_stack):
    first, second = make_stack(), make_stack()
    first.start_gateway()
    second.start_gateway()
    both = f"{first.control},{second.control}"
    first.start_worker("prefill-a", "prefill", "--gateway", both)
    first.start_worker("decode-a", "decode", "--gateway", both)
    for stack in (first, second):
        stack.wait_workers({"prefill-a", "decode-a"})
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        one = pool.map(lambda prompt: completion(first, prompt, max_tokens=12), PROMPTS[:4])
        two = pool.map(lambda prompt: streamed(second, prompt, max_tokens=12), PROMPTS[:4])
        texts = list(one)
        assert list(two) == texts
    first.stop("gateway")  # the workers go on serving the other one
    assert [completion(second, prompt, max_tokens=12) for prompt in PROMPTS[:4]] == texts
    assert all(proc.poll() is None for proc in first.procs.values())


def test_with_curve_only_peers_holding_the_keys_get_in(make_stack, tmp_path):
    import subprocess
    import sys

    keys, other = tmp_path / "keys", tmp_path / "other-keys"
    for folder in (keys, other):
        subprocess.run(
            [sys.executable, "-m", "kvferry.tools.cli", "keys", str(folder)], check=True, capture_output=True
        )
    stack = make_stack(extra_env={"KVFERRY_CURVE_KEYS": str(keys)}).start_pair()
    reference = completion(stack, PROMPTS[0], max_tokens=8)
    stack.start_worker("no-keys", "decode", env={"KVFERRY_CURVE_KEYS": ""})
    stack.start_worker("wrong-keys", "decode", env={"KVFERRY_CURVE_KEYS": str(other)})
    # Raw injection without the keys: a valid registration, on the control socket and on the KV socket.
    ctx = zmq.Context.instance()
    for address in (stack.control, stack.workers()["decode-a"]["kv_address"]):
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(address)
        sock.send_multipart(
            p.encode(p.Register(int(p.Role.DECODE), "intruder", "m", "float32", 16, 8, 64, "tcp://x:1"))
        )
        sock.send_multipart([b"garbage"])
        assert not sock.poll(2000), "a peer without the keys got an answer"
        sock.close()
    stack.wait_for(
        lambda: "attempt 3" in stack.log("no-keys") and "attempt 3" in stack.log("wrong-keys"),
        60,
        "the keyless workers to retry",
    )
    workers = stack.workers()
    assert set(workers) == {"prefill-a", "decode-a"}
    status, info = stack.get("/v1/workers")
    assert info["gateway"]["protocol_errors"] == 0 and workers["decode-a"]["protocol_errors"] == 0, "nothing got in"
    assert completion(stack, PROMPTS[0], max_tokens=8) == reference


def test_a_decode_worker_frees_a_request_the_gateway_does_not_know(make_stack, tmp_path):
    """KV for a request no gateway sent (as after a lost Abort): the decode worker takes it and streams tokens, the
    gateway answers with an Abort, and the decode worker runs no step for it once the Abort has come (its trace, in
    the order its loop wrote it) and frees its blocks, not its 2,000 tokens later."""
    import json

    traces = tmp_path / "traces"
    stack = make_stack(extra_env={"KVFERRY_TRACE_DIR": str(traces)}).start_pair()
    decode = stack.workers()["decode-a"]
    shape = [30, 2, 16, 2, 3, 64]  # SmolLM2: layers, blocks for 20 tokens, block size, K/V, KV heads, head dim
    frame = bytes(4 * 30 * 2 * 16 * 2 * 3 * 64)
    transfer = p.KVTransfer(
        "nobody",
        list(range(300, 320)),
        [400],
        [0],
        SamplingParams(max_tokens=2000, temperature=0.0, top_p=1.0, top_k=0, seed=None, ignore_eos=True),
        20,
        "float32",
        shape,
        time.time() + 600,
    )
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(decode["kv_address"])
    sock.send_multipart(p.encode(transfer, "cmpl-unknown", frames=[frame]))
    assert sock.poll(10_000), "no acknowledgement"
    assert p.decode(sock.recv_multipart()).message.accepted
    sock.close()

    def lines(role):  # in the order each process wrote them: its step loop receives, handles and steps in turn
        return [
            json.loads(line)
            for f in sorted(traces.glob(f"{role}*.jsonl"))
            for line in f.read_text().splitlines()
            if line.strip()
        ]

    def is_abort(r, ev):
        return r.get("kind") == "Abort" and r["rid"] == "cmpl-unknown" and r["ev"] == ev

    stack.wait_for(lambda: any(is_abort(r, "recv") for r in lines("decode")), 20, "the gateway's Abort at decode")
    stack.wait_for(lambda: stack.workers()["decode-a"]["free_blocks"] == decode["num_blocks"], 10, "its blocks freed")
    # A heartbeat sent after the blocks were seen free: every line the worker wrote before it is on disk (a line
    # waits at most until the next write to be flushed), so a step after the Abort would show.
    freed_at = time.time()
    stack.wait_for(
        lambda: any(r.get("kind") == "Heartbeat" and r["ev"] == "send" and r["ts"] > freed_at for r in lines("decode")),
        10,
        "a later heartbeat in the decode worker's trace",
    )
    records = lines("decode")
    abort = next(i for i, r in enumerate(records) if is_abort(r, "recv"))
    steps = [
        i for i, r in enumerate(records) if r.get("name") == "decode.step" and "cmpl-unknown" in r["attrs"]["rids"]
    ]
    assert steps, "it never streamed a token"
    assert max(steps) < abort, f"{sum(i > abort for i in steps)} steps ran it after the Abort had come"
    assert any(is_abort(r, "send") for r in lines("gateway"))

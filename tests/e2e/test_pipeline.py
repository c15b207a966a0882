"""The disaggregated stack as a user runs it: real processes, real ZeroMQ sockets, real HTTP on 127.0.0.1."""

import concurrent.futures

import pytest

from kvferry.common.config import EngineConfig
from kvferry.common.engine import LLMEngine
from kvferry.common.sampling import SamplingParams
from tests.e2e.stack import Stack

pytestmark = pytest.mark.slow
WORKERS = {"prefill-a", "prefill-b", "decode-a", "decode-b"}
PROMPTS = [
    "The capital of France is",
    "Write a haiku about rivers.",
    "What is 12 times 12?",
    "Once upon a time, a fox",
    "List three colours.",
    "Explain paged attention briefly.",
    "The quick brown fox",
    "Name a planet.",
    "Why is the sky blue?",
    "Translate 'hello' into French.",
    "A recipe for bread starts with",
    "Describe a cat in one sentence.",
    "def fibonacci(n):",
    "The best way to learn is",
    "Tell me a joke.",
    "In 1969, humans",
]


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    s = Stack(tmp_path_factory.mktemp("stack"))
    try:
        s.start_gateway()
        for name in sorted(WORKERS):
            s.start_worker(name, name.split("-")[0])
        s.wait_workers(WORKERS)
        yield s
    finally:
        s.close()


@pytest.fixture(scope="module")
def reference():
    engine = LLMEngine(EngineConfig(kv_cache_memory=256 * 2**20))
    params = SamplingParams(max_tokens=24, temperature=0)
    texts = {}
    for chat in (False, True):
        for out, prompt in zip(engine.generate(PROMPTS, params, chat=chat), PROMPTS):
            texts[(prompt, chat)] = (out.text, out.finish_reason.name.lower())
    return texts


def ask(stack: Stack, prompt: str, chat: bool, stream: bool) -> tuple[str, str]:
    """The answer's text and finish reason."""
    body = {"max_tokens": 24, "temperature": 0}
    if chat:
        body["messages"] = [{"role": "user", "content": prompt}]
        path = "/v1/chat/completions"
    else:
        body["prompt"] = prompt
        path = "/v1/completions"
    if stream:
        events = stack.stream(path, body)
        assert events[-1] == "[DONE]"
        chunks = [e["choices"][0] for e in events[:-1] if e["choices"]]
        text = "".join((c["delta"].get("content", "") if chat else c["text"]) for c in chunks)
        return text, chunks[-1]["finish_reason"]
    status, reply = stack.post(path, body)
    assert status == 200, reply
    choice = reply["choices"][0]
    assert reply["usage"]["completion_tokens"] >= 1 and reply["usage"]["prompt_tokens"] >= 1
    return (choice["message"]["content"] if chat else choice["text"]), choice["finish_reason"]


def test_concurrent_requests_match_the_in_process_engine(stack, reference):
    cases = [(prompt, i % 2 == 0, i % 4 < 2) for i, prompt in enumerate(PROMPTS)]  # chat/completion x stream/not
    with concurrent.futures.ThreadPoolExecutor(len(cases)) as pool:
        answers = list(pool.map(lambda c: ask(stack, *c), cases))
    for (prompt, chat, stream), answer in zip(cases, answers):
        assert answer == reference[(prompt, chat)], (prompt, chat, stream)
    stack.wait_for(lambda: all(w["running"] == 0 for w in stack.workers().values()), 10, "idle workers")
    workers = stack.workers()
    assert set(workers) == WORKERS
    for worker in workers.values():
        assert worker["requests_served"] >= 1, worker
        assert worker["free_blocks"] == worker["num_blocks"], worker  # every block came back
    # The short completion prompts fill no block, so nothing is asked of the decode worker first: their first five
    # layer groups of six go out while the prompt's later layers still compute.
    prefill = [w for w in workers.values() if w["role"] == "prefill"]
    assert sum(w["kv_bytes_sent_early"] for w in prefill) > 0, prefill
    assert all(w["kv_bytes_sent_early"] < w["kv_bytes_sent"] for w in prefill), prefill  # the last group never is


def test_openai_client(stack):
    from openai import OpenAI

    client = OpenAI(base_url=stack.url + "/v1", api_key="unused")
    names = [m.id for m in client.models.list().data]
    assert names == [
        "HuggingFaceTB/SmolLM2-135M-Instruct",
        "SmolLM2-135M-Instruct",
    ]  # its hub id first, then the short name
    model = names[0]
    done = client.completions.create(model=model, prompt="The capital of France is", max_tokens=8, temperature=0)
    assert "Paris" in done.choices[0].text and done.usage.completion_tokens == 8
    streamed = "".join(
        c.choices[0].text
        for c in client.completions.create(
            model=model, prompt="The capital of France is", max_tokens=8, temperature=0, stream=True
        )
        if c.choices
    )
    assert streamed == done.choices[0].text
    chat = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Say hello"}], max_tokens=10, temperature=0
    )
    parts = client.chat.completions.create(
        model=model,
        max_tokens=10,
        temperature=0,
        messages=[{"role": "user", "content": [{"type": "text", "text": "Say "}, {"type": "text", "text": "hello"}]}],
    )
    assert parts.choices[0].message.content == chat.choices[0].message.content
    assert chat.choices[0].message.role == "assistant" and chat.choices[0].message.content
    pieces = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "Say hello"}],
        max_tokens=10,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(pieces)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == chat.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == chat.usage.completion_tokens


def test_stop_strings_even_across_tokens(stack):
    status, full = stack.post(
        "/v1/completions", {"prompt": "The capital of France is", "max_tokens": 8, "temperature": 0}
    )
    text = full["choices"][0]["text"]  # " Paris.\n\nThe answer is:"
    stop = text[3:7]  # "ris." starts inside the token " Paris"
    status, cut = stack.post(
        "/v1/completions", {"prompt": "The capital of France is", "max_tokens": 8, "temperature": 0, "stop": [stop]}
    )
    assert status == 200 and cut["choices"][0]["text"] == text[:3] and cut["choices"][0]["finish_reason"] == "stop"
    events = stack.stream(
        "/v1/completions", {"prompt": "The capital of France is", "max_tokens": 8, "temperature": 0, "stop": stop}
    )
    assert "".join(e["choices"][0]["text"] for e in events[:-1] if e["choices"]) == text[:3]


@pytest.mark.parametrize(
    "path,body,raw,status,code",
    [
        ("/v1/completions", None, b"{not json", 400, None),
        ("/v1/completions", {"prompt": 5}, None, 400, None),
        ("/v1/completions", {"prompt": "hi", "temperature": "hot"}, None, 400, None),
        ("/v1/completions", {"prompt": "hi", "max_tokens": -1}, None, 400, None),
        ("/v1/completions", {"prompt": "hi", "top_p": 7}, None, 400, None),
        ("/v1/completions", {"prompt": "hi", "max_tokens": 10**6}, None, 400, "context_length_exceeded"),
        ("/v1/completions", {"prompt": "hi", "model": "gpt-17"}, None, 404, "model_not_found"),
        ("/v1/chat/completions", {"messages": "hello"}, None, 400, None),
        ("/v1/completions", {"prompt": "hi", "best_of": 3}, None, 400, None),
        ("/v1/completions", {"prompt": "hi", "seed": 2**85}, None, 400, None),  # was a 500 (found by schemathesis)
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "hi"}], "top_k": 2**95},
            None,
            400,
            None,
        ),  # was a 500 (found by schemathesis)
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function"}]},
            None,
            400,
            None,
        ),
    ],
)
def test_bad_requests_get_openai_shaped_errors(stack, path, body, raw, status, code):
    got, reply = stack.post(path, body, raw=raw)
    assert got == status
    assert set(reply["error"]) == {"message", "type", "param", "code"} and reply["error"]["message"]
    assert reply["error"]["code"] == code


def test_late_joiner_gets_traffic_and_a_stopped_worker_disappears(make_stack):
    s = make_stack()
    s.start_gateway()
    s.wait_for(lambda: s.get("/health")[0] == 503, 60, "gateway up")  # raises if it never answers
    status, health = s.get("/health")  # up, and unhealthy for want of workers of both roles
    assert status == 503 and "prefill" in health["reason"] and "decode" in health["reason"], health
    status, reply = s.post("/v1/completions", {"prompt": "hi", "max_tokens": 2})
    assert status == 503 and reply["error"]["type"] == "service_unavailable"
    s.start_worker("p1", "prefill")
    s.start_worker("d1", "decode")
    s.wait_workers({"p1", "d1"})
    assert s.get("/health")[0] == 200
    s.start_worker("d2", "decode")  # joins a running gateway, no restart
    s.wait_workers({"d2"})
    for _ in range(3):
        assert s.post("/v1/completions", {"prompt": "Hello", "max_tokens": 2})[0] == 200
    assert s.workers()["d2"]["requests_served"] >= 1
    s.stop("d2")
    s.wait_for(lambda: "d2" not in s.workers(), 10, "d2 to be dropped")
    served_d1 = s.workers()["d1"]["requests_served"]
    for _ in range(2):
        assert s.post("/v1/completions", {"prompt": "Hello", "max_tokens": 2})[0] == 200
    assert s.workers()["d1"]["requests_served"] == served_d1 + 2
    s.stop("p1")
    s.wait_for(lambda: s.get("/health")[0] == 503, 10, "health to fail without prefill")


def test_mismatched_worker_is_refused_on_both_sides(make_stack):
    s = make_stack()
    s.start_gateway()
    proc = s.start_worker("odd", "decode", "--block-size", "8")
    assert proc.wait(timeout=180) != 0
    assert "block size mismatch" in s.log("odd") and "block size mismatch" in s.log("gateway")
    assert "odd" not in s.workers()


def test_garbage_on_the_wire_is_counted_and_survived(stack):
    import zmq

    ctx = zmq.Context.instance()
    decode = next(w for w in stack.workers().values() if w["role"] == "decode")
    for address in (stack.control, decode["kv_address"]):
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 1000)
        sock.connect(address)
        sock.send_multipart([b"\x93not", b"a message"])
        sock.send_multipart([b"\x95\x01\x63\xa1r\x80\x80"])  # msgpack, but kind 99
        sock.close()
    stack.wait_for(lambda: stack.get("/v1/workers")[1]["gateway"]["protocol_errors"] >= 2, 10, "gateway count")
    stack.wait_for(lambda: stack.workers()[decode["id"]]["protocol_errors"] >= 2, 10, "decode worker count")
    status, reply = stack.post(
        "/v1/completions", {"prompt": "The capital of France is", "max_tokens": 4, "temperature": 0}
    )
    assert status == 200 and "Paris" in reply["choices"][0]["text"]


def test_a_full_decode_worker_makes_requests_wait_not_fail(make_stack):
    # 40 blocks of 16 tokens on the decode worker (each 368,640 bytes in the CPU's half-precision cache): one
    # 300-token conversation at a time fits.
    s = make_stack(kv_cache_memory=str(40 * 368640))  # the decode worker lowers its max_model_len to 640
    s.start_gateway()
    s.start_worker("p", "prefill", "--kv-cache-memory", "256MiB")
    s.start_worker("d", "decode")
    s.wait_workers({"p", "d"})
    prompt = list(range(1000, 1300))

    def one(_):
        return s.post("/v1/completions", {"prompt": prompt, "max_tokens": 40, "temperature": 0, "ignore_eos": True})

    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        replies = list(pool.map(one, range(3)))
    for status, reply in replies:
        assert status == 200, reply
        assert reply["usage"]["completion_tokens"] == 40 and reply["choices"][0]["finish_reason"] == "length"
    # The decode worker holds 640 tokens: the gateway's limit follows its smallest worker.
    status, reply = s.post("/v1/completions", {"prompt": prompt, "max_tokens": 400})
    assert status == 400 and reply["error"]["code"] == "context_length_exceeded" and "640" in reply["error"]["message"]
    assert len({r["choices"][0]["text"] for _, r in replies}) == 1  # same prompt, greedy: same text
    s.wait_for(lambda: all(w["free_blocks"] == w["num_blocks"] for w in s.workers().values()), 10, "blocks back")

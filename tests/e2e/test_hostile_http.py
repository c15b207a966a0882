"""Hostile HTTP against a real gateway and a real prefill/decode pair (a tiny random model with the default
tokenizer): one body of each kind a client can get wrong or push to the extreme gets a 4xx that says what is wrong,
never a 5xx, a hang or a worker crash; afterwards the same worker processes serve on, every KV block is back in the
pools, and a greedy request still equals the in-process engine's output. A non-streaming client that disconnects
stops its request, and connections past --max-connections get 503."""

import http.client
import json
import os
import random
import re
import socket
import string
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from kvferry.common.sampling import MAX_SEED
from tests.e2e.stack import Stack, tiny_stack

VOCAB = 49152  # the default tokenizer's, which the tiny chat model shares
MAX_CONNECTIONS = 32
MAX_PROMPT_CHARS = 1_000_000  # the defaults of the settings the cases push past
MAX_BODY = 8 * 2**20
PROMPT = "The capital of France is"
GRAMMAR_CACHE_BYTES = 32 * 2**20  # a small bound, so that 30 large constraints pass it several times over


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    limits = {"KVFERRY_MAX_CONNECTIONS": str(MAX_CONNECTIONS), "KVFERRY_GRAMMAR_CACHE_BYTES": str(GRAMMAR_CACHE_BYTES)}
    with tiny_stack(tmp_path_factory.mktemp("hostile"), extra_env=limits) as stack:
        stack.start_pair()
        stack.pids = {name: proc.pid for name, proc in stack.procs.items()}
        yield stack


def send(stack: Stack, path: str, raw: bytes, content_type: str | None = "application/json", timeout: float = 120):
    """POST raw bytes with exactly this Content-Type (or none); the status and the parsed JSON reply. The timeout
    only guards against a hang."""
    conn = http.client.HTTPConnection("127.0.0.1", stack.port, timeout=timeout)
    try:
        conn.request("POST", path, body=raw, headers={"content-type": content_type} if content_type else {})
        response = conn.getresponse()
        text = response.read()
    finally:
        conn.close()
    try:
        return response.status, json.loads(text)
    except ValueError:
        return response.status, {"raw": text[:300].decode(errors="replace")}


def dumps(body) -> bytes:
    return json.dumps(body).encode()


deep = lambda n: b"[" * n + b"]" * n  # noqa: E731
digits = lambda n: b"1" + b"0" * (n - 1)  # noqa: E731
many_stop_ids = lambda n: {"prompt": "hi", "max_tokens": 2, "stop_token_ids": [7] * n}  # noqa: E731
long_stop = {"prompt": "hi", "max_tokens": 2, "stop": ["x" * 1025]}
many_stop_chars = {"prompt": "hi", "max_tokens": 2, "stop": ["x" * 1000] * 5}
huge_bias_key = {"prompt": "hi", "max_tokens": 2, "logit_bias": {"1" + "0" * 5000: 1}}
odd_digit_key = {"prompt": "hi", "max_tokens": 2, "logit_bias": {"\u00b2": 1}}  # str.isdigit, yet int() refuses it
SCHEMA = "response_format.json_schema.schema"


def with_schema(schema: dict) -> bytes:
    """A chat request whose answer must match schema."""
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    return dumps({**body, "response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}})


def shared_properties(num_properties: int) -> dict:
    """A oneOf whose check compared its branches in depth over every shared required property: hours at 2000."""
    props = {f"p{i}": {"$ref": "#/$defs/o"} for i in range(num_properties)}
    return {
        "$defs": {"o": {"type": "object", "properties": props, "required": list(props)}},
        "oneOf": [{"$ref": "#/$defs/o"}, {"$ref": "#/$defs/o"}],
    }


def ref_chain(num_links: int) -> dict:
    defs = {f"a{i}": {"anyOf": [{"$ref": f"#/$defs/a{i + 1}"}, {"type": "null"}]} for i in range(num_links)}
    return {"$defs": {**defs, f"a{num_links}": {"type": "string"}}, "$ref": "#/$defs/a0"}


nested_pattern = "(" * 900 + "a" + ")" * 900
list_ref = lambda index: {"type": "array", "prefixItems": [{}], "items": {"$ref": f"#/prefixItems/{index}"}}  # noqa: E731

# (path, body, content type, the status, the param the error names or a word its message holds, or several)
CASES = {
    "deep nesting": ("/v1/completions", b'{"prompt": ' + deep(100_000) + b"}", None, 400, "nested"),
    "deep nesting in messages": (
        "/v1/chat/completions",
        b'{"messages": [{"role": "user", "content": "hi", "x": ' + deep(2000) + b"}]}",
        None,
        400,
        "nested",
    ),
    "max_tokens of 5000 digits": (
        "/v1/completions",
        b'{"prompt": "hi", "max_tokens": ' + digits(5000) + b"}",
        None,
        400,
        "digits",
    ),
    "seed of 30 digits": ("/v1/completions", b'{"prompt": "hi", "seed": ' + digits(30) + b"}", None, 400, "seed"),
    "n of 30 digits": ("/v1/completions", b'{"prompt": "hi", "n": ' + digits(30) + b"}", None, 400, "n"),
    "temperature of 30 digits": (
        "/v1/completions",
        b'{"prompt": "hi", "max_tokens": 2, "temperature": ' + digits(30) + b"}",
        None,
        400,
        "temperature",
    ),
    "a token id of 30 digits": ("/v1/completions", b'{"prompt": [' + digits(30) + b"]}", None, 400, "prompt"),
    "a stop token id of 30 digits": (
        "/v1/completions",
        b'{"prompt": "hi", "stop_token_ids": [' + digits(30) + b"]}",
        None,
        400,
        "stop_token_ids",
    ),
    "detokenize a token id of 30 digits": ("/detokenize", b'{"tokens": [' + digits(30) + b"]}", None, 400, "tokens"),
    "a lone surrogate in a prompt": ("/v1/completions", b'{"prompt": "hi \\ud800"}', None, 400, "prompt"),
    "a lone surrogate in a message": (
        "/v1/chat/completions",
        b'{"messages": [{"role": "user", "content": "\\udc00 hi"}]}',
        None,
        400,
        "messages",
    ),
    "a lone surrogate in the model": ("/v1/completions", b'{"prompt": "hi", "model": "\\ud800"}', None, 400, "model"),
    "a lone surrogate as a field name": ("/v1/completions", b'{"prompt": "hi", "\\ud800": 1}', None, 400, "surrogate"),
    "tokenize a lone surrogate": ("/tokenize", b'{"prompt": "\\ud800"}', None, 400, "prompt"),
    "a message that is a string": ("/v1/chat/completions", dumps({"messages": ["hi"]}), None, 400, "messages"),
    "a message that is null": ("/v1/chat/completions", dumps({"messages": [None]}), None, 400, "messages"),
    "messages that are a string": ("/tokenize", dumps({"messages": "hi"}), None, 400, "messages"),
    "text/plain": ("/v1/completions", dumps({"prompt": "hi"}), "text/plain", 415, "application/json"),
    "no content type": ("/v1/chat/completions", dumps({"messages": []}), "", 415, "application/json"),
    "a form": ("/tokenize", b"prompt=hi", "application/x-www-form-urlencoded", 415, "application/json"),
    "301 logit_bias entries": (
        "/v1/completions",
        dumps({"prompt": "hi", "logit_bias": {str(i): 1 for i in range(301)}}),
        None,
        400,
        "logit_bias",
    ),
    "2000 stop_token_ids": ("/v1/completions", dumps(many_stop_ids(2000)), None, 400, "stop_token_ids"),
    "400k stop_token_ids": ("/v1/completions", dumps(many_stop_ids(400_000)), None, 400, "stop_token_ids"),
    "a prompt over max_prompt_chars": (
        "/v1/completions",
        dumps({"prompt": "ab" * (MAX_PROMPT_CHARS // 2) + "c"}),
        None,
        400,
        ("prompt", "characters"),
    ),
    "prompts over max_prompt_chars together": (
        "/v1/completions",
        dumps({"prompt": ["a" * (MAX_PROMPT_CHARS // 2)] * 2 + ["b"]}),
        None,
        400,
        ("prompt", "characters"),
    ),
    "messages over max_prompt_chars": (
        "/v1/chat/completions",
        dumps({"messages": [{"role": "user", "content": "ab" * (MAX_PROMPT_CHARS // 2) + "c"}]}),
        None,
        400,
        ("messages", "characters"),
    ),
    "tokenize over max_prompt_chars": (
        "/tokenize",
        dumps({"prompt": "a" * (MAX_PROMPT_CHARS + 1)}),
        None,
        400,
        ("prompt", "characters"),
    ),
    "detokenize more tokens than the context": ("/detokenize", dumps({"tokens": [5] * 9000}), None, 400, "tokens"),
    "n times prompts over the fan-out bound": (
        "/v1/completions",
        dumps({"prompt": ["hi"] * 5, "n": 16, "max_tokens": 1}),  # 80 choices; max_n 16, max_prompts 64
        None,
        400,
        "n",
    ),
    "an oversized body": ("/v1/completions", dumps({"prompt": "a" * MAX_BODY}), None, 413, "bytes"),
    # Issue 39: each once a 500, a held text thread, or a constraint that compiled for long or into much memory
    "a $ref index of a superscript digit": ("/v1/chat/completions", with_schema(list_ref("\u00b2")), None, 400, SCHEMA),
    "a $ref index of 5000 digits": ("/v1/chat/completions", with_schema(list_ref("1" * 5000)), None, 400, SCHEMA),
    "a pattern nested 900 deep": (
        "/v1/chat/completions",
        with_schema({"type": "string", "pattern": nested_pattern}),
        None,
        400,
        (SCHEMA, "nested"),
    ),
    "a type list of 11,000 objects": (
        "/v1/chat/completions",
        with_schema({"type": [{"a": i} for i in range(11_000)]}),
        None,
        400,
        (SCHEMA, "type: a list of at most 7"),  # before the metaschema compares the 11,000 pairwise (130 s)
    ),
    "a oneOf whose check grows as the cube of its properties": (
        "/v1/chat/completions",
        with_schema(shared_properties(2000)),
        None,
        400,
        (SCHEMA, "steps"),
    ),
    "a $ref chain of 1500 links": ("/v1/chat/completions", with_schema(ref_chain(1500)), None, 400, (SCHEMA, "$refs")),
    "an enum of 1024 hundred-character values": (
        "/v1/chat/completions",
        with_schema({"enum": [f"{i:04d}" + "x" * 96 for i in range(1024)]}),
        None,
        400,
        (SCHEMA, "characters"),
    ),
    "a choice of 10,000 strings": (
        "/v1/completions",
        dumps({"prompt": "hi", "structured_outputs": {"choice": [f"c{i}" for i in range(10_000)]}}),
        None,
        400,
        "structured_outputs.choice",
    ),
    "echo with 20 logprobs and n 16 on a long prompt": (
        "/v1/completions",
        dumps({"prompt": "hello " * 4000, "echo": True, "logprobs": 20, "n": 16, "max_tokens": 16}),
        None,
        400,
        "logprobs",
    ),
}
PARSING_CASES = [
    pytest.param(long_stop, "stop", id="a stop string over max_stop_length"),
    pytest.param(many_stop_chars, "stop", id="stop strings over max_stop_chars"),
    pytest.param(huge_bias_key, "logit_bias", id="a logit_bias key of 5000 digits"),
    pytest.param(odd_digit_key, "logit_bias", id="a logit_bias key of a superscript digit"),
]


def names_it(error: dict, what: str | tuple[str, ...]) -> bool:
    """Each of what is the error's param or a word of its message."""
    words = (what,) if isinstance(what, str) else what
    return all(error.get("param") == word or word in error.get("message", "") for word in words)


@pytest.mark.parametrize("case", list(CASES))
def test_a_hostile_body_gets_a_4xx_that_says_what_is_wrong(stack, case):
    path, raw, content_type, want, what = CASES[case]
    status, reply = send(stack, path, raw, "application/json" if content_type is None else content_type or None)
    assert status == want, (case, status, reply)
    assert set(reply["error"]) == {"message", "type", "param", "code"} and names_it(reply["error"], what), reply


@pytest.mark.parametrize("body, param", PARSING_CASES)
def test_a_body_request_parsing_must_refuse_gets_400(stack, body, param):
    status, reply = send(stack, "/v1/completions", dumps(body))
    assert status == 400 and names_it(reply["error"], param), (status, reply)


def test_the_largest_seed_with_n_2_wraps_round_for_the_second_choice(stack):
    status, reply = send(stack, "/v1/completions", dumps({"prompt": "hi", "n": 2, "seed": MAX_SEED, "max_tokens": 2}))
    assert status == 200 and len(reply["choices"]) == 2, (status, reply)


def test_a_nul_character_is_text_the_tokenizer_takes(stack):
    status, reply = send(stack, "/v1/completions", dumps({"prompt": "a\u0000b", "max_tokens": 2}))
    assert status == 200 and len(reply["choices"]) == 1, reply


def test_json_with_a_charset_or_a_json_suffix_is_served(stack):
    for content_type in ("application/json; charset=utf-8", "application/vnd.kvferry+json"):
        status, reply = send(stack, "/v1/completions", dumps({"prompt": "hi", "max_tokens": 2}), content_type)
        assert status == 200, (content_type, reply)


# -- a non-streaming client that leaves ------------------------------------------------------------------------------
def metric(stack: Stack, name: str) -> float:
    found = re.search(rf"^{re.escape(name)} (\S+)$", stack.text("/metrics"), re.M)
    return float(found.group(1)) if found else 0.0


GENERATED = "kvferry:generation_tokens_total"
ABORTED = 'kvferry:request_success_total{finished_reason="abort"}'


def decode_worker(stack: Stack) -> dict:
    return stack.workers()["decode-a"]


def test_a_non_streaming_client_that_disconnects_stops_its_generation(stack):
    max_tokens = 6000  # at a few ms a token, the whole would take far longer than the waits below allow for
    stack.wait_for(lambda: decode_worker(stack)["running"] == 0, 60, "an idle decode worker")
    generated, aborted = metric(stack, GENERATED), metric(stack, ABORTED)
    body = dumps({"prompt": PROMPT, "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0})
    client = socket.create_connection(("127.0.0.1", stack.port), timeout=30)
    client.sendall(
        b"POST /v1/completions HTTP/1.1\r\nhost: gateway\r\ncontent-type: application/json\r\n"
        b"content-length: %d\r\n\r\n%s" % (len(body), body)
    )
    stack.wait_for(lambda: metric(stack, GENERATED) >= generated + 20, 60, "tokens flowing")
    client.close()  # the client goes away before any byte of the response
    at_close = metric(stack, GENERATED)
    stack.wait_for(lambda: decode_worker(stack)["running"] == 0, 60, "the decode worker idle again")
    stack.wait_for(lambda: stack.get("/v1/workers")[1]["gateway"]["requests_in_flight"] == 0, 30, "no flight left")
    after = metric(stack, GENERATED) - at_close
    print(f"{at_close - generated:.0f} tokens before the disconnect, {after:.0f} after")
    assert after <= 200, f"{after:.0f} tokens generated after the client left (of {max_tokens})"
    assert metric(stack, ABORTED) == aborted + 1  # counted as an abort, not as a request that finished


# -- connections past --max-connections -----------------------------------------------------------------------------
def test_connections_past_max_connections_get_503(stack):
    idle = [socket.create_connection(("127.0.0.1", stack.port), timeout=30) for _ in range(MAX_CONNECTIONS)]
    try:
        time.sleep(0.5)  # every connection accepted by the server
        status, reply = send(stack, "/v1/completions", dumps({"prompt": "hi", "max_tokens": 1}), timeout=60)
        assert status == 503, reply
    finally:
        for sock in idle:
            sock.close()
    hi = dumps({"prompt": "hi", "max_tokens": 1})
    stack.wait_for(lambda: send(stack, "/v1/completions", hi)[0] == 200, 30, "served again")


# -- checks that would hold the gateway's text threads --------------------------------------------------------------
def cpu_seconds(pid: int) -> float:
    """The process's user and system CPU time so far."""
    with open(f"/proc/{pid}/stat") as stat:
        fields = stat.read().rsplit(") ", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def cpu_over(pid: int, seconds: float) -> float:
    before = cpu_seconds(pid)
    time.sleep(seconds)
    return cpu_seconds(pid) - before


def test_schemas_that_exhaust_their_budget_hold_up_no_plain_request_and_leave_the_gateway_idle(stack):
    """Four of them in flight take every text thread until refused: a plain completion beside them is served in
    about its own time, they each get a 400 naming the field, and then the gateway's CPU is idle again. Four more
    whose clients leave at once stop as well (before, each held a thread for hours and a core with them)."""
    plain = dumps({"prompt": PROMPT, "max_tokens": 4, "temperature": 0})
    started = time.monotonic()
    assert send(stack, "/v1/completions", plain)[0] == 200
    alone_s = time.monotonic() - started
    heavy = with_schema(shared_properties(2000))
    with ThreadPoolExecutor(4) as pool:
        refusals = [pool.submit(send, stack, "/v1/chat/completions", heavy) for _ in range(4)]
        time.sleep(0.3)  # their bodies are in, their checks running
        started = time.monotonic()
        status, reply = send(stack, "/v1/completions", plain)
        beside_s = time.monotonic() - started
        assert status == 200, reply
        for refusal in refusals:
            status, reply = refusal.result()
            assert status == 400 and reply["error"]["param"] == SCHEMA and "steps" in reply["error"]["message"]
    print(f"a plain completion: {alone_s:.2f} s alone, {beside_s:.2f} s beside four schemas being refused")
    assert beside_s < 10 * alone_s + 10  # a guard: before, it waited behind the four for hours
    gateway = stack.procs["gateway"].pid
    for _ in range(4):  # abandoned: the client sends the body and leaves
        client = socket.create_connection(("127.0.0.1", stack.port), timeout=30)
        client.sendall(
            b"POST /v1/chat/completions HTTP/1.1\r\nhost: gateway\r\ncontent-type: application/json\r\n"
            b"content-length: %d\r\n\r\n%s" % (len(heavy), heavy)
        )
        client.close()
    time.sleep(3)  # each check stops at its next look, a budget's worth of steps at most
    idle = cpu_over(gateway, 3)
    print(f"the gateway's CPU over 3 s after: {idle:.2f} s")
    assert idle < 0.5  # heartbeats and metrics only, not a check still running


def rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as status:
        return next(int(line.split()[1]) * 1024 for line in status if line.startswith("VmRSS:"))


def with_descendants(pid: int) -> list[int]:
    """pid and its children's pids (a worker's compile process), from /proc."""
    children = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as stat:
                    if int(stat.read().rsplit(") ", 1)[1].split()[1]) == pid:
                        children.append(int(entry))
            except (FileNotFoundError, ProcessLookupError, IndexError):
                pass
    return [pid, *children]


def random_enum(rng: random.Random, num_chars: int = 32_000) -> dict:
    """An enum of random 100-character values, within the gateway's bound on their characters: each compiles to
    megabytes of token masks (random text shares no prefixes)."""
    alphabet = string.ascii_letters + string.digits
    return {"enum": ["".join(rng.choice(alphabet) for _ in range(100)) for _ in range(num_chars // 102)]}


def test_distinct_large_enums_grow_no_workers_memory_past_the_grammar_caches_bound(stack):
    rng = random.Random(39)
    ask = lambda schema: send(stack, "/v1/chat/completions", with_schema(schema))  # noqa: E731
    for _ in range(3):  # the one-time set-up: xgrammar's import, the tokenizer's info, the compile process
        status, reply = ask(random_enum(rng))
        assert status == 200, reply
    workers = {name: stack.procs[name].pid for name in ("prefill-a", "decode-a")}
    before = {pid: rss_bytes(pid) for worker in workers.values() for pid in with_descendants(worker)}
    for _ in range(30):
        status, reply = ask(random_enum(rng))
        assert status == 200, reply
    grown = {pid: rss_bytes(pid) - rss for pid, rss in before.items()}
    print("RSS grown by 30 enums (MiB):", {pid: round(g / 2**20, 1) for pid, g in grown.items()})
    assert max(grown.values()) <= GRAMMAR_CACHE_BYTES, grown


def test_a_request_value_with_line_breaks_forges_no_log_line(stack):
    forged = "FORGED kvferry.gateway: worker decode-z joined as decode"
    status, reply = send(stack, "/v1/completions", dumps({"prompt": "hi", "model": f"x\n{forged}\r\n{forged}"}))
    assert status == 404 and reply["error"]["param"] == "model"
    status, _ = send(stack, "/v1/completions", dumps({"prompt": "hi", "max_tokens": 1, "user": f"u\n{forged}"}))
    assert status == 200
    time.sleep(0.5)
    assert not any(line.startswith("FORGED") for line in stack.log("gateway").splitlines())


# -- afterwards ----------------------------------------------------------------------------------------------------
def test_afterwards_the_same_workers_serve_on_with_every_block_free_and_the_engines_output(stack):
    assert set(stack.workers()) == {"prefill-a", "decode-a"}
    for name, proc in stack.procs.items():
        assert proc.poll() is None and proc.pid == stack.pids[name], f"{name} exited"
    for name in ("prefill-a", "decode-a"):
        assert stack.log("gateway").count(f"worker {name} joined") == 1, f"{name} registered again"
    stack.wait_for(
        lambda: all(w["free_blocks"] == w["num_blocks"] for w in stack.workers().values()), 60, "every block free"
    )
    from kvferry.common.config import EngineConfig
    from kvferry.common.engine import LLMEngine
    from kvferry.common.sampling import SamplingParams

    greedy = dict(max_tokens=12, temperature=0, ignore_eos=True)
    status, reply = stack.post("/v1/completions", {"prompt": PROMPT, **greedy})
    assert status == 200, reply
    model = str(stack.log_dir / "tiny-chat")
    engine = LLMEngine(EngineConfig(model=model, kv_cache_memory=16 * 2**20))
    [want] = engine.generate([PROMPT], SamplingParams(**greedy))
    assert reply["choices"][0]["text"] == want.text

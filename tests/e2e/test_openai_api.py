"""The OpenAI API's parameters through the `openai` client on a real stack, logprobs against the in-process
engine, n with a prompt prefilled once, cancellation that frees every block, API keys, limits, tokenizer routes."""

import http.client
import json
import time

import pytest

from kvferry.common.config import EngineConfig
from kvferry.common.engine import LLMEngine
from kvferry.common.sampling import SamplingParams
from tests.e2e.stack import running_pair

pytestmark = pytest.mark.slow
KEY = "sk-kvferry-test"
PROMPT = "The capital of France is"
NAMES = ("smol-135m", "HuggingFaceTB/SmolLM2-135M-Instruct")  # --served-model-name, through its variable


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    started = int(time.time())
    with running_pair(
        tmp_path_factory.mktemp("openai"),
        extra_env={
            "KVFERRY_API_KEY": KEY,
            "KVFERRY_MAX_N": "4",
            "KVFERRY_MAX_TOKENS_LIMIT": "256",
            "KVFERRY_MAX_BODY_SIZE": "64KiB",
            "KVFERRY_MAX_STOP": "4",
            "KVFERRY_SERVED_MODEL_NAME": " ".join(NAMES),
        },
    ) as s:
        s.started = started  # before the gateway loaded the model
        yield s


@pytest.fixture(scope="module")
def client(stack):
    from openai import OpenAI

    return OpenAI(base_url=stack.url + "/v1", api_key=KEY, max_retries=0)


@pytest.fixture(scope="module")
def engine():
    return LLMEngine(EngineConfig(kv_cache_memory=256 * 2**20))


@pytest.fixture(scope="module")
def model(client):
    return client.models.list().data[0].id


def authed(stack, path, body, method="POST", key=KEY):
    conn = http.client.HTTPConnection("127.0.0.1", stack.port, timeout=120)
    conn.request(
        method,
        path,
        body=json.dumps(body) if body is not None else None,
        headers={"content-type": "application/json", **({"authorization": f"Bearer {key}"} if key else {})},
    )
    response = conn.getresponse()
    return response.status, json.loads(response.read())


def test_greedy_logprobs_match_the_in_process_engine(client, model, engine):
    ids = engine.tokenizer.encode(PROMPT)
    [ref] = engine.generate([ids], SamplingParams(max_tokens=6, temperature=0, logprobs=5, prompt_logprobs=5))
    done = client.completions.create(model=model, prompt=PROMPT, max_tokens=6, temperature=0, logprobs=5)
    lp = done.choices[0].logprobs
    assert len(lp.token_logprobs) == 6 and len(lp.top_logprobs[0]) == 5
    for got, want in zip(lp.token_logprobs, ref.logprobs):
        assert got == pytest.approx(want.logprob, abs=1e-4)
    assert lp.text_offset[0] == 0 and "".join(lp.tokens) == done.choices[0].text
    echoed = client.completions.create(model=model, prompt=PROMPT, max_tokens=0, echo=True, logprobs=1)
    choice = echoed.choices[0]
    assert choice.text == PROMPT and echoed.usage.completion_tokens == 0
    assert choice.logprobs.token_logprobs[0] is None and len(choice.logprobs.token_logprobs) == len(ids)
    for got, want in zip(choice.logprobs.token_logprobs[1:], ref.prompt_logprobs[1:]):
        assert got == pytest.approx(want.logprob, abs=1e-4)
    chat = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "Hi"}],
        max_tokens=4,
        temperature=0,
        logprobs=True,
        top_logprobs=3,
    )
    content = chat.choices[0].logprobs.content
    assert len(content) == 4 and all(len(c.top_logprobs) == 3 and c.logprob <= 0 for c in content)
    assert content[0].top_logprobs[0].logprob == pytest.approx(content[0].logprob, abs=1e-6)  # greedy: the best


def test_n_choices_are_reproducible_different_and_prefilled_once(stack, client, model):
    def prefilled():
        return stack.workers()["prefill-a"]["prompts_prefilled"]

    before = settled(stack, lambda s: prefilled())
    kwargs = dict(model=model, prompt="Once upon a time", max_tokens=12, temperature=1.0, seed=7, n=3)
    first = client.completions.create(**kwargs)
    stack.wait_for(lambda: prefilled() == before + 1, 10, "the prompt counted once")
    texts = [c.text for c in sorted(first.choices, key=lambda c: c.index)]
    assert len(texts) == 3 and len(set(texts)) == 3 and first.usage.completion_tokens == 36
    again = client.completions.create(**kwargs)
    assert [c.text for c in sorted(again.choices, key=lambda c: c.index)] == texts
    streamed = {}
    for chunk in client.completions.create(**kwargs, stream=True):
        for c in chunk.choices:
            streamed[c.index] = streamed.get(c.index, "") + c.text
    assert [streamed[i] for i in range(3)] == texts
    stack.wait_for(lambda: prefilled() == before + 3, 10, "one prefill per request")
    chat = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "Tell a joke"}],
        n=2,
        max_completion_tokens=8,
        temperature=1.0,
        seed=3,
    )
    assert len(chat.choices) == 2 and chat.choices[0].message.content != chat.choices[1].message.content


def test_sampling_parameters_each_take_effect(client, model, engine):
    base = dict(model=model, prompt=PROMPT, max_tokens=12, temperature=0)
    plain = client.completions.create(**base).choices[0].text
    forced = client.completions.create(**base, logit_bias={"42": 100}).choices[0]
    assert forced.text == engine.tokenizer.decode([42] * 12)
    for kw in ({"presence_penalty": 2.0}, {"frequency_penalty": 2.0}, {"extra_body": {"repetition_penalty": 1.8}}):
        assert client.completions.create(**base, **kw).choices[0].text != plain, kw
    stop_id = engine.tokenizer.encode(plain)[0]
    stopped = client.completions.create(**base, extra_body={"stop_token_ids": [stop_id]}).choices[0]
    # As in vLLM: a stop token that is not a special token stays in the text.
    assert stopped.text == engine.tokenizer.decode([stop_id]) and stopped.finish_reason == "stop"
    held = client.completions.create(**base, extra_body={"stop_token_ids": [stop_id], "min_tokens": 3}).choices[0]
    # min_tokens masks the stop token for three tokens: the in-process engine says where it then ends, and why.
    [want] = engine.generate(
        [PROMPT], SamplingParams(max_tokens=12, temperature=0, stop_token_ids=(stop_id,), min_tokens=3)
    )
    assert (held.text, held.finish_reason) == (want.text, want.finish_reason.name.lower())
    assert len(engine.tokenizer.encode(held.text)) >= 3
    assert (
        client.completions.create(**{**base, "temperature": 1.0}, extra_body={"min_p": 1.0}, seed=1).choices[0].text
        == plain
    )
    seeded = [client.completions.create(**{**base, "temperature": 1.0}, seed=11).choices[0].text for _ in range(2)]
    assert seeded[0] == seeded[1]
    chat = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Count to ten"}], max_completion_tokens=5, temperature=0
    )
    assert chat.usage.completion_tokens == 5 and chat.choices[0].finish_reason == "length"


def test_streaming_usage_and_finish_reasons(client, model):
    chunks = list(
        client.completions.create(
            model=model, prompt=PROMPT, max_tokens=5, temperature=0, stream=True, stream_options={"include_usage": True}
        )
    )
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 5
    assert [c.choices[0].finish_reason for c in chunks[:-1]][-1] == "length"


def test_the_served_names_are_listed_answered_to_and_the_first_reported(stack, client, model):
    from openai import NotFoundError

    listed = client.models.list().data
    assert model == NAMES[0] and [m.id for m in listed] == list(NAMES)
    assert len({m.created for m in listed}) == 1 and stack.started <= listed[0].created <= time.time()
    done = client.completions.create(model=NAMES[1], prompt=PROMPT, max_tokens=2, temperature=0)
    assert done.model == NAMES[0]
    with pytest.raises(NotFoundError) as caught:  # not one of this stack's names, though the default's short name
        client.completions.create(model="SmolLM2-135M-Instruct", prompt=PROMPT, max_tokens=2)
    assert caught.value.body["code"] == "model_not_found" and NAMES[1] in caught.value.body["message"]


@pytest.mark.parametrize("chat", [False, True])
def test_continuous_usage_stats_give_the_usage_so_far_in_every_chunk(client, model, chat):
    options = {"include_usage": True, "continuous_usage_stats": True}  # what guidellm sends
    common = dict(model=model, max_tokens=6, temperature=0, stream=True, stream_options=options)
    common["extra_body"] = {"ignore_eos": True, **({} if chat else {"return_token_ids": True})}
    if chat:
        chunks = list(client.chat.completions.create(**common, messages=[{"role": "user", "content": "Hi"}]))
        whole = client.chat.completions.create(model=model, max_tokens=1, messages=[{"role": "user", "content": "Hi"}])
    else:
        chunks = list(client.completions.create(**common, prompt=PROMPT))
        whole = client.completions.create(model=model, max_tokens=1, prompt=PROMPT)
    *with_choices, last = chunks
    assert last.choices == [] and last.usage.completion_tokens == 6
    assert all(c.choices and c.usage is not None for c in with_choices)
    assert {c.usage.prompt_tokens for c in chunks} == {whole.usage.prompt_tokens}
    assert all(c.usage.total_tokens == c.usage.prompt_tokens + c.usage.completion_tokens for c in chunks)
    so_far = [c.usage.completion_tokens for c in with_choices]
    assert so_far == sorted(so_far) and so_far[-1] == 6
    if chat:
        assert so_far[0] == 0  # the role's chunk, before any token
    else:  # exactly the tokens sent so far
        counted = [len(c.choices[0].model_extra["token_ids"]) for c in with_choices]
        assert so_far == [sum(counted[: i + 1]) for i in range(len(counted))]


def free_blocks(stack) -> dict[str, int]:
    return {name: w["free_blocks"] for name, w in stack.workers().items()}


def settled(stack, read, timeout: float = 60):
    """read(stack) once the workers' heartbeats have caught up with earlier requests (two readings agree)."""
    give_up_at = time.monotonic() + timeout  # a guard against a hang, not a timing
    previous = read(stack)
    while time.monotonic() < give_up_at:
        time.sleep(1.2)  # more than two heartbeat intervals of the stack (0.5 s)
        current = read(stack)
        if current == previous:
            return current
        previous = current
    raise AssertionError(f"the workers' readings never settled within {timeout} s: last {previous}")


def test_a_client_that_disconnects_mid_stream_frees_every_block(stack):
    idle = settled(stack, free_blocks)
    conn = http.client.HTTPConnection("127.0.0.1", stack.port, timeout=60)
    conn.request(
        "POST",
        "/v1/completions",
        body=json.dumps({"prompt": PROMPT * 40, "max_tokens": 200, "ignore_eos": True, "stream": True}),
        headers={"content-type": "application/json", "authorization": f"Bearer {KEY}"},
    )
    response = conn.getresponse()
    for _ in range(4):  # a few tokens in: the request holds blocks on the decode worker
        response.readline()
        response.readline()
    stack.wait_for(lambda: free_blocks(stack)["decode-a"] < idle["decode-a"], 10, "blocks in use")
    conn.sock.close()  # the client goes away
    conn.close()
    left = time.monotonic()
    stack.wait_for(lambda: free_blocks(stack) == idle, 10, "every block back")
    print(f"blocks back {time.monotonic() - left:.2f} s after the disconnect (heartbeats every 0.5 s)")


def test_a_stop_string_frees_the_rest_of_the_request(stack, client, model):
    idle = settled(stack, free_blocks)
    text = client.completions.create(model=model, prompt=PROMPT, max_tokens=8, temperature=0).choices[0].text
    cut = client.completions.create(
        model=model, prompt=PROMPT, max_tokens=200, temperature=0, stop=[text[3:7]], extra_body={"ignore_eos": True}
    )
    assert cut.choices[0].finish_reason == "stop"
    stack.wait_for(lambda: free_blocks(stack) == idle, 10, "every block back")


def test_tokenizer_routes_and_version(stack, engine):
    status, tokens = authed(stack, "/tokenize", {"prompt": PROMPT, "add_special_tokens": False})
    assert status == 200 and tokens["tokens"] == engine.tokenizer.encode(PROMPT, add_special_tokens=False)
    assert tokens["count"] == len(tokens["tokens"]) and tokens["max_model_len"] > 0
    status, text = authed(stack, "/detokenize", {"tokens": tokens["tokens"]})
    assert status == 200 and text["prompt"] == PROMPT
    status, chat = authed(stack, "/tokenize", {"messages": [{"role": "user", "content": "Hi"}]})
    assert chat["tokens"] == list(engine.encode("Hi", chat=True))
    status, info = authed(stack, "/tokenizer_info", None, method="GET")
    assert status == 200 and info["eos_token"] == engine.tokenizer.eos_token and info["chat_template"]
    assert stack.get("/version")[1]["version"]
    status, bad = authed(stack, "/detokenize", {"tokens": [10**9]})
    assert status == 400 and bad["error"]["param"] == "tokens"


def test_api_keys(stack, model):
    from openai import AuthenticationError, OpenAI

    with pytest.raises(AuthenticationError):
        OpenAI(base_url=stack.url + "/v1", api_key="wrong", max_retries=0).models.list()
    for key in (None, "wrong"):
        status, reply = authed(stack, "/tokenize", {"prompt": "hi"}, key=key)
        assert status == 401 and reply["error"]["code"] == "invalid_api_key"
        status, reply = authed(stack, "/v1/completions", {"prompt": "hi"}, key=key)
        assert status == 401 and set(reply["error"]) == {"message", "type", "param", "code"}
    assert stack.get("/health")[0] == 200
    assert "kvferry:prompt_tokens_total" in stack.text("/metrics")


@pytest.mark.parametrize(
    "body,param",
    [
        ({"n": -1}, "n"),
        ({"n": 5}, "n"),
        ({"top_p": 1.5}, "top_p"),
        ({"logprobs": 21}, "logprobs"),
        ({"logit_bias": {"99999999": 1}}, "logit_bias"),
        ({"stream_options": {"include_usage": True}}, "stream_options"),
        (
            {"stream": True, "stream_options": {"continuous_usage_stats": "yes"}},
            "stream_options.continuous_usage_stats",
        ),
        ({"max_tokens": 300}, "max_tokens"),
        ({"stop": ["a", "b", "c", "d", "e"]}, "stop"),
        ({"frequency_penalty": 3}, "frequency_penalty"),
        ({"min_tokens": 50, "max_tokens": 5}, "min_tokens"),
        ({"stop_token_ids": [-1]}, "stop_token_ids"),
        ({"guided_json": "{not json"}, "guided_json"),
        ({"best_of": 2}, "best_of"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"echo": "yes"}, "echo"),
        ({"prompt": ["a"] * 65}, "prompt"),
        ({"prompt": []}, "prompt"),
        ({"prompt": [[1], []]}, "prompt"),
    ],
)
def test_bad_values_name_their_field(stack, body, param):
    status, reply = authed(stack, "/v1/completions", {"prompt": PROMPT, **body})
    assert status == 400 and reply["error"]["param"] == param, reply


@pytest.mark.parametrize(
    "body,param",
    [
        ({"top_logprobs": 3}, "top_logprobs"),
        ({"top_logprobs": 21, "logprobs": True}, "top_logprobs"),
        ({"echo": True}, "echo"),
        ({"response_format": {"type": "xml"}}, "response_format"),
    ],
)
def test_bad_chat_values_name_their_field(stack, body, param):
    status, reply = authed(stack, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], **body})
    assert status == 400 and reply["error"]["param"] == param, reply


def test_a_body_over_the_limit_gets_413(stack):
    status, reply = authed(stack, "/v1/completions", {"prompt": "x" * 70_000})
    assert status == 413 and reply["error"]["code"] == "request_too_large"


def test_openapi_describes_every_route(stack):
    status, spec = stack.get("/openapi.json")
    assert status == 200 and spec["openapi"].startswith("3.")
    for path in (
        "/v1/completions",
        "/v1/chat/completions",
        "/v1/models",
        "/tokenize",
        "/detokenize",
        "/tokenizer_info",
        "/version",
        "/health",
        "/metrics",
        "/openapi.json",
    ):
        assert path in spec["paths"], path
    post = spec["paths"]["/v1/completions"]["post"]
    assert {"400", "401", "413", "503"} <= set(post["responses"]) and "requestBody" in post


def test_an_error_after_streaming_started_is_an_sse_event_then_done(make_stack):
    s = make_stack().start_pair("prefill-b", "decode-b")
    conn = http.client.HTTPConnection("127.0.0.1", s.port, timeout=60)
    conn.request(
        "POST",
        "/v1/completions",
        body=json.dumps({"prompt": PROMPT, "max_tokens": 400, "ignore_eos": True, "stream": True}),
        headers={"content-type": "application/json"},
    )
    response = conn.getresponse()
    events = []
    while True:
        line = response.readline().decode()
        if not line:
            break
        if line.startswith("data: "):
            events.append(line[6:].strip())
            if len(events) == 3:
                s.stop("decode-b")  # killed mid-stream: the gateway notices the missing heartbeats
    assert events[-1] == "[DONE]"
    error = json.loads(events[-2])
    assert set(error["error"]) == {"message", "type", "param", "code"} and "decode-b" in error["error"]["message"]
    assert all("choices" in json.loads(e) for e in events[:-2])


def test_a_batch_of_prompts_gets_its_choices_in_order(client, model):
    prompts = [PROMPT, "Once upon a time"]
    alone = [
        client.completions.create(model=model, prompt=p, max_tokens=6, temperature=0).choices[0].text for p in prompts
    ]
    batch = client.completions.create(model=model, prompt=prompts, max_tokens=6, temperature=0, n=2)
    by_index = {c.index: c.text for c in batch.choices}
    assert by_index == {0: alone[0], 1: alone[0], 2: alone[1], 3: alone[1]}
    assert batch.usage.completion_tokens == 24
    streamed: dict[int, str] = {}
    for chunk in client.completions.create(model=model, prompt=prompts, max_tokens=6, temperature=0, stream=True):
        for c in chunk.choices:
            streamed[c.index] = streamed.get(c.index, "") + c.text
    assert streamed == {0: alone[0], 1: alone[1]}
    ids = client.completions.create(model=model, prompt=[[5, 6, 7], [8, 9]], max_tokens=2, temperature=0)
    assert [c.index for c in ids.choices] == [0, 1] and ids.usage.prompt_tokens == 5


def test_a_choice_ended_by_a_stop_string_leaves_the_decode_batch_at_once(stack, client, model):
    import threading

    kwargs = dict(
        model=model,
        prompt="Once upon a time",
        temperature=1.0,
        seed=21,
        n=2,
        max_tokens=100,
        extra_body={"ignore_eos": True},
    )
    full = {c.index: c.text for c in client.completions.create(**kwargs).choices}
    stop = next((full[0][:k] for k in range(2, 12) if full[0][:k].strip() and full[0][:k] not in full[1]), None)
    assert stop, full  # a stop string choice 0 meets at once and choice 1 never does
    samples, done = [], threading.Event()

    def watch():
        while not done.is_set():
            samples.append((time.monotonic(), stack.workers()["decode-a"]["running"]))
            time.sleep(0.1)

    watcher = threading.Thread(target=watch)
    watcher.start()
    ended = {}
    try:
        for chunk in client.completions.create(**kwargs, stop=[stop], stream=True):
            for c in chunk.choices:
                if c.finish_reason:
                    ended[c.index] = (c.finish_reason, time.monotonic())
    finally:
        done.set()
        watcher.join()
    assert ended[0][0] == "stop" and ended[1][0] == "length"
    alone = [running for t, running in samples if ended[0][1] + 1.0 < t < ended[1][1] - 0.3]
    assert alone and min(alone) == 1, (alone, ended)  # choice 1 decodes on its own: choice 0 left the batch

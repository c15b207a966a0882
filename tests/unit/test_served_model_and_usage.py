"""The served model at the gateway, in process over a fake core: /v1/models (every name, the load time), the names a
request may give (--served-model-name, and the default model's two), and stream_options.continuous_usage_stats on both
streaming endpoints."""

import json
import time

import pytest
from starlette.testclient import TestClient

from kvferry.common.gateway_config import GatewayConfig
from kvferry.common.sequence import FinishReason
from kvferry.services.gateway.api import Api
from kvferry.services.gateway.flight import Event
from kvferry.services.gateway.main import DEFAULT_MODEL_SOURCE, load_text_side, served_names
from kvferry.services.gateway.server import GatewayCore

NAMES = ("org/tiny-chat", "tiny")
LOADED_AT = 1_750_000_000.75


@pytest.fixture(scope="module")
def tokenizer():
    return load_text_side(None)[0]


@pytest.fixture(scope="module")
def api(tokenizer):
    core = GatewayCore("tcp://127.0.0.1:0", "SmolLM2-135M-Instruct", 16)
    try:
        yield Api(core, tokenizer, NAMES, 2048, GatewayConfig(max_n=4), loaded_at=LOADED_AT)
    finally:
        core.control.socket.close()


@pytest.fixture
def served(api, monkeypatch):
    """A client, and the events the fake workers answer each request with."""
    answer: list[Event] = []

    async def generate_batches(prompt_ids, params, request_id=None, trace=None, n=1, flights=None):
        for event in answer:
            yield [event]

    monkeypatch.setattr(api.core, "generate_batches", generate_batches)
    return TestClient(api.app(), raise_server_exceptions=False), answer


def sse_events(response) -> list[dict]:
    lines = [line[len("data: ") :] for line in response.text.splitlines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


def test_the_default_model_is_served_under_its_hub_id_and_its_short_name(tmp_path):
    assert served_names(None) == served_names("") == (DEFAULT_MODEL_SOURCE, "SmolLM2-135M-Instruct")
    assert DEFAULT_MODEL_SOURCE == "HuggingFaceTB/SmolLM2-135M-Instruct"
    (tmp_path / "Qwen3-0.6B").mkdir()
    assert served_names(tmp_path / "Qwen3-0.6B") == ("Qwen3-0.6B",)  # a folder: its whole name
    assert served_names(tmp_path / "tiny.Q8_0.gguf") == ("tiny.Q8_0",)  # a file: without its suffix
    assert served_names(None, ("mine", "other")) == ("mine", "other")  # --served-model-name replaces both


def test_models_lists_every_name_with_the_time_the_model_was_loaded(served):
    client, _ = served
    response = client.get("/v1/models")
    assert response.status_code == 200
    cards = response.json()["data"]
    assert [c["id"] for c in cards] == list(NAMES)
    assert {c["created"] for c in cards} == {1_750_000_000}
    assert all(c["object"] == "model" and c["max_model_len"] == 2048 for c in cards)


def test_without_a_load_time_created_is_when_the_api_was_built(tokenizer):
    core = GatewayCore("tcp://127.0.0.1:0", "SmolLM2-135M-Instruct", 16)
    try:
        before = int(time.time())
        api = Api(core, tokenizer, "one-name", 2048)
        after = int(time.time())
        cards = TestClient(api.app()).get("/v1/models").json()["data"]
    finally:
        core.control.socket.close()
    assert [c["id"] for c in cards] == ["one-name"] and before <= cards[0]["created"] <= after


@pytest.mark.parametrize("asked", [None, *NAMES])
def test_a_request_may_name_the_model_by_any_name_and_the_reply_gives_the_first(served, asked):
    client, answer = served
    answer.append(Event([11, 12], FinishReason.LENGTH))
    body = {"prompt": "hi", "max_tokens": 2} | ({"model": asked} if asked else {})
    reply = client.post("/v1/completions", json=body)
    assert reply.status_code == 200, reply.text
    assert reply.json()["model"] == NAMES[0] and reply.json()["usage"]["completion_tokens"] == 2


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions", "/tokenize"])
def test_an_unknown_model_is_a_404_naming_what_is_served(served, path):
    client, _ = served
    body = {"prompt": "hi", "messages": [{"role": "user", "content": "hi"}]}
    body = {k: v for k, v in body.items() if (k == "messages") == (path == "/v1/chat/completions")}
    for model in ("SmolLM2-135M-Instruct", "TINY", "x" * 5000):
        reply = client.post(path, json={**body, "model": model})
        error = reply.json()["error"]
        assert reply.status_code == 404 and (error["code"], error["param"]) == ("model_not_found", "model")
        assert "'org/tiny-chat' or 'tiny'" in error["message"] and len(error["message"]) < 300
    reply = client.post(path, json={**body, "model": ["tiny"]})
    assert reply.status_code == 400 and reply.json()["error"]["param"] == "model"


def three_tokens() -> list[Event]:
    return [Event([11], None, start=0), Event([12], None, start=1), Event([13], FinishReason.LENGTH, start=2)]


@pytest.mark.parametrize("chat", [False, True])
@pytest.mark.parametrize("include_usage", [False, True])
def test_continuous_usage_stats_puts_the_usage_so_far_in_every_chunk(served, tokenizer, chat, include_usage):
    client, answer = served
    answer.extend(three_tokens())
    options = {"continuous_usage_stats": True, "include_usage": include_usage}
    if chat:
        path, body = "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}
        text = tokenizer.apply_chat_template(body["messages"], add_generation_prompt=True, tokenize=False)
        num_prompt = len(tokenizer.encode(text, add_special_tokens=False))
    else:
        path, body = "/v1/completions", {"prompt": "Hello there"}
        num_prompt = len(tokenizer.encode("Hello there"))
    reply = client.post(path, json={**body, "max_tokens": 3, "stream": True, "stream_options": options})
    assert reply.status_code == 200, reply.text
    chunks = sse_events(reply)
    with_choices = [c for c in chunks if c["choices"]]
    outs = [c["usage"]["completion_tokens"] for c in with_choices]
    assert outs == ([0, 1, 2, 3] if chat else [1, 2, 3])  # chat's first chunk is the role, before any token
    for c in with_choices:
        u = c["usage"]
        assert u["prompt_tokens"] == num_prompt and u["total_tokens"] == num_prompt + u["completion_tokens"]
    if include_usage:  # the last chunk, without choices, as before: the final usage
        assert chunks[-1]["choices"] == [] and chunks[-1]["usage"] == with_choices[-1]["usage"]
        assert len(chunks) == len(with_choices) + 1
    else:
        assert len(chunks) == len(with_choices)


def test_without_continuous_usage_stats_only_include_usage_adds_usage(served):
    client, answer = served
    for options in ({}, {"include_usage": True}, {"continuous_usage_stats": False}, {"include_usage": None}):
        answer[:] = three_tokens()
        body = {"prompt": "hi", "max_tokens": 3, "stream": True, "stream_options": options}
        chunks = sse_events(client.post("/v1/completions", json=body))
        assert all("usage" not in c for c in chunks if c["choices"]), options
        assert ("usage" in chunks[-1]) == bool(options.get("include_usage")), options


@pytest.mark.parametrize(
    "options,param",
    [
        ({"continuous_usage_stats": "yes"}, "stream_options.continuous_usage_stats"),
        ({"continuous_usage_stats": 1}, "stream_options.continuous_usage_stats"),
        ({"include_usage": "true"}, "stream_options.include_usage"),
        ({"include_usage": True, "usage_every": True}, "stream_options"),
        ("continuous", "stream_options"),
    ],
)
def test_stream_options_take_booleans_and_no_other_key(served, options, param):
    client, answer = served
    answer.extend(three_tokens())
    reply = client.post("/v1/completions", json={"prompt": "hi", "stream": True, "stream_options": options})
    assert reply.status_code == 400 and reply.json()["error"]["param"] == param, reply.text


@pytest.mark.parametrize(
    "body, param",
    [
        ({"prompt": "hi", "add_special_tokens": "yes"}, "add_special_tokens"),
        ({"prompt": 5}, "prompt"),
        ({"messages": [{"role": "user", "content": "hi"}], "add_generation_prompt": 1}, "add_generation_prompt"),
    ],
)
def test_tokenize_reads_its_fields_through_its_declared_schema(served, body, param):
    client, _ = served
    reply = client.post("/tokenize", json=body)
    assert reply.status_code == 400 and reply.json()["error"]["param"] == param, reply.text
    assert client.post("/tokenize", json={"prompt": "hi", "add_special_tokens": False}).json()["count"] >= 1

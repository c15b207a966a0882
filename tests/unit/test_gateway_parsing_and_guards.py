"""Request parsing at the gateway (pure) and the API-key / body-size guard (a real ASGI app, in process)."""

import pytest
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.responses import JSONResponse
from starlette.routing import Route
from starlette.testclient import TestClient

from kvferry.common.gateway_config import GatewayConfig
from kvferry.common.sampling import MAX_LOGIT_BIAS, MAX_STOP_TOKEN_IDS
from kvferry.services.gateway.api_error import ApiError
from kvferry.services.gateway.guards import Guards
from kvferry.services.gateway.request_parsing import parse_generations


def parse(body, chat=False, num_prompt=5, max_model_len=64):
    return parse_generations(
        body, chat, [list(range(num_prompt))], max_model_len, 1000, GatewayConfig(max_tokens_limit=100)
    )[0]


def test_a_prompt_that_fills_the_context_is_refused_before_any_default():
    for chat in (False, True):
        with pytest.raises(ApiError) as caught:
            parse({}, chat=chat, num_prompt=64)
        assert caught.value.code == "context_length_exceeded"
        assert caught.value.param == ("messages" if chat else "prompt")
    assert parse({}, chat=True, num_prompt=63).params.max_tokens == 1  # chat's default: what is left


def test_max_tokens_zero_means_the_prompt_alone_only_with_echo():
    g = parse({"max_tokens": 0, "echo": True, "logprobs": 1})
    assert g.prompt_only and g.params.max_tokens == 1 and g.params.prompt_logprobs == 1
    with pytest.raises(ApiError) as caught:
        parse({"max_tokens": 0})
    assert caught.value.param == "max_tokens"
    assert not parse({}).prompt_only


def test_the_largest_max_tokens_is_a_limit_but_the_context_comes_first():
    with pytest.raises(ApiError) as caught:
        parse({"max_tokens": 101}, max_model_len=1000)
    assert caught.value.param == "max_tokens" and caught.value.code is None
    with pytest.raises(ApiError) as caught:
        parse({"max_tokens": 101})
    assert caught.value.code == "context_length_exceeded"


def refused(body, limits=None) -> ApiError:
    with pytest.raises(ApiError) as caught:
        parse_generations(body, False, [[1, 2, 3]], 64, 1000, limits or GatewayConfig(max_tokens_limit=100))
    assert caught.value.status == 400
    return caught.value


def test_stop_strings_are_bounded_in_length_each_and_together():
    limits = GatewayConfig(max_tokens_limit=100, max_stop=4, max_stop_length=10, max_stop_chars=25)
    ok = lambda stop: parse_generations({"stop": stop}, False, [[1, 2, 3]], 64, 1000, limits)[0].stop  # noqa: E731
    assert ok("x" * 10) == ["x" * 10] and ok(["x" * 10, "y" * 10, "z" * 5]) == ["x" * 10, "y" * 10, "z" * 5]
    error = refused({"stop": "x" * 11}, limits)
    assert error.param == "stop" and "10 characters" in error.message
    error = refused({"stop": ["x" * 10, "y" * 10, "z" * 6]}, limits)
    assert error.param == "stop" and "25 characters" in error.message
    assert refused({"stop": ["a"] * 5}, limits).param == "stop"  # the count, before any string is looked at
    assert "at most 4" in refused({"stop": [None] * 5}, limits).message
    assert refused({"stop": ["a", 1]}, limits).param == "stop"


def test_logit_bias_and_stop_token_ids_are_bounded_before_their_entries_are_checked():
    assert len(parse({"logit_bias": {str(i): 1 for i in range(MAX_LOGIT_BIAS)}}).params.logit_bias) == MAX_LOGIT_BIAS
    error = refused({"logit_bias": {str(-i): "bad" for i in range(400_000)}})
    assert error.param == "logit_bias" and f"at most {MAX_LOGIT_BIAS}" in error.message
    assert refused({"logit_bias": {str(i): 1 for i in range(MAX_LOGIT_BIAS + 1)}}).param == "logit_bias"
    assert len(parse({"stop_token_ids": [7] * MAX_STOP_TOKEN_IDS}).params.stop_token_ids) == MAX_STOP_TOKEN_IDS
    error = refused({"stop_token_ids": [-1] * 400_000})
    assert error.param == "stop_token_ids" and f"at most {MAX_STOP_TOKEN_IDS}" in error.message
    assert refused({"stop_token_ids": [7] * (MAX_STOP_TOKEN_IDS + 1)}).param == "stop_token_ids"


def test_stream_options_are_booleans_read_only_with_stream():
    streamed = lambda options: parse({"stream": True, "stream_options": options})  # noqa: E731
    g = streamed({"include_usage": True, "continuous_usage_stats": True})
    assert (g.include_usage, g.continuous_usage) == (True, True)
    g = streamed({"continuous_usage_stats": True})  # usage in every chunk, without the last usage-only chunk
    assert (g.include_usage, g.continuous_usage) == (False, True)
    assert (streamed({}).include_usage, streamed(None).continuous_usage) == (False, False)
    assert streamed({"include_usage": None, "continuous_usage_stats": False}).continuous_usage is False
    for options, param in (
        ({"continuous_usage_stats": "true"}, "stream_options.continuous_usage_stats"),
        ({"continuous_usage_stats": 0}, "stream_options.continuous_usage_stats"),
        ({"include_usage": [True]}, "stream_options.include_usage"),
        ({"include_usage": True, "x" * 10_000: True}, "stream_options"),
        (["include_usage"], "stream_options"),
    ):
        error = refused({"stream": True, "stream_options": options})
        assert error.param == param and len(error.message) < 200, options
    assert refused({"stream_options": {"continuous_usage_stats": True}}).param == "stream_options"  # no stream


def app_with_guards(**kwargs):
    async def ok(request):
        return JSONResponse({"ok": True, "body_bytes": len(await request.body())})

    routes = [Route(p, ok, methods=["GET", "POST"]) for p in ("/v1/models", "/tokenize", "/health", "/metrics", "/new")]
    return Starlette(routes=routes, middleware=[Middleware(Guards, **kwargs)])


@pytest.mark.parametrize("root_path", ["", "/api"])
def test_every_route_but_the_open_ones_needs_the_key(root_path):
    client = TestClient(app_with_guards(api_key="k1", max_body_bytes=100), root_path=root_path)
    for path in ("/v1/models", "/tokenize", "/new"):
        for headers in ({}, {"authorization": "Bearer k2"}, {"authorization": "k1"}):
            response = client.get(root_path + path, headers=headers)
            assert response.status_code == 401 and response.json()["error"]["code"] == "invalid_api_key"
        assert client.get(root_path + path, headers={"authorization": "Bearer k1"}).status_code == 200
    for path in ("/health", "/metrics"):
        assert client.get(root_path + path).status_code == 200


def test_bodies_over_the_limit_get_413_by_length_or_when_chunked():
    client = TestClient(app_with_guards(api_key=None, max_body_bytes=100))
    assert client.post("/tokenize", content=b"x" * 100).json()["body_bytes"] == 100
    assert client.post("/tokenize", content=b"x" * 101).status_code == 413
    chunks = lambda n: (b"x" * 10 for _ in range(n))  # noqa: E731 - no Content-Length: sent chunked
    assert client.post("/tokenize", content=chunks(10)).json()["body_bytes"] == 100
    response = client.post("/tokenize", content=chunks(11))
    assert response.status_code == 413 and response.json()["error"]["code"] == "request_too_large"

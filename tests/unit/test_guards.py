"""What stands between a client and the gateway's routes, against the ASGI apps directly: the Guards middleware (API
key for every kind of connection, JSON content type, body size, chunked bodies) and the API's own checks of a body
(bounded JSON, text the tokenizer can take, the prompt's size, the fan-out), with tokenizing off the event loop."""

import asyncio
import contextlib
import json
import time

import httpx
import pytest
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.responses import JSONResponse
from starlette.routing import Route, WebSocketRoute
from starlette.testclient import TestClient
from starlette.websockets import WebSocketDisconnect

from kvferry.common.gateway_config import GatewayConfig
from kvferry.services.gateway.guards import Guards

JSON_PATHS = frozenset({"/tokenize", "/v1/completions"})


def guarded(api_key: str | None = None, max_body_bytes: int = 1000, started: list | None = None) -> Starlette:
    async def echo(request):
        return JSONResponse({"body_bytes": len(await request.body())})

    async def hello(websocket):
        await websocket.accept()
        await websocket.send_text("hello")
        await websocket.close()

    @contextlib.asynccontextmanager
    async def lifespan(app):
        if started is not None:
            started.append(True)
        yield

    routes = [Route(p, echo, methods=["GET", "POST"]) for p in ("/tokenize", "/v1/completions", "/health", "/other")]
    return Starlette(
        routes=[*routes, WebSocketRoute("/ws", hello)],
        middleware=[Middleware(Guards, api_key=api_key, max_body_bytes=max_body_bytes, json_paths=JSON_PATHS)],
        lifespan=lifespan,
    )


# -- content type -----------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "content_type",
    [None, "text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x", "text/json", "json"],
)
def test_a_post_to_a_json_route_that_is_not_json_gets_415(content_type):
    client = TestClient(guarded())
    headers = {"content-type": content_type} if content_type else {}
    for path in JSON_PATHS:
        response = client.post(path, content=b'{"prompt": "hi"}', headers=headers)
        assert response.status_code == 415, (path, content_type)
        error = response.json()["error"]
        assert error["code"] == "unsupported_media_type" and "application/json" in error["message"]


@pytest.mark.parametrize(
    "content_type",
    [
        "application/json",
        "application/json; charset=utf-8",
        "Application/JSON ; charset=UTF-8",
        "application/vnd.x+json",
    ],
)
def test_json_with_parameters_or_a_json_suffix_is_accepted(content_type):
    response = TestClient(guarded()).post("/tokenize", content=b"{}", headers={"content-type": content_type})
    assert response.status_code == 200 and response.json() == {"body_bytes": 2}


def test_only_posts_to_json_routes_are_held_to_json():
    client = TestClient(guarded())
    assert client.get("/tokenize").status_code == 200
    assert client.post("/other", content=b"x", headers={"content-type": "text/plain"}).status_code == 200


def test_the_key_is_checked_before_the_content_type():
    client = TestClient(guarded(api_key="k1"))
    assert client.post("/tokenize", content=b"x", headers={"content-type": "text/plain"}).status_code == 401
    response = client.post(
        "/tokenize", content=b"x", headers={"content-type": "text/plain", "authorization": "Bearer k1"}
    )
    assert response.status_code == 415


# -- websockets and other scopes ---------------------------------------------------------------------------------
@pytest.mark.parametrize("headers", [{}, {"authorization": "Bearer k2"}, {"authorization": "k1"}])
def test_a_websocket_without_the_key_is_refused_before_it_is_accepted(headers):
    client = TestClient(guarded(api_key="k1"))
    with pytest.raises(WebSocketDisconnect) as closed:
        with client.websocket_connect("/ws", headers=headers) as ws:
            ws.receive_text()
    assert closed.value.code == 1008  # policy violation; a server answers a close before the accept with 403


def test_a_websocket_with_the_key_or_without_a_key_configured_reaches_its_route():
    with TestClient(guarded(api_key="k1")).websocket_connect("/ws", headers={"authorization": "Bearer k1"}) as ws:
        assert ws.receive_text() == "hello"
    with TestClient(guarded()).websocket_connect("/ws") as ws:
        assert ws.receive_text() == "hello"


def test_lifespan_passes_through_with_a_key():
    started = []
    with TestClient(guarded(api_key="k1", started=started)):
        pass
    assert started == [True]


def test_a_scope_of_an_unknown_type_without_the_key_never_reaches_the_app():
    reached = []

    async def app(scope, receive, send):
        reached.append(scope["type"])

    async def receive():
        return {"type": "webtransport.connect"}

    async def send(message):
        pass

    guards = Guards(app, api_key="k1", max_body_bytes=100)
    scope = {"type": "webtransport", "path": "/v1/models", "headers": []}
    asyncio.run(guards(scope, receive, send))
    assert reached == []
    asyncio.run(guards({**scope, "headers": [(b"authorization", b"Bearer k1")]}, receive, send))
    assert reached == ["webtransport"]


# -- body size -----------------------------------------------------------------------------------------------------
def test_a_chunked_json_body_is_counted_and_handed_on_whole():
    client = TestClient(guarded(max_body_bytes=100))
    chunks = lambda n: (b" " * 10 for _ in range(n))  # noqa: E731 - no Content-Length: sent chunked
    headers = {"content-type": "application/json"}
    assert client.post("/tokenize", content=chunks(10), headers=headers).json() == {"body_bytes": 100}
    response = client.post("/tokenize", content=chunks(11), headers=headers)
    assert response.status_code == 413 and response.json()["error"]["code"] == "request_too_large"


def call(app, scope: dict, body_parts: list[bytes]) -> tuple[list[dict], int]:
    """One HTTP request straight through an ASGI app: the messages it sent, and how many body messages it read."""
    sent, parts = [], list(body_parts)
    read = 0

    async def receive():
        nonlocal read
        if parts:
            read += 1
            return {"type": "http.request", "body": parts.pop(0), "more_body": bool(parts)}
        await asyncio.sleep(3600)

    async def send(message):
        sent.append(message)

    asyncio.run(asyncio.wait_for(app(scope, receive, send), 10))
    return sent, read


def http_scope(path: str, headers: list[tuple[bytes, bytes]], method: str = "POST") -> dict:
    return {"type": "http", "method": method, "path": path, "root_path": "", "headers": headers, "query_string": b""}


def test_a_content_length_of_thousands_of_digits_gets_413():
    headers = [(b"content-type", b"application/json"), (b"content-length", b"9" * 5000)]
    sent, _ = call(guarded(), http_scope("/tokenize", headers), [b"{}"])
    assert sent[0]["status"] == 413


def test_a_chunked_body_of_the_wrong_type_is_refused_before_it_is_read():
    sent, read = call(guarded(), http_scope("/tokenize", [(b"content-type", b"text/plain")]), [b"x"] * 5)
    assert sent[0]["status"] == 415 and read == 0


# -- the API's checks of a body -------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def api():
    """The gateway's API over a core with no workers: a body that passes every check gets 503, one that does not a
    4xx."""
    from tests.gateway_api import in_process_api

    with in_process_api(GatewayConfig(max_n=4, max_prompts=8, max_prompt_chars=1000)) as served_api:
        yield served_api


@pytest.fixture(scope="module")
def client(api):
    return TestClient(api.app(), raise_server_exceptions=False)


def post(client, path: str, raw: bytes):
    response = client.post(path, content=raw, headers={"content-type": "application/json"})
    return response.status_code, response.json()


def error_of(client, path: str, raw: bytes | dict) -> tuple[int, dict]:
    status, reply = post(client, path, raw if isinstance(raw, bytes) else json.dumps(raw).encode())
    assert 400 <= status < 500, (status, reply)
    return status, reply["error"]


deep = lambda n: b"[" * n + b"]" * n  # noqa: E731


@pytest.mark.parametrize(
    "raw, says",
    [
        (b'{"prompt": ' + deep(100_000) + b"}", "nested"),  # json.loads raises RecursionError
        (b'{"prompt": "hi", "user": ' + deep(65) + b"}", "nested"),  # parses, but deeper than any OpenAI body
        (b'{"prompt": "hi", "max_tokens": 1' + b"0" * 5000 + b"}", "digits"),  # int's max_str_digits ValueError
        (
            b'{"prompt": "hi", "max_tokens": 2, "temperature": 1' + b"0" * 30 + b"}",
            "64-bit",
        ),  # OverflowError in msgpack
        (b'{"prompt": [1' + b"0" * 30 + b"]}", "64-bit"),
        (b'{"prompt": "\\ud800"}', "surrogate"),  # the tokenizer cannot take it
        (b'{"prompt": "hi", "model": "\\ud800"}', "surrogate"),  # nor can the error naming it be written as UTF-8
        (b'{"prompt": "hi", "\\udfff": 1}', "surrogate"),
        (b'{"prompt": "hi", "stop": ["\\ud800"]}', "surrogate"),
    ],
)
def test_a_body_json_cannot_carry_safely_gets_400(client, raw, says):
    for path in ("/v1/completions", "/tokenize"):
        status, error = error_of(client, path, raw)
        assert status == 400 and says in error["message"], (path, error)


def test_a_surrogate_pair_is_text_and_a_nul_is_a_character(client):
    status, reply = post(client, "/tokenize", b'{"prompt": "\\ud83d\\ude00 a\\u0000b"}')
    assert status == 200 and reply["count"] > 0


@pytest.mark.parametrize(
    "path, body, param",
    [
        ("/v1/completions", {"prompt": "x" * 1001}, "prompt"),
        ("/v1/completions", {"prompt": ["x" * 500, "x" * 501]}, "prompt"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x" * 1001}]}, "messages"),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": [{"type": "text", "text": "x" * 600}] * 2}]},
            "messages",
        ),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x", "name": "y" * 1001}]}, "messages"),
        ("/tokenize", {"prompt": "x" * 1001}, "prompt"),
        ("/tokenize", {"messages": [{"role": "user", "content": "x" * 1001}]}, "messages"),
    ],
)
def test_prompts_over_max_prompt_chars_get_400_before_tokenizing(client, path, body, param):
    status, error = error_of(client, path, body)
    assert status == 400 and error["param"] == param and "1000 characters" in error["message"], error


def test_many_short_messages_are_counted_as_the_template_renders_them(client):
    body = {"messages": [{"role": "user", "content": "x"}] * 50}  # 250 characters, some 1500 through the template
    status, error = error_of(client, "/tokenize", body)
    assert status == 400 and error["param"] == "messages" and "through the chat template" in error["message"], error


def test_prompts_at_max_prompt_chars_pass(client):
    assert post(client, "/tokenize", json.dumps({"prompt": "x" * 1000}).encode())[0] == 200
    assert post(client, "/v1/completions", json.dumps({"prompt": ["x" * 500] * 2}).encode())[0] == 503  # no workers


def test_detokenize_takes_at_most_the_models_context(client):
    status, error = error_of(client, "/detokenize", {"tokens": [5] * 2049})
    assert status == 400 and error["param"] == "tokens" and "2048" in error["message"]
    assert post(client, "/detokenize", json.dumps({"tokens": [5] * 2048}).encode())[0] == 200


def test_prompts_times_n_is_bounded(client):
    # max_n 4 and max_prompts 8: at most 8 choices in one request
    assert post(client, "/v1/completions", json.dumps({"prompt": ["a", "b"], "n": 4}).encode())[0] == 503
    status, error = error_of(client, "/v1/completions", {"prompt": ["a", "b", "c"], "n": 4})
    assert status == 400 and error["param"] == "n" and "8" in error["message"]


@pytest.mark.parametrize(
    "body",
    [
        {"prompt": "The quick brown fox jumps over the lazy dog. " * 20_000},
        {"messages": [{"role": "user", "content": "The quick brown fox jumps over the lazy dog. " * 20_000}]},
    ],
)
def test_tokenizing_a_long_prompt_leaves_the_event_loop_running(api, body):
    """Tokenizing ~900,000 characters takes about a second: the loop must go on serving meanwhile."""
    api.config.max_prompt_chars, saved = 1_000_000, api.config.max_prompt_chars

    async def main():
        ticks = 0

        async def tick():
            nonlocal ticks
            while True:
                await asyncio.sleep(0.005)
                ticks += 1

        ticker = asyncio.create_task(tick())
        await asyncio.sleep(0.02)
        transport = httpx.ASGITransport(app=api.app())
        async with httpx.AsyncClient(transport=transport, base_url="http://gateway") as http:
            before, started = ticks, time.monotonic()
            response = await http.post("/tokenize", json=body)
            during, took = ticks - before, time.monotonic() - started
        ticker.cancel()
        return response, during, took

    try:
        response, ticks, took = asyncio.run(main())
    finally:
        api.config.max_prompt_chars = saved
    assert response.status_code == 200 and response.json()["count"] > 100_000
    tokenizer = api.tokenizer  # the same ids as the tokenizers library's own encode, and the chat template
    if "prompt" in body:
        assert response.json()["tokens"] == tokenizer.backend.encode(body["prompt"]).ids
    else:
        assert response.json()["tokens"] == tokenizer.apply_chat_template(body["messages"], add_generation_prompt=True)
    print(f"{ticks} ticks of the loop in {took:.2f} s of tokenizing")
    assert ticks >= 10, f"the event loop stood still while tokenizing ({ticks} ticks in {took:.2f} s)"

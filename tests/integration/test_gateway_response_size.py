"""How large a response one request may ask for, and how the gateway builds a large one: the real Api over a real
GatewayCore in this process, over HTTP (ASGI) with raw ZeroMQ sockets on loopback playing the workers. Echo with
logprobs and n multiply the response: past --max-logprob-entries the request is refused before any work, the
prompt's logprobs are built once per prompt whatever n is, and a large body is built off the event loop."""

import asyncio
import json
import threading

import httpx
import pytest
from starlette.responses import JSONResponse

from kvferry.common import protocol as p
from kvferry.common.gateway_config import GatewayConfig
from kvferry.common.sampling import TokenLogprobs
from kvferry.common.sequence import FinishReason
from kvferry.services.gateway import response_consumer
from kvferry.services.gateway.api import Api
from kvferry.services.gateway.choices import Choices
from kvferry.services.gateway.responses import CompletionLogprobs
from kvferry.services.gateway.server import Deadlines, GatewayCore
from tests.gateway_api import MODEL
from tests.integration.test_gateway_peers import BLOCK, pair
from tests.integration.test_gateway_peers import MODEL as WORKER_MODEL

MAX_MODEL_LEN = 32768


@pytest.fixture(scope="module")
def tokenizer():
    from kvferry.services.gateway.main import load_text_side

    return load_text_side(None)[0]


def served(tokenizer, test, limits: GatewayConfig | None = None, workers: bool = True) -> None:
    """Run test(http, prefill) against an Api over a started core; prefill: a fake prefill worker (with its decode
    worker registered too), or None without workers."""

    async def main():
        # The core's model: the fake workers' (they register with it); the API's: the tokenizer's.
        core = GatewayCore("tcp://127.0.0.1:0", WORKER_MODEL, BLOCK, heartbeat_interval_s=30, deadlines=Deadlines())
        core.start()
        try:
            api = Api(core, tokenizer, MODEL, MAX_MODEL_LEN, limits)
            prefill = (await pair(core))[0] if workers else None
            transport = httpx.ASGITransport(app=api.app())
            async with httpx.AsyncClient(transport=transport, base_url="http://gateway", timeout=60) as http:
                await asyncio.wait_for(test(http, prefill), 60)  # a hang guard only
        finally:
            await core.stop()

    asyncio.run(main())


def entry(token_id: int, width: int) -> TokenLogprobs:
    return TokenLogprobs(token_id, -0.5, tuple(range(100, 100 + width)), tuple(-1.0 - i for i in range(width)))


async def answer_prefills(prefill, num_prompts: int, width: int) -> None:
    """Each prompt's choices end with their first token, the prompt's logprobs with choice 0 (as a worker sends)."""
    for _ in range(num_prompts):
        request, rid = await prefill.next(p.PrefillRequest)
        prompt = request.prompt_token_ids
        prompt_logprobs = [None, *(entry(t, width) for t in prompt[1:])]
        for choice in range(request.n):
            first = p.FirstToken(
                7,
                int(FinishReason.LENGTH),
                logprobs=[entry(7, width)],
                prompt_logprobs=prompt_logprobs if choice == 0 else [],
                choice=choice,
            )
            prefill.send(first, rid)


def test_echo_with_many_logprobs_and_choices_on_a_long_prompt_is_refused_naming_the_fields(tokenizer):
    async def test(http, _):
        long_echo = {"prompt": [5] * 8000, "echo": True, "logprobs": 20, "n": 16, "max_tokens": 1}
        response = await http.post("/v1/completions", json=long_echo)
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert error["param"] == "logprobs"
        for named in ("n", "logprobs", "echo", "max_tokens", "max-logprob-entries"):
            assert named in error["message"], error["message"]
        # The same request within the bound gets past the check (to find no workers).
        small = {**long_echo, "prompt": [5] * 100, "n": 2}
        assert (await http.post("/v1/completions", json=small)).status_code == 503
        # Streamed, only the echoed prompts are held at once; whole, every token's entries are.
        many = {"prompt": "hi", "logprobs": 20, "n": 16, "max_tokens": 16000}
        assert (await http.post("/v1/completions", json={**many, "stream": True})).status_code == 503
        whole = await http.post("/v1/completions", json=many)
        assert whole.status_code == 400 and "max_tokens" in whole.json()["error"]["message"]
        chat = {"messages": [{"role": "user", "content": "hi"}], "logprobs": True, "top_logprobs": 20, "n": 16}
        refused = await http.post("/v1/chat/completions", json=chat)  # its max_tokens: the context left
        assert refused.status_code == 400 and refused.json()["error"]["param"] == "top_logprobs"

    served(tokenizer, test, workers=False)


def test_the_prompts_logprobs_are_built_once_per_prompt_whatever_n(tokenizer, monkeypatch):
    built = []  # the lengths of the logprobs parts built
    real_part = CompletionLogprobs.part

    def counted(self, entries, token_ids):
        built.append(len(token_ids))
        return real_part(self, entries, token_ids)

    monkeypatch.setattr(CompletionLogprobs, "part", counted)
    prompts = [[5] * 300, [6] * 200]

    async def test(http, prefill):
        body = {"prompt": prompts, "echo": True, "logprobs": 2, "n": 3, "max_tokens": 0}
        sent = asyncio.ensure_future(http.post("/v1/completions", json=body))
        await answer_prefills(prefill, len(prompts), width=2)
        response = await sent
        assert response.status_code == 200, response.text
        choices = response.json()["choices"]
        assert len(choices) == 6
        for index, choice in enumerate(choices):
            logprobs = choice["logprobs"]
            prompt = prompts[index // 3]
            assert len(logprobs["tokens"]) == len(prompt) and logprobs["token_logprobs"][0] is None
            assert logprobs["token_logprobs"][1:] == [-0.5] * (len(prompt) - 1)
            assert logprobs == choices[index // 3 * 3]["logprobs"]  # every choice of a prompt shows the same

    served(tokenizer, test)
    assert sorted(built) == [200, 300], built  # one per prompt, not one per choice


def test_a_large_whole_body_is_built_off_the_event_loop_and_a_small_one_on_it(tokenizer, monkeypatch):
    threads = {"built": [], "rendered": []}
    real_whole, real_render = Choices.whole, JSONResponse.render

    def whole(self, shape):
        threads["built"].append(threading.current_thread().name)
        return real_whole(self, shape)

    def render(self, content):
        if isinstance(content, dict) and "choices" in content:
            threads["rendered"].append(threading.current_thread().name)
        return real_render(self, content)

    def part(self, entries, token_ids):
        threads["echoed"].append(threading.current_thread().name)
        return real_part(self, entries, token_ids)

    def sse(obj):
        if obj.get("choices") and obj["choices"][0]["logprobs"]:
            threads["chunk"].append(threading.current_thread().name)
        return real_sse(obj)

    threads["echoed"], threads["chunk"] = [], []
    real_part, real_sse = CompletionLogprobs.part, response_consumer.sse
    monkeypatch.setattr(Choices, "whole", whole)
    monkeypatch.setattr(JSONResponse, "render", render)
    monkeypatch.setattr(CompletionLogprobs, "part", part)
    monkeypatch.setattr(response_consumer, "sse", sse)  # where the streamed chunks are serialized

    async def test(http, prefill):
        for stream in (False, True):
            for prompt, width in (([5] * 10, 0), ([5] * 900, 20)):
                body = {"prompt": prompt, "echo": True, "logprobs": width, "max_tokens": 0, "stream": stream}
                sent = asyncio.ensure_future(http.post("/v1/completions", json=body))
                await answer_prefills(prefill, 1, width)
                response = await sent
                assert response.status_code == 200, response.text
                if stream:
                    chunk = json.loads(response.text.split("\n\n")[0].removeprefix("data: "))
                else:
                    chunk = response.json()
                assert len(chunk["choices"][0]["logprobs"]["tokens"]) == len(prompt)

    served(tokenizer, test)
    on_loop = threading.main_thread().name
    off_loop = lambda name: name.startswith("kvferry-text")  # noqa: E731
    assert threads["built"][0] == on_loop and threads["rendered"][0] == on_loop, threads
    assert off_loop(threads["built"][1]) and off_loop(threads["rendered"][1]), threads
    # The echoed prompt's logprobs too, whole or streamed (small, large, small, large); and the large chunk.
    assert [off_loop(name) for name in threads["echoed"]] == [False, True, False, True], threads
    assert [off_loop(name) for name in threads["chunk"]] == [False, True], threads

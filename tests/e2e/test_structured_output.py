"""Structured output and tool calls end to end: SmolLM2 on a real stack (one prefill and one decode worker), the
openai client over real HTTP. Every output must parse and validate, whatever the 135M model would rather say;
the constraint holds across the prefill/decode split, for each of n choices, beside unconstrained requests, and
across a decode worker killed mid-stream."""

import concurrent.futures
import json
import re
import time

import jsonschema
import pytest

from tests.e2e.stack import Stack, running_pair, tiny_stack

pytestmark = pytest.mark.slow
MAX_TOKENS = 300
MODEL = "SmolLM2-135M-Instruct"
SCHEMAS = {  # bounded: each finishes well inside MAX_TOKENS
    "nested objects, a pattern": {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 24},
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
            "address": {
                "type": "object",
                "properties": {"city": {"type": "string", "maxLength": 20}, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                "required": ["city", "zip"],
            },
        },
        "required": ["name", "age", "address"],
    },
    "an array of objects with maxItems": {
        "type": "object",
        "properties": {
            "items": {
                "type": "array",
                "items": {
                    "type": "object",
                    "properties": {"sku": {"type": "string", "maxLength": 8}, "qty": {"type": "integer", "minimum": 0, "maximum": 99}},
                    "required": ["sku", "qty"],
                },
                "minItems": 1,
                "maxItems": 3,
            }
        },
        "required": ["items"],
    },
    "enums and bounded numbers": {
        "type": "object",
        "properties": {
            "sensor": {"enum": ["temp", "humidity", "pressure"]},
            "value": {"type": "number", "minimum": -50, "maximum": 150},
            "ok": {"type": "boolean"},
        },
        "required": ["sensor", "value", "ok"],
    },
    "optional fields, strings with maxLength": {
        "type": "object",
        "properties": {
            "title": {"type": "string", "maxLength": 30},
            "priority": {"enum": ["low", "medium", "high"]},
            "note": {"type": "string", "maxLength": 40},
            "attendees": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 4},
        },
        "required": ["title", "priority"],
    },
}  # fmt: skip
WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 30}, "unit": {"enum": ["celsius", "fahrenheit"]}},
            "required": ["city", "unit"],
        },
    },
}
ASK_WEATHER = [{"role": "user", "content": "What is the weather like in Paris today?"}]
ASK_WEATHER_BODY = {"messages": ASK_WEATHER}


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    with running_pair(tmp_path_factory.mktemp("structured"), extra_env={"KVFERRY_MAX_N": "4"}) as s:
        yield s


@pytest.fixture(scope="module")
def client(stack):
    from openai import OpenAI

    return OpenAI(base_url=stack.url + "/v1", api_key="unused", max_retries=0, timeout=300)


def ask_json(client, schema: dict, **kw):
    return client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Reply with a JSON object: make up an example."}],
        response_format={"type": "json_schema", "json_schema": {"name": "example", "schema": schema, "strict": True}},
        max_tokens=MAX_TOKENS,
        **kw,
    )


@pytest.mark.parametrize("name", list(SCHEMAS))
def test_sampled_and_greedy_outputs_of_a_bounded_schema_all_validate(client, name):
    schema = SCHEMAS[name]
    with concurrent.futures.ThreadPoolExecutor(21) as pool:
        sampled = list(pool.map(lambda seed: ask_json(client, schema, temperature=1.0, seed=seed), range(20)))
    greedy = ask_json(client, schema, temperature=0)
    for reply in [*sampled, greedy]:
        choice = reply.choices[0]
        assert choice.finish_reason == "stop" and reply.usage.completion_tokens < MAX_TOKENS // 2
        jsonschema.validate(json.loads(choice.message.content), schema)


def test_parse_with_a_pydantic_model_returns_the_object(client):
    from pydantic import BaseModel, Field

    class City(BaseModel):
        name: str = Field(max_length=20)
        country: str = Field(max_length=20)
        population_millions: int = Field(ge=0, le=50)

    reply = client.beta.chat.completions.parse(
        model=MODEL,
        messages=[{"role": "user", "content": "Describe Paris as JSON."}],
        response_format=City,
        max_tokens=MAX_TOKENS,
        temperature=0,
    )
    parsed = reply.choices[0].message.parsed
    assert isinstance(parsed, City) and parsed.name


def test_json_object_regex_and_choice_match_on_both_endpoints(client):
    reply = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "A JSON object, please."}],
        response_format={"type": "json_object"}, max_tokens=MAX_TOKENS, temperature=0,
    )  # fmt: skip
    assert isinstance(json.loads(reply.choices[0].message.content), dict)
    phone = r"\(\d{3}\) \d{3}-\d{4}"
    for seed in range(3):
        text = client.completions.create(
            model=MODEL, prompt="Call me at", max_tokens=40, temperature=1.0, seed=seed,
            extra_body={"structured_outputs": {"regex": phone}},
        ).choices[0].text  # fmt: skip
        assert re.fullmatch(phone, text), text
        answer = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Is the sky green?"}], max_tokens=10,
            temperature=1.0, seed=seed, extra_body={"structured_outputs": {"choice": ["yes", "no", "maybe"]}},
        ).choices[0]  # fmt: skip
        assert answer.message.content in ("yes", "no", "maybe") and answer.finish_reason == "stop"


def test_n_choices_each_validate(client):
    schema = SCHEMAS["optional fields, strings with maxLength"]
    reply = ask_json(client, schema, temperature=1.0, n=4, seed=5)
    assert len(reply.choices) == 4 and len({c.message.content for c in reply.choices}) > 1
    for choice in reply.choices:
        jsonschema.validate(json.loads(choice.message.content), schema)


def test_unconstrained_requests_are_the_same_beside_constrained_ones(stack, client):
    prompts = ["Once upon a time", "The best way to learn is"]
    plain = lambda prompt: (
        client.completions.create(
            model=MODEL, prompt=prompt, max_tokens=40, temperature=0, extra_body={"ignore_eos": True}
        )
        .choices[0]
        .text
    )
    alone = [plain(p) for p in prompts]
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        constrained = [
            pool.submit(ask_json, client, SCHEMAS["enums and bounded numbers"], temperature=1.0) for _ in range(6)
        ]
        beside = list(pool.map(plain, prompts))
        [c.result() for c in constrained]
    assert beside == alone


def check_weather_call(call) -> dict:
    assert call.type == "function" and call.function.name == "get_weather"
    assert re.fullmatch(r"call_[A-Za-z0-9]{24}", call.id)
    arguments = json.loads(call.function.arguments)
    jsonschema.validate(arguments, WEATHER_TOOL["function"]["parameters"])
    return arguments


def test_a_required_tool_call_validates_whole_and_streamed(client):
    reply = client.chat.completions.create(
        model=MODEL, messages=ASK_WEATHER, tools=[WEATHER_TOOL], tool_choice="required", parallel_tool_calls=False,
        temperature=0, max_tokens=MAX_TOKENS,
    )  # fmt: skip
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls" and len(choice.message.tool_calls) == 1
    whole = check_weather_call(choice.message.tool_calls[0])
    chunks = list(
        client.chat.completions.create(
            model=MODEL, messages=ASK_WEATHER, tools=[WEATHER_TOOL], tool_choice="required", temperature=0,
            parallel_tool_calls=False, max_tokens=MAX_TOKENS, stream=True,
        )
    )  # fmt: skip
    deltas = [d for c in chunks for d in (c.choices[0].delta.tool_calls or []) if c.choices]
    assert deltas[0].function.name == "get_weather" and deltas[0].id
    assert all(d.function.name is None for d in deltas[1:])  # the name once, then argument fragments
    streamed = json.loads("".join(d.function.arguments or "" for d in deltas))
    assert streamed == whole and chunks[-1].choices[0].finish_reason == "tool_calls"


def test_a_named_tool_and_a_two_turn_conversation(client):
    reply = client.chat.completions.create(
        model=MODEL, messages=ASK_WEATHER, tools=[WEATHER_TOOL], temperature=0, max_tokens=MAX_TOKENS,
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
    )  # fmt: skip
    call = reply.choices[0].message.tool_calls[0]
    check_weather_call(call)
    follow_up = [
        *ASK_WEATHER,
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temperature": 18, "sky": "cloudy"})},
    ]
    answer = client.chat.completions.create(
        model=MODEL, messages=follow_up, tools=[WEATHER_TOOL], tool_choice="none", temperature=0, max_tokens=60
    )  # fmt: skip
    message = answer.choices[0].message
    assert message.content and not message.tool_calls
    # The reason matches what happened: all 60 tokens spent, or an end before them.
    ran_out = answer.usage.completion_tokens == 60
    assert answer.choices[0].finish_reason == ("length" if ran_out else "stop"), answer


def test_invalid_constraints_get_a_400_naming_the_field(stack):
    cases = [
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": 5}}}}, "response_format"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "number", "multipleOf": 3}}}}, "response_format"),
        ({"structured_outputs": {"regex": "(unclosed"}}, "structured_outputs.regex"),
        ({"structured_outputs": {"grammar": "root ::= missing_rule"}}, "structured_outputs.grammar"),
    ]  # fmt: skip
    for extra, field in cases:
        body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 8, **extra}
        for stream in (False, True):
            status, reply = stack.post("/v1/chat/completions", {**body, "stream": stream})
            assert status == 400 and reply["error"]["param"].startswith(field), (extra, reply)


def test_the_grammar_counters_reach_metrics(stack):
    text = stack.text("/metrics")
    compiles = re.findall(r"^kvferry:grammar_compiles_total\{[^}]*\} (\S+)", text, re.M)
    hits = re.findall(r"^kvferry:grammar_cache_hits_total\{[^}]*\} (\S+)", text, re.M)
    assert sum(map(float, compiles)) >= 2 and sum(map(float, hits)) >= 1, text[-2000:]


LONG = {  # at least 6 records: a long generation, for a kill to land in the middle of
    "type": "object",
    "properties": {"records": {"type": "array", "items": SCHEMAS["nested objects, a pattern"], "minItems": 6, "maxItems": 6}},
    "required": ["records"],
}  # fmt: skip


def test_a_constrained_stream_survives_its_decode_worker_killed(tmp_path):
    fast = {"KVFERRY_STEP_TIMEOUT": "10", "KVFERRY_FIRST_TOKEN_TIMEOUT": "30"}
    with Stack(tmp_path, extra_env=fast) as stack:
        stack.start_pair(decode="victim")
        stack.start_worker("survivor", "decode", env={"KVFERRY_KV_CACHE_MEMORY": "128MiB"})  # gets nothing first
        stack.wait_workers({"survivor"})
        body = {
            "messages": [{"role": "user", "content": "Six people as JSON."}],
            "max_tokens": 600,
            "temperature": 0,
            "response_format": {"type": "json_schema", "json_schema": {"name": "people", "schema": LONG}},
        }
        status, reference = stack.post("/v1/chat/completions", body)
        assert status == 200 and reference["choices"][0]["finish_reason"] == "stop"
        expected = reference["choices"][0]["message"]["content"]
        jsonschema.validate(json.loads(expected), LONG)
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            stream = pool.submit(stack.stream, "/v1/chat/completions", body)
            stack.wait_for(lambda: stack.workers()["victim"]["requests_in_flight"] == 1, 30, "the stream on victim")
            time.sleep(1.5)  # some tokens out, most to come
            stack.stop("victim")
            events = stream.result(timeout=300)
        assert events[-1] == "[DONE]" and not [e for e in events[:-1] if "error" in e]
        text = "".join(c["delta"].get("content") or "" for e in events[:-1] for c in e["choices"])
        assert stack.get("/v1/workers")[1]["gateway"]["moves"] >= 1  # it did move
        jsonschema.validate(json.loads(text), LONG)
        assert text == expected


def test_a_dead_end_finishes_with_error_not_a_hang(stack):
    # Complete after "no", which then needs EOS; min_tokens masks EOS: no token is left.
    body = {"max_tokens": 10, "min_tokens": 5, "structured_outputs": {"choice": ["no"]}, "temperature": 0}
    for path, extra in (("/v1/completions", {"prompt": "Yes or no?"}), ("/v1/chat/completions", ASK_WEATHER_BODY)):
        status, reply = stack.post(path, {**body, **extra}, timeout=60)
        choice = reply["choices"][0]
        assert status == 200 and choice["finish_reason"] == "error", reply
        assert choice["error"]["type"] == "constraint_dead_end"
        events = stack.stream(path, {**body, **extra}, timeout=60)
        assert events[-1] == "[DONE]" and events[-2]["choices"][0]["finish_reason"] == "error"


def test_traces_record_the_constraint_and_its_compile_and_a_slow_compile_is_a_400(tmp_path):
    from kvferry.tools.trace.reader import load

    trace_dir = tmp_path / "traces"
    with tiny_stack(tmp_path, extra_env={"KVFERRY_TRACE_DIR": str(trace_dir)}) as stack:
        stack.start_pair()
        schema = SCHEMAS["enums and bounded numbers"]
        body = {"prompt": "Data:", "max_tokens": 60, "structured_outputs": {"json": schema}}
        for _ in range(2):  # compiled, then from the cache
            status, reply = stack.post("/v1/completions", body)
            assert status == 200 and reply["choices"][0]["finish_reason"] == "stop", reply
            jsonschema.validate(json.loads(reply["choices"][0]["text"]), schema)

        def compile_spans():
            spans = [r for r in load(str(trace_dir)).records if r.get("name") == "grammar.compile"]
            return spans if len(spans) >= 4 else None  # prefill and decode, each request

        stack.wait_for(compile_spans, 30, "grammar.compile spans")
        spans = compile_spans()
        assert {s["role"] for s in spans} == {"prefill", "decode"}
        assert all(s["attrs"]["kind"] == "json" and s["attrs"]["field"] == "structured_outputs.json" for s in spans)
        assert [s["attrs"]["cached"] for s in spans if s["role"] == "prefill"] == [False, True]
        prefill = [r for r in load(str(trace_dir)).records if r.get("name") == "prefill"]
        assert prefill and all(r["attrs"]["constraint"] == "json" for r in prefill)
    (tmp_path / "slow").mkdir()
    with tiny_stack(tmp_path / "slow", extra_env={"KVFERRY_GRAMMAR_COMPILE_TIMEOUT": "0.02"}) as stack:
        stack.start_pair()
        slow = {"prompt": "Data:", "max_tokens": 8, "structured_outputs": {"regex": "[a-z]{1,5000}"}}  # 0.4 s
        status, reply = stack.post("/v1/completions", slow)
        assert status == 400 and reply["error"]["param"] == "structured_outputs.regex", reply
        assert "took longer than the 0.02 s" in reply["error"]["message"]

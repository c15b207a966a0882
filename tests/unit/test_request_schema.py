"""The request schema is declared once (request_fields.py): what /openapi.json says of each field is what the gateway
accepts and refuses, and adding an API parameter is one declaration."""

import pytest

from kvferry.common.gateway_config import GatewayConfig
from kvferry.services.gateway import request_fields
from kvferry.services.gateway.api_error import ApiError
from kvferry.services.gateway.openapi import openapi_spec
from kvferry.services.gateway.request_fields import CHAT, COMPLETIONS
from kvferry.services.gateway.request_parsing import check_fields, parse_generations
from kvferry.services.gateway.request_schema import INTEGER, NUMBER, Param

VOCAB = 1000
LIMITS = GatewayConfig(max_tokens_limit=100, max_n=3, max_stop=2)
# top_logprobs needs logprobs: true
BASE = {COMPLETIONS: {"prompt": "x", "max_tokens": 4}, CHAT: {"messages": [], "max_tokens": 4, "logprobs": True}}


def parse(body: dict, name: str, limits: GatewayConfig = LIMITS):
    return parse_generations({**BASE[name], **body}, name == CHAT, [[1, 2, 3]], 1000, VOCAB, limits)[0]


def refusal(body: dict, name: str, limits: GatewayConfig = LIMITS) -> ApiError:
    with pytest.raises(ApiError) as caught:
        parse(body, name, limits)
    assert caught.value.status == 400 and len(caught.value.message) < 300
    return caught.value


@pytest.mark.parametrize("name", [COMPLETIONS, CHAT])
def test_every_field_the_description_lists_is_accepted_and_no_other(name):
    described = openapi_spec("0", LIMITS)["components"]["schemas"][name]
    assert described["additionalProperties"] is False
    for field in described["properties"]:
        check_fields({field: None}, name == CHAT)
    assert refusal({"temperature_": 1}, name).param == "temperature_"
    other = CHAT if name == COMPLETIONS else COMPLETIONS
    for field in set(openapi_spec("0", LIMITS)["components"]["schemas"][other]["properties"]) - set(
        described["properties"]
    ):
        assert "unknown parameter" in refusal({field: 1}, name).message


@pytest.mark.parametrize("name", [COMPLETIONS, CHAT])
def test_every_described_bound_and_type_is_a_400_naming_its_field(name):
    properties = openapi_spec("0", LIMITS)["components"]["schemas"][name]["properties"]
    num_bounds = 0
    for field, spec in properties.items():
        if spec.get("type") in ("integer", "number", "boolean"):
            assert refusal({field: "1"}, name).param == field
        low, high = spec.get("minimum"), spec.get("maximum")
        if "enum" in spec:  # known, not honoured: only the value that asks for nothing
            parse({field: spec["enum"][0]}, name)
            assert refusal({field: 2}, name).param == field
        elif spec.get("type") in ("integer", "number") and field != "max_tokens":
            step = 1 if spec["type"] == "integer" else 0.5
            if low is not None:
                below = low if spec.get("exclusiveMinimum") else low - step
                assert refusal({field: below}, name).param == field, field
                num_bounds += 1
            if high is not None:
                assert refusal({field: high + step}, name).param == field, field
                num_bounds += 1
            parse({field: high if high is not None and high < 100 else low + step}, name)  # within: accepted
    assert num_bounds >= 15
    # max_tokens' limit is checked after the context length, and still names its field
    assert refusal({"max_tokens": properties["max_tokens"]["maximum"] + 1}, name).param == "max_tokens"


def test_the_limits_flow_into_the_checks_and_the_description():
    for limits in (
        GatewayConfig(max_n=2, max_tokens_limit=50, max_stop=1),
        GatewayConfig(max_n=5, max_tokens_limit=500, max_stop=3),
    ):
        properties = openapi_spec("0", limits)["components"]["schemas"][COMPLETIONS]["properties"]
        assert (
            properties["n"]["maximum"] == limits.max_n
            and properties["max_tokens"]["maximum"] == limits.max_tokens_limit
        )
        assert properties["stop"]["oneOf"][1]["maxItems"] == limits.max_stop
        assert parse({"n": limits.max_n}, COMPLETIONS, limits).n == limits.max_n
        assert refusal({"n": limits.max_n + 1}, COMPLETIONS, limits).param == "n"
        assert refusal({"stop": ["a"] * (limits.max_stop + 1)}, COMPLETIONS, limits).param == "stop"


def test_adding_a_parameter_is_one_declaration(monkeypatch):
    """A new field declared in request_fields.py alone is accepted, checked against its bound (a limit), and
    described."""
    plain = request_fields.BUILDERS[COMPLETIONS]

    def with_knob(limits: GatewayConfig):
        schema = plain(limits)
        return type(schema)({**schema.params, "knob": Param(INTEGER, lo=1, hi=limits.max_n, doc="new")}, ("prompt",))

    monkeypatch.setitem(request_fields.BUILDERS, COMPLETIONS, with_knob)
    request_fields._built.cache_clear()
    try:
        described = openapi_spec("0", LIMITS)["components"]["schemas"][COMPLETIONS]["properties"]["knob"]
        assert described == {"type": "integer", "minimum": 1, "maximum": 3, "nullable": True, "description": "new"}
        parse({"knob": 3}, COMPLETIONS)
        error = refusal({"knob": 4}, COMPLETIONS)
        assert error.param == "knob" and error.message == "'knob' must be an integer from 1 to 3, got 4"
        assert refusal({"knob": 4}, CHAT).message == "unknown parameter 'knob'"
    finally:
        request_fields._built.cache_clear()


def test_a_sampling_parameter_declared_once_reaches_the_engine(monkeypatch):
    """A field named as one of SamplingParams' needs only its Param: taken away, min_p is an unknown field; declared
    again in the builder alone, it is read, checked and handed to the engine's SamplingParams."""
    plain = request_fields.BUILDERS[COMPLETIONS]

    def without_min_p(limits: GatewayConfig):
        schema = plain(limits)
        return type(schema)({k: v for k, v in schema.params.items() if k != "min_p"}, ("prompt",))

    def with_min_p_again(limits: GatewayConfig):
        schema = without_min_p(limits)
        return type(schema)({**schema.params, "min_p": Param(NUMBER, lo=0, hi=0.5, default=0.0)}, ("prompt",))

    try:
        monkeypatch.setitem(request_fields.BUILDERS, COMPLETIONS, without_min_p)
        request_fields._built.cache_clear()
        assert refusal({"min_p": 0.25}, COMPLETIONS).message == "unknown parameter 'min_p'"
        assert parse({}, COMPLETIONS).params.min_p == 0.0  # the engine's own default, not a second list's
        monkeypatch.setitem(request_fields.BUILDERS, COMPLETIONS, with_min_p_again)
        request_fields._built.cache_clear()
        assert parse({"min_p": 0.25}, COMPLETIONS).params.min_p == 0.25
        assert refusal({"min_p": 0.75}, COMPLETIONS).param == "min_p"
    finally:
        request_fields._built.cache_clear()


def test_a_nested_object_names_its_own_fields():
    for options, param, says in (
        ({"include_usage": "yes"}, "stream_options.include_usage", "must be true or false"),
        ({"x" * 5000: True}, "stream_options", "unknown parameter 'stream_options.xxx"),
        ([], "stream_options", "must be an object"),
    ):
        error = refusal({"stream": True, "stream_options": options}, CHAT)
        assert error.param == param and says in error.message

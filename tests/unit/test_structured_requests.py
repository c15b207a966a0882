"""Structured output at the gateway: each request form to its exact Constraint, every invalid one to a 400 naming its
field, the JSON Schema support walker against what xgrammar really enforces, and the HTTP behaviour of a worker's
compile error and of a constraint's dead end (a fake core stands in for the workers)."""

import json
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from starlette.testclient import TestClient

from kvferry.common import json_schema_support
from kvferry.common.constraint import MAX_CONSTRAINT_BYTES, Constraint
from kvferry.common.gateway_config import GatewayConfig
from kvferry.common.json_schema_support import (
    ANNOTATIONS,
    FORMATS,
    MAX_ENUM_VALUES,
    MAX_OPTIONAL_PROPERTIES,
    MAX_PROPERTIES,
    SUPPORTED,
    UnsupportedSchema,
    check_supported,
)
from kvferry.common.sequence import FinishReason
from kvferry.services.gateway.api import Api
from kvferry.services.gateway.api_error import ApiError
from kvferry.services.gateway.flight import Event
from kvferry.services.gateway.schema_checks import checked_schema
from tests.gateway_api import in_process_api

PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 20}, "âge": {"type": "integer", "minimum": 0}},
    "required": ["name"],
}
PERSON_SPEC = '{"type":"object","properties":{"name":{"type":"string","maxLength":20},"âge":{"type":"integer","minimum":0}},"required":["name"]}'  # noqa: E501
SCHEMA_FIELD = "response_format.json_schema.schema"
KEYWORDS = sorted(SUPPORTED | ANNOTATIONS | {"$defs", "allOf", "a", "#", "#/$defs/a", "object", "integer", "string"})


def json_schema(schema, **extra) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "person", "schema": schema, **extra}}


def rules(body: dict, chat: bool = True):
    return Api.output_rules({"messages": [], **body} if chat else {"prompt": "x", **body}, chat)[1]


# -- the request forms -----------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "body, expected",
    [
        ({}, None),
        ({"response_format": {"type": "text"}}, None),
        ({"response_format": {"type": "json_object"}}, Constraint("json", '{"type":"object"}', "response_format")),
        ({"response_format": json_schema(PERSON)}, Constraint("json", PERSON_SPEC, SCHEMA_FIELD)),
        (
            {"response_format": json_schema(PERSON, strict=True, description="a person")},
            Constraint("json", PERSON_SPEC, SCHEMA_FIELD),
        ),
        ({"structured_outputs": {"json": PERSON}}, Constraint("json", PERSON_SPEC, "structured_outputs.json")),
        (
            {"structured_outputs": {"json": json.dumps(PERSON, indent=2)}},
            Constraint("json", PERSON_SPEC, "structured_outputs.json"),
        ),
        ({"structured_outputs": {"regex": r"\d+"}}, Constraint("regex", r"\d+", "structured_outputs.regex")),
        (
            {"structured_outputs": {"choice": ["oui", "non"], "regex": None}},
            Constraint("choice", '["oui","non"]', "structured_outputs.choice"),
        ),
        (
            {"structured_outputs": {"grammar": 'root ::= "a"'}},
            Constraint("grammar", 'root ::= "a"', "structured_outputs.grammar"),
        ),
        (
            {"structured_outputs": {"json_object": True}},
            Constraint("json", '{"type":"object"}', "structured_outputs.json_object"),
        ),
        ({"guided_json": PERSON}, Constraint("json", PERSON_SPEC, "guided_json")),
        ({"guided_regex": "a|b"}, Constraint("regex", "a|b", "guided_regex")),
        ({"guided_choice": ["a"]}, Constraint("choice", '["a"]', "guided_choice")),
        ({"guided_grammar": "root ::= [a-z]+"}, Constraint("grammar", "root ::= [a-z]+", "guided_grammar")),
    ],
)
def test_each_form_gives_its_exact_constraint_on_both_endpoints(body, expected):
    assert rules(body, chat=True) == expected
    assert rules(body, chat=False) == expected


def test_the_schema_keeps_the_users_key_order():
    schema = {"type": "object", "properties": {"z": {"type": "string"}, "a": {"type": "string"}}, "required": ["z"]}
    spec = rules({"response_format": json_schema(schema)}).spec
    assert spec == '{"type":"object","properties":{"z":{"type":"string"},"a":{"type":"string"}},"required":["z"]}'


def test_the_constraint_reaches_every_choice():
    from kvferry.services.gateway.request_parsing import parse_generations

    constraint = Constraint("regex", "x", "structured_outputs.regex")
    g = parse_generations({"n": 3}, False, [[1, 2]], 64, 1000, GatewayConfig(max_tokens_limit=100), constraint)[0]
    assert g.params.constraint == constraint and g.n == 3


# -- every invalid form: a 400 naming its field ---------------------------------------------------------------------
BIG = {"type": "object", "description": "x" * MAX_CONSTRAINT_BYTES}
INVALID = [
    # response_format
    ({"response_format": "json"}, "response_format", "must be an object"),
    ({"response_format": {"type": "xml"}}, "response_format", "text, json_object or json_schema"),
    ({"response_format": {"type": "json_object", "schema": {}}}, "response_format.schema", "unknown field"),
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema", "'name' and 'schema'"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": {}}}}, "response_format.json_schema.name", "1 to 64"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "a b", "schema": {}}}}, "response_format.json_schema.name", "1 to 64"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "a" * 65, "schema": {}}}}, "response_format.json_schema.name", "1 to 64"),
    ({"response_format": json_schema({}, strict="yes")}, "response_format.json_schema.strict", "bool"),
    ({"response_format": json_schema({}, description=3)}, "response_format.json_schema.description", "str"),
    ({"response_format": json_schema({}, extra=1)}, "response_format.json_schema.extra", "unknown field"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, SCHEMA_FIELD, "JSON Schema object"),
    ({"response_format": json_schema('{"type": "object"}')}, SCHEMA_FIELD, "JSON Schema object"),
    ({"response_format": json_schema({"type": "bogus"})}, SCHEMA_FIELD, "not a valid JSON Schema"),
    ({"response_format": json_schema({"type": "object", "properties": {"a": {"minimum": "x"}}})}, SCHEMA_FIELD, ".properties.a.minimum: not a valid"),
    ({"response_format": json_schema(BIG)}, SCHEMA_FIELD, f"at most {MAX_CONSTRAINT_BYTES} bytes"),
    ({"response_format": json_schema({"type": "object", "properties": {"tags": {"type": "array", "uniqueItems": True}}})}, SCHEMA_FIELD,
     f"{SCHEMA_FIELD}.properties.tags: 'uniqueItems' is not supported by the structured-output engine"),
    ({"response_format": json_schema({"type": "object", "properties": {"age": {"type": "number", "multipleOf": 3}}})}, SCHEMA_FIELD,
     f"{SCHEMA_FIELD}.properties.age: 'multipleOf' is supported only"),
    ({"response_format": json_schema({"maximum": float("nan"), "type": "number"})}, SCHEMA_FIELD, "not finite"),
    ({"response_format": json_schema({"enum": list(range(1025))})}, SCHEMA_FIELD,
     f"{SCHEMA_FIELD}: an 'enum' of more than 1024 values is not supported"),
    # structured_outputs
    ({"structured_outputs": "json"}, "structured_outputs", "must be an object"),
    ({"structured_outputs": {}}, "structured_outputs", "exactly one"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs", "exactly one"),
    ({"structured_outputs": {"backend": "xgrammar"}}, "structured_outputs.backend", "not supported"),
    ({"structured_outputs": {"structural_tag": "{}"}}, "structured_outputs.structural_tag", "not supported"),
    ({"structured_outputs": {"choice": []}}, "structured_outputs.choice", "non-empty list of strings"),
    ({"structured_outputs": {"choice": ["a", 1]}}, "structured_outputs.choice", "non-empty list of strings"),
    ({"structured_outputs": {"choice": "a"}}, "structured_outputs.choice", "non-empty list of strings"),
    ({"structured_outputs": {"regex": 5}}, "structured_outputs.regex", "non-empty string"),
    ({"structured_outputs": {"regex": ""}}, "structured_outputs.regex", "non-empty string"),
    ({"structured_outputs": {"regex": "a" * (MAX_CONSTRAINT_BYTES + 1)}}, "structured_outputs.regex", "bytes"),
    ({"structured_outputs": {"grammar": ["root ::= a"]}}, "structured_outputs.grammar", "non-empty string"),
    ({"structured_outputs": {"json": "{not json"}}, "structured_outputs.json", "not valid JSON"),
    ({"structured_outputs": {"json": "[1]"}}, "structured_outputs.json", "JSON Schema object"),
    ({"structured_outputs": {"json": True}}, "structured_outputs.json", "JSON Schema object"),
    ({"structured_outputs": {"json": "[" * 100 + "]" * 100}}, "structured_outputs.json", "nested"),
    ({"structured_outputs": {"json": "[" * 100_000 + "]" * 100_000}}, "structured_outputs.json", "bytes"),
    ({"structured_outputs": {"json": '{"type": "number", "maximum": NaN}'}}, "structured_outputs.json", "not finite"),
    ({"structured_outputs": {"json": '{"title": "\\ud800"}'}}, "structured_outputs.json", "surrogate"),
    ({"structured_outputs": {"json": '{"type": "object", "not": {}}'}}, "structured_outputs.json", "structured_outputs.json: 'not' is not supported"),
    ({"structured_outputs": {"json_object": "yes"}}, "structured_outputs.json_object", "boolean"),
    ({"structured_outputs": {"json": {"$schema": "http://json-schema.org/draft-04/schema#"}}}, "structured_outputs.json", "drafts"),
    ({"structured_outputs": {"json": {"$schema": {"a": 1}}}}, "structured_outputs.json", "drafts"),
    ({"guided_regex": 3}, "guided_regex", "non-empty string"),
    ({"guided_choice": []}, "guided_choice", "non-empty list"),
    # more than one source
    ({"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}}, "structured_outputs", "only one of"),
    ({"guided_json": {}, "guided_regex": "a"}, "guided_regex", "only one of"),
    ({"structured_outputs": {"regex": "a"}, "guided_choice": ["a"]}, "guided_choice", "only one of"),
]  # fmt: skip


@pytest.mark.parametrize("body, param, says", INVALID)
def test_an_invalid_constraint_gets_a_400_naming_its_field(body, param, says):
    with pytest.raises(ApiError) as caught:
        rules(body)
    error = caught.value
    assert (error.status, error.param) == (400, param), error.message
    assert says in error.message, error.message


def test_response_format_and_tools_together_only_with_tool_choice_none():
    tool = {"type": "function", "function": {"name": "f"}}
    body = {"response_format": {"type": "json_object"}, "tools": [tool]}
    with pytest.raises(ApiError) as caught:
        rules(body)
    assert caught.value.param == "response_format" and "tool_choice" in caught.value.message
    assert rules({**body, "tool_choice": "none"}) == Constraint("json", '{"type":"object"}', "response_format")


# -- the schemas the engine enforces in full -----------------------------------------------------------------------
def refusal(schema) -> str:
    with pytest.raises(UnsupportedSchema) as caught:
        check_supported(schema, "s")
    return str(caught.value)


@pytest.mark.parametrize(
    "schema, says",
    [
        ({"allOf": [{"type": "integer"}]}, "s: 'allOf' is not supported"),
        ({"type": "integer", "not": {"const": 3}}, "s: 'not' is not supported"),
        ({"type": "integer", "if": {}, "then": {}, "else": {}}, "s: 'if' is not supported"),
        ({"type": "array", "contains": {"const": 1}}, "'contains' is not supported"),
        ({"type": "array", "minContains": 1}, "'minContains' is not supported"),
        ({"type": "object", "dependentRequired": {"a": ["b"]}}, "'dependentRequired' is not supported"),
        ({"type": "object", "dependentSchemas": {}}, "'dependentSchemas' is not supported"),
        ({"type": "object", "patternProperties": {"^x": {}}}, "'patternProperties' is not supported"),
        ({"type": "object", "unevaluatedProperties": False}, "'unevaluatedProperties' is not supported"),
        ({"type": "array", "unevaluatedItems": False}, "'unevaluatedItems' is not supported"),
        ({"type": "array", "additionalItems": False}, "'additionalItems' is not supported"),
        ({"type": "string", "nullable": True}, "'nullable' is not supported"),
        ({"type": "string", "contentEncoding": "base64"}, "'contentEncoding' is not supported"),
        ({"$anchor": "a"}, "'$anchor' is not supported"),
        ({"type": "string", "format": "iri"}, "the format 'iri' is not supported"),
        ({"type": "string", "format": "idn-email"}, "format 'idn-email'"),
        ({"type": "string", "format": "regex"}, "format 'regex'"),
        ({"type": "integer", "multipleOf": 1.5}, "'multipleOf' is supported only"),
        ({"type": ["integer", "number"], "multipleOf": 2}, "'multipleOf' is supported only"),
        ({"type": "integer", "minimum": 1.5}, "'minimum' of an integer must be a whole number"),
        ({"minimum": 3}, "'minimum' needs a 'type' that includes 'number'"),
        ({"maxLength": 3}, "'maxLength' needs a 'type' that includes 'string'"),
        ({"minItems": 1}, "'minItems' needs a 'type' that includes 'array'"),
        ({"required": ["a"], "properties": {"a": {}}}, "'required' needs a 'type' that includes 'object'"),
        ({"type": "string", "format": "email", "maxLength": 9}, "'format' and 'maxLength' together"),
        ({"type": "string", "pattern": "^a+$", "minLength": 2}, "'pattern' and 'minLength' together"),
        ({"type": "string", "format": "date", "pattern": "^2"}, "'format' and 'pattern' together"),
        ({"type": "object", "properties": {"a": {}}, "required": ["b"]}, "the required property 'b' is not in"),
        ({"type": "object", "required": ["b"]}, "the required property 'b'"),
        ({"$defs": {"i": {"type": "integer"}}, "$ref": "#/$defs/i", "maximum": 3}, "'maximum' beside '$ref'"),
        ({"type": "object", "anyOf": [{"type": "object"}]}, "'type' beside 'anyOf'"),
        ({"type": "integer", "oneOf": [{"type": "integer"}]}, "'type' beside 'oneOf'"),
        ({"type": "string", "enum": ["a"], "maxLength": 0}, "'maxLength' beside 'enum'"),
        ({"type": "integer", "enum": ["a", 1]}, "the value 'a' does not match 'type'"),
        ({"type": "integer", "const": "a"}, "does not match 'type'"),
        ({"enum": [1], "const": 1}, "beside"),
        ({"$ref": "http://example.com/s.json"}, "only '#/...' within the schema"),
        ({"$ref": "#I"}, "only '#/...'"),
        ({"$ref": "#/$defs/missing"}, "points at nothing"),
        ({"type": "object", "properties": {"a": False}}, "s.properties.a: the schema false is supported only"),
        ({"anyOf": [False, {"type": "integer"}]}, "s.anyOf[0]: the schema false"),
        ({"type": "array", "items": [{"type": "integer"}]}, "'items' as a list is not supported"),
        ({"oneOf": [{"type": "integer"}, {"type": "number"}]}, "s.oneOf[1]: this branch may match what oneOf[0]"),
        ({"oneOf": [{"type": "object"}, {"type": "object", "properties": {"a": {}}}]}, "oneOf[1]"),
        ({"oneOf": [{"type": "integer"}] * 300}, "more than 256 branches"),
        ({"oneOf": [{"enum": ["a", 1]}, {"enum": [1.0]}]}, "s.oneOf[1]: this branch may match"),  # 1 and 1.0 are one
        ({"oneOf": [{"const": {"a": 1, "b": [2]}}, {"enum": [{"b": [2.0], "a": 1}]}]}, "s.oneOf[1]"),
        ({"enum": list(range(1025))}, "s: an 'enum' of more than 1024 values is not supported (this one has 1025)"),
        ({"type": "object", "properties": {"o": {"type": "object", "properties": {f"p{i}": {} for i in range(129)}}}},
         "s.properties.o: an object with more than 128 optional properties is not supported (this one has 129"),
        ({"type": "object", "properties": {f"p{i}": {} for i in range(300)}, "required": [f"p{i}" for i in range(171)]},
         "s: an object with more than 128 optional properties"),
        ({"type": "object", "$defs": {f"d{k}": {"type": "object", "properties": {f"p{i}": {} for i in range(700)},
                                                "required": [f"p{i}" for i in range(700)]} for k in range(3)}},
         "s.$defs.d2: a schema with more than 2048 properties in all"),
        ({"type": "array", "items": {"type": "object", "properties": {"x": {"uniqueItems": True}}}},
         "s.items.properties.x: 'uniqueItems'"),
        ({"$defs": {"a": {"type": "object", "if": {}}}, "type": "object"}, "s.$defs.a: 'if'"),
        ([], "a schema must be a JSON object"),
        (True, "a schema must be a JSON object"),
    ],
)  # fmt: skip
def test_what_the_engine_would_not_enforce_is_refused_with_its_path(schema, says):
    assert says in refusal(schema)


ENFORCED = [  # (schema, outputs that must pass, outputs that must fail): the walker accepts each, xgrammar enforces it
    ({"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}, ['{"a": 1}'], ['{}', '{"a": "x"}']),
    ({"type": "object", "properties": {"a": {"type": "integer"}}}, ['{"a": 1}', "{}"], ['{"b": 1}']),
    ({"type": "object", "additionalProperties": {"type": "string"}}, ['{"k": "v"}'], ['{"k": 1}']),
    ({"type": "object", "additionalProperties": {"type": "integer"}, "minProperties": 1, "maxProperties": 1}, ['{"a": 1}'], ["{}", '{"a": 1, "b": 2}']),
    ({"type": "object", "propertyNames": {"maxLength": 1}, "additionalProperties": {"type": "integer"}}, ['{"a": 1}'], ['{"ab": 1}']),
    ({"type": ["integer", "null"]}, ["1", "null"], ['"x"']),
    ({"type": "array", "items": {"type": "integer"}, "minItems": 1, "maxItems": 2}, ["[1]", "[1, 2]"], ["[]", "[1, 2, 3]"]),
    ({"type": "array", "prefixItems": [{"type": "integer"}, {"type": "string"}], "items": False}, ['[1, "a"]'], ['["a", 1]', '[1, "a", 2]']),
    ({"enum": ["a", 1, None]}, ['"a"', "1", "null"], ['"b"']),
    ({"type": "string", "enum": ["a", "b"]}, ['"a"'], ['"c"']),
    ({"type": "integer", "const": 2}, ["2"], ["3"]),
    ({"anyOf": [{"type": "integer"}, {"type": "string"}]}, ["1", '"a"'], ["null"]),
    ({"oneOf": [{"type": "integer"}, {"type": "string"}]}, ["1", '"a"'], ["null"]),
    ({"oneOf": [{"type": "object", "properties": {"k": {"const": "a"}, "x": {"type": "integer"}}, "required": ["k", "x"]},
                {"type": "object", "properties": {"k": {"const": "b"}, "y": {"type": "string"}}, "required": ["k", "y"]}]},
     ['{"k": "a", "x": 1}', '{"k": "b", "y": "s"}'], ['{"k": "a", "y": "s"}']),
    ({"$defs": {"i": {"type": "integer"}}, "type": "object", "properties": {"a": {"$ref": "#/$defs/i"}}, "required": ["a"]}, ['{"a": 1}'], ['{"a": "x"}']),
    ({"definitions": {"i": {"type": "integer"}}, "$ref": "#/definitions/i", "description": "an annotation"}, ["1"], ['"x"']),
    ({"type": "object", "properties": {"c": {"$ref": "#"}}}, ['{"c": {}}', "{}"], ['{"c": 1}']),
    ({"type": "integer", "minimum": 1, "maximum": 5}, ["1", "5"], ["0", "6"]),
    ({"type": "integer", "exclusiveMinimum": 1, "exclusiveMaximum": 5}, ["2", "4"], ["1", "5"]),
    ({"type": "number", "minimum": 1.5, "maximum": 2.5}, ["2.0"], ["3.0", "1.0"]),
    ({"type": "integer", "multipleOf": 3, "minimum": 4, "maximum": 20}, ["6", "18"], ["3", "21", "7"]),
    ({"type": "string", "minLength": 2, "maxLength": 3}, ['"ab"', '"abc"'], ['"a"', '"abcd"']),
    ({"type": "string", "pattern": "^[a-z]+$"}, ['"abc"'], ['"AB"']),
    ({"type": "string", "title": "t", "default": "x", "examples": ["a"], "deprecated": True, "readOnly": True, "$comment": "c"}, ['"a"'], ["1"]),
    ({}, ["1", '{"a": [1]}'], []),
    ({"$schema": "https://json-schema.org/draft/2020-12/schema", "$id": "https://x.org/s", "type": "integer"}, ["1"], ['"x"']),
    ({"type": "object", "properties": {"a": True}, "required": ["a"]}, ['{"a": 1}'], ["{}"]),
    ({"oneOf": [{"enum": [[True], "a"]}, {"enum": [[1], 1.5]}]}, ["[true]", "[1]", '"a"', "1.5"], ["[2]", "true"]),
]  # fmt: skip
FORMAT_SAMPLES = {
    "email": ('"first.last@sub.example.org"', '"a@"'),
    "date": ('"2024-01-02"', '"2024-1-2"'),
    "date-time": ('"2024-01-02T03:04:05.123+01:00"', '"2024-01-02"'),
    "time": ('"23:59:59+02:00"', '"25:00:00Z"'),
    "duration": ('"P1Y2M3DT4H5M6S"', '"1D"'),
    "uuid": ('"123e4567-e89b-12d3-a456-426614174000"', '"123e4567"'),
    "ipv4": ('"1.2.3.4"', '"1.2.3"'),
    "ipv6": ('"2001:db8::1"', '"1.2.3.4"'),
    "uri": ('"https://x.org/a?b=c#d"', '"/relative"'),
    "uri-reference": ('"/a/b"', '"a b"'),
    "uri-template": ('"http://x/{id}"', '"x{"'),
    "hostname": ('"a-b.example"', '"a_b"'),
    "json-pointer": ('"/a/~0b"', '"a"'),
    "relative-json-pointer": ('"1/a"', '"/a"'),
}


@pytest.fixture(scope="module")
def compiler(tmp_path_factory):
    xgr = pytest.importorskip("xgrammar")
    from transformers import AutoTokenizer

    from tests.tiny_models import save_tiny_chat_model

    folder = tmp_path_factory.mktemp("tiny_chat")
    save_tiny_chat_model(folder)
    return xgr, xgr.GrammarCompiler(xgr.TokenizerInfo.from_huggingface(AutoTokenizer.from_pretrained(folder)))


def completes(xgr, grammar, text: str) -> bool:
    matcher = xgr.GrammarMatcher(grammar)
    return matcher.accept_string(text) and matcher.is_completed()


@pytest.mark.parametrize(
    "schema, good, bad",
    ENFORCED + [({"type": "string", "format": f}, [g], [b]) for f, (g, b) in FORMAT_SAMPLES.items()],
)
def test_what_the_walker_accepts_xgrammar_enforces(compiler, schema, good, bad):
    check_supported(schema, "s")
    xgr, compile_ = compiler
    grammar = compile_.compile_json_schema(json.dumps(schema), any_whitespace=False)
    for text in good:
        assert completes(xgr, grammar, text), text
    for text in bad:
        assert not completes(xgr, grammar, text), text


def test_every_supported_format_has_a_sample():
    assert set(FORMAT_SAMPLES) == FORMATS


@pytest.mark.parametrize(
    "schema, passes",
    [
        ({"type": "integer", "multipleOf": 5}, "7"),  # the brief's list said ignored: it holds for integers ...
        ({"type": "number", "multipleOf": 0.5}, "1.2"),  # ... and not for numbers, which the walker refuses
        ({"type": "array", "items": {"type": "integer"}, "uniqueItems": True}, "[1, 1]"),
        ({"type": "string", "format": "iri"}, '"x y"'),
        ({"type": "string", "format": "email", "maxLength": 5}, '"abc@def.gh"'),
        ({"type": "string", "pattern": "^a+$", "maxLength": 2}, '"aaa"'),
        ({"$defs": {"i": {"type": "integer"}}, "$ref": "#/$defs/i", "maximum": 3}, "5"),
        ({"type": "integer", "enum": ["a", 1]}, '"a"'),
        ({"minimum": 3}, "1"),
        ({"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["b"]}, '{"a": 1}'),
    ],
)
def test_what_the_walker_refuses_xgrammar_would_let_through(compiler, schema, passes):
    """Why each rule is there: xgrammar compiles these and accepts an output the schema refuses."""
    xgr, compile_ = compiler
    grammar = compile_.compile_json_schema(json.dumps(schema), any_whitespace=False)
    if schema.get("multipleOf") == 5:  # the one it enforces: accepted only as a prefix ("70")
        assert not completes(xgr, grammar, passes)
        check_supported(schema, "s")
        return
    assert completes(xgr, grammar, passes)
    with pytest.raises(UnsupportedSchema):
        check_supported(schema, "s")


def test_the_limits_themselves_are_supported():
    names = [f"p{i}" for i in range(MAX_PROPERTIES // 2)]
    wide = {"type": "object", "properties": dict.fromkeys(names, {}), "required": names[MAX_OPTIONAL_PROPERTIES:]}
    check_supported({"type": "object", "$defs": {"a": wide, "b": wide}}, "s")  # MAX_PROPERTIES in all
    check_supported({"enum": list(range(MAX_ENUM_VALUES))}, "s")
    check_supported({"oneOf": [{"enum": [[True]]}, {"enum": [[1]]}]}, "s")  # true is not 1, nor [true] [1]


def walker_steps(schema) -> int:
    """The Python calls and returns the support walk makes in its module: a measure of its work that no timing noise
    can flake."""
    steps = 0

    def count(frame, event, arg):
        nonlocal steps
        steps += frame.f_code.co_filename == json_schema_support.__file__

    sys.setprofile(count)
    try:
        check_supported(schema, "s")
    finally:
        sys.setprofile(None)
    return steps


def test_the_oneof_check_is_linear_in_the_enums_values():
    """Each pair of values was compared (2 enums of 9000 values took 2 s); sets make it linear."""

    def disjoint_enums(n: int) -> dict:
        return {"oneOf": [{"enum": list(range(n))}, {"enum": [str(i) for i in range(n)]}, {"const": [n]}]}

    few, many = walker_steps(disjoint_enums(MAX_ENUM_VALUES // 4)), walker_steps(disjoint_enums(MAX_ENUM_VALUES))
    assert many < 5 * few, (few, many)


def test_a_pydantic_models_schema_is_supported():
    from pydantic import BaseModel, Field

    class Address(BaseModel):
        city: str = Field(max_length=20)

    class Person(BaseModel):
        name: str = Field(max_length=20)
        age: int = Field(ge=0, le=150)
        email: str | None = None
        address: Address
        tags: list[str] = Field(default_factory=list, max_length=3)

    check_supported(Person.model_json_schema(), "s")


# -- over HTTP, against a fake core ---------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def api():
    with in_process_api(GatewayConfig(max_n=4)) as served_api:
        yield served_api


@pytest.fixture
def served(api, monkeypatch):
    """A client, and a function to set the events the fake workers answer with; the params they got are kept."""
    answer: list[Event] = []
    received: list = []

    async def generate_batches(prompt_ids, params, request_id=None, trace=None, n=1, flights=None):
        received.append(params)
        for event in answer:
            yield [event]

    monkeypatch.setattr(api.core, "generate_batches", generate_batches)
    return TestClient(api.app(), raise_server_exceptions=False), answer, received


def chat(client, stream: bool = False, **extra):
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 20, "stream": stream, **extra}
    return client.post("/v1/chat/completions", json=body)


def sse_events(response) -> list:
    lines = [line[len("data: ") :] for line in response.text.splitlines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


def test_a_valid_constraint_reaches_the_workers_and_an_invalid_one_never_does(served):
    client, answer, received = served
    answer.append(Event([1], FinishReason.STOP))
    assert chat(client, response_format={"type": "json_object"}).status_code == 200
    assert received[-1].constraint == Constraint("json", '{"type":"object"}', "response_format")
    response = chat(client, response_format=json_schema({"type": "object", "not": {}}))
    assert response.status_code == 400 and response.json()["error"]["param"] == SCHEMA_FIELD
    assert len(received) == 1


@pytest.mark.parametrize("stream", [False, True])
def test_a_workers_compile_error_is_a_400_naming_the_field_even_for_a_stream(served, stream):
    client, answer, _ = served
    answer.append(Event(error="structured_outputs.regex: unbalanced parenthesis at 3", error_code=400))
    response = chat(client, stream, structured_outputs={"regex": "(ab"})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "structured_outputs.regex" and error["type"] == "invalid_request_error"
    assert "unbalanced" in error["message"]


def test_a_workers_other_errors_keep_their_status_and_name_no_field(served):
    client, answer, _ = served
    answer.append(Event(error="the request took longer than 5 s: really", error_code=504))
    error = chat(client).json()["error"]
    assert error["param"] is None and error["type"] == "server_error"


def test_a_dead_end_finishes_error_with_its_error_whole_and_streamed(api, served):
    client, answer, _ = served
    ids = api.tokenizer.encode('{"a": ', add_special_tokens=False)
    answer += [Event(ids[:1]), Event(ids[1:], FinishReason.DEAD_END, start=1)]
    choice = chat(client, structured_outputs={"json_object": True}).json()["choices"][0]
    assert choice["finish_reason"] == "error" and choice["message"]["content"] == '{"a": '
    assert choice["error"] == {
        "message": "the output constraint allows no further token",
        "type": "constraint_dead_end",
    }
    events = sse_events(chat(client, stream=True, structured_outputs={"json_object": True}))
    last = events[-1]["choices"][0]
    assert last["finish_reason"] == "error" and last["error"]["type"] == "constraint_dead_end"
    assert all("error" not in e["choices"][0] for e in events[:-1])


def test_the_grammar_counters_are_in_metrics(api):
    from kvferry.common import protocol as p
    from kvferry.services.gateway.registry import WorkerInfo

    stats = p.WorkerStats(1, 1, 0, 0, 0, num_grammar_compiles=3, num_grammar_cache_hits=5, grammar_compile_s=0.25)
    worker = WorkerInfo("prefill-1", p.Role.PREFILL, b"id", "m", "float32", 16, 100, 2048, "", stats, 0.0)
    api.core.registry.workers[b"id"] = worker
    try:
        text = api.metrics.exposition().decode()
    finally:
        del api.core.registry.workers[b"id"]
    labels = '{role="prefill",worker="prefill-1"}'
    assert f"kvferry:grammar_compiles_total{labels} 3.0" in text
    assert f"kvferry:grammar_cache_hits_total{labels} 5.0" in text
    assert f"kvferry:grammar_compile_seconds_total{labels} 0.25" in text


def test_the_openapi_description_has_the_structured_output_fields():
    from kvferry.services.gateway.openapi import openapi_spec

    spec = openapi_spec("0", GatewayConfig())["components"]["schemas"]
    for name in ("response_format", "structured_outputs", "guided_json"):
        assert name in spec["ChatCompletionRequest"]["properties"] and name in spec["CompletionRequest"]["properties"]
    for name in ("tools", "tool_choice", "parallel_tool_calls"):
        assert name in spec["ChatCompletionRequest"]["properties"]


def test_a_dead_end_with_no_token_ends_its_choice():
    """A choice whose constraint allowed no token: a first token of -1, or decode Tokens with none, end it."""
    from kvferry.common import protocol as p
    from kvferry.common.sampling import SamplingParams
    from kvferry.services.gateway.flight import Flight
    from kvferry.services.gateway.server import GatewayCore

    flight = Flight("r", [1, 2], SamplingParams(max_tokens=8), p.TraceContext(), 2)
    first = GatewayCore._event(p.FirstToken(-1, int(FinishReason.DEAD_END), choice=0), flight)
    assert first.error is None and first.token_ids == [] and first.finish_reason == FinishReason.DEAD_END
    assert flight.accept(first) == [first] and flight.finished == [True, False]
    assert flight.accept(GatewayCore._event(p.FirstToken(7, choice=1), flight))[0].token_ids == [7]
    last = GatewayCore._event(p.Tokens([], start=1, choice=1, finish_reason=int(FinishReason.DEAD_END)), flight)
    assert flight.accept(last) == [last] and flight.done and flight.outputs == [[], [7]]
    assert GatewayCore._event(p.FirstToken(-1, choice=0), flight).error  # -1 only for a dead end


@settings(max_examples=300, deadline=None, database=None)
@given(
    st.recursive(
        st.none() | st.booleans() | st.integers(-5, 5) | st.floats(-5, 5) | st.sampled_from(list(KEYWORDS)),
        lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.sampled_from(KEYWORDS), inner, max_size=4),
        max_leaves=20,
    )
)
def test_any_schema_gets_an_answer_or_a_400_never_a_crash(schema):
    try:
        checked_schema(schema, "s")
    except ApiError as exc:
        assert exc.status == 400 and exc.param == "s"

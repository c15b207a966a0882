"""The OpenAPI description of the request fields whose values other modules check: the prompt (Api.prompt_ids), the
messages (chat_messages.py), the output constraints (constraints.py) and the tools (tools.py). request_fields.py
declares them, with these as their spec."""

from kvferry.common.constraint import MAX_CONSTRAINT_BYTES
from kvferry.services.gateway.tools import MAX_TOOLS

STRING, BOOLEAN = {"type": "string"}, {"type": "boolean"}
FUNCTION_TYPE = {"type": "string", "enum": ["function"]}
NAME = {"type": "string", "pattern": "^[a-zA-Z0-9_-]{1,64}$"}
SCHEMA = {
    "type": "object",
    "description": "a JSON Schema (draft 2020-12) of the keywords docs/structured-output.md lists; at most "
    f"{MAX_CONSTRAINT_BYTES} bytes as compact JSON",
}
TOKEN_IDS = {"type": "array", "items": {"type": "integer", "minimum": 0}}


def object_of(properties: dict, *required: str, closed: bool = False, **more) -> dict:
    """An object schema; closed: no other property (additionalProperties: false); more: keywords before those."""
    out = {"type": "object", **({"required": list(required)} if required else {}), **more}
    return {**out, **({"additionalProperties": False} if closed else {}), "properties": properties}


def nullable(schema: dict, description: str = "") -> dict:
    return {**schema, "nullable": True, **({"description": description} if description else {})}


def prompt(max_prompts: int) -> dict:
    batch_item = {"oneOf": [STRING, {**TOKEN_IDS, "minItems": 1}]}
    batch = {"type": "array", "minItems": 1, "maxItems": max_prompts, "items": batch_item}
    return {"oneOf": [STRING, TOKEN_IDS, batch]}


def tool_call() -> dict:
    function = object_of({"name": STRING, "arguments": {**STRING, "description": "JSON"}}, "name", "arguments")
    return object_of({"id": STRING, "type": FUNCTION_TYPE, "function": function}, "id", "type", "function")


MESSAGE = object_of(
    {
        "role": STRING,
        "content": nullable(STRING, "null only beside tool_calls"),
        "tool_calls": {"type": "array", "minItems": 1, "items": tool_call(), "description": "assistant's"},
        "tool_call_id": {**STRING, "description": "a tool message's: the call it answers"},
    },
    "role",
)
MESSAGES = {"type": "array", "minItems": 1, "items": MESSAGE}

_JSON_OR_TEXT = {"oneOf": [SCHEMA, {**STRING, "description": "a JSON Schema as JSON text"}]}
_CHOICE = {"type": "array", "minItems": 1, "items": STRING}
_TEXT = {"type": "string", "minLength": 1}
_JSON_SCHEMA = object_of(
    {
        "name": NAME,
        "schema": SCHEMA,
        "strict": nullable(BOOLEAN, "the schema is always enforced"),
        "description": nullable(STRING),
    },
    "name",
    "schema",
    closed=True,
)
_RESPONSE_FORMAT = {
    "oneOf": [
        object_of({"type": {**STRING, "enum": ["text", "json_object"]}}, "type", closed=True),
        object_of(
            {"type": {**STRING, "enum": ["json_schema"]}, "json_schema": _JSON_SCHEMA},
            "type",
            "json_schema",
            closed=True,
        ),
    ]
}
_STRUCTURED_OUTPUTS = object_of(
    {
        "json": _JSON_OR_TEXT,
        "regex": _TEXT,
        "choice": _CHOICE,
        "grammar": {**_TEXT, "description": "EBNF, as xgrammar reads it"},
        "json_object": BOOLEAN,
    },
    closed=True,
    minProperties=1,
    maxProperties=1,
)
# The fields that constrain the output, on both endpoints (docs/structured-output.md): (spec, description).
STRUCTURED = {
    "response_format": (_RESPONSE_FORMAT, "OpenAI's: any JSON object, or JSON following a schema"),
    "structured_outputs": (_STRUCTURED_OUTPUTS, "vLLM's: exactly one of json, regex, choice, grammar and json_object"),
    "guided_json": (_JSON_OR_TEXT, "vLLM's older name of structured_outputs.json"),
    "guided_regex": (_TEXT, ""),
    "guided_choice": (_CHOICE, ""),
    "guided_grammar": (_TEXT, ""),
}

_FUNCTION = object_of(
    {
        "name": NAME,
        "description": nullable(STRING),
        "parameters": nullable(SCHEMA, "a JSON Schema of the arguments, whose root is 'type': 'object'"),
        "strict": nullable(BOOLEAN),
    },
    "name",
    closed=True,
)


def tools() -> dict:
    tool = object_of({"type": FUNCTION_TYPE, "function": _FUNCTION}, "type", "function", closed=True)
    return {"type": "array", "maxItems": MAX_TOOLS, "items": tool}


_NAMED_FUNCTION = object_of({"name": STRING}, "name")
TOOL_CHOICE = {
    "oneOf": [
        {**STRING, "enum": ["none", "auto", "required"]},
        object_of({"type": FUNCTION_TYPE, "function": _NAMED_FUNCTION}, "type", "function"),
    ]
}

"""The OpenAPI description of the request fields whose values other modules check: the prompt (Api.prompt_ids), the
messages (chat_messages.py), the output constraints (constraints.py) and the tools (tools.py). request_fields.py
declares them, with these as their spec."""

from kvferry.common.constraint import MAX_CONSTRAINT_BYTES
from kvferry.services.gateway.tools import MAX_TOOLS

NAME = {"type": "string", "pattern": "^[a-zA-Z0-9_-]{1,64}$"}
SCHEMA = {
    "type": "object",
    "description": "a JSON Schema (draft 2020-12) of the keywords docs/structured-output.md lists; at most "
    f"{MAX_CONSTRAINT_BYTES} bytes as compact JSON",
}
TOKEN_IDS = {"type": "array", "items": {"type": "integer", "minimum": 0}}


def prompt(max_prompts: int) -> dict:
    return {
        "oneOf": [
            {"type": "string"},
            TOKEN_IDS,
            {
                "type": "array",
                "minItems": 1,
                "maxItems": max_prompts,
                "items": {"oneOf": [{"type": "string"}, {**TOKEN_IDS, "minItems": 1}]},
            },
        ]
    }


def tool_call() -> dict:
    return {
        "type": "object",
        "required": ["id", "type", "function"],
        "properties": {
            "id": {"type": "string"},
            "type": {"type": "string", "enum": ["function"]},
            "function": {
                "type": "object",
                "required": ["name", "arguments"],
                "properties": {"name": {"type": "string"}, "arguments": {"type": "string", "description": "JSON"}},
            },
        },
    }


MESSAGES = {
    "type": "array",
    "minItems": 1,
    "items": {
        "type": "object",
        "required": ["role"],
        "properties": {
            "role": {"type": "string"},
            "content": {"type": "string", "nullable": True, "description": "null only beside tool_calls"},
            "tool_calls": {"type": "array", "minItems": 1, "items": tool_call(), "description": "assistant's"},
            "tool_call_id": {"type": "string", "description": "a tool message's: the call it answers"},
        },
    },
}

_JSON_OR_TEXT = {"oneOf": [SCHEMA, {"type": "string", "description": "a JSON Schema as JSON text"}]}
_CHOICE = {"type": "array", "minItems": 1, "items": {"type": "string"}}
_TEXT = {"type": "string", "minLength": 1}
_JSON_SCHEMA = {
    "type": "object",
    "required": ["name", "schema"],
    "additionalProperties": False,
    "properties": {
        "name": NAME,
        "schema": SCHEMA,
        "strict": {"type": "boolean", "nullable": True, "description": "the schema is always enforced"},
        "description": {"type": "string", "nullable": True},
    },
}
# The fields that constrain the output, on both endpoints (docs/structured-output.md): (spec, description).
STRUCTURED = {
    "response_format": (
        {
            "oneOf": [
                {
                    "type": "object",
                    "required": ["type"],
                    "additionalProperties": False,
                    "properties": {"type": {"type": "string", "enum": ["text", "json_object"]}},
                },
                {
                    "type": "object",
                    "required": ["type", "json_schema"],
                    "additionalProperties": False,
                    "properties": {"type": {"type": "string", "enum": ["json_schema"]}, "json_schema": _JSON_SCHEMA},
                },
            ]
        },
        "OpenAI's: any JSON object, or JSON following a schema",
    ),
    "structured_outputs": (
        {
            "type": "object",
            "minProperties": 1,
            "maxProperties": 1,
            "additionalProperties": False,
            "properties": {
                "json": _JSON_OR_TEXT,
                "regex": _TEXT,
                "choice": _CHOICE,
                "grammar": {**_TEXT, "description": "EBNF, as xgrammar reads it"},
                "json_object": {"type": "boolean"},
            },
        },
        "vLLM's: exactly one of json, regex, choice, grammar and json_object",
    ),
    "guided_json": (_JSON_OR_TEXT, "vLLM's older name of structured_outputs.json"),
    "guided_regex": (_TEXT, ""),
    "guided_choice": (_CHOICE, ""),
    "guided_grammar": (_TEXT, ""),
}

_FUNCTION = {
    "type": "object",
    "required": ["name"],
    "additionalProperties": False,
    "properties": {
        "name": NAME,
        "description": {"type": "string", "nullable": True},
        "parameters": {
            **SCHEMA,
            "nullable": True,
            "description": "a JSON Schema of the arguments, whose root is 'type': 'object'",
        },
        "strict": {"type": "boolean", "nullable": True},
    },
}


def tools() -> dict:
    return {
        "type": "array",
        "maxItems": MAX_TOOLS,
        "items": {
            "type": "object",
            "required": ["type", "function"],
            "additionalProperties": False,
            "properties": {"type": {"type": "string", "enum": ["function"]}, "function": _FUNCTION},
        },
    }


TOOL_CHOICE = {
    "oneOf": [
        {"type": "string", "enum": ["none", "auto", "required"]},
        {
            "type": "object",
            "required": ["type", "function"],
            "properties": {
                "type": {"type": "string", "enum": ["function"]},
                "function": {"type": "object", "required": ["name"], "properties": {"name": {"type": "string"}}},
            },
        },
    ]
}

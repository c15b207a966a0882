"""GET /openapi.json: every route, its request schema and its error responses (OpenAPI 3.0)."""

from kvferry.common.constraint import MAX_CONSTRAINT_BYTES
from kvferry.common.sampling import MAX_LOGIT_BIAS, MAX_LOGPROBS, MAX_SEED, MAX_STOP_TOKEN_IDS, MAX_TOP_K
from kvferry.services.gateway.tools import MAX_TOOLS

NAME = {"type": "string", "pattern": "^[a-zA-Z0-9_-]{1,64}$"}
SCHEMA = {
    "type": "object",
    "description": "a JSON Schema (draft 2020-12) of the keywords docs/structured-output.md lists; at most "
    f"{MAX_CONSTRAINT_BYTES} bytes as compact JSON",
}

ERROR_CODES = {
    "400": "invalid request (param names the field)",
    "401": "missing or wrong API key",
    "404": "unknown model",
    "413": "request body too large",
    "415": "the body is not sent as JSON (Content-Type: application/json)",
    "503": "no live prefill or decode worker",
}


def _num(lo=None, hi=None, integer=False, **extra) -> dict:
    out = {"type": "integer" if integer else "number", "nullable": True, **extra}
    if lo is not None:
        out["minimum"] = lo
    if hi is not None:
        out["maximum"] = hi
    return out


def _sampling(limits) -> dict:
    stop_string = {"type": "string", "maxLength": limits.max_stop_length}
    return {
        "model": {"type": "string", "nullable": True},
        "max_tokens": _num(0, limits.max_tokens, True),
        "temperature": _num(0),
        "top_p": _num(0, 1, exclusiveMinimum=True),
        "top_k": _num(-1, MAX_TOP_K, True),
        "min_p": _num(0, 1),
        "n": _num(1, limits.max_n, True),
        "seed": _num(0, MAX_SEED, True),
        "presence_penalty": _num(-2, 2),
        "frequency_penalty": _num(-2, 2),
        "repetition_penalty": _num(0, 2, exclusiveMinimum=True),
        "min_tokens": _num(0, limits.max_tokens, True),
        "ignore_eos": {"type": "boolean", "nullable": True},
        "return_token_ids": {
            "type": "boolean",
            "nullable": True,
            "description": "each choice (each streamed chunk) carries the output's token ids in token_ids, as vLLM's",
        },
        "stop_token_ids": {
            "type": "array",
            "items": {"type": "integer", "minimum": 0},
            "maxItems": MAX_STOP_TOKEN_IDS,
            "nullable": True,
        },
        "stop": {
            "oneOf": [stop_string, {"type": "array", "items": stop_string, "maxItems": limits.max_stop}],
            "nullable": True,
            "description": f"at most {limits.max_stop} strings of at most {limits.max_stop_length} characters each, "
            f"{limits.max_stop_chars} characters together",
        },
        "logit_bias": {
            "type": "object",
            "additionalProperties": {"type": "number", "minimum": -100, "maximum": 100},
            "maxProperties": MAX_LOGIT_BIAS,
            "nullable": True,
        },
        "stream": {"type": "boolean", "nullable": True},
        "stream_options": {
            "type": "object",
            "nullable": True,
            "additionalProperties": False,
            "properties": {
                "include_usage": {
                    "type": "boolean",
                    "nullable": True,
                    "description": "a last chunk, with no choices, carries the request's usage",
                },
                "continuous_usage_stats": {
                    "type": "boolean",
                    "nullable": True,
                    "description": "vLLM's: every chunk carries the request's usage so far",
                },
            },
            "description": "only with stream: true",
        },
        "user": {"type": "string", "nullable": True},
    }


def _structured() -> dict:
    """The fields that constrain the output, on both endpoints (docs/structured-output.md)."""
    json_or_text = {"oneOf": [SCHEMA, {"type": "string", "description": "a JSON Schema as JSON text"}]}
    choice = {"type": "array", "minItems": 1, "items": {"type": "string"}}
    text = {"type": "string", "minLength": 1}
    json_schema = {
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
    return {
        "response_format": {
            "nullable": True,
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
                    "properties": {"type": {"type": "string", "enum": ["json_schema"]}, "json_schema": json_schema},
                },
            ],
            "description": "OpenAI's: any JSON object, or JSON following a schema",
        },
        "structured_outputs": {
            "type": "object",
            "nullable": True,
            "minProperties": 1,
            "maxProperties": 1,
            "additionalProperties": False,
            "properties": {
                "json": json_or_text,
                "regex": text,
                "choice": choice,
                "grammar": {**text, "description": "EBNF, as xgrammar reads it"},
                "json_object": {"type": "boolean"},
            },
            "description": "vLLM's: exactly one of json, regex, choice, grammar and json_object",
        },
        "guided_json": {
            **json_or_text,
            "nullable": True,
            "description": "vLLM's older name of structured_outputs.json",
        },
        "guided_regex": {**text, "nullable": True},
        "guided_choice": {**choice, "nullable": True},
        "guided_grammar": {**text, "nullable": True},
    }


def _tools() -> dict:
    """Chat's tools: calls are generated as <tool_call> blocks and returned as message.tool_calls."""
    function = {
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
    named = {
        "type": "object",
        "required": ["type", "function"],
        "properties": {
            "type": {"type": "string", "enum": ["function"]},
            "function": {"type": "object", "required": ["name"], "properties": {"name": {"type": "string"}}},
        },
    }
    return {
        "tools": {
            "type": "array",
            "nullable": True,
            "maxItems": MAX_TOOLS,
            "items": {
                "type": "object",
                "required": ["type", "function"],
                "additionalProperties": False,
                "properties": {"type": {"type": "string", "enum": ["function"]}, "function": function},
            },
        },
        "tool_choice": {
            "nullable": True,
            "oneOf": [{"type": "string", "enum": ["none", "auto", "required"]}, named],
            "description": 'default "auto" with tools, "none" without',
        },
        "parallel_tool_calls": {"type": "boolean", "nullable": True},
    }


def _tool_call() -> dict:
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


def _chat_completion() -> dict:
    """The whole chat response (a stream sends chat.completion.chunk events of the same parts as deltas)."""
    return {
        "type": "object",
        "properties": {
            "id": {"type": "string"},
            "object": {"type": "string"},
            "choices": {
                "type": "array",
                "items": {
                    "type": "object",
                    "properties": {
                        "index": {"type": "integer"},
                        "message": {
                            "type": "object",
                            "properties": {
                                "role": {"type": "string"},
                                "content": {"type": "string", "nullable": True},
                                "tool_calls": {"type": "array", "items": _tool_call()},
                            },
                        },
                        "finish_reason": {"type": "string", "enum": ["stop", "length", "tool_calls", "error", "abort"]},
                        "error": {
                            "type": "object",
                            "description": 'with finish_reason "error": the output constraint allowed no token',
                            "properties": {"message": {"type": "string"}, "type": {"type": "string"}},
                        },
                    },
                },
            },
            "usage": {"type": "object"},
        },
    }


def _errors() -> dict:
    return {
        code: {"description": what, "content": {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}}}
        for code, what in ERROR_CODES.items()
    }


def _post(summary: str, schema: str, errors: bool = True, reply: str | None = None) -> dict:
    reply_schema = {"$ref": f"#/components/schemas/{reply}"} if reply else {"type": "object"}
    responses = {
        "200": {
            "description": "success (text/event-stream when stream is true)",
            "content": {"application/json": {"schema": reply_schema}},
        }
    }
    if errors:
        responses.update(_errors())
    return {
        "post": {
            "summary": summary,
            "requestBody": {
                "required": True,
                "content": {"application/json": {"schema": {"$ref": f"#/components/schemas/{schema}"}}},
            },
            "responses": responses,
        }
    }


def _get(summary: str, extra: dict | None = None) -> dict:
    return {
        "get": {
            "summary": summary,
            "responses": {
                "200": {"description": "success", "content": {"application/json": {"schema": {"type": "object"}}}},
                **(extra or {}),
            },
        }
    }


def openapi_spec(version: str, limits) -> dict:
    sampling = {**_sampling(limits), **_structured()}
    message = {
        "type": "object",
        "required": ["role"],
        "properties": {
            "role": {"type": "string"},
            "content": {"type": "string", "nullable": True, "description": "null only beside tool_calls"},
            "tool_calls": {"type": "array", "minItems": 1, "items": _tool_call(), "description": "assistant's"},
            "tool_call_id": {"type": "string", "description": "a tool message's: the call it answers"},
        },
    }
    schemas = {
        "CompletionRequest": {
            "type": "object",
            "required": ["prompt"],
            "additionalProperties": False,
            "properties": {
                **sampling,
                "prompt": {
                    "oneOf": [
                        {"type": "string"},
                        {"type": "array", "items": {"type": "integer", "minimum": 0}},
                        {
                            "type": "array",
                            "minItems": 1,
                            "maxItems": limits.max_prompts,
                            "items": {
                                "oneOf": [
                                    {"type": "string"},
                                    {"type": "array", "minItems": 1, "items": {"type": "integer", "minimum": 0}},
                                ]
                            },
                        },
                    ]
                },
                "echo": {"type": "boolean", "nullable": True},
                "logprobs": _num(0, MAX_LOGPROBS, True),
                "best_of": _num(1, 1, True),
                "suffix": {"type": "string", "nullable": True, "maxLength": 0},
            },
        },
        "ChatCompletionRequest": {
            "type": "object",
            "required": ["messages"],
            "additionalProperties": False,
            "properties": {
                **sampling,
                "messages": {"type": "array", "minItems": 1, "items": message},
                "max_completion_tokens": _num(1, limits.max_tokens, True),
                "logprobs": {"type": "boolean", "nullable": True},
                "top_logprobs": _num(0, MAX_LOGPROBS, True),
                **_tools(),
            },
        },
        "ChatCompletion": _chat_completion(),
        "TokenizeRequest": {
            "type": "object",
            "properties": {
                "model": {"type": "string", "nullable": True},
                "prompt": {"type": "string"},
                "messages": {"type": "array", "minItems": 1, "items": message},
                "tools": _tools()["tools"],
                "tool_choice": _tools()["tool_choice"],
                "add_special_tokens": {"type": "boolean"},
                "add_generation_prompt": {"type": "boolean"},
            },
        },
        "DetokenizeRequest": {
            "type": "object",
            "required": ["tokens"],
            "properties": {
                "model": {"type": "string", "nullable": True},
                "tokens": {"type": "array", "items": {"type": "integer", "minimum": 0}},
            },
        },
        "Error": {
            "type": "object",
            "required": ["error"],
            "properties": {
                "error": {
                    "type": "object",
                    "properties": {
                        "message": {"type": "string"},
                        "type": {"type": "string"},
                        "param": {"type": "string", "nullable": True},
                        "code": {"nullable": True},
                    },
                }
            },
        },
    }
    unavailable = {"503": {"description": "no live prefill or decode worker"}}
    paths = {
        "/v1/completions": _post("Text completion (OpenAI)", "CompletionRequest"),
        "/v1/chat/completions": _post("Chat completion (OpenAI)", "ChatCompletionRequest", reply="ChatCompletion"),
        "/v1/models": _get(
            "The served model, once under each of its names (--served-model-name)", {"401": _errors()["401"]}
        ),
        "/tokenize": _post("Text or chat messages to token ids", "TokenizeRequest"),
        "/detokenize": _post("Token ids to text", "DetokenizeRequest"),
        "/tokenizer_info": _get("The tokenizer's special tokens and chat template", {"401": _errors()["401"]}),
        "/version": _get("kvferry's version"),
        "/health": _get("200 with a live prefill and decode worker", unavailable),
        "/v1/workers": _get("Live workers and their stats", {"401": _errors()["401"]}),
        "/metrics": {
            "get": {
                "summary": "Prometheus metrics",
                "responses": {
                    "200": {
                        "description": "text exposition format",
                        "content": {"text/plain": {"schema": {"type": "string"}}},
                    }
                },
            }
        },
        "/openapi.json": _get("This description"),
    }
    return {
        "openapi": "3.0.3",
        "info": {"title": "kvferry", "version": version},
        "paths": paths,
        "components": {"schemas": schemas, "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}}},
    }

"""GET /openapi.json: every route, its request schema and its error responses (OpenAPI 3.0). The request bodies'
schemas are their endpoints' declarations (request_fields.py), the same that check every request."""

from kvferry.services.gateway.other_fields import tool_call
from kvferry.services.gateway.request_fields import BUILDERS, schema_of

ERROR_CODES = {
    "400": "invalid request (param names the field)",
    "401": "missing or wrong API key",
    "404": "unknown model",
    "413": "request body too large",
    "415": "the body is not sent as JSON (Content-Type: application/json)",
    "503": "no live prefill or decode worker",
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
                                "tool_calls": {"type": "array", "items": tool_call()},
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
    schemas = {
        **{name: schema_of(name, limits).openapi() for name in BUILDERS},
        "ChatCompletion": _chat_completion(),
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

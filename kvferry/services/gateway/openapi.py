"""GET /openapi.json: every route, its request schema and its error responses (OpenAPI 3.0). The request bodies'
schemas are their endpoints' declarations (request_fields.py), the same that check every request."""

from kvferry.services.gateway.other_fields import STRING, nullable, object_of, tool_call
from kvferry.services.gateway.request_fields import BUILDERS, schema_of

ERROR_CODES = {
    "400": "invalid request (param names the field)",
    "401": "missing or wrong API key",
    "404": "unknown model",
    "413": "request body too large",
    "415": "the body is not sent as JSON (Content-Type: application/json)",
    "503": "no live prefill or decode worker",
}
FINISH_REASONS = ["stop", "length", "tool_calls", "error", "abort"]


def _chat_completion() -> dict:
    """The whole chat response (a stream sends chat.completion.chunk events of the same parts as deltas)."""
    message = object_of(
        {"role": STRING, "content": nullable(STRING), "tool_calls": {"type": "array", "items": tool_call()}}
    )
    error = object_of(
        {"message": STRING, "type": STRING},
        description='with finish_reason "error": the output constraint allowed no token',
    )
    choice = object_of(
        {
            "index": {"type": "integer"},
            "message": message,
            "finish_reason": {**STRING, "enum": FINISH_REASONS},
            "error": error,
        }
    )
    choices = {"type": "array", "items": choice}
    return object_of({"id": STRING, "object": STRING, "choices": choices, "usage": {"type": "object"}})


def _json(schema: dict, description: str) -> dict:
    return {"description": description, "content": {"application/json": {"schema": schema}}}


def _errors(*codes: str) -> dict:
    return {code: _json({"$ref": "#/components/schemas/Error"}, ERROR_CODES[code]) for code in codes or ERROR_CODES}


def _post(summary: str, schema: str, reply: str | None = None) -> dict:
    reply_schema = {"$ref": f"#/components/schemas/{reply}"} if reply else {"type": "object"}
    request = {
        "required": True,
        "content": {"application/json": {"schema": {"$ref": f"#/components/schemas/{schema}"}}},
    }
    responses = {"200": _json(reply_schema, "success (text/event-stream when stream is true)"), **_errors()}
    return {"post": {"summary": summary, "requestBody": request, "responses": responses}}


def _get(summary: str, extra: dict | None = None) -> dict:
    return {"get": {"summary": summary, "responses": {"200": _json({"type": "object"}, "success"), **(extra or {})}}}


def openapi_spec(version: str, limits) -> dict:
    error = object_of({"message": STRING, "type": STRING, "param": nullable(STRING), "code": {"nullable": True}})
    schemas = {
        **{name: schema_of(name, limits).openapi() for name in BUILDERS},
        "ChatCompletion": _chat_completion(),
        "Error": object_of({"error": error}, "error"),
    }
    metrics = {"description": "text exposition format", "content": {"text/plain": {"schema": STRING}}}
    paths = {
        "/v1/completions": _post("Text completion (OpenAI)", "CompletionRequest"),
        "/v1/chat/completions": _post("Chat completion (OpenAI)", "ChatCompletionRequest", reply="ChatCompletion"),
        "/v1/models": _get("The served model, once under each of its names (--served-model-name)", _errors("401")),
        "/tokenize": _post("Text or chat messages to token ids", "TokenizeRequest"),
        "/detokenize": _post("Token ids to text", "DetokenizeRequest"),
        "/tokenizer_info": _get("The tokenizer's special tokens and chat template", _errors("401")),
        "/version": _get("kvferry's version"),
        "/health": _get("200 with a live prefill and decode worker", {"503": {"description": ERROR_CODES["503"]}}),
        "/v1/workers": _get("Live workers and their stats", _errors("401")),
        "/metrics": {"get": {"summary": "Prometheus metrics", "responses": {"200": metrics}}},
        "/openapi.json": _get("This description"),
    }
    return {
        "openapi": "3.0.3",
        "info": {"title": "kvferry", "version": version},
        "paths": paths,
        "components": {"schemas": schemas, "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}}},
    }

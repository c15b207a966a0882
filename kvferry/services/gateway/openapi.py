"""GET /openapi.json: every route, its request schema and its error responses (OpenAPI 3.0)."""

from kvferry.common.sampling import MAX_LOGIT_BIAS, MAX_LOGPROBS, MAX_SEED, MAX_STOP_TOKEN_IDS, MAX_TOP_K

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
        "stream_options": {"type": "object", "nullable": True, "properties": {"include_usage": {"type": "boolean"}}},
        "user": {"type": "string", "nullable": True},
    }


def _errors() -> dict:
    return {
        code: {"description": what, "content": {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}}}
        for code, what in ERROR_CODES.items()
    }


def _post(summary: str, schema: str, errors: bool = True) -> dict:
    responses = {
        "200": {
            "description": "success (text/event-stream when stream is true)",
            "content": {"application/json": {"schema": {"type": "object"}}},
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
    sampling = _sampling(limits)
    message = {
        "type": "object",
        "required": ["role", "content"],
        "properties": {"role": {"type": "string"}, "content": {"type": "string"}},
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
            },
        },
        "TokenizeRequest": {
            "type": "object",
            "properties": {
                "model": {"type": "string", "nullable": True},
                "prompt": {"type": "string"},
                "messages": {"type": "array", "minItems": 1, "items": message},
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
        "/v1/chat/completions": _post("Chat completion (OpenAI)", "ChatCompletionRequest"),
        "/v1/models": _get("The served model", {"401": _errors()["401"]}),
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

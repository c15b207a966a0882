"""A request body as JSON, bounded before anything else looks at it: nested at most MAX_JSON_DEPTH deep, every integer
within 64 bits (what msgpack carries to the workers), every string Unicode text. Each failure is a 400 naming its
field, never a RecursionError, a ValueError or an OverflowError further in."""

import json
import sys

from kvferry.services.gateway.api_error import ApiError

MAX_JSON_DEPTH = 64  # far deeper than any OpenAI body goes; it bounds every walk over one, here and in the template
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1


def parse_json_body(raw: bytes) -> dict:
    """The body as a JSON object, bounded as above (JSON's \\u escapes allow a lone surrogate, which neither UTF-8 nor
    the tokenizer can take)."""
    nested = f"the body is nested more than {MAX_JSON_DEPTH} levels deep"
    try:
        body = json.loads(raw)
    except RecursionError:
        raise ApiError(400, nested) from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ApiError(400, f"the body is not valid JSON: {exc}") from None
    except ValueError:  # json's only other one: int() refuses an integer of more digits than this
        raise ApiError(400, f"the body holds an integer of more than {sys.get_int_max_str_digits()} digits") from None
    if not isinstance(body, dict):
        raise ApiError(400, "the body must be a JSON object")
    for name, value in body.items():
        if has_lone_surrogate(name):  # not echoed: the error could not be written as UTF-8 either
            raise ApiError(400, "a field name holds a lone surrogate (\\ud800-\\udfff without its pair): not text")
        _check_value(name, value, nested)
    return body


def parse_json_text(text: str, field: str):
    """A JSON value the body carries as a string (a schema sent as text), bounded as the body is: each failure a 400
    naming field."""
    nested = f"'{field}' is nested more than {MAX_JSON_DEPTH} levels deep"
    try:
        value = json.loads(text)
    except RecursionError:
        raise ApiError(400, nested, field) from None
    except ValueError as exc:
        raise ApiError(400, f"'{field}' is not valid JSON: {exc}", field) from None
    _check_value(field, value, nested, depth=1)
    return value


def has_lone_surrogate(text: str) -> bool:
    if text.isascii():
        return False
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


def _check_value(name: str, value, nested: str, depth: int = 2) -> None:
    """Walks the field `name`'s value (at that depth: a body's top-level field is 2, the body 1) without recursing,
    and raises an ApiError naming it at the first thing parse_json_body refuses."""
    pending = [(value, depth)]
    while pending:
        item, depth = pending.pop()
        if isinstance(item, str):
            if has_lone_surrogate(item):
                raise ApiError(
                    400, f"'{name}' holds a lone surrogate (\\ud800-\\udfff without its pair): not text", name
                )
        elif isinstance(item, int):
            if not INT64_MIN <= item <= INT64_MAX:
                raise ApiError(400, f"'{name}' holds an integer outside the signed 64-bit range", name)
        elif isinstance(item, (list, dict)):
            if depth > MAX_JSON_DEPTH:
                raise ApiError(400, nested, name)
            if isinstance(item, dict):
                pending.extend((key, depth) for key in item)
                pending.extend((child, depth + 1) for child in item.values())
            elif item and all(type(child) is int for child in item):  # token ids: checked at C speed
                if min(item) < INT64_MIN or max(item) > INT64_MAX:
                    raise ApiError(400, f"'{name}' holds an integer outside the signed 64-bit range", name)
            else:
                pending.extend((child, depth + 1) for child in item)

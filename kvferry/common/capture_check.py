"""What each field of a capture line may hold, checked before a reader trusts it.

A capture is read back by `kvferry replay`, `simulate` and `plan`, maybe long after and elsewhere, and a line may be
cut off, edited or crafted: a wrong type would surface as a traceback deep in a report, a negative or endless time
as a replay that sleeps for ever, a deeply nested body as a RecursionError. So every field is checked by type and
range, and a line that fails is named and skipped. Standard library only: the gateway imports the format.
"""

import math

MAX_BODY_DEPTH = 64  # the gateway refuses a body nested deeper (services/gateway/json_body.py), so none is captured


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_finite(value) -> bool:
    """A finite number, of any sign (an int too large for a float is not one)."""
    if not (_is_int(value) or isinstance(value, float)):
        return False
    try:
        return math.isfinite(value)
    except OverflowError:
        return False


def _is_time(value) -> bool:
    """A finite, non-negative number of seconds."""
    return _is_finite(value) and value >= 0


def _list_of(check):
    return lambda value: isinstance(value, list) and all(check(v) for v in value)


def _depth_within(value, limit: int) -> bool:
    """Whether value nests at most limit lists and objects deep; iterative, so any depth is safe to ask about."""
    pending = [(value, 1)]
    while pending:
        item, depth = pending.pop()
        if isinstance(item, dict | list):
            if depth > limit:
                return False
            pending.extend((v, depth + 1) for v in (item.values() if isinstance(item, dict) else item))
    return True


_ids = _list_of(_list_of(_is_int))
# Each field -> (its check, what it must be, for the message). A field may be absent where Record has a default.
FIELDS = {
    "request_id": (lambda v: isinstance(v, str), "a string"),
    "trace_id": (lambda v: isinstance(v, str), "a string"),
    "model": (lambda v: isinstance(v, str), "a string"),
    "arrival_unix": (_is_time, "a finite time in seconds, at least 0"),
    "arrival_monotonic": (_is_finite, "a finite number"),
    "endpoint": (lambda v: isinstance(v, str), "a string"),
    "status": (_is_int, "an integer"),
    "body": (lambda v: v is None or isinstance(v, dict), "an object or null"),
    "error": (lambda v: isinstance(v, str), "a string"),
    "prompt_token_ids": (_ids, "a list of lists of integers"),
    "output_token_ids": (_ids, "a list of lists of integers"),
    "output_text": (_list_of(lambda v: isinstance(v, str)), "a list of strings"),
    "finish_reasons": (_list_of(lambda v: v is None or isinstance(v, str)), "a list of strings or nulls"),
    "ttft_s": (lambda v: v is None or _is_time(v), "null or a finite time in seconds, at least 0"),
    "itl_s": (_list_of(_list_of(_is_time)), "a list of lists of finite times in seconds, at least 0"),
    "e2e_s": (_is_time, "a finite time in seconds, at least 0"),
    "routes": (_list_of(_list_of(lambda v: isinstance(v, dict))), "a list of lists of objects"),
    "moves": (lambda v: _is_int(v) and v >= 0, "an integer, at least 0"),
}
REQUIRED = ("request_id", "arrival_unix", "endpoint", "status", "trace_id", "model", "arrival_monotonic", "body")


def problem(raw: dict) -> str | None:
    """What is wrong with a line's fields, or None."""
    for name in REQUIRED:
        if name not in raw:
            return f"field {name!r} is missing"
    for name, (check, must_be) in FIELDS.items():
        if name in raw and not check(raw[name]):
            return f"field {name!r} is not {must_be}"
    if not _depth_within(raw["body"], MAX_BODY_DEPTH):
        return f"field 'body' is nested more than {MAX_BODY_DEPTH} levels deep"
    return None

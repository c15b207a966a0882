"""The checks a JSON Schema from a request passes at the gateway, each a 400 naming its field: JSON syntax (when it
comes as text), the size of its canonical text, its metaschema, and the engine's support for every keyword in it.

The canonical text is what the workers compile and cache by: compact, keys in the user's order (a schema's property
order is the order the output follows).
"""

import json

from jsonschema import Draft6Validator, Draft7Validator, Draft201909Validator, Draft202012Validator
from jsonschema.exceptions import SchemaError
from jsonschema.validators import validator_for

from kvferry.common.constraint import MAX_CONSTRAINT_BYTES
from kvferry.common.json_schema_support import UnsupportedSchema, check_supported
from kvferry.services.gateway import json_body
from kvferry.services.gateway.request_parsing import ApiError

MAX_MESSAGE_CHARS = 300  # of a metaschema error quoted back: it may quote the whole schema
# The drafts whose meaning the engine follows; draft 4 and older differ (boolean exclusiveMinimum, ...).
DRAFTS = (Draft202012Validator, Draft201909Validator, Draft7Validator, Draft6Validator)


def canonical(value, field: str) -> str:
    """value as the compact JSON text a Constraint carries, within MAX_CONSTRAINT_BYTES."""
    try:
        text = json.dumps(value, separators=(",", ":"), ensure_ascii=False, allow_nan=False)
    except ValueError:
        raise ApiError(400, f"'{field}' holds a number that is not finite (NaN or Infinity)", field) from None
    check_size(text, field)
    return text


def check_size(text: str, field: str) -> int:
    """text's UTF-8 size, within MAX_CONSTRAINT_BYTES."""
    try:
        size = len(text.encode("utf-8"))
    except UnicodeEncodeError:
        raise ApiError(
            400, f"'{field}' holds a lone surrogate (\\ud800-\\udfff without its pair): not text", field
        ) from None
    if size > MAX_CONSTRAINT_BYTES:
        raise ApiError(400, f"'{field}' is {size} bytes long; at most {MAX_CONSTRAINT_BYTES} bytes", field)
    return size


def parse_json_text(text: str, field: str):
    """A JSON value sent as a string (vLLM's structured_outputs.json may be either)."""
    check_size(text, field)
    return json_body.parse_json_text(text, field)


def checked_schema(schema, field: str) -> str:
    """The canonical text of a JSON Schema that the engine enforces in full, or a 400 that says why not."""
    if isinstance(schema, str):
        schema = parse_json_text(schema, field)
    if not isinstance(schema, dict):
        raise ApiError(400, f"'{field}' must be a JSON Schema object ({{}} for any JSON value)", field)
    text = canonical(schema, field)  # before the walks: the size bounds them
    draft = Draft202012Validator
    if "$schema" in schema:
        draft = validator_for(schema, default=None) if isinstance(schema["$schema"], str) else None
        if draft not in DRAFTS:
            raise ApiError(
                400, f"{field}.$schema: only JSON Schema drafts 2020-12, 2019-09, 7 and 6 are supported", field
            )
    try:
        draft.check_schema(schema)
    except SchemaError as exc:
        where = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in exc.absolute_path)
        message = exc.message if len(exc.message) <= MAX_MESSAGE_CHARS else exc.message[:MAX_MESSAGE_CHARS] + "..."
        raise ApiError(400, f"{field}{where}: not a valid JSON Schema: {message}", field) from None
    try:
        check_supported(schema, field)
    except UnsupportedSchema as exc:
        raise ApiError(400, str(exc), field) from None
    return text

"""The checks a JSON Schema from a request passes, each a 400 naming its field: JSON syntax (sent as text), the size
of its canonical text (compact, keys in the user's order, which the output follows: what workers compile and cache
by), its metaschema, and the engine's support for every keyword in it.

Each check's work is bounded by its input's size (common/work_budget.py). The metaschema check gets only inputs where
it stays linear: a first pass refuses the rest (jsonschema compares a `type` list's items pairwise, and Python's re
recurses on each group of a `pattern`).
"""

import json

from jsonschema import Draft6Validator, Draft7Validator, Draft201909Validator, Draft202012Validator
from jsonschema.exceptions import SchemaError
from jsonschema.validators import validator_for

from kvferry.common.constraint import MAX_CONSTRAINT_BYTES
from kvferry.common.json_schema_support import MAX_PATTERN_DEPTH, UnsupportedSchema, check_supported, pattern_depth
from kvferry.common.work_budget import WorkBudget, WorkBudgetExceeded
from kvferry.services.gateway import json_body
from kvferry.services.gateway.api_error import ApiError

MAX_MESSAGE_CHARS = 300  # of a metaschema error quoted back: it may quote the whole schema
# The drafts whose meaning the engine follows; draft 4 and older differ (boolean exclusiveMinimum, ...).
DRAFTS = (Draft202012Validator, Draft201909Validator, Draft7Validator, Draft6Validator)
NUM_JSON_TYPES = 7  # a `type` list names each of them at most once
STRING_LISTS = ("required",)  # lists the metaschema holds unique: jsonschema sorts strings, compares others pairwise
STRING_LIST_MAPS = ("dependentRequired", "dependencies")  # name -> such a list
# Where a schema holds schemas, in every draft the metaschema check follows: what the first pass walks (not values,
# such as enum, const, default or examples, nor property names).
SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas", "dependencies")
SCHEMA_LISTS = ("prefixItems", "allOf", "anyOf", "oneOf", "items")  # items: a list in drafts 6 and 7
SCHEMA_VALUES = (
    "additionalProperties",
    "items",
    "additionalItems",
    "propertyNames",
    "contains",
    "not",
    "if",
    "then",
    "else",
    "unevaluatedItems",
    "unevaluatedProperties",
    "contentSchema",
)


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


def checked_schema(schema, field: str) -> str:
    """The canonical text of a JSON Schema that the engine enforces in full, or a 400 that says why not."""
    if isinstance(schema, str):  # vLLM's structured_outputs.json may be a schema's text
        check_size(schema, field)
        schema = json_body.parse_json_text(schema, field)
    if not isinstance(schema, dict):
        raise ApiError(400, f"'{field}' must be a JSON Schema object ({{}} for any JSON value)", field)
    text = canonical(schema, field)  # before the walks: the size bounds them
    budget = WorkBudget(len(text))
    _before_metaschema(schema, field, budget)
    draft = Draft202012Validator
    if "$schema" in schema:
        draft = validator_for(schema, default=None) if isinstance(schema["$schema"], str) else None
        if draft not in DRAFTS:
            raise ApiError(
                400, f"{field}.$schema: only JSON Schema drafts 2020-12, 2019-09, 7 and 6 are supported", field
            )
    try:
        draft.check_schema(schema)
    except RecursionError:  # the first pass bounds what recurses; this keeps any other case a 400, not a 500
        raise ApiError(400, f"'{field}' nests too deeply to check", field) from None
    except SchemaError as exc:
        where = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in exc.absolute_path)
        message = exc.message if len(exc.message) <= MAX_MESSAGE_CHARS else exc.message[:MAX_MESSAGE_CHARS] + "..."
        raise ApiError(400, f"{field}{where}: not a valid JSON Schema: {message}", field) from None
    try:
        check_supported(schema, field, budget)
    except UnsupportedSchema as exc:
        raise ApiError(400, str(exc), field) from None
    return text


def _before_metaschema(schema, field: str, budget: WorkBudget) -> None:
    """Refuse what would make the metaschema check more than linear, or recurse past Python's limit, in every schema
    it would reach: a `type` list longer than the JSON types or not all names, `required` names that are not all
    strings, a `pattern` (or patternProperties name) nested deeper than MAX_PATTERN_DEPTH."""
    pending = [(schema, field)]
    try:
        while pending:
            node, path = pending.pop()
            budget.spend()
            if not isinstance(node, dict):
                continue
            _metaschema_hazards(node, path, field)
            for name in SCHEMA_MAPS:
                if isinstance(node.get(name), dict):
                    pending.extend((child, f"{path}.{name}.{key}") for key, child in node[name].items())
            for name in SCHEMA_LISTS:
                if isinstance(node.get(name), list):
                    pending.extend((child, f"{path}.{name}[{i}]") for i, child in enumerate(node[name]))
            pending.extend((node[name], f"{path}.{name}") for name in SCHEMA_VALUES if name in node)
    except WorkBudgetExceeded as exc:
        raise ApiError(400, f"'{field}' takes {exc} to check", field) from None


def _metaschema_hazards(node: dict, path: str, field: str) -> None:
    kind = node.get("type")
    if isinstance(kind, list) and (len(kind) > NUM_JSON_TYPES or not all(isinstance(k, str) for k in kind)):
        raise ApiError(400, f"{path}.type: a list of at most {NUM_JSON_TYPES} JSON type names", field)
    lists = [(name, node[name]) for name in STRING_LISTS if name in node]
    for name in STRING_LIST_MAPS:
        if isinstance(node.get(name), dict):
            lists.extend((f"{name}.{key}", value) for key, value in node[name].items())
    for name, value in lists:
        if isinstance(value, list) and not all(isinstance(item, str) for item in value):
            raise ApiError(400, f"{path}.{name}: a list of property names (strings)", field)
    patterns = [("pattern", node["pattern"])] if isinstance(node.get("pattern"), str) else []
    if isinstance(node.get("patternProperties"), dict):
        patterns.extend(("patternProperties", name) for name in node["patternProperties"])
    for name, pattern in patterns:
        if pattern_depth(pattern) > MAX_PATTERN_DEPTH:
            raise ApiError(
                400, f"{path}.{name}: a regular expression with groups nested more than {MAX_PATTERN_DEPTH} deep", field
            )

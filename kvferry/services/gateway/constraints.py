"""A request's one output constraint, from whichever field asks for it (at most one may): OpenAI's response_format,
vLLM's structured_outputs or older guided_*, or chat's tools. A Constraint names its field, so that a worker's compile
error names it too.
"""

from kvferry.common.constraint import CHOICE, GRAMMAR, JSON, REGEX, Constraint
from kvferry.common.json_schema_support import MAX_ENUM_VALUES, MAX_VALUE_CHARS
from kvferry.services.gateway.api_error import ApiError
from kvferry.services.gateway.schema_checks import canonical, check_size, checked_schema
from kvferry.services.gateway.tools import Tools, check_keys, check_named, tool_constraint

ANY_OBJECT = '{"type":"object"}'
STRUCTURED_KINDS = {"json": JSON, "regex": REGEX, "choice": CHOICE, "grammar": GRAMMAR}
GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}
JSON_SCHEMA_KEYS = {"name", "schema", "strict", "description"}
FIELDS = ("response_format", "structured_outputs", *GUIDED)  # the fields besides tools that constrain the output


def request_constraint(body: dict, tools: Tools | None = None) -> Constraint | None:
    """The constraint every choice of the request is generated under, or None."""
    asking = [name for name in FIELDS if _asks(name, body.get(name))]
    if tools is not None and tools.calls_allowed and asking:
        raise ApiError(400, f"'{asking[0]}' cannot be combined with tools unless tool_choice is \"none\"", asking[0])
    if len(asking) > 1:
        raise ApiError(400, f"only one of {', '.join(asking)} may constrain the output", asking[1])
    if tools is not None and tools.calls_allowed:
        return tool_constraint(tools)
    if not asking:
        return None
    name = asking[0]
    if name == "response_format":
        return _response_format(body[name])
    if name == "structured_outputs":
        return _structured_outputs(body[name])
    return structured(GUIDED[name], body[name], name)


def structured(kind: str, value, name: str) -> Constraint:
    """One of vLLM's forms: json (a schema, or its text), regex, choice (strings) or grammar (EBNF)."""
    if kind == "json":
        return Constraint(JSON, checked_schema(value, name), name)
    if kind == "choice":
        if not isinstance(value, list) or not value or not all(isinstance(v, str) for v in value):
            raise ApiError(400, f"'{name}' must be a non-empty list of strings", name)
        # The bounds of an enum's values: each is an alternative the engine precomputes masks for.
        if len(value) > MAX_ENUM_VALUES:
            raise ApiError(400, f"'{name}' has {len(value)} choices; at most {MAX_ENUM_VALUES}", name)
        num_chars = sum(map(len, value))
        if num_chars > MAX_VALUE_CHARS:
            raise ApiError(400, f"'{name}' holds {num_chars} characters in all; at most {MAX_VALUE_CHARS}", name)
        return Constraint(CHOICE, canonical(value, name), name)
    if not isinstance(value, str) or not value:
        raise ApiError(400, f"'{name}' must be a non-empty string", name)
    check_size(value, name)
    return Constraint(STRUCTURED_KINDS[kind], value, name)


def _asks(name: str, value) -> bool:
    if value is None:
        return False
    if name == "response_format":
        return not (isinstance(value, dict) and value.get("type") == "text" and len(value) == 1)
    return True


def _response_format(value) -> Constraint:
    types = ("text", "json_object", "json_schema")
    if not isinstance(value, dict) or value.get("type") not in types:
        raise ApiError(
            400,
            "'response_format' must be an object whose 'type' is text, json_object or json_schema",
            "response_format",
        )
    check_keys(value, {"type", "json_schema"} if value["type"] == "json_schema" else {"type"}, "response_format")
    if value["type"] == "json_object":
        return Constraint(JSON, ANY_OBJECT, "response_format")
    spec = value.get("json_schema")
    where = "response_format.json_schema"
    if not isinstance(spec, dict):
        raise ApiError(400, f"'{where}' must be an object with 'name' and 'schema'", where)
    check_keys(spec, JSON_SCHEMA_KEYS, where)
    check_named(spec, where)
    if not isinstance(spec.get("schema"), dict):
        raise ApiError(400, f"'{where}.schema' must be a JSON Schema object", f"{where}.schema")
    return Constraint(JSON, checked_schema(spec["schema"], f"{where}.schema"), f"{where}.schema")


def _structured_outputs(value) -> Constraint:
    name = "structured_outputs"
    if not isinstance(value, dict):
        raise ApiError(400, f"'{name}' must be an object with one of json, regex, choice or grammar", name)
    given = {k: v for k, v in value.items() if v is not None and not (k == "json_object" and v is False)}
    unknown = sorted(set(given) - set(STRUCTURED_KINDS) - {"json_object"})
    if unknown:
        raise ApiError(
            400,
            f"'{name}.{unknown[0]}' is not supported (json, regex, choice, grammar, json_object)",
            f"{name}.{unknown[0]}",
        )
    if len(given) != 1:
        raise ApiError(400, f"'{name}' must hold exactly one of json, regex, choice, grammar and json_object", name)
    ((kind, spec),) = given.items()
    if kind == "json_object":
        if spec is not True:
            raise ApiError(400, f"'{name}.json_object' must be a boolean", f"{name}.json_object")
        return Constraint(JSON, ANY_OBJECT, f"{name}.json_object")
    return structured(kind, spec, f"{name}.{kind}")

"""Chat's tools, tool_choice and parallel_tool_calls: checked, and turned into the structural tag that constrains
the output to calls in kvferry's one format, `<tool_call>\n{"name": NAME, "arguments": ARGS}\n</tool_call>`, ARGS
following the function's parameter schema. "auto" lets the model write text and constrains a call once it writes
`<tool_call>`; "required" allows only calls (at least one); a named function allows that one. Without
parallel_tool_calls the output ends after the first call.

The checks run cheapest first (every tool's shape, the parameter schemas' size together, then each schema's walks),
so that a large body of many tools is refused at once.
"""

import re
from dataclasses import dataclass

from kvferry.common.constraint import MAX_CONSTRAINT_BYTES, STRUCTURAL_TAG, Constraint
from kvferry.services.gateway.api_error import ApiError
from kvferry.services.gateway.schema_checks import canonical, check_size, checked_schema

MAX_TOOLS = 128
NAME = re.compile(r"[a-zA-Z0-9_-]{1,64}")  # OpenAI's rule for function and schema names
CALL_BEGIN, CALL_END = "<tool_call>", "</tool_call>"
FUNCTION_KEYS = {"name", "description", "parameters", "strict"}
NO_PARAMETERS = {"type": "object", "properties": {}}
# A root led by one of these may let the arguments be something other than an object: such a call never reads back.
ROOT_LEADERS = ("enum", "const", "anyOf", "oneOf", "$ref")


@dataclass(frozen=True)
class Tools:
    definitions: list[dict]  # the tools as the client sent them: what a chat template or the tool prompt shows
    parameters: dict[str, dict]  # function name -> its parameter schema, as checked
    choice: str  # "none", "auto", "required" or "named"
    named: str | None = None  # the function tool_choice names
    parallel: bool = True

    @property
    def calls_allowed(self) -> bool:
        return self.choice != "none"

    @property
    def tool_choice(self):
        """tool_choice as the client wrote it (the tool prompt template reads it)."""
        return {"type": "function", "function": {"name": self.named}} if self.named else self.choice


def parse_tools(body: dict) -> Tools | None:
    """A chat request's tools; None when it has none (and tool_choice, if given, is "none")."""
    tools = body.get("tools")  # checked here: no Schema has read the body yet
    if tools is not None and not isinstance(tools, list):
        raise ApiError(400, "'tools' must be list", "tools")
    tools = tools or []
    if len(tools) > MAX_TOOLS:
        raise ApiError(400, f"at most {MAX_TOOLS} tools per request", "tools")
    parameters = {}
    for i, tool in enumerate(tools):
        name, schema = _function(tool, f"tools[{i}]")
        if name in parameters:
            raise ApiError(400, f"two tools are named {name!r}", f"tools[{i}].function.name")
        parameters[name] = schema
    _check_size_together(list(parameters.values()))
    for i, schema in enumerate(parameters.values()):
        checked_schema(schema, _parameters_field(i))
    parallel = body.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise ApiError(400, "'parallel_tool_calls' must be bool", "parallel_tool_calls")
    choice, named = _tool_choice(body.get("tool_choice"), parameters)
    if not tools:
        return None
    return Tools(tools, parameters, choice, named, parallel is not False)


def tool_constraint(tools: Tools) -> Constraint | None:
    """The structural tag the output follows (None for tool_choice "none"). Compact JSON, as every spec."""
    if not tools.calls_allowed:
        return None
    tags = {name: _tag(name, schema) for name, schema in tools.parameters.items()}
    required, every = tools.choice == "required", list(tags.values())
    ends = {"at_least_one": required, "stop_after_first": not tools.parallel}
    if tools.named is not None:
        form, name = tags[tools.named], "tool_choice"
    elif required:  # only calls, separated by newlines
        form, name = {"type": "tags_with_separator", "tags": every, "separator": "\n", **ends}, "tool_choice"
    else:  # text, until the model writes <tool_call>
        form, name = {"type": "triggered_tags", "triggers": [CALL_BEGIN], "tags": every, **ends}, "tools"
    return Constraint(STRUCTURAL_TAG, canonical({"type": "structural_tag", "format": form}, name), name)


def _tag(name: str, schema: dict) -> dict:
    # The begin fixes the text up to the arguments, so the stream parser knows the name before they come; one
    # whitespace at most between the arguments' tokens bounds how long a bounded schema's call can be.
    return {
        "type": "tag",
        "begin": f'{CALL_BEGIN}\n{{"name": "{name}", "arguments": ',
        "content": {"type": "json_schema", "json_schema": schema, "max_whitespace_cnt": 1},
        "end": f"}}\n{CALL_END}",
    }


def _check_size_together(schemas: list[dict]) -> None:
    """The structural tag holds every parameter schema, so together they fit the constraint's limit. Counted until
    they pass it, so that a body of many large tools costs no more than one."""
    total = 0
    for i, schema in enumerate(schemas):
        total += check_size(canonical(schema, _parameters_field(i)), _parameters_field(i))
        if total > MAX_CONSTRAINT_BYTES:
            raise ApiError(
                400,
                f"'tools' holds parameter schemas of more than {MAX_CONSTRAINT_BYTES} bytes together (as compact JSON, "
                f"up to tools[{i}]); at most {MAX_CONSTRAINT_BYTES} bytes, as they all go into one constraint",
                "tools",
            )


def _parameters_field(i: int) -> str:
    return f"tools[{i}].function.parameters"


def _function(tool, where: str) -> tuple[str, dict]:
    if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(tool.get("function"), dict):
        raise ApiError(400, f'\'{where}\' must be {{"type": "function", "function": {{...}}}}', where)
    check_keys(tool, {"type", "function"}, where)
    function, where = tool["function"], f"{where}.function"
    check_keys(function, FUNCTION_KEYS, where)
    name = check_named(function, where)
    schema = function.get("parameters")
    if schema is None:
        return name, dict(NO_PARAMETERS)
    path = f"{where}.parameters"
    if not isinstance(schema, dict):
        raise ApiError(400, f"'{path}' must be a JSON Schema object", path)
    if "type" not in schema:
        schema = {"type": "object", **schema}
    leader = next((key for key in ROOT_LEADERS if key in schema), None)
    if schema["type"] != "object" or leader is not None:
        how = f"not by {leader!r}" if leader is not None else "and no other 'type'"
        raise ApiError(
            400,
            f"'{path}' must describe a JSON object by 'type': 'object' at its root, {how}: a call's arguments are one "
            "JSON object",
            path,
        )
    return name, schema


def check_keys(value: dict, allowed: set, where: str) -> None:
    extra = sorted(set(value) - allowed)
    if extra:
        raise ApiError(400, f"unknown field {extra[0]!r} in '{where}'", f"{where}.{extra[0]}")


def check_named(spec: dict, where: str) -> str:
    """The name of a function (or of a response_format's schema), and its optional description and strict, checked."""
    name = spec.get("name")
    if not isinstance(name, str) or not NAME.fullmatch(name):
        raise ApiError(400, f"'{where}.name' must be 1 to 64 of a-z, A-Z, 0-9, _ and -", f"{where}.name")
    for key, kind in (("description", str), ("strict", bool)):
        if spec.get(key) is not None and not isinstance(spec[key], kind):
            raise ApiError(400, f"'{where}.{key}' must be a {kind.__name__}", f"{where}.{key}")
    return name


def _tool_choice(choice, parameters: dict) -> tuple[str, str | None]:
    if choice is None:
        return ("auto" if parameters else "none"), None
    if choice in ("none", "auto", "required"):
        if choice != "none" and not parameters:
            raise ApiError(400, f"tool_choice {choice!r} needs 'tools'", "tool_choice")
        return choice, None
    named = choice.get("function") if isinstance(choice, dict) and choice.get("type") == "function" else None
    name = named.get("name") if isinstance(named, dict) else None
    if not isinstance(name, str):
        raise ApiError(
            400,
            '\'tool_choice\' must be "none", "auto", "required" or {"type": "function", "function": {"name": ...}}',
            "tool_choice",
        )
    if name not in parameters:
        raise ApiError(400, f"tool_choice names the function {name!r}, which is not in 'tools'", "tool_choice")
    return "named", name

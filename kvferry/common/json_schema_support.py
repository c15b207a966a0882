"""Which JSON Schemas the structured-output engine (xgrammar 0.2.9) enforces in full: a schema that asks for more is
refused with the JSON path of what it cannot do, never compiled with parts of it silently dropped.

docs/structured-output.md lists what is supported and what is refused, as measured by compiling schemas and matching
outputs that should pass and fail. Besides the keywords it ignores outright, the engine drops keywords in some
combinations (a keyword of one JSON type without a `type` naming it, the keywords beside `$ref`, `anyOf`/`oneOf` or
`enum`/`const`, ...), refused here too, and schemas whose compile would take seconds are refused for their size (the
limits below). Standard library only (the gateway and the tests share it); the schema has passed its metaschema.
"""

import json
import math
from urllib.parse import unquote

from kvferry.common.work_budget import WorkBudget, WorkBudgetExceeded

ANNOTATIONS = frozenset(
    {
        "title",
        "description",
        "default",
        "examples",
        "$schema",
        "$id",
        "$comment",
        "deprecated",
        "readOnly",
        "writeOnly",
        "discriminator",  # OpenAPI's (pydantic writes it): the oneOf it sits beside is checked for overlap instead
    }
)
CONTAINERS = frozenset({"$defs", "definitions"})  # schemas kept for $ref, walked like the rest
NUMBER_KEYWORDS = frozenset({"minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf"})
STRING_KEYWORDS = frozenset({"minLength", "maxLength", "pattern", "format"})
ARRAY_KEYWORDS = frozenset({"items", "prefixItems", "minItems", "maxItems"})
OBJECT_KEYWORDS = frozenset(
    {"properties", "required", "additionalProperties", "minProperties", "maxProperties", "propertyNames"}
)
COMBINATORS = frozenset({"anyOf", "oneOf"})
SUPPORTED = (
    frozenset({"type", "enum", "const", "$ref"})
    | NUMBER_KEYWORDS
    | STRING_KEYWORDS
    | ARRAY_KEYWORDS
    | OBJECT_KEYWORDS
    | COMBINATORS
)
FORMATS = frozenset(
    {
        "email",
        "date",
        "date-time",
        "time",
        "duration",
        "uuid",
        "ipv4",
        "ipv6",
        "uri",
        "uri-reference",
        "uri-template",
        "hostname",
        "json-pointer",
        "relative-json-pointer",
    }
)
KIND_OF = {
    **dict.fromkeys(NUMBER_KEYWORDS, "number"),
    **dict.fromkeys(STRING_KEYWORDS, "string"),
    **dict.fromkeys(ARRAY_KEYWORDS, "array"),
    **dict.fromkeys(OBJECT_KEYWORDS, "object"),
}
FALSE_ALLOWED = frozenset({"additionalProperties", "items"})  # where the engine takes the schema `false`
MAX_REF_HOPS = 32  # a $ref chain longer than this is taken as a loop when oneOf branches are compared
MAX_ONE_OF = 256  # branches of one oneOf: each pair is compared
MAX_ENUM_VALUES = 1024  # of one enum: each value is an alternative of the grammar, and a oneOf compares them all
# The compile time grows about quadratically with an object's optional properties (not in 'required'), little with
# required ones; within these it stays well under a second (docs/structured-output.md has the figures).
MAX_OPTIONAL_PROPERTIES = 128  # of one object
MAX_PROPERTIES = 2048  # of every object in the schema together, nested and in $defs too
# Each enum or const value is an alternative the engine precomputes token masks for, each character costing compiled
# grammar memory: their characters together bound it.
MAX_VALUE_CHARS = 32_768  # of every enum and const value in the schema, as JSON text
# The compile time grows faster than linearly with a chain of $refs (a $ref to a schema holding a $ref, and so on).
# Real schemas nest a few levels.
MAX_REF_DEPTH = 64
# Groups nested in a pattern: Python's re (the metaschema's regex check) recurses on each; real ones nest a few.
MAX_PATTERN_DEPTH = 64


class UnsupportedSchema(ValueError):
    """A schema the engine would not enforce in full. path: where, as dotted JSON path from the request field."""

    def __init__(self, path: str, why: str):
        super().__init__(f"{path}: {why}")
        self.path, self.why = path, why


def check_supported(schema, path: str, budget: WorkBudget | None = None) -> None:
    """Raise UnsupportedSchema at the first part of schema the structured-output engine does not enforce. path: the
    request field the schema came from (each error's path starts with it). budget: the steps the walk may take
    (default: in proportion to the schema's compact JSON); past them the schema is refused as too costly to check.
    Raises WorkCancelled when the budget's request is no longer wanted."""
    if not isinstance(schema, dict):
        raise UnsupportedSchema(path, "a schema must be a JSON object ({} for any JSON value)")
    if budget is None:
        budget = WorkBudget(len(json.dumps(schema, separators=(",", ":"))))
    try:
        walk = _Walk(schema, budget)
        walk.node(schema, path, None)
        walk.ref_chain("#", path, set())
    except WorkBudgetExceeded as exc:
        raise UnsupportedSchema(
            path,
            f"checking this schema takes {exc} (oneOf branches compared pairwise over shared properties, or $ref "
            "chains followed many times); simplify it, or use anyOf for branches that need not exclude each other",
        ) from None


def json_types(value) -> set[str]:
    """The JSON Schema types a value belongs to (an integral number is both integer and number)."""
    if value is None:
        return {"null"}
    if isinstance(value, bool):
        return {"boolean"}
    if isinstance(value, int):
        return {"integer", "number"}
    if isinstance(value, float):
        return {"integer", "number"} if value.is_integer() else {"number"}
    if isinstance(value, str):
        return {"string"}
    return {"array"} if isinstance(value, list) else {"object"}


def _types(schema: dict) -> set[str] | None:
    kind = schema.get("type")
    if isinstance(kind, str):
        return {kind}
    if isinstance(kind, list):
        return {k for k in kind if isinstance(k, str)}
    return None


def _covers(types: set[str], kind: str) -> bool:
    return kind in types or (kind == "number" and "integer" in types)


class _Walk:
    def __init__(self, root: dict, budget: WorkBudget):
        self.root, self.budget = root, budget
        self.num_properties = 0  # of the objects walked so far
        self.num_value_chars = 0  # of the enum and const values walked so far, as JSON text
        self.ref_depths: dict[str, int] = {}  # a $ref -> the longest chain of $refs from it (cycles end a chain)
        # id(schema) -> _facts(schema): ids stay unique, as every schema here lives in root for the walk
        self.value_facts: dict[int, tuple[frozenset[str], frozenset[str]]] = {}

    def node(self, schema, path: str, implied: str | None, key: str = "") -> None:
        """implied: the type a place gives its schema (propertyNames' is a string)."""
        if schema is True:
            return
        if schema is False:
            if key not in FALSE_ALLOWED:
                raise UnsupportedSchema(path, "the schema false is supported only as additionalProperties or items")
            return
        if not isinstance(schema, dict):
            raise UnsupportedSchema(path, "a schema must be a JSON object or a boolean")
        self.budget.spend(1 + len(schema))
        for name in schema:
            if name not in SUPPORTED and name not in ANNOTATIONS and name not in CONTAINERS:
                raise UnsupportedSchema(path, f"{name!r} is not supported by the structured-output engine")
        self._alone(schema, path)
        types = _types(schema) or ({implied} if implied else set())
        for name in schema:
            kind = KIND_OF.get(name)
            if kind is not None and not _covers(types, kind):
                raise UnsupportedSchema(
                    path, f"{name!r} needs a 'type' that includes {kind!r} (without it the engine ignores {name!r})"
                )
        self._values(schema, path, types)
        self._numbers(schema, path, types)
        self._strings(schema, path)
        self._objects(schema, path)
        if "$ref" in schema:
            self._target(schema["$ref"], path)
        self._children(schema, path)

    def _alone(self, schema: dict, path: str) -> None:
        """$ref, anyOf/oneOf and enum/const: the engine drops what stands beside them."""
        for leader, allowed in (("$ref", ()), ("anyOf", ()), ("oneOf", ()), ("enum", ("type",)), ("const", ("type",))):
            if leader not in schema:
                continue
            beside = [n for n in schema if n not in (leader, *allowed) and n not in ANNOTATIONS | CONTAINERS]
            if beside:
                raise UnsupportedSchema(
                    path, f"{beside[0]!r} beside {leader!r} is not supported (the engine ignores one of them)"
                )

    def _values(self, schema: dict, path: str, types: set[str]) -> None:
        values = list(schema["enum"]) if isinstance(schema.get("enum"), list) else []
        self.budget.spend(1 + len(values))
        if len(values) > MAX_ENUM_VALUES:
            raise UnsupportedSchema(
                path, f"an 'enum' of more than {MAX_ENUM_VALUES} values is not supported (this one has {len(values)})"
            )
        if "const" in schema:
            values.append(schema["const"])
        for value in values:
            self.num_value_chars += len(json.dumps(value, separators=(",", ":"), ensure_ascii=False))
            if self.num_value_chars > MAX_VALUE_CHARS:
                raise UnsupportedSchema(
                    path,
                    f"a schema whose enum and const values hold more than {MAX_VALUE_CHARS} characters together (as "
                    "JSON) is not supported: each character costs the engine memory in every worker",
                )
        if "type" not in schema:
            return
        for value in values:
            if not json_types(value) & types:
                raise UnsupportedSchema(path, f"the value {_short(value)} does not match 'type' {schema['type']!r}")

    def _numbers(self, schema: dict, path: str, types: set[str]) -> None:
        if "multipleOf" in schema:
            step = schema["multipleOf"]
            whole = isinstance(step, (int, float)) and math.isfinite(step) and float(step).is_integer()
            if "number" in types or not whole:
                raise UnsupportedSchema(
                    path, "'multipleOf' is supported only with 'type': 'integer' and a whole-number divisor"
                )
        if types & {"number", "integer"} == {"integer"}:
            for name in ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"):
                bound = schema.get(name)
                if isinstance(bound, float) and not bound.is_integer():
                    raise UnsupportedSchema(path, f"{name!r} of an integer must be a whole number")

    def _strings(self, schema: dict, path: str) -> None:
        shapes = [n for n in ("format", "pattern") if n in schema]
        if "minLength" in schema or "maxLength" in schema:
            shapes.append("minLength" if "minLength" in schema else "maxLength")
        if len(shapes) > 1:
            raise UnsupportedSchema(
                path, f"{shapes[0]!r} and {shapes[1]!r} together are not supported (the engine keeps only one)"
            )
        if isinstance(schema.get("pattern"), str) and pattern_depth(schema["pattern"]) > MAX_PATTERN_DEPTH:
            raise UnsupportedSchema(path, f"a 'pattern' with groups nested more than {MAX_PATTERN_DEPTH} deep")
        fmt = schema.get("format")
        if fmt is not None and fmt not in FORMATS:
            raise UnsupportedSchema(
                path, f"the format {_short(fmt)} is not supported; supported: {', '.join(sorted(FORMATS))}"
            )

    def _objects(self, schema: dict, path: str) -> None:
        listed = schema.get("properties") if isinstance(schema.get("properties"), dict) else {}
        required = _names(schema.get("required"))
        missing = next((name for name in required if name not in listed), None)
        if missing is not None:
            raise UnsupportedSchema(path, f"the required property {_short(missing)} is not in 'properties'")
        self.num_properties += len(listed)
        if self.num_properties > MAX_PROPERTIES:
            raise UnsupportedSchema(
                path,
                f"a schema with more than {MAX_PROPERTIES} properties in all (every object's, nested and in $defs) is "
                "not supported: the engine's compile time grows with them",
            )
        num_optional = len(listed.keys() - set(required))
        if num_optional > MAX_OPTIONAL_PROPERTIES:
            raise UnsupportedSchema(
                path,
                f"an object with more than {MAX_OPTIONAL_PROPERTIES} optional properties is not supported (this one has "
                f"{num_optional} not in 'required'): the engine's compile time grows fast with them; require more of "
                "them or nest them in objects",
            )

    def _children(self, schema: dict, path: str) -> None:
        for name in ("properties", *CONTAINERS):
            children = schema.get(name)
            if isinstance(children, dict):
                for key, child in children.items():
                    self.node(child, f"{path}.{name}.{key}", None)
        for name in ("additionalProperties", "items"):
            if name in schema:
                if isinstance(schema[name], list):
                    raise UnsupportedSchema(path, f"{name!r} as a list is not supported (use prefixItems)")
                self.node(schema[name], f"{path}.{name}", None, name)
        if "propertyNames" in schema:
            self.node(schema["propertyNames"], f"{path}.propertyNames", "string")
        for name in ("prefixItems", *COMBINATORS):
            branches = schema.get(name)
            if isinstance(branches, list):
                for i, child in enumerate(branches):
                    self.node(child, f"{path}.{name}[{i}]", None)
        if isinstance(schema.get("oneOf"), list):
            self._one_of(schema["oneOf"], path)

    # -- $ref ------------------------------------------------------------------------------------------------------
    def _target(self, ref, path: str):
        """What a $ref points at: only JSON pointers within the schema ('#', '#/...')."""
        if not isinstance(ref, str) or not (ref == "#" or ref.startswith("#/")):
            raise UnsupportedSchema(path, f"the $ref {_short(ref)} is not supported: only '#/...' within the schema")
        self.budget.spend(1 + len(ref) // 8)  # each part is unquoted and looked up
        node = self.root
        for part in ref[2:].split("/") if ref != "#" else ():
            part = unquote(part).replace("~1", "/").replace("~0", "~")
            if isinstance(node, dict) and part in node:
                node = node[part]
            elif isinstance(node, list) and 0 <= _index(part) < len(node):
                node = node[_index(part)]
            else:
                raise UnsupportedSchema(path, f"the $ref {_short(ref)} points at nothing in the schema")
        return node

    def ref_chain(self, ref: str, path: str, on_chain: set[str]) -> int:
        """The longest chain of $refs from ref (the links to a $ref already on the chain end it); UnsupportedSchema
        where the chain that led here (len(on_chain) links) and the longest from here pass MAX_REF_DEPTH together.
        Each target's $refs are gathered once: the work is linear in the schema."""
        if ref in on_chain:
            return 0
        longest = self.ref_depths.get(ref)
        if longest is None and len(on_chain) <= MAX_REF_DEPTH:  # past it, refused below without going deeper
            on_chain.add(ref)
            longest = max(
                (1 + self.ref_chain(inner, path, on_chain) for inner in self._refs_under(self._target(ref, path))),
                default=0,
            )
            on_chain.discard(ref)
            self.ref_depths[ref] = longest
        if len(on_chain) + (longest or 0) > MAX_REF_DEPTH:
            raise UnsupportedSchema(
                path,
                f"a chain of more than {MAX_REF_DEPTH} $refs (a $ref to a schema holding a $ref, and so on) is not "
                "supported: the engine's compile time grows fast with its length",
            )
        return longest

    def _refs_under(self, schema) -> list[str]:
        """The $refs in schema and the schemas inside it, but not in $defs (reached only by a $ref of their own)."""
        refs, pending = [], [schema]
        while pending:
            node = pending.pop()
            self.budget.spend()
            if not isinstance(node, dict):
                continue
            if isinstance(node.get("$ref"), str):
                refs.append(node["$ref"])
            if isinstance(node.get("properties"), dict):
                pending.extend(node["properties"].values())
            pending.extend(node[k] for k in ("additionalProperties", "items", "propertyNames") if k in node)
            for name in ("prefixItems", *COMBINATORS):
                if isinstance(node.get(name), list):
                    pending.extend(node[name])
        return refs

    def _resolved(self, schema, path: str):
        for _ in range(MAX_REF_HOPS):
            if not (isinstance(schema, dict) and "$ref" in schema):
                return schema
            schema = self._target(schema["$ref"], path)
        return True  # a loop of $refs: compared as anything

    # -- oneOf -----------------------------------------------------------------------------------------------------
    def _one_of(self, branches: list, path: str) -> None:
        if len(branches) > MAX_ONE_OF:
            raise UnsupportedSchema(path, f"a oneOf of more than {MAX_ONE_OF} branches is not supported (use anyOf)")
        for i in range(len(branches)):
            for j in range(i):
                self.budget.spend()
                if not self._disjoint(branches[j], branches[i], path, 3):
                    raise UnsupportedSchema(
                        f"{path}.oneOf[{i}]",
                        f"this branch may match what oneOf[{j}] matches; the engine generates oneOf as anyOf, so "
                        "use anyOf, or make the branches exclusive (different types, or a property with different "
                        "const values required in each)",
                    )

    def _disjoint(self, a, b, path: str, depth: int) -> bool:
        """Whether no JSON value can match both schemas (False when unsure)."""
        self.budget.spend()
        a, b = self._resolved(a, path), self._resolved(b, path)
        if a is False or b is False:
            return True
        if not (isinstance(a, dict) and isinstance(b, dict)) or depth == 0:
            return False
        fa, fb = self._facts(a), self._facts(b)
        ta, tb = _types(a), _types(b)
        if fa is not None and fb is not None:
            self.budget.spend(min(len(fa[0]), len(fb[0])))  # a set's isdisjoint walks the smaller
            return fa[0].isdisjoint(fb[0])
        for facts, types in ((fa, tb), (fb, ta)):
            if facts is not None and types is not None:
                return facts[1].isdisjoint(_widened(types))
        if ta is not None and tb is not None and not _widened(ta) & _widened(tb):
            return True
        return self._told_apart(a, b, path, depth)

    def _told_apart(self, a: dict, b: dict, path: str, depth: int) -> bool:
        """Two object schemas that each require a property whose schemas cannot match the same value."""
        pa, pb = a.get("properties"), b.get("properties")
        if not (isinstance(pa, dict) and isinstance(pb, dict)):
            return False
        self.budget.spend(_num_names(a.get("required")) + _num_names(b.get("required")))
        in_b = set(_names(b.get("required")))
        required = [k for k in _names(a.get("required")) if k in in_b]
        return any(k in pa and k in pb and self._disjoint(pa[k], pb[k], path, depth - 1) for k in required)

    def _facts(self, schema: dict) -> tuple[frozenset[str], frozenset[str]] | None:
        """An enum's or a const's values, each as _value_key, and the JSON types among them; None for other schemas.
        Kept per schema: a oneOf compares each branch with every other, and sets make each comparison linear."""
        if "const" in schema:
            values = [schema["const"]]
        elif isinstance(schema.get("enum"), list):
            values = schema["enum"]
        else:
            return None
        facts = self.value_facts.get(id(schema))
        if facts is None:
            self.budget.spend(len(values))
            kinds = frozenset(kind for value in values for kind in json_types(value))
            facts = self.value_facts[id(schema)] = (frozenset(map(_value_key, values)), kinds)
        return facts


def _value_key(value) -> str:
    """One text per JSON Schema value: equal values (1 and 1.0, objects whose keys come in another order) get the
    same text, and the text tells the types apart (true is not 1, as Python's == would have it)."""
    return json.dumps(_integral(value), sort_keys=True)


def _integral(value):
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, list):
        return [_integral(item) for item in value]
    if isinstance(value, dict):
        return {key: _integral(item) for key, item in value.items()}
    return value


def pattern_depth(pattern: str) -> int:
    """How deep a regular expression's groups nest (escapes and character classes skipped)."""
    depth = deepest = 0
    escaped = in_class = False
    for char in pattern:
        if escaped:
            escaped = False
        elif char == "\\":
            escaped = True
        elif in_class:
            in_class = char != "]"
        elif char == "[":
            in_class = True
        elif char == "(":
            depth += 1
            deepest = max(deepest, depth)
        elif char == ")":
            depth = max(depth - 1, 0)
    return deepest


def _index(part: str) -> int:
    """A $ref part as a list index: ASCII digits only (str.isdigit takes '²', which int() refuses), and no more of
    them than an index of a list within MAX_CONSTRAINT_BYTES can have (int() refuses thousands); -1 otherwise."""
    return int(part) if part.isascii() and part.isdigit() and len(part) <= 6 else -1


def _num_names(required) -> int:
    return len(required) if isinstance(required, list) else 0


def _names(required) -> list[str]:
    return [k for k in required if isinstance(k, str)] if isinstance(required, list) else []


def _widened(types: set[str]) -> set[str]:
    return types | {"integer"} if "number" in types else types


def _short(value, most: int = 80) -> str:
    text = json.dumps(value, ensure_ascii=False) if not isinstance(value, str) else repr(value)
    return text if len(text) <= most else text[: most - 3] + "..."

"""A property of the gateway's schema bounds, on random JSON Schemas drawn from the keywords the engine supports, with
sizes up to the gateway's limits: every check finishes within its work budget (counted in steps), and every schema
the gateway accepts compiles on a worker's compile path (real xgrammar, the default model's tokenizer, the child
process a timeout kills) within the compile timeout.

The schemas are seeded: a failure names its seed, and `draw(random.Random(seed))` makes it again.
"""

import json
import random

import pytest
from jsonschema import Draft202012Validator

from kvferry.common import settings
from kvferry.common.constraint import JSON, MAX_CONSTRAINT_BYTES, Constraint
from kvferry.common.errors import InvalidRequest
from kvferry.common.json_schema_support import (
    FORMATS,
    MAX_ENUM_VALUES,
    MAX_OPTIONAL_PROPERTIES,
    MAX_PROPERTIES,
    MAX_REF_DEPTH,
    MAX_VALUE_CHARS,
    UnsupportedSchema,
    check_supported,
)
from kvferry.common.structured.grammars import GrammarCache
from kvferry.common.work_budget import WorkBudget
from kvferry.services.gateway.api_error import ApiError
from kvferry.services.gateway.schema_checks import checked_schema

pytestmark = pytest.mark.slow  # seconds of work: `make check` leaves it to `make test`

NUM_RANDOM = 40
EOS = 2
COMPILE_TIMEOUT_S = float(settings.default("grammar_compile_timeout"))
FIELD = "response_format.json_schema.schema"


class Draw:
    """Random schemas of the supported keywords; defs: the $defs a $ref may point at (filled as drawn)."""

    def __init__(self, rng: random.Random, max_depth: int):
        self.rng, self.max_depth, self.defs = rng, max_depth, {}

    def schema(self, depth: int = 0) -> dict:
        kinds = ["string", "integer", "number", "boolean", "null", "enum", "const"]
        if depth < self.max_depth:
            kinds += ["object", "object", "array", "anyOf", "oneOf", "ref"]
        return getattr(self, "_" + self.rng.choice(kinds))(depth)

    def _string(self, depth):
        shape = self.rng.choice(["plain", "length", "pattern", "format"])
        if shape == "length":
            low = self.rng.randint(0, 20)
            return {"type": "string", "minLength": low, "maxLength": low + self.rng.randint(0, 200)}
        if shape == "pattern":
            return {"type": "string", "pattern": self.rng.choice(["^[a-z]+$", "[0-9]{3}-[0-9]{4}", "(ab|cd)*x?"])}
        if shape == "format":
            return {"type": "string", "format": self.rng.choice(sorted(FORMATS))}
        return {"type": "string"}

    def _integer(self, depth):
        low = self.rng.randint(-(10**6), 10**6)
        schema = {"type": "integer", "minimum": low, "maximum": low + self.rng.randint(0, 10**6)}
        if self.rng.random() < 0.3:
            schema["multipleOf"] = self.rng.randint(1, 9)
        return schema

    def _number(self, depth):
        return {"type": "number", "minimum": -self.rng.random() * 1e3, "maximum": self.rng.random() * 1e3}

    def _boolean(self, depth):
        return {"type": "boolean"}

    def _null(self, depth):
        return {"type": "null"}

    def _enum(self, depth):
        return {"enum": [self._value() for _ in range(self.rng.randint(1, 20))]}

    def _const(self, depth):
        return {"const": self._value()}

    def _value(self):
        return self.rng.choice([self.rng.randint(-99, 99), f"v{self.rng.randint(0, 10**6)}", True, None, 1.5])

    def _object(self, depth):
        names = [f"p{i}" for i in range(self.rng.randint(0, 8))]
        schema = {"type": "object", "properties": {n: self.schema(depth + 1) for n in names}}
        schema["required"] = [n for n in names if self.rng.random() < 0.6]
        schema["additionalProperties"] = self.rng.choice([False, True, {"type": "integer"}])
        return schema

    def _array(self, depth):
        low = self.rng.randint(0, 3)
        schema = {"type": "array", "items": self.schema(depth + 1), "minItems": low}
        if self.rng.random() < 0.5:
            schema["maxItems"] = low + self.rng.randint(0, 10)
        if self.rng.random() < 0.3:
            schema["prefixItems"] = [self.schema(depth + 1) for _ in range(self.rng.randint(1, 3))]
        return schema

    def _anyOf(self, depth):
        return {"anyOf": [self.schema(depth + 1) for _ in range(self.rng.randint(2, 4))]}

    def _oneOf(self, depth):
        """Branches told apart by a required const tag, with other properties of their own."""
        branches = []
        for i in range(self.rng.randint(2, 6)):
            props = {"kind": {"const": f"k{i}"}, "body": self.schema(depth + 1)}
            branches.append({"type": "object", "properties": props, "required": ["kind", "body"]})
        return {"oneOf": branches}

    def _ref(self, depth):
        name = f"d{len(self.defs)}"
        self.defs[name] = {}  # taken before it is drawn: it may point at itself
        self.defs[name] = self.schema(depth + 1)
        return {"$ref": f"#/$defs/{name}"}


def draw(rng: random.Random) -> dict:
    d = Draw(rng, max_depth=rng.randint(1, 5))
    root = d._object(0)
    if d.defs:
        root["$defs"] = d.defs
    return root


def at_the_limits() -> dict[str, dict]:
    """Schemas at each bound the gateway sets for the compile's sake, and one of each past it."""
    # MAX_REF_DEPTH $refs in a row: the root's, then one in each of the chain's schemas but the last
    last = MAX_REF_DEPTH - 1
    chain = {f"a{i}": {"anyOf": [{"$ref": f"#/$defs/a{i + 1}"}, {"type": "null"}]} for i in range(last)}
    chain[f"a{last}"] = {"type": "string"}
    value_len = MAX_VALUE_CHARS // MAX_ENUM_VALUES - 2  # as JSON, with its quotes: the values fill the bound exactly
    enum = [f"{i:04d}" + "x" * (value_len - 4) for i in range(MAX_ENUM_VALUES)]
    wide = {f"p{i}": {"type": "integer"} for i in range((MAX_PROPERTIES - MAX_OPTIONAL_PROPERTIES - 3) // 2)}
    optional = {f"q{i}": {"type": "string"} for i in range(MAX_OPTIONAL_PROPERTIES)}
    wide_object = {"type": "object", "properties": wide, "required": list(wide)}
    return {
        "ref chain": {"$defs": chain, "$ref": "#/$defs/a0"},
        "enum": {"type": "object", "properties": {"e": {"enum": enum}}, "required": ["e"]},
        "properties": {
            "type": "object",
            "properties": {"a": wide_object, "b": wide_object, "o": {"type": "object", "properties": optional}},
            "required": ["a", "b", "o"],
        },
        "oneOf": {"oneOf": [{"const": f"label-{i}"} for i in range(256)]},
        "nested": nested(60),
    }


def nested(levels: int) -> dict:
    schema = {"type": "string"}
    for _ in range(levels):
        schema = {"type": "object", "properties": {"x": schema, "y": {"type": "integer"}}, "required": ["x"]}
    return schema


def schemas() -> list[tuple[str, dict]]:
    drawn = [(f"seed {seed}", draw(random.Random(seed))) for seed in range(NUM_RANDOM)]
    return drawn + list(at_the_limits().items())


@pytest.fixture(scope="module")
def grammars():
    from transformers import AutoTokenizer

    from kvferry.common.model_files import resolve_model

    tokenizer = AutoTokenizer.from_pretrained(resolve_model(None))
    cache = GrammarCache(lambda: tokenizer, len(tokenizer), (EOS,), isolated=True)
    cache.compile(Constraint(JSON, '{"type":"string"}', FIELD))  # the one-time set-up, outside any timeout
    yield cache
    cache.close()


def test_every_check_finishes_within_its_budget_and_every_accepted_schema_compiles_in_time(grammars):
    num_accepted = 0
    for name, schema in schemas():
        text = json.dumps(schema, separators=(",", ":"))
        if len(text.encode()) > MAX_CONSTRAINT_BYTES:
            continue
        budget = WorkBudget(len(text))
        Draft202012Validator.check_schema(schema)  # drawn from the supported keywords: always valid
        try:
            check_supported(schema, FIELD, budget)
        except UnsupportedSchema as exc:
            assert "steps its size allows" not in exc.why, f"{name}: {exc}"
            continue  # a refusal for another reason (an overlap the walk cannot rule out, say) is the gateway's 400
        finally:
            assert budget.num_spent <= budget.num_steps, name
        checked_schema(schema, FIELD)  # the gateway's whole check agrees
        try:
            grammars.compile(Constraint(JSON, text, FIELD), timeout_s=COMPILE_TIMEOUT_S)
        except InvalidRequest as exc:  # a refusal by the engine is a 400 too; a timeout is not one of them
            assert "took longer" not in str(exc), f"{name}: {exc}"
        num_accepted += 1
    assert num_accepted >= NUM_RANDOM // 2  # the draw makes mostly acceptable schemas: the property is not vacuous


def test_one_past_each_compile_bound_is_refused_at_the_gateway():
    chain = at_the_limits()["ref chain"]
    chain["$defs"][f"a{MAX_REF_DEPTH - 1}"] = {"anyOf": [{"$ref": "#/$defs/extra"}, {"type": "null"}]}
    chain["$defs"]["extra"] = {"type": "string"}
    enum = at_the_limits()["enum"]
    enum["properties"]["e"]["enum"][0] += "x"
    for schema in (chain, enum):
        with pytest.raises(ApiError) as refused:
            checked_schema(schema, FIELD)
        assert refused.value.status == 400 and refused.value.param == FIELD

"""A request body's schema, declared once: each field a Param, from which come the unknown-field refusal, the type
and bound checks (a 400 whose param names the field) and the field's part of /openapi.json.

Not pydantic or msgspec: neither checks a list's length before its entries (a body of 400,000 stop_token_ids must cost
nothing), keeps the messages and `param`s clients read, or writes OpenAPI 3.0. A field these checks cannot say (a
logit_bias key) declares its own `read`, beside its `spec`.
"""

import math
from collections.abc import Callable
from dataclasses import dataclass

from kvferry.services.gateway.api_error import ApiError

BOOLEAN, INTEGER, NUMBER, STRING, OBJECT, ARRAY = "boolean", "integer", "number", "string", "object", "array"
# type: (the Python types of its JSON values, how an error names it)
TYPES = {
    BOOLEAN: ((bool,), "true or false"),
    INTEGER: ((int,), "an integer"),
    NUMBER: ((int, float), "a number"),
    STRING: ((str,), "a string"),
    OBJECT: ((dict,), "an object"),
    ARRAY: ((list,), "a list"),
}
MAX_SHOWN = 100  # characters of a client's field name that an error repeats


@dataclass(frozen=True)
class Param:
    """One field. type: one of TYPES, or "" for a field another module checks (then spec says what it is). lo/hi:
    inclusive bounds (above_lo: lo itself is not); check_hi=False leaves hi to parse_generations, after the context
    length (that error says more). only: the values that ask for nothing, of a field kvferry does not honour.
    read(name, value, vocab_size): a compound field's own check, returning its value. fields: a nested object's
    schema. spec: its OpenAPI schema where type and bounds do not say it all."""

    type: str = ""
    lo: float | None = None
    hi: float | None = None
    above_lo: bool = False
    check_hi: bool = True
    default: object = None
    doc: str = ""
    only: tuple = ()
    read: Callable | None = None
    fields: "Schema | None" = None
    spec: dict | None = None

    def what(self) -> str:
        """What a value must be, as an error says it: "an integer from 1 to 16", "a number in (0, 2]"."""
        noun = TYPES[self.type][1] if self.type else "valid"
        hi = self.hi if self.check_hi else None
        if self.above_lo:
            return f"{noun} in ({self.lo}, {hi if hi is not None else 'inf'}]"
        if self.lo is not None and hi is not None:
            return f"{noun} from {self.lo} to {hi}"
        if self.lo is not None:
            return f"{noun} of at least {self.lo}"
        if hi is not None:
            return f"{noun} of at most {hi}"
        return noun

    def value(self, name: str, value, vocab_size: int):
        """value checked (it is not None); the field's value, or an ApiError naming it."""
        types = TYPES[self.type][0] if self.type else None
        if types is not None and (not isinstance(value, types) or isinstance(value, bool) and self.type != BOOLEAN):
            raise ApiError(400, f"'{name}' must be {self.what()}", name)
        if isinstance(value, float) and not math.isfinite(value):
            raise ApiError(400, f"'{name}' must be a finite number", name)
        if self.type in (INTEGER, NUMBER) and not self._within(value):
            raise ApiError(400, f"'{name}' must be {self.what()}, got {value!r}", name)
        if self.fields is not None:
            return self.fields.read(value, vocab_size, prefix=f"{name}.")
        return self.read(name, value, vocab_size) if self.read is not None else value

    def _within(self, value) -> bool:
        lo, hi = self.lo, self.hi if self.check_hi else None
        above = lo is None or (value > lo if self.above_lo else value >= lo)
        return above and (hi is None or value <= hi)

    def openapi(self) -> dict:
        out: dict = {"type": self.type} if self.type else {}
        if self.fields is not None:
            out.update(self.fields.openapi())
        for key, bound in (("minimum", self.lo), ("maximum", self.hi)):
            if bound is not None:
                out[key] = bound
        if self.above_lo:
            out["exclusiveMinimum"] = True
        if self.only:
            out["enum"] = [v for v in self.only if v is not None]
        out.update(self.spec or {})
        out["nullable"] = True
        if self.doc:
            out["description"] = self.doc
        return out


@dataclass(frozen=True)
class Schema:
    """An object's fields. closed: a field not declared is refused (OpenAPI's additionalProperties: false).
    required: the fields OpenAPI lists as required (their own modules refuse a body without them)."""

    params: dict[str, Param]
    required: tuple[str, ...] = ()
    closed: bool = True

    def check_names(self, body: dict, prefix: str = "") -> None:
        """An unknown field, or one not honoured that asks for something, first: it may be what was meant to
        constrain the output."""
        for name, value in body.items():
            param = self.params.get(name)
            if param is None and self.closed:
                shown = name if len(name) <= MAX_SHOWN else name[:MAX_SHOWN] + "..."
                raise ApiError(400, f"unknown parameter '{prefix}{shown}'", prefix[:-1] or name)
            if param is not None and param.only and value is not None and value not in param.only:
                raise ApiError(400, f"'{prefix}{name}' is not supported", prefix + name)

    def read(self, body, vocab_size: int, prefix: str = "") -> dict:
        """Every declared field's value (its default where it is absent or null), each checked."""
        if not isinstance(body, dict):
            raise ApiError(400, f"'{prefix[:-1]}' must be an object", prefix[:-1] or None)
        self.check_names(body, prefix)
        out = {}
        for name, param in self.params.items():
            value = body.get(name)
            out[name] = param.default if value is None else param.value(prefix + name, value, vocab_size)
        return out

    def openapi(self) -> dict:
        out: dict = {"type": OBJECT}
        if self.required:
            out["required"] = list(self.required)
        if self.closed:
            out["additionalProperties"] = False
        out["properties"] = {name: param.openapi() for name, param in self.params.items()}
        for name in self.required:  # a required field is never null
            out["properties"][name].pop("nullable", None)
        return out

"""A structured-output constraint as it travels: what the output must match, as text, never a compiled object.

The gateway (which has no xgrammar, and checks JSON syntax and the JSON Schema metaschema) turns a request's
response_format, structured_outputs or tools into one Constraint; each worker compiles it (common/structured/),
cached by (kind, spec), so `spec` is canonical: compact JSON, keys in the user's order (a schema's property order is
the output's). Standard library only: the gateway imports this.
"""

from dataclasses import dataclass

from kvferry.common.errors import InvalidRequest

JSON, REGEX, CHOICE, GRAMMAR, STRUCTURAL_TAG = "json", "regex", "choice", "grammar", "structural_tag"
KINDS = (JSON, REGEX, CHOICE, GRAMMAR, STRUCTURAL_TAG)
MAX_CONSTRAINT_BYTES = 1 << 17  # a spec's UTF-8 size: a bound on compile work and on the messages that carry it
MAX_FIELD_CHARS = 200


@dataclass(frozen=True)
class Constraint:
    """kind json: spec is a JSON Schema (json_object is {"type":"object"}); regex: a regular expression; choice: a
    JSON array of the strings allowed; grammar: EBNF as xgrammar reads it (GBNF); structural_tag: xgrammar's
    structural tag JSON (tool calls). field: the request field it came from, which errors name."""

    kind: str
    spec: str
    field: str = ""

    def __post_init__(self):
        if self.kind not in KINDS:
            raise InvalidRequest(f"constraint kind must be one of {', '.join(KINDS)}, got {self.kind!r}")
        if not isinstance(self.spec, str) or len(self.spec.encode("utf-8", "surrogatepass")) > MAX_CONSTRAINT_BYTES:
            raise InvalidRequest(f"{self.field or 'the constraint'} is longer than {MAX_CONSTRAINT_BYTES} bytes")
        if not isinstance(self.field, str) or len(self.field) > MAX_FIELD_CHARS:
            raise InvalidRequest(f"a constraint's field name is at most {MAX_FIELD_CHARS} characters")

    @property
    def key(self) -> tuple[str, str]:
        """What the compiled grammar is cached by."""
        return self.kind, self.spec

"""One constraint through xgrammar's compiler: in a worker's compile process, or in process for the offline
engine (grammars.py). Standard library only until it is given a compiler."""

import json

from kvferry.common.constraint import CHOICE, GRAMMAR, JSON, REGEX, STRUCTURAL_TAG
from kvferry.common.errors import InvalidRequest


def compile_constraint(compiler, kind: str, spec: str):
    """xgrammar's compile of one constraint; InvalidRequest with xgrammar's reason when it refuses it."""
    try:
        if kind == JSON:
            return compiler.compile_json_schema(spec, any_whitespace=False, strict_mode=True)
        if kind == REGEX:
            return compiler.compile_regex(spec)
        if kind == CHOICE:
            return compiler.compile_grammar(choice_grammar(spec))
        if kind == GRAMMAR:
            return compiler.compile_grammar(spec)
        assert kind == STRUCTURAL_TAG, kind
        return compiler.compile_structural_tag(spec)
    except InvalidRequest:
        raise
    except Exception as exc:  # xgrammar raises RuntimeError (and a few others) for what it cannot compile
        raise InvalidRequest(_reason(exc)) from None


def choice_grammar(spec: str) -> str:
    """A JSON array of strings -> an EBNF grammar matching exactly one of them."""
    try:
        choices = json.loads(spec)
    except ValueError:
        choices = None
    if not isinstance(choices, list) or not choices or not all(isinstance(c, str) for c in choices):
        raise InvalidRequest("choice must be a non-empty list of strings")
    # A JSON string literal is an EBNF one too: the same escapes (\", \\, \n, \uXXXX).
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=True) for c in choices)


def _reason(exc: Exception) -> str:
    """xgrammar's message without its C++ source location: '[12:00:00] /project/cpp/x.cc:94: Regex ...'."""
    text = str(exc).strip()
    first, _, rest = text.partition(": ")
    return rest.strip() if rest and ".cc:" in first else text

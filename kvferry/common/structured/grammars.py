"""Compiled grammars for structured-output constraints, cached by their canonical text.

xgrammar compiles a constraint against the tokenizer's vocabulary into a grammar whose token masks are mostly
precomputed; a compile takes milliseconds to seconds, so a worker compiles each (kind, spec) once, on a thread off
its step loop (services/constraint_compiles.py), and keeps the result in a bounded LRU. xgrammar's compile lets go
of the GIL, so the loop keeps stepping meanwhile. xgrammar is imported on the first constraint: a worker that
never sees one does not pay its import.

Whitespace is constrained (JSON with fixed separators, and at most one whitespace character in a row inside a
structural tag's JSON), so a bounded schema always finishes within a bounded number of tokens.
"""

import json
import threading
import time
from collections import OrderedDict
from collections.abc import Callable

from kvferry.common.constraint import CHOICE, GRAMMAR, JSON, REGEX, STRUCTURAL_TAG, Constraint
from kvferry.common.errors import InvalidRequest

MAX_CACHED_GRAMMARS = 256  # compiled grammars kept: each holds its token masks, tens of KiB to a few MiB


class GrammarCache:
    def __init__(
        self,
        load_tokenizer: Callable[[], object],
        vocab_size: int,
        stop_token_ids: tuple[int, ...],
        capacity: int = MAX_CACHED_GRAMMARS,
    ):
        """load_tokenizer: transformers' tokenizer (None: the folder has none), called when the first constraint
        comes."""
        self._load_tokenizer, self._vocab_size, self._stop_token_ids = load_tokenizer, vocab_size, list(stop_token_ids)
        self._compiler = None
        self._compiled: OrderedDict[tuple[str, str], object] = OrderedDict()
        self._lock = threading.Lock()  # the compile thread stores, the step loop reads
        self.capacity = capacity
        self.num_compiles = 0
        self.num_cache_hits = 0
        self.compile_s = 0.0

    def cached(self, constraint: Constraint, count: bool = True):
        """The compiled grammar if it is in the cache (counted as a hit where a request asked), else None."""
        with self._lock:
            compiled = self._compiled.get(constraint.key)
            if compiled is not None:
                self._compiled.move_to_end(constraint.key)
                self.num_cache_hits += count
            return compiled

    def compile(self, constraint: Constraint):
        """The compiled grammar, from the cache or compiled now (blocking: call it off the step loop).
        InvalidRequest naming the constraint's field when xgrammar refuses it."""
        compiled = self.cached(constraint, count=False)
        if compiled is not None:
            return compiled
        started = time.perf_counter()
        compiled = self._compile(constraint)
        with self._lock:
            self.num_compiles += 1
            self.compile_s += time.perf_counter() - started
            self._compiled[constraint.key] = compiled
            while len(self._compiled) > self.capacity:
                self._compiled.popitem(last=False)
        return compiled

    def compiler(self):
        """xgrammar's compiler, built on the first call: the tokenizer's load, xgrammar's import and its pass over
        the vocabulary, a second or two once per process. The compile thread calls it before it starts a compile's
        clock: a constraint's timeout bounds its own compile, not this."""
        return self._compiler or self._make_compiler()

    def _compile(self, constraint: Constraint):
        compiler = self.compiler()
        kind, spec = constraint.kind, constraint.spec
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
        except InvalidRequest as exc:
            raise InvalidRequest(f"{constraint.field}: {exc}") from None
        except Exception as exc:  # xgrammar raises RuntimeError (and a few others) for what it cannot compile
            raise InvalidRequest(f"{constraint.field}: {_reason(exc)}") from None

    def _make_compiler(self):
        tokenizer = self._load_tokenizer()
        if tokenizer is None:
            raise InvalidRequest("this model folder has no tokenizer, which structured output needs")
        import xgrammar

        info = xgrammar.TokenizerInfo.from_huggingface(
            tokenizer, vocab_size=self._vocab_size, stop_token_ids=self._stop_token_ids
        )
        # One thread: the worker's step loop shares the machine; xgrammar's own cache is off, ours counts hits.
        self._compiler = xgrammar.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        return self._compiler


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

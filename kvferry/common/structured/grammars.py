"""Compiled grammars for structured-output constraints, cached by their canonical text.

A compile takes milliseconds to seconds, so a worker compiles each (kind, spec) once, on a thread off its step loop
(services/constraint_compiles.py), and keeps it in an LRU bounded by count and by the bytes the grammars hold (their
token masks: a large enum's can be tens of MiB, docs/structured-output.md). One larger than the whole bound is served
to the requests waiting for it, not kept. A worker first tries each new constraint in a child process that a timeout
can kill (compile_process.py), and compiles it itself once the trial finished in time; the offline engine compiles in
process. xgrammar is imported on the first constraint.

Whitespace is constrained (JSON with fixed separators, at most one whitespace character in a row inside a structural
tag's JSON), so a bounded schema always finishes within a bounded number of tokens.
"""

import threading
import time
from collections import OrderedDict
from collections.abc import Callable

from kvferry.common.constraint import Constraint
from kvferry.common.errors import InvalidRequest
from kvferry.common.structured.compile_process import CompileProcess, compile_constraint, give_back_memory
from kvferry.common.worker_config import WorkerConfig

MAX_CACHED_GRAMMARS = 256  # compiled grammars kept, however small
DEFAULT_CACHE_BYTES = WorkerConfig.grammar_cache_bytes  # what they may hold together
LARGE_GRAMMAR_BYTES = 1 << 20  # past this, the memory a compile freed is handed back to the system


class GrammarCache:
    def __init__(
        self,
        load_tokenizer: Callable[[], object],
        vocab_size: int,
        stop_token_ids: tuple[int, ...],
        capacity: int = MAX_CACHED_GRAMMARS,
        max_bytes: int = DEFAULT_CACHE_BYTES,
        isolated: bool = False,
    ):
        """load_tokenizer: transformers' tokenizer (None: the folder has none), called when the first constraint
        comes. isolated: trial-compile each new constraint in a child process first (a worker's)."""
        self._load_tokenizer, self._vocab_size, self._stop_token_ids = load_tokenizer, vocab_size, list(stop_token_ids)
        self._tokenizer_info = self._compiler = self._process = None
        self._compiled: OrderedDict[tuple[str, str], tuple[object, int]] = OrderedDict()  # -> (grammar, its bytes)
        self._lock = threading.Lock()  # the compile thread stores, the step loop reads
        self.capacity, self.max_bytes, self.isolated = capacity, max_bytes, isolated
        self.num_bytes = 0  # what the cached grammars hold, by xgrammar's count
        self.num_compiles = 0
        self.num_cache_hits = 0
        self.compile_s = 0.0

    def cached(self, constraint: Constraint, count: bool = True):
        """The compiled grammar if it is in the cache (counted as a hit where a request asked), else None."""
        with self._lock:
            entry = self._compiled.get(constraint.key)
            if entry is None:
                return None
            self._compiled.move_to_end(constraint.key)
            self.num_cache_hits += count
            return entry[0]

    def compile(self, constraint: Constraint, timeout_s: float | None = None, on_trial_passed=None):
        """The compiled grammar, from the cache or compiled now (blocking: call it off the step loop).
        InvalidRequest naming the constraint's field when xgrammar refuses it. isolated: CompileTimedOut when
        timeout_s passes first in the trial (the child that compiled it is killed), CompileProcessEnded when the child
        died, and on_trial_passed() called once the trial is done, before the compile here, which takes about as
        long again and is not bounded; in process, timeout_s is not enforced."""
        compiled = self.cached(constraint, count=False)
        if compiled is not None:
            return compiled
        started = time.perf_counter()
        compiled = self._compile(constraint, timeout_s, on_trial_passed)
        with self._lock:
            self.num_compiles += 1
            self.compile_s += time.perf_counter() - started
            self._store(constraint.key, compiled)
        return compiled

    def set_up(self) -> None:
        """Make ready to compile: the tokenizer's load, xgrammar's import and its pass over the vocabulary, a second
        or two once per process; isolated, also a fresh child process (once more after each kill). The compile
        thread calls it before it starts a compile's clock: a constraint's timeout bounds compiles, not this."""
        if self._tokenizer_info is None:
            self._tokenizer_info = self._make_tokenizer_info()
        # One thread: the worker's step loop shares the machine; xgrammar's own cache is off, ours counts hits.
        self._compiler = self._compiler or self._xgrammar().GrammarCompiler(
            self._tokenizer_info, max_threads=1, cache_enabled=False
        )
        if not self.isolated:
            return
        if self._process is None:
            self._process = CompileProcess(self._tokenizer_info.serialize_json())
        if not self._process.running:
            self._process.start()

    @property
    def compile_process_pid(self) -> int | None:
        """The latest compile child's process id; None in process or before the first compile."""
        return self._process.pid if self._process else None

    def kill_compile(self) -> None:
        """From any thread: a compile under way in the child ends (the worker is closing)."""
        if self._process is not None:
            self._process.kill()

    def close(self) -> None:
        """The child process ends (call it from the thread that compiles)."""
        if self._process is not None:
            self._process.close()

    def _store(self, key, compiled) -> None:
        """Newest last; the oldest go past either bound. One larger than the whole byte bound is not kept."""
        size = compiled.memory_size_bytes
        if size > self.max_bytes:
            return
        _, replaced = self._compiled.pop(key, (None, 0))  # the offline engine may compile one twice at once
        self.num_bytes -= replaced
        self._compiled[key] = (compiled, size)
        self.num_bytes += size
        while len(self._compiled) > self.capacity or self.num_bytes > self.max_bytes:
            _, (_, evicted) = self._compiled.popitem(last=False)
            self.num_bytes -= evicted

    def _compile(self, constraint: Constraint, timeout_s: float | None, on_trial_passed=None):
        self.set_up()
        try:
            if self.isolated:  # the trial a timeout can stop: what passes it compiles here in about the same time
                self._process.compile(constraint.kind, constraint.spec, timeout_s)
                if on_trial_passed is not None:
                    on_trial_passed()
            compiled = compile_constraint(self._compiler, constraint.kind, constraint.spec)
            if compiled.memory_size_bytes > LARGE_GRAMMAR_BYTES:
                give_back_memory()
            return compiled
        except InvalidRequest as exc:
            raise InvalidRequest(f"{constraint.field}: {exc}") from None

    def _make_tokenizer_info(self):
        tokenizer = self._load_tokenizer()
        if tokenizer is None:
            raise InvalidRequest("this model folder has no tokenizer, which structured output needs")
        return self._xgrammar().TokenizerInfo.from_huggingface(
            tokenizer, vocab_size=self._vocab_size, stop_token_ids=self._stop_token_ids
        )

    @staticmethod
    def _xgrammar():
        import xgrammar

        return xgrammar

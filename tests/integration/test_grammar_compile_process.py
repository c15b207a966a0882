"""A worker's compiles in their child process, with real xgrammar and the default model's tokenizer: a compile past
its timeout is killed (its core is free, the next constraint compiles after it), and distinct large constraints
one after another grow the worker's memory by at most the cache's byte bound."""

import json
import random
import string
import time

import pytest

from kvferry.common.constraint import Constraint
from kvferry.common.structured.grammars import GrammarCache
from kvferry.services.constraint_compiles import ConstraintCompiles

pytestmark = pytest.mark.slow  # seconds of work: `make check` leaves it to `make test`

EOS = 2
YES_NO = Constraint("choice", '["yes","no"]', "structured_outputs.choice")
REGEX = Constraint("regex", "[0-9]{3}", "structured_outputs.regex")
# 2000 optional properties in one object: xgrammar 0.2.9 compiles it in tens of seconds (docs/structured-output.md)
SLOW = Constraint(
    "json",
    json.dumps({"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(2000)}}),
    "response_format.json_schema.schema",
)


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    from kvferry.common.model_files import resolve_model

    return AutoTokenizer.from_pretrained(resolve_model(None))


def finished(compiles, until, count=1):
    deadline, done = time.monotonic() + until, []
    while time.monotonic() < deadline and len(done) < count:
        done += compiles.take_finished()
        time.sleep(0.01)
    return done


def compiled(compiles, owner, constraint, until=60.0):
    """One constraint through the compile path, as a worker's request waits for it."""
    grammar = compiles.ready(owner, constraint)
    if grammar is not None:
        return grammar
    [done] = finished(compiles, until)
    assert done.owner == owner and done.error == "", done.error
    return done.grammar


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().split(") ", 1)[1][0] != "Z"
    except FileNotFoundError:
        return False


def rss_bytes(pid: int | str = "self") -> int:
    with open(f"/proc/{pid}/status") as status:
        return next(int(line.split()[1]) * 1024 for line in status if line.startswith("VmRSS:"))


def test_a_compile_past_its_timeout_is_killed_and_the_constraint_behind_it_compiles(tokenizer):
    grammars = GrammarCache(lambda: tokenizer, len(tokenizer), (EOS,), isolated=True)
    compiles = ConstraintCompiles(grammars, timeout_s=2)
    try:
        compiled(compiles, "warm", YES_NO)  # the one-time set-up: the tokenizer's info and the child's start
        first_child = grammars.compile_process_pid
        assert first_child is not None and alive(first_child)
        assert compiles.ready("slow", SLOW) is None
        time.sleep(1)
        assert compiles.ready("quick", REGEX) is None  # queued behind it, 1 s of its 2 left when the slow one ends
        done = {d.owner: d for d in finished(compiles, until=60, count=2)}
        assert sorted(done) == ["quick", "slow"]
        assert "took longer than the 2 s" in done["slow"].error and done["slow"].grammar is None
        assert done["quick"].error == "" and done["quick"].grammar is not None
        assert not alive(first_child)  # killed: the core it held is free
        assert grammars.compile_process_pid not in (None, first_child)  # a fresh child compiled the quick one
    finally:
        compiles.close()
    deadline = time.monotonic() + 5
    while alive(grammars.compile_process_pid) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not alive(grammars.compile_process_pid)  # closing ends the child too


def random_enum(seed: int, num_values: int = 256, chars: int = 100) -> Constraint:
    """Random strings: xgrammar keeps token masks for each, about 6 MiB for 256 of 100 characters."""
    rng = random.Random(seed)
    values = ["".join(rng.choice(string.ascii_letters) for _ in range(chars)) for _ in range(num_values)]
    return Constraint("json", json.dumps({"enum": values}), "response_format.json_schema.schema")


def test_30_distinct_large_enums_grow_the_workers_memory_by_at_most_the_caches_byte_bound(tokenizer):
    bound = 32 << 20  # five of them
    grammars = GrammarCache(lambda: tokenizer, len(tokenizer), (EOS,), max_bytes=bound, isolated=True)
    compiles = ConstraintCompiles(grammars, timeout_s=8)
    try:
        compiled(compiles, "warm", YES_NO)
        before, child_before = rss_bytes(), rss_bytes(grammars.compile_process_pid)
        sizes = []
        for seed in range(30):
            grammar = compiled(compiles, f"request-{seed}", random_enum(seed))
            sizes.append(grammar.memory_size_bytes)
            del grammar  # the request ended: only the cache holds it now
            assert grammars.num_bytes <= bound
        assert sum(sizes) > 4 * bound  # a cache bounded by count (256) would hold all of them
        assert rss_bytes() - before <= bound
        assert rss_bytes(grammars.compile_process_pid) - child_before <= bound  # the child keeps none of them
    finally:
        compiles.close()

"""Structured output on the worker side, without a model: the grammar cache, matchers rebuilt from tokens, the
bitmask on exactly the constrained rows, the scheduler's dead end, and compiles off the loop (with timeouts)."""

import json
import random
import string
import threading
import time

import pytest
import torch

from kvferry.common.block_manager import BlockManager
from kvferry.common.constraint import Constraint
from kvferry.common.errors import InvalidRequest
from kvferry.common.model.sampler import mask_constrained, sample, uniform
from kvferry.common.sampling import SamplingParams
from kvferry.common.scheduler import Scheduler
from kvferry.common.sequence import FinishReason, Sequence
from kvferry.common.structured.compile_process import CompileProcessEnded, choice_grammar
from kvferry.common.structured.grammars import GrammarCache
from kvferry.common.structured.matcher import ConstraintState
from kvferry.services.constraint_compiles import ConstraintCompiles

EOS = 2
YES_NO = Constraint("choice", '["yes","no"]', "structured_outputs.choice")
FLAGS = Constraint(
    "json",
    '{"type":"object","properties":{"a":{"enum":["x","y"]},"b":{"type":"boolean"}},"required":["a","b"]}',
    "response_format.json_schema.schema",
)


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    from kvferry.common.model_files import resolve_model

    return AutoTokenizer.from_pretrained(resolve_model(None))


@pytest.fixture
def grammars(tokenizer):
    return GrammarCache(lambda: tokenizer, len(tokenizer), (EOS,), capacity=2)


def allowed_ids(state, vocab) -> set[int]:
    import xgrammar

    bitmask = xgrammar.allocate_token_bitmask(1, vocab)
    state.fill(bitmask, 0)
    logits = torch.zeros(1, vocab)
    xgrammar.apply_token_bitmask_inplace(logits, bitmask)
    return set(torch.nonzero(logits[0] == 0).flatten().tolist())


def test_the_cache_compiles_each_constraint_once_and_evicts_the_oldest(grammars):
    first = grammars.compile(YES_NO)
    assert grammars.cached(YES_NO) is first and grammars.compile(YES_NO) is first
    assert (grammars.num_compiles, grammars.num_cache_hits) == (1, 1) and grammars.compile_s > 0
    grammars.compile(FLAGS)
    grammars.compile(Constraint("regex", "[0-9]+", "structured_outputs.regex"))  # capacity 2: YES_NO goes
    assert grammars.cached(YES_NO) is None and grammars.cached(FLAGS) is not None
    assert grammars.num_compiles == 3


def random_enum(seed: int, num_values: int = 64, chars: int = 100) -> Constraint:
    """An enum of random strings: xgrammar keeps token masks for each, about 1.6 MiB for 64 of 100 characters."""
    rng = random.Random(seed)
    values = ["".join(rng.choice(string.ascii_letters) for _ in range(chars)) for _ in range(num_values)]
    return Constraint("json", json.dumps({"enum": values}), "response_format.json_schema.schema")


def test_the_cache_is_bounded_by_the_bytes_its_grammars_hold_not_only_by_their_count(tokenizer):
    enums = [random_enum(seed) for seed in range(6)]
    size = GrammarCache(lambda: tokenizer, len(tokenizer), (EOS,)).compile(enums[0]).memory_size_bytes
    bound = int(size * 2.5)  # room for two of them (their sizes differ a little)
    grammars = GrammarCache(lambda: tokenizer, len(tokenizer), (EOS,), max_bytes=bound)  # the count's cap: 256
    for i, enum in enumerate(enums):
        assert grammars.compile(enum) is not None
        held = [grammars.cached(e, count=False) for e in enums[: i + 1]]
        assert sum(g.memory_size_bytes for g in held if g is not None) == grammars.num_bytes <= bound
    assert [grammars.cached(e, count=False) is not None for e in enums] == [False] * 4 + [True] * 2  # the newest

    small = GrammarCache(lambda: tokenizer, len(tokenizer), (EOS,), max_bytes=size // 2)
    assert small.compile(enums[0]) is not None  # larger than the whole bound: served, not kept
    assert small.cached(enums[0]) is None and small.num_bytes == 0
    assert small.compile(YES_NO) is not None and small.cached(YES_NO) is not None  # a small one still is


@pytest.mark.parametrize(
    "constraint, reason",
    [
        (Constraint("regex", "(ab", "structured_outputs.regex"), "parenthesis"),
        (Constraint("grammar", "root ::= undefined_rule", "structured_outputs.grammar"), "undefined_rule"),
        (Constraint("json", '{"type":"bogus"}', "response_format.json_schema.schema"), "bogus"),
        (Constraint("structural_tag", '{"type":"structural_tag","format":{"type":"nope"}}', "tools"), "nope"),
        (Constraint("choice", "[]", "structured_outputs.choice"), "non-empty"),
    ],
)
def test_a_constraint_xgrammar_refuses_is_an_invalid_request_naming_its_field(grammars, constraint, reason):
    with pytest.raises(InvalidRequest) as refused:
        grammars.compile(constraint)
    assert str(refused.value).startswith(constraint.field + ": ") and reason in str(refused.value)
    assert ".cc:" not in str(refused.value)  # xgrammar's C++ source location is left out


def test_choice_grammar_escapes_its_strings(grammars, tokenizer):
    choices = ['say "hi"', "back\\slash", "two\nlines", "café"]
    compiled = grammars.compile(Constraint("choice", json.dumps(choices), "c"))
    assert choice_grammar('["a","b"]') == 'root ::= "a" | "b"'
    for text in choices:
        state = ConstraintState(compiled)
        ids = tokenizer.encode(text)
        assert all(state.accept(t) for t in ids) and state.accept(EOS) and state.terminated


def test_a_matcher_rebuilt_from_tokens_allows_what_the_stepped_one_does(grammars, tokenizer):
    compiled = grammars.compile(FLAGS)
    ids = tokenizer.encode('{"a": "y", "b": t')
    stepped = ConstraintState(compiled)
    for token_id in ids:
        assert stepped.accept(token_id)
    rebuilt = ConstraintState(compiled, ids)
    vocab = len(tokenizer)
    allowed = allowed_ids(rebuilt, vocab)
    assert allowed == allowed_ids(stepped, vocab) and set(tokenizer.encode("rue")[:1]) <= allowed
    assert all("rue".startswith(tokenizer.decode([t])) for t in allowed)  # "true" goes on, and nothing else
    assert stepped.again(ids[:2]).accept(ids[2])  # a fresh state of the same grammar, elsewhere in the output
    with pytest.raises(InvalidRequest, match="breaks its constraint at token 0"):
        ConstraintState(compiled, tokenizer.encode("[1]"))


def test_the_bitmask_touches_exactly_the_constrained_rows_and_not_the_input(grammars, tokenizer):
    vocab = len(tokenizer)
    logits = torch.randn(4, vocab)
    before = logits.clone()
    states = [None, ConstraintState(grammars.compile(YES_NO)), None, ConstraintState(grammars.compile(FLAGS))]
    masked = mask_constrained(logits, states)
    assert torch.equal(logits, before)  # the model's logits stay for logprobs
    assert torch.equal(masked[0], before[0]) and torch.equal(masked[2], before[2])
    for row in (1, 3):
        allowed = allowed_ids(states[row], vocab)
        kept = set(torch.nonzero(masked[row] > float("-inf")).flatten().tolist())
        assert kept == allowed and 0 < len(allowed) < vocab
        assert torch.equal(masked[row][sorted(allowed)], before[row][sorted(allowed)])
    assert all(tokenizer.decode([t]) in ("{", '{"') for t in allowed_ids(states[3], vocab))
    assert mask_constrained(logits, [None] * 4) is logits  # nothing constrained: nothing copied


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=0),
        SamplingParams(temperature=1.5),
        SamplingParams(temperature=1.0, top_k=5),
        SamplingParams(temperature=1.0, top_p=0.1),
        SamplingParams(temperature=1.0, min_p=0.5),
    ],
    ids=["greedy", "random", "top_k", "top_p", "min_p"],
)
def test_every_sampling_method_draws_only_allowed_tokens(grammars, tokenizer, params):
    vocab = len(tokenizer)
    for seed in range(5):
        logits = torch.randn(2, vocab, generator=torch.Generator().manual_seed(seed)) * 5
        state = ConstraintState(grammars.compile(YES_NO))
        u = None if params.greedy else uniform(seed, 0)
        token_ids = sample(logits, [params, params], [u, u], [state, None])
        assert token_ids[0] in allowed_ids(state, vocab)


class Rejecting:
    """A constraint state whose grammar allows nothing more (what ConstraintState.accept says at a dead end)."""

    terminated = False

    def accept(self, token_id):
        return False


def scheduler():
    return Scheduler(BlockManager(16, 4), 4, 64, 64, eos_token_ids=(EOS,))


def run_one_step(sch, seq, token_id):
    sch.add(seq)
    plan = sch.schedule()
    return sch.update(plan, [token_id])


def test_a_token_the_constraint_refuses_ends_the_sequence_as_a_dead_end_without_it():
    sch = scheduler()
    seq = Sequence("r", [5, 6, 7], SamplingParams(max_tokens=8))
    seq.constraint_state = Rejecting()
    assert run_one_step(sch, seq, 9) == [seq]
    assert seq.finish_reason == FinishReason.DEAD_END and seq.output_token_ids == []


def test_a_completed_constraint_ends_the_sequence_even_with_ignore_eos(grammars, tokenizer):
    sch = scheduler()
    seq = Sequence("r", [5, 6, 7], SamplingParams(max_tokens=8, ignore_eos=True))
    seq.constraint_state = ConstraintState(grammars.compile(YES_NO), tokenizer.encode("no"))
    assert run_one_step(sch, seq, EOS) == [seq]
    assert seq.finish_reason == FinishReason.STOP


class SlowGrammars:
    """A grammar cache whose compile waits for the test's word: the thing under test is the waiting around it."""

    def __init__(self, set_up_s: float = 0.0, trial_passes: bool = False, dies: bool = False):
        """trial_passes: each compile's trial in a child passes at once, before the compile waits; dies: the
        compile child dies under each compile."""
        self.release = threading.Event()
        self.compiled: dict = {}
        self.set_up_s, self.set_up_done = set_up_s, False
        self.trial_passes, self.dies = trial_passes, dies

    def set_up(self):  # the tokenizer's load and xgrammar's import: once, and as slow as set_up_s
        if not self.set_up_done:
            time.sleep(self.set_up_s)
            self.set_up_done = True

    def cached(self, constraint, count=True):
        return self.compiled.get(constraint.key)

    def compile(self, constraint, timeout_s=None, on_trial_passed=None):  # in process: nothing stops it
        if self.dies:
            raise CompileProcessEnded("the compile process ended (exit status -9)")
        if self.trial_passes:
            on_trial_passed()
        self.release.wait(10)
        if constraint.kind == "regex" and constraint.spec == "(":
            raise InvalidRequest(f"{constraint.field}: the parenthesis is not closed")
        self.compiled[constraint.key] = object()
        return self.compiled[constraint.key]

    def kill_compile(self):
        pass

    def close(self):
        pass


def finished(compiles, until=5.0, count=1):
    deadline, done = time.monotonic() + until, []
    while time.monotonic() < deadline and len(done) < count:
        done += compiles.take_finished()
        time.sleep(0.01)
    return done


REGEX = Constraint("regex", "[0-9]{3}", "structured_outputs.regex")


def test_compiles_run_off_the_loop_shared_by_requests_with_the_same_constraint():
    grammars = SlowGrammars()
    compiles = ConstraintCompiles(grammars, timeout_s=30)
    try:
        assert compiles.ready("a", YES_NO) is None and compiles.ready("b", YES_NO) is None  # one compile for both
        assert compiles.waiting("a") and compiles.take_finished() == []
        grammars.release.set()
        done = finished(compiles, count=2)
        assert sorted(d.owner for d in done) == ["a", "b"] and all(d.error == "" for d in done)
        assert done[0].grammar is grammars.compiled[YES_NO.key] is done[1].grammar  # the request keeps it
        assert compiles.ready("c", YES_NO) is done[0].grammar  # in the cache now
        assert compiles.ready("d", Constraint("regex", "(", "structured_outputs.regex")) is None
        [bad] = finished(compiles)
        assert bad.owner == "d" and bad.error == "structured_outputs.regex: the parenthesis is not closed"
        assert bad.grammar is None and not bad.retry
    finally:
        compiles.close()


def test_the_one_time_set_up_before_the_first_compile_is_not_counted_against_its_timeout():
    grammars = SlowGrammars(set_up_s=0.5)
    grammars.release.set()  # each compile itself is instant
    compiles = ConstraintCompiles(grammars, timeout_s=0.2)
    try:
        assert compiles.ready("a", FLAGS) is None
        [done] = finished(compiles)
        assert done.owner == "a" and done.error == "" and done.grammar is grammars.compiled[FLAGS.key]
        assert grammars.set_up_done
    finally:
        compiles.close()


def test_a_compile_past_its_timeout_fails_its_own_requests_and_is_refused_at_once_after():
    grammars = SlowGrammars()
    compiles = ConstraintCompiles(grammars, timeout_s=0.05)
    try:
        assert compiles.ready("a", FLAGS) is None
        assert compiles.ready("forgotten", YES_NO) is None
        compiles.forget("forgotten")  # its compile has not begun: dropped
        [late] = finished(compiles)
        assert late.owner == "a" and "took longer than the 0.05 s" in late.error and not late.retry
        assert late.error.startswith("response_format.json_schema.schema: ")
        assert compiles.ready("b", FLAGS) is None  # refused at once, not queued behind the stuck compile
        assert compiles.waiting("b")
        [again] = finished(compiles, 0.5)
        assert again.owner == "b" and "took longer" in again.error
        grammars.release.set()
        time.sleep(0.1)
        assert YES_NO.key not in grammars.compiled  # nobody waited for it any more
    finally:
        grammars.release.set()
        compiles.close()


def test_a_queued_constraint_waits_on_the_clock_that_started_when_it_was_submitted():
    grammars = SlowGrammars()  # its compiles hold the thread until released: a compile nobody can stop
    compiles = ConstraintCompiles(grammars, timeout_s=0.5)
    try:
        assert compiles.ready("slow", FLAGS) is None
        assert compiles.ready("queued", REGEX) is None  # behind it, with no compile of its own under way
        done = {d.owner: d for d in finished(compiles, until=5, count=2)}
        assert sorted(done) == ["queued", "slow"]
        assert "took longer than the 0.5 s" in done["slow"].error and not done["slow"].retry
        queued = done["queued"]
        assert queued.error.startswith("structured_outputs.regex: ") and "0.5 s" in queued.error
        assert queued.grammar is None and queued.retry  # the queue's doing, not its own: another worker may
        grammars.release.set()
        time.sleep(0.2)
        assert REGEX.key not in grammars.compiled  # it timed out waiting: never compiled
        assert compiles.ready("again", REGEX) is None  # not remembered as too slow: queued afresh
        [again] = finished(compiles)
        assert again.owner == "again" and again.error == "" and again.grammar is grammars.compiled[REGEX.key]
    finally:
        grammars.release.set()
        compiles.close()


def test_past_its_queue_cap_a_worker_refuses_constraints_for_another_to_take(monkeypatch):
    from kvferry.services import constraint_compiles

    monkeypatch.setattr(constraint_compiles, "MAX_QUEUED_COMPILES", 2)
    grammars = SlowGrammars()
    compiles = ConstraintCompiles(grammars, timeout_s=30)
    try:
        assert compiles.ready("a", FLAGS) is None and compiles.ready("b", REGEX) is None
        assert compiles.ready("c", YES_NO) is None
        [busy] = finished(compiles)
        assert busy.owner == "c" and busy.retry and "2 constraints to compile already" in busy.error
    finally:
        grammars.release.set()
        compiles.close()


def test_past_the_bytes_its_queue_may_hold_a_worker_refuses_constraints_for_another_to_take(monkeypatch):
    from kvferry.services import constraint_compiles

    monkeypatch.setattr(constraint_compiles, "MAX_QUEUED_COMPILE_BYTES", len(FLAGS.spec) + len(REGEX.spec))
    grammars = SlowGrammars()
    compiles = ConstraintCompiles(grammars, timeout_s=30)
    try:
        assert compiles.ready("a", FLAGS) is None and compiles.ready("b", REGEX) is None  # exactly full
        assert compiles.ready("c", YES_NO) is None
        [busy] = finished(compiles)
        assert busy.owner == "c" and busy.retry and "bytes of constraints to compile already" in busy.error
        assert busy.error.startswith("structured_outputs.choice: ")
    finally:
        grammars.release.set()
        compiles.close()


def test_closing_does_not_wait_for_a_compile_under_way():
    grammars = SlowGrammars()
    compiles = ConstraintCompiles(grammars, timeout_s=30)
    compiles.ready("a", FLAGS)
    time.sleep(0.05)
    started = time.monotonic()
    compiles.close()
    assert compiles._thread.daemon and time.monotonic() - started < 1  # the process may exit meanwhile
    grammars.release.set()


def test_a_constraint_whose_trial_passed_is_compiled_past_its_deadline_not_failed_at_it():
    """The trial in the child took its time within the timeout; the compile in the worker takes about as long again,
    and the constraint is served, not failed half-way (nor remembered as too slow)."""
    grammars = SlowGrammars(trial_passes=True)
    compiles = ConstraintCompiles(grammars, timeout_s=0.1)
    try:
        assert compiles.ready("a", FLAGS) is None
        time.sleep(0.4)  # well past its deadline
        assert compiles.take_finished() == [] and compiles.next_deadline_in() is None
        grammars.release.set()
        [done] = finished(compiles)
        assert done.owner == "a" and done.error == "" and done.grammar is grammars.compiled[FLAGS.key]
    finally:
        grammars.release.set()
        compiles.close()


def test_a_compile_child_that_dies_is_a_refusal_another_worker_may_take():
    compiles = ConstraintCompiles(SlowGrammars(dies=True), timeout_s=30)
    try:
        assert compiles.ready("a", FLAGS) is None
        [done] = finished(compiles)
        assert done.retry and "compile process ended" in done.error and done.grammar is None
        assert compiles.ready("b", FLAGS) is None  # not remembered as the constraint's fault
    finally:
        compiles.close()


def test_constraints_nobody_waits_for_still_count_in_the_queue_until_the_thread_takes_them(monkeypatch):
    """A client that sends a constraint and leaves, again and again, while a compile holds the thread: each spec
    stays on the thread's queue until it is taken off, so each counts against the queue's caps until then."""
    from kvferry.services import constraint_compiles

    monkeypatch.setattr(constraint_compiles, "MAX_QUEUED_COMPILE_BYTES", 4096)
    grammars = SlowGrammars()
    compiles = ConstraintCompiles(grammars, timeout_s=30)
    try:
        assert compiles.ready("holds the thread", FLAGS) is None
        time.sleep(0.1)
        refused = []
        for i in range(100):
            constraint = Constraint("regex", f"[0-9]{{{i}}}" + "x" * 200, "structured_outputs.regex")
            assert compiles.ready(f"left-{i}", constraint) is None
            done = compiles.take_finished()  # a refusal comes at once
            refused += done
            if not done:
                compiles.forget(f"left-{i}")  # the client left
        assert refused and all(done.retry and "bytes of constraints" in done.error for done in refused)
        assert len(refused) >= 100 - 4096 // 200
    finally:
        grammars.release.set()
        compiles.close()

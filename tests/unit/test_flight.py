"""The gateway's per-request state: every token delivered once and in order, whatever the workers' messages do."""

from kvferry.common import protocol as p
from kvferry.common.sampling import SamplingParams
from kvferry.common.sequence import FinishReason
from kvferry.services.gateway.flight import Event, Flight


def flight(n=1):
    return Flight("r", [1, 2, 3], SamplingParams(max_tokens=8), p.TraceContext(), n)


def tokens(ids, start, choice=0, finish=None, decode=True):
    message = p.Tokens(list(ids), start=start, choice=choice) if decode else p.FirstToken(ids[0], choice=choice)
    return Event(list(ids), finish, start=start, choice=choice, message=message)


def delivered(f, events):
    return [t for e in events for t in f.accept(e) for t in t.token_ids]


def test_in_order_messages_pass_through():
    f = flight()
    assert delivered(
        f, [tokens([10], 0, decode=False), tokens([11, 12], 1), tokens([13], 3, finish=FinishReason.LENGTH)]
    ) == [10, 11, 12, 13]
    assert f.done and f.outputs == [[10, 11, 12, 13]] and f.decode_started


def test_repeats_are_dropped_and_overlaps_trimmed():
    f = flight()
    assert delivered(f, [tokens([10], 0), tokens([10], 0), tokens([10, 11], 0), tokens([11, 12], 1)]) == [10, 11, 12]


def test_early_messages_wait_for_the_gap_to_fill():
    f = flight()
    assert f.accept(tokens([12], 2)) == [] and f.accept(tokens([11], 1)) == []
    assert f.gap_age(f.early_since + 1.5) == 1.5
    assert delivered(f, [tokens([10], 0, decode=False)]) == [10, 11, 12]
    assert not f.early and f.gap_age(1e12) == 0.0


def test_choices_are_kept_apart_and_a_finished_choice_takes_nothing_more():
    f = flight(n=2)
    assert delivered(
        f, [tokens([5], 0, choice=1, finish=FinishReason.STOP), tokens([7], 0, choice=0), tokens([6], 1, choice=1)]
    ) == [5, 7]
    assert f.finished == [False, True] and not f.done


def test_a_new_attempt_resumes_from_what_was_delivered():
    f = flight()
    delivered(f, [tokens([10], 0), tokens([11], 1), tokens([13], 3)])  # 12 was lost
    assert f.early and f.can_resume()
    f.next_attempt()
    assert (f.attempt, f.num_moves, f.early, f.got_first_token) == (1, 1, {}, False)
    assert f.resume_token_ids() == [10, 11]
    assert delivered(f, [tokens([12], 2, decode=False), tokens([13, 14], 3, finish=FinishReason.STOP)]) == [12, 13, 14]


def test_several_choices_move_only_before_any_token():
    f = flight(n=2)
    assert f.can_resume()
    f.accept(tokens([5], 0, choice=1))
    assert not f.can_resume()


def test_the_prefill_worker_matters_until_the_kv_lands():
    f = flight()
    f.prefill_identity, f.decode_identity = b"p", b"d"
    assert f.involves(b"p") and f.involves(b"d")
    f.accept(tokens([10], 0, decode=False))
    assert f.involves(b"p")
    f.accept(tokens([11], 1))
    assert not f.involves(b"p") and f.involves(b"d") and not f.involves(b"x")

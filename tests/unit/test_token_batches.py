"""A decode step's tokens for one gateway in one TokenBatch: its round trip, its strict decoding, and its split
within the kind's size limit (token_batches), whose per-entry bound must hold for the widest entries."""

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvferry.common import protocol as p
from kvferry.common.sampling import MAX_LOGPROBS, TokenLogprobs

WIDEST_INT = 2**64 - 1


def entry(rid="r", ids=(5,), **fields):
    return rid, p.Tokens(list(ids), **fields)


def test_a_batch_round_trips_with_every_field_and_with_defaults_left_off_the_wire():
    logprobs = [TokenLogprobs(5, -0.5, (5, 9), (-0.5, -1.25))]
    sequences = [
        entry("a", [5], start=3),
        entry("b", [6, 7], finish_reason=1, kv_transfer_s=0.25, kv_transfer_bytes=4096, choice=2, attempt=1),
        entry("c", [5], logprobs=logprobs, start=9),
        entry("d", [], finish_reason=3, start=4),  # a constraint's dead end: no token
    ]
    header, *_ = p.encode(p.TokenBatch(sequences))
    assert p.decode([header]).message == p.TokenBatch(sequences)
    body = msgpack.unpackb(header)[4]
    assert body["sequences"][0] == ["a", {"token_ids": [5], "start": 3}]  # the receiver fills in the rest


@pytest.mark.parametrize(
    "sequences, says",
    [
        ([["a"]], "expected a list of 2"),
        ([["a", {"token_ids": [1]}, 3]], "expected a list of 2"),
        ([[7, {"token_ids": [1]}]], "expected str"),
        ([["a", [1]]], "expected a map"),
        ([["a", {"start": 1}]], "missing field 'token_ids'"),
        ([["a", {"token_ids": [1], "extra": 1}]], "unknown fields"),
        ([["a", {"token_ids": [1, "2"]}]], "TokenBatch.sequences[][].token_ids[]: expected an int"),
        ([["a", {"token_ids": [True]}]], "expected an int"),
        ([["a", {"token_ids": [1], "start": 1.5}]], "TokenBatch.sequences[][].start: expected an int"),
        ("a", "expected a list"),
    ],
)
def test_a_malformed_entry_is_a_protocol_error(sequences, says):
    header = msgpack.packb([int(p.Kind.TOKEN_BATCH), p.PROTOCOL_VERSION, "", {}, {"sequences": sequences}])
    with pytest.raises(p.ProtocolError, match=says.replace("[", r"\[").replace("]", r"\]")):
        p.decode([header])


def packed_entry_bytes(request_id: str, tokens: p.Tokens) -> int:
    """What the entry adds to a batch's header."""
    one = len(p.encode(p.TokenBatch([(request_id, tokens)]))[0])
    return one - len(p.encode(p.TokenBatch([]))[0])


ints = st.one_of(st.integers(-(2**63), WIDEST_INT), st.sampled_from([0, -1, WIDEST_INT, -(2**63)]))
widest_logprobs = TokenLogprobs(2**32 - 1, -1.0, (2**32 - 1,) * MAX_LOGPROBS, (-1.0,) * MAX_LOGPROBS)
tokens_fields = st.builds(
    p.Tokens,
    token_ids=st.lists(st.integers(0, 2**32 - 1), max_size=40),
    finish_reason=ints,
    kv_transfer_s=st.floats(allow_nan=False),
    kv_transfer_bytes=ints,
    logprobs=st.lists(st.just(widest_logprobs), max_size=3),
    choice=ints,
    attempt=ints,
    start=ints,
)


@settings(max_examples=300, deadline=None)
@given(request_id=st.text(max_size=300), tokens=tokens_fields)
def test_the_bound_on_an_entry_holds_for_any_entry(request_id, tokens):
    assert packed_entry_bytes(request_id, tokens) <= p.token_batch_entry_bytes(request_id, tokens)


@settings(max_examples=100, deadline=None)
@given(
    sequences=st.lists(st.tuples(st.text(max_size=60), tokens_fields), max_size=30),
    max_bytes=st.integers(200, 20_000),
)
def test_a_step_is_cut_into_batches_within_the_bound_in_order(sequences, max_bytes):
    batches = p.token_batches(sequences, max_bytes)
    assert [e for batch in batches for e in batch.sequences] == sequences  # all, in order, once
    empty = len(p.encode(p.TokenBatch([]))[0]) + 4  # the list's header may grow
    for batch in batches:
        bound = sum(p.token_batch_entry_bytes(*e) for e in batch.sequences)
        assert bound <= max_bytes or len(batch.sequences) == 1  # an entry past the bound goes alone
        assert len(p.encode(batch)[0]) <= empty + bound
        assert p.decode(p.encode(batch)).message == batch


def test_a_whole_step_of_many_sequences_is_one_batch_at_the_kinds_limit():
    sequences = [entry(f"chatcmpl-{i:032x}", [i], start=100) for i in range(4096)]
    assert p.token_batches(sequences) == [p.TokenBatch(sequences)]
    assert p.max_header_bytes(p.Kind.TOKEN_BATCH) >= p.SMALL_HEADER_BYTES + p.TOKEN_BATCH_BYTES


def test_register_reply_says_whether_the_gateway_takes_batches():
    for takes in (False, True):
        reply = p.RegisterReply(True, token_batches=takes)
        assert p.decode(p.encode(reply)).message.token_batches is takes

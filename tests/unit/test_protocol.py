"""The wire protocol: round trips, and one ProtocolError for every kind of bad message."""

import dataclasses

import msgpack
import pytest

from kvferry.common import protocol as p
from kvferry.common.constraint import Constraint
from kvferry.common.sampling import SamplingParams, TokenLogprobs

SAMPLING = SamplingParams(
    max_tokens=8, temperature=0.5, top_p=0.9, top_k=0, seed=None, ignore_eos=False, stop_token_ids=(2,)
)


def kv_message(num_blocks=2):
    return p.KVTransfer(
        prefill_worker_id="p0",
        prompt_token_ids=[1, 2, 3],
        output_token_ids=[9],
        choices=[0],
        sampling=SAMPLING,
        num_computed_tokens=3,
        dtype="float32",
        shape=[2, num_blocks, 4, 2, 1, 2],
        deadline_s=1e9,
    )


def test_every_kind_round_trips():
    trace = p.TraceContext("t" * 32, "s" * 16, "")
    messages = [
        p.Register(
            role=p.Role.DECODE,
            worker_id="d0",
            model="m",
            dtype="float32",
            block_size=16,
            num_blocks=10,
            max_model_len=64,
            kv_address="tcp://127.0.0.1:6000",
        ),
        p.RegisterReply(accepted=False, reason="model mismatch"),
        p.Heartbeat("d0", p.WorkerStats(1, 2, 3, 4, 5)),
        p.PrefillRequest([1, 2], SAMPLING, "d0", "tcp://x:1", 12.5),
        p.FirstToken(7),
        p.KVAck(True),
        p.Tokens([1, 2], finish_reason=1, kv_transfer_s=0.01),
        p.Abort(),
        p.RequestFailed("boom", 503),
        p.Deregister("d0", final=True),
        p.Heartbeat("d0", p.WorkerStats(1, 2, 3, 4, 5), healthy=False),
        p.PrefillRequest([1, 2], SAMPLING, "d0", "tcp://x:1", 12.5, attempt=2, resume_token_ids=[5, 6], choice=0),
        p.Tokens([3], start=7, attempt=1),
        p.Abort(attempt=3),
        p.RequestFailed("gave up", 503, 1, retry=True),
        p.KVQuery([b"\x01" * 16, b"\x02" * 16], attempt=1),
        p.KVHeld(2),
        p.KVAck(False, "gone", resend_all=True),
    ]
    for message in messages:
        env = p.decode(p.encode(message, "req-1", trace))
        assert env.message == message and env.request_id == "req-1" and env.trace == trace and env.frames == []
    frame = bytes(2 * 2 * 4 * 2 * 1 * 2 * 4)
    env = p.decode(p.encode(kv_message(), "r", frames=[frame]))
    assert env.message == kv_message() and [bytes(f) for f in env.frames] == [frame]


def header(kind=p.Kind.ABORT, version=p.PROTOCOL_VERSION, request_id="r", trace=None, body=None):
    return msgpack.packb([kind, version, request_id, trace if trace is not None else {}, body or {}])


@pytest.mark.parametrize(
    "parts,why",
    [
        ([], "empty"),
        ([b"\xc1\xff garbage"], "undecodable"),
        ([msgpack.packb({"kind": 1})], "header must be"),
        ([header(kind=99)], "unknown message kind 99"),
        ([header(kind=True)], "unknown message kind"),
        ([header(version=p.PROTOCOL_VERSION + 1)], f"protocol version {p.PROTOCOL_VERSION + 1}"),
        ([header(request_id=5)], "request_id"),
        ([header(p.Kind.FIRST_TOKEN, body={"token_id": "7"})], "FirstToken.token_id: expected an int"),
        ([header(p.Kind.FIRST_TOKEN, body={})], "missing field 'token_id'"),
        ([header(p.Kind.FIRST_TOKEN, body={"token_id": 1, "evil": 2})], "unknown fields"),
        ([header(p.Kind.KV_ACK, body={"accepted": 1})], "expected bool"),
        ([header(p.Kind.TOKENS, body={"token_ids": [1, "x"]})], r"token_ids\[\]"),
        ([header(trace={"trace_id": 1})], "trace.trace_id"),
        ([header(), b"unexpected frame"], "carries 0 frames"),
        ([b"x" * (p.MAX_HEADER_BYTES + 1)], "exceeds"),
    ],
)
def test_bad_messages_raise_one_protocol_error(parts, why):
    with pytest.raises(p.ProtocolError, match=why):
        p.decode(parts)


def test_kv_frames_must_match_their_description():
    good = bytes(2 * 2 * 4 * 2 * 1 * 2 * 4)
    [head, _] = p.encode(kv_message(), "r", frames=[good])
    with pytest.raises(p.ProtocolError, match="KV frame of"):
        p.decode([head, good[:-4]])  # truncated
    with pytest.raises(p.ProtocolError, match="carries 1 frames"):
        p.decode([head, good, good])  # K and V apart, as before protocol 9
    bad_dtype = kv_message()
    bad_dtype.dtype = "int8"
    with pytest.raises(p.ProtocolError, match="dtype"):
        p.decode(p.encode(bad_dtype, "r", frames=[good]))
    for shape in ([2, 2, 4, 1, 2], [2, 2, 4, 3, 1, 2]):  # no K/V axis; three where K and V are two
        bad_shape = kv_message()
        bad_shape.shape = shape
        with pytest.raises(p.ProtocolError, match="is not"):
            p.decode(p.encode(bad_shape, "r", frames=[good]))


def test_encode_refuses_a_wrong_frame_count():
    with pytest.raises(p.ProtocolError):
        p.encode(p.Abort(), "r", frames=[b"x"])


def test_sampling_params_and_logprobs_travel_field_by_field():
    """Every SamplingParams field set away from its default comes back the same: the wire carries the dataclass by
    field name, so a field added anywhere cannot shift the others."""
    params = SamplingParams(
        max_tokens=9, temperature=0.7, top_p=0.8, top_k=5, seed=2**63 - 1, ignore_eos=True, stop_token_ids=(3, 4),
        presence_penalty=0.5, frequency_penalty=-0.5, repetition_penalty=1.3, min_p=0.1, min_tokens=2,
        logit_bias=((7, -3.5), (8, 100.0)), logprobs=3, prompt_logprobs=2,
        constraint=Constraint("json", '{"type":"object"}', "response_format"),
    )  # fmt: skip
    assert all(getattr(params, f.name) != f.default for f in dataclasses.fields(SamplingParams))
    request = p.PrefillRequest([1, 2], params, "d0", "tcp://127.0.0.1:1", 1e9)
    assert p.decode(p.encode(request, "r")).message.sampling == params
    entry = TokenLogprobs(5, -0.25, (5, 6), (-0.25, -1.5))
    tokens = p.Tokens([5], logprobs=[entry])
    assert p.decode(p.encode(tokens, "r")).message.logprobs == [entry]


def test_sampling_params_out_of_range_on_the_wire_is_a_protocol_error():
    body = p._to_wire(p.PrefillRequest([1], SAMPLING, "d0", "tcp://127.0.0.1:1", 1e9))
    body["sampling"]["top_p"] = 7.0
    header = msgpack.packb([int(p.Kind.PREFILL_REQUEST), p.PROTOCOL_VERSION, "r", p._to_wire(p.TraceContext()), body])
    with pytest.raises(p.ProtocolError, match="top_p"):
        p.decode([header])


def test_encode_packs_what_to_wire_makes():
    """encode packs each dataclass through msgpack's hook, a level at a time: the bytes are those of the message
    made whole first (_to_wire), for every kind, nested dataclasses and defaults left off included."""
    trace = p.TraceContext("t" * 32, "s" * 16, "")
    params = SamplingParams(max_tokens=9, temperature=0.7, seed=3, stop_token_ids=(3, 4), logit_bias=((7, -3.5),))
    entry = TokenLogprobs(5, -0.25, (5, 6), (-0.25, -1.5))
    messages = [
        p.Heartbeat("d0", p.WorkerStats(1, 2, 3, 4, 5)),
        p.PrefillRequest([1, 2], params, "d0", "tcp://x:1", 12.5, attempt=2, resume_token_ids=[5, 6]),
        p.Tokens([1, 2], finish_reason=1, kv_transfer_s=0.01, logprobs=[entry, entry]),
        p.TokenBatch([("a", p.Tokens([3], start=7)), ("b", p.Tokens([4], logprobs=[entry], choice=2, attempt=1))]),
        p.KVQuery([b"\x01" * 16], attempt=1),
        kv_message(),
    ]
    for message in messages:
        frames = [bytes(2 * 2 * 4 * 2 * 1 * 2 * 4)] * p.FRAMED.get(message.KIND, 0)
        for context in (trace, None):
            made = p._to_wire(message)
            wire = [int(message.KIND), p.PROTOCOL_VERSION, "r", p._to_wire(context or p.TraceContext()), made]
            assert p.encode(message, "r", context, frames)[0] == msgpack.packb(wire, use_bin_type=True)
    # And a step's batch by hand: each entry [request id, its fields not at their default].
    batch = p.TokenBatch([("a", p.Tokens([3], start=7)), ("b", p.Tokens([4], finish_reason=0))])
    body = {"sequences": [["a", {"token_ids": [3], "start": 7}], ["b", {"token_ids": [4], "finish_reason": 0}]]}
    wire = [int(p.Kind.TOKEN_BATCH), p.PROTOCOL_VERSION, "", p._to_wire(trace), body]
    assert p.encode(batch, "", trace)[0] == msgpack.packb(wire, use_bin_type=True)


@pytest.mark.parametrize("value", [2**64, -(2**63) - 1, object(), {1, 2}])
def test_encode_fails_on_what_msgpack_cannot_pack_as_packing_to_wire_did(value):
    """The hook must not turn msgpack's own errors into dataclasses.fields' (an OverflowError into a TypeError that
    names no type): a request's failure text carries them."""
    message = p.Tokens([1, value])
    with pytest.raises(Exception) as before:
        msgpack.packb(p._to_wire(message), use_bin_type=True)
    with pytest.raises(Exception) as after:
        p.encode(message, "r")
    assert (type(after.value), str(after.value)) == (type(before.value), str(before.value))

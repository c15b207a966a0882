"""Trace context, W3C traceparent, the JSON-lines sink, and traced channels over real ZeroMQ sockets."""

import json
import subprocess
import sys

import pytest
import zmq

from kvferry.common import protocol as p
from kvferry.common import tracing
from kvferry.common.sampling import SamplingParams
from kvferry.common.transport import Channel

VALID = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"


def test_a_valid_traceparent_becomes_the_parent():
    ctx = tracing.parse_traceparent(VALID)
    assert ctx == p.TraceContext("4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7", "")
    child = tracing.child_of(ctx)
    assert child.trace_id == ctx.trace_id and child.parent_id == ctx.span_id
    assert len(child.span_id) == 16 and child.span_id != ctx.span_id
    assert tracing.format_traceparent(child) == f"00-{ctx.trace_id}-{child.span_id}-01"
    assert tracing.parse_traceparent(tracing.format_traceparent(child)).span_id == child.span_id
    # A later version may carry more fields; its first four are still read.
    assert tracing.parse_traceparent("01-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-extra") is not None


@pytest.mark.parametrize(
    "header",
    [
        "",
        "garbage",
        "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7",  # missing flags
        "00-4BF92F3577B34DA6A3CE929D0E0E4736-00f067aa0ba902b7-01",  # upper case
        "00-00000000000000000000000000000000-00f067aa0ba902b7-01",  # all-zero trace id
        "00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01",  # all-zero span id
        "ff-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",  # forbidden version
        "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-extra",  # version 00 has four fields
        "00-4bf92f3577b34da6a3ce929d0e0e473-00f067aa0ba902b7-01",  # short trace id
    ],
)
def test_a_malformed_traceparent_is_ignored(header):
    assert tracing.parse_traceparent(header) is None
    assert tracing.child_of(tracing.parse_traceparent(header)).parent_id == ""  # a new trace, no parent


def test_without_a_parent_a_new_trace_is_minted():
    a, b = tracing.child_of(None), tracing.child_of(None)
    assert len(a.trace_id) == 32 and a.trace_id != b.trace_id and a.parent_id == ""


def test_tracer_writes_one_json_line_per_record(tmp_path):
    tracer = tracing.Tracer(str(tmp_path), "decode", "decode-a")
    ctx = tracing.child_of(None)
    tracer.message("send", "Tokens", "gateway", "r1", ctx, 40, 0)
    tracer.span("decode.step", 10.0, 10.5, batch_size=2, rids=["r1", "r2"])
    tracer.span("kv.transfer_in", 9.0, 9.1, "r1", ctx, bytes=1024)
    tracer.close()
    (path,) = tmp_path.glob("decode-a-*.jsonl")
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert [line["ev"] for line in lines] == ["send", "span", "span"]
    send = lines[0]
    assert send["role"] == "decode" and send["proc"] == "decode-a" and send["kind"] == "Tokens"
    assert send["peer"] == "gateway" and send["rid"] == "r1" and send["header_bytes"] == 40
    assert (send["trace_id"], send["span_id"], send["parent_id"]) == (ctx.trace_id, ctx.span_id, ctx.parent_id)
    assert lines[1]["dur"] == pytest.approx(0.5) and lines[1]["attrs"]["rids"] == ["r1", "r2"]
    assert lines[2]["span_id"] == ctx.span_id and lines[2]["attrs"]["bytes"] == 1024


def test_channels_trace_both_ends_of_a_message(tmp_path):
    ctx_ = zmq.Context()
    router, dealer = ctx_.socket(zmq.ROUTER), ctx_.socket(zmq.DEALER)
    dealer.setsockopt(zmq.IDENTITY, b"prefill-a")
    router.bind("inproc://traced")
    dealer.connect("inproc://traced")
    sender = tracing.Tracer(str(tmp_path), "prefill", "prefill-a")
    receiver = tracing.Tracer(str(tmp_path), "decode", "decode-a")
    out = Channel(dealer, "out", peer_name="decode-a", tracer=sender)
    into = Channel(router, "in", tracer=receiver)
    parent = tracing.child_of(None)
    frame = bytes(2 * 1 * 4 * 2 * 1 * 2 * 4)
    msg = p.KVTransfer(
        prefill_worker_id="prefill-a",
        prompt_token_ids=[1, 2],
        output_token_ids=[3],
        choices=[0],
        sampling=SamplingParams(max_tokens=4, temperature=0.0, top_p=1.0, top_k=0, seed=None, ignore_eos=False),
        num_computed_tokens=2,
        dtype="float32",
        shape=[2, 1, 4, 2, 1, 2],
        deadline_s=1e12,
    )
    sent_ctx = out.send(msg, "r1", parent, frames=[frame])
    peer, env = into.recv()
    assert peer == b"prefill-a" and env.trace == sent_ctx
    assert sent_ctx.trace_id == parent.trace_id and sent_ctx.parent_id == parent.span_id
    into.send(p.KVAck(True), "r1", env.trace, to=peer)
    assert out.recv()[1].trace.parent_id == sent_ctx.span_id  # the ack is a child of the transfer
    sender.close(), receiver.close()
    for sock in (router, dealer):
        sock.close(linger=0)
    ctx_.term()
    (sent,) = [json.loads(x) for f in tmp_path.glob("prefill-a-*") for x in f.read_text().splitlines() if '"send"' in x]
    (got,) = [json.loads(x) for f in tmp_path.glob("decode-a-*") for x in f.read_text().splitlines() if '"recv"' in x]
    assert sent["span_id"] == got["span_id"] == sent_ctx.span_id
    assert sent["payload_bytes"] == got["payload_bytes"] == len(frame)
    assert sent["header_bytes"] == got["header_bytes"] > 0
    assert sent["peer"] == "decode-a" and got["peer"] == "prefill-a" and got["kind"] == "KVTransfer"


def test_tracing_off_writes_nothing_and_imports_no_opentelemetry(tmp_path):
    code = (
        "import sys; from kvferry.common import tracing; t = tracing.configure('gateway', 'gateway', None, None);"
        "assert not t.enabled; t.message('send', 'Abort', 'x', 'r', tracing.child_of(None), 1); t.span('s', 0, 1);"
        "assert not [m for m in sys.modules if m.startswith('opentelemetry')], 'imported opentelemetry'"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=tmp_path)
    assert list(tmp_path.iterdir()) == []


def test_with_tracing_off_a_channel_never_calls_the_tracer():
    class Off:
        enabled = False
        exporter = None

        def message(self, *args, **kwargs):
            raise AssertionError("a disabled tracer was called")

        span = message

    ctx_ = zmq.Context()
    a, b = ctx_.socket(zmq.PAIR), ctx_.socket(zmq.PAIR)
    a.bind("inproc://off")
    b.connect("inproc://off")
    out, into = Channel(a, "a", tracer=Off()), Channel(b, "b", tracer=Off())
    sent = out.send(p.Abort(), "r1", tracing.child_of(None))
    assert into.recv()[1].trace == sent  # the context still travels: only the recording is off
    for sock in (a, b):
        sock.close(linger=0)
    ctx_.term()

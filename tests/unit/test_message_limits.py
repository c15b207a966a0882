"""Message size limits: each kind's header limit holds its largest legal content, encode refuses what decode would
(naming the field that made it too large), a worker's full CacheUpdate goes in chunks that each fit, and every
socket is capped at what it may legally receive."""

import dataclasses
import time

import msgpack
import pytest
import zmq

from kvferry.common import protocol as p
from kvferry.common.block_hash import HASH_BYTES
from kvferry.common.constraint import MAX_CONSTRAINT_BYTES, MAX_FIELD_CHARS, STRUCTURAL_TAG, Constraint
from kvferry.common.model.kv_blocks import layer_groups
from kvferry.common.model.runner import KVCacheLayout
from kvferry.common.sampling import (
    MAX_LOGIT_BIAS,
    MAX_LOGPROBS,
    MAX_SEED,
    MAX_STOP_TOKEN_IDS,
    MAX_TOP_K,
    SamplingParams,
    TokenLogprobs,
)
from kvferry.common.transport import limit_socket
from kvferry.services.decode.worker import max_kv_frame_bytes
from kvferry.services.worker import CACHE_SYNC_S, Worker

WIDEST_TOKEN = 2**32 - 1  # the widest a token id packs (a vocabulary is smaller)
WIDEST_INT = 2**64 - 1
NAME = "w" * 200  # worker ids, addresses: far longer than any real one
WIDEST_SAMPLING = SamplingParams(
    max_tokens=2**62, temperature=1.5, top_p=0.5, top_k=MAX_TOP_K, seed=MAX_SEED, ignore_eos=True,
    stop_token_ids=(WIDEST_INT,) * MAX_STOP_TOKEN_IDS, presence_penalty=-1.5, frequency_penalty=1.5,
    repetition_penalty=1.5, min_p=0.5, min_tokens=2**62, logit_bias=((WIDEST_INT, -99.5),) * MAX_LOGIT_BIAS,
    logprobs=MAX_LOGPROBS, prompt_logprobs=MAX_LOGPROBS,
    constraint=Constraint(STRUCTURAL_TAG, "\U0001f600" * (MAX_CONSTRAINT_BYTES // 4), "\u00e9" * MAX_FIELD_CHARS),
)  # fmt: skip
TRACE = p.TraceContext("t" * 32, "s" * 16, "q" * 16)
WIDEST_LOGPROBS = TokenLogprobs(WIDEST_TOKEN, -1.5, (WIDEST_TOKEN,) * MAX_LOGPROBS, (-1.5,) * MAX_LOGPROBS)


def largest_prefill_request(extra_tokens: int = 0) -> p.PrefillRequest:
    """The longest context split between prompt and resumed tokens, the widest sampling."""
    half = p.MAX_CONTEXT_TOKENS // 2
    return p.PrefillRequest(
        prompt_token_ids=[WIDEST_TOKEN] * (half + extra_tokens),
        sampling=WIDEST_SAMPLING,
        decode_worker_id=NAME,
        decode_address="tcp://" + NAME + ":65535",
        deadline_s=time.time() + 1e6,
        n=p.MAX_CHOICES,
        attempt=WIDEST_INT,
        resume_token_ids=[WIDEST_TOKEN] * (p.MAX_CONTEXT_TOKENS - half),
        choice=p.MAX_CHOICES - 1,
    )


def largest_kv_transfer() -> p.KVTransfer:
    return p.KVTransfer(
        prefill_worker_id=NAME,
        prompt_token_ids=[WIDEST_TOKEN] * (p.MAX_CONTEXT_TOKENS - 1),
        output_token_ids=[WIDEST_TOKEN] * p.MAX_CHOICES,
        choices=list(range(p.MAX_CHOICES)),
        sampling=WIDEST_SAMPLING,
        num_computed_tokens=WIDEST_INT,
        dtype="float32",
        shape=[1, 1, 1, 2, 1, 1],  # its numbers' width is in the fixed allowance; its frame is small to build
        deadline_s=1e12,
        gather_s=1.5,
        sent_at=1e12,
        attempt=WIDEST_INT,
        resume_token_ids=[WIDEST_TOKEN],
        gateway_id=NAME,
        num_skipped_blocks=WIDEST_INT,
        layer_start=WIDEST_INT,
    )


def test_the_largest_legal_prefill_request_and_kv_transfer_pass_encode_and_decode():
    request = largest_prefill_request()
    header = p.encode(request, NAME, TRACE)[0]
    assert len(header) <= p.max_header_bytes(p.Kind.PREFILL_REQUEST)
    assert p.decode([header]).message == request
    transfer = largest_kv_transfer()
    header, frame = p.encode(transfer, NAME, TRACE, frames=[bytes(8)])
    assert len(header) <= p.max_header_bytes(p.Kind.KV_TRANSFER)
    assert p.decode([header, frame]).message == transfer


def test_the_limits_are_tight_not_just_large():
    """A header limit is its kind's legal content plus a fixed allowance, no more: a prompt past the context bound
    by a little is refused."""
    size = len(p.encode(largest_prefill_request(), NAME, TRACE)[0])
    assert p.max_header_bytes(p.Kind.PREFILL_REQUEST) - size <= p.SMALL_HEADER_BYTES
    with pytest.raises(p.MessageTooLarge) as refused:
        p.encode(largest_prefill_request(extra_tokens=p.SMALL_HEADER_BYTES // 4), NAME, TRACE)
    assert refused.value.field == "prompt_token_ids"
    assert "PrefillRequest" in str(refused.value) and "prompt_token_ids" in str(refused.value)


@pytest.mark.parametrize("kind", [p.Kind.FIRST_TOKEN, p.Kind.TOKENS])
def test_a_whole_context_of_logprobs_fits(kind):
    """FirstToken carries the prompt's logprobs (echo), Tokens up to every output token's: with the widest
    alternatives, MAX_CONTEXT_TOKENS of them fit. Measured on a slice and by the bytes each entry adds, since the
    whole would take seconds to build."""

    def message(n):
        if kind == p.Kind.FIRST_TOKEN:
            return p.FirstToken(WIDEST_TOKEN, 5, 1.5, 1.5, [WIDEST_LOGPROBS], [None] + [WIDEST_LOGPROBS] * (n - 1))
        return p.Tokens([WIDEST_TOKEN] * n, 5, 1.5, WIDEST_INT, [WIDEST_LOGPROBS] * n, WIDEST_INT, WIDEST_INT)

    small, large = (len(p.encode(message(n), NAME, TRACE)[0]) for n in (1000, 3000))
    per_entry = (large - small) / 2000
    assert small - 1000 * per_entry + p.MAX_CONTEXT_TOKENS * per_entry <= p.max_header_bytes(kind)
    assert p.decode(p.encode(message(3000), NAME, TRACE)).message == message(3000)


def test_encode_refuses_an_oversized_message_naming_its_largest_field():
    """The issue's case: 400k stop_token_ids made a 1.9 MB PrefillRequest that the worker dropped. SamplingParams
    refuses them now; slipped past it, encode still does, and says which field."""
    params = SamplingParams()
    object.__setattr__(params, "stop_token_ids", (100_000,) * 400_000)  # past its own check; a 128k vocabulary
    request = p.PrefillRequest([1, 2, 3], params, "d0", "tcp://127.0.0.1:1", 1e12)
    with pytest.raises(p.MessageTooLarge) as refused:
        p.encode(request, "r")
    assert isinstance(refused.value, p.ProtocolError)
    assert refused.value.field == "sampling.stop_token_ids"
    assert "PrefillRequest" in str(refused.value) and "sampling.stop_token_ids" in str(refused.value)
    with pytest.raises(p.MessageTooLarge, match="request_id") as refused:
        p.encode(p.Abort(), "r" * p.SMALL_HEADER_BYTES)
    assert refused.value.field == "request_id"


def test_encode_refuses_an_oversized_frame():
    class Huge:
        nbytes = p.MAX_FRAME_BYTES + 1

    message = dataclasses.replace(largest_kv_transfer(), prompt_token_ids=[1])
    with pytest.raises(p.MessageTooLarge, match="frame") as refused:
        p.encode(message, "r", frames=[Huge()])
    assert refused.value.field == "frames"


def test_decode_holds_each_kind_to_its_own_limit():
    """A header a PrefillRequest may have is far too big for an Abort: refused by its kind's limit, before
    unpacking when the kind can be read from its first bytes, and after when it cannot."""
    padding = "r" * (p.max_header_bytes(p.Kind.ABORT) + 10)
    big_abort = msgpack.packb([int(p.Kind.ABORT), p.PROTOCOL_VERSION, padding, {}, {}])
    assert len(big_abort) < p.max_header_bytes(p.Kind.PREFILL_REQUEST)
    with pytest.raises(p.MessageTooLarge, match="Abort"):
        p.decode([big_abort])
    # The same content as a 16-bit array (a header a canonical packer never writes): the kind is read after.
    with pytest.raises(p.MessageTooLarge, match="Abort"):
        p.decode([b"\xdc\x00\x05" + big_abort[1:]])
    request = p.PrefillRequest([1] * 20_000, SamplingParams(), "d0", "tcp://127.0.0.1:1", 1e12)
    assert p.decode(p.encode(request, padding)).message == request
    with pytest.raises(p.ProtocolError, match="exceeds"):
        p.decode([b"\x95" + b"\0" * p.MAX_HEADER_BYTES])


def test_every_kind_has_a_limit_and_small_kinds_a_small_one():
    assert p.MAX_HEADER_BYTES == max(p.max_header_bytes(k) for k in p.Kind)
    small = (p.Kind.REGISTER, p.Kind.REGISTER_REPLY, p.Kind.HEARTBEAT, p.Kind.ABORT, p.Kind.KV_ACK, p.Kind.KV_HELD)
    assert all(p.max_header_bytes(k) == p.SMALL_HEADER_BYTES for k in small)
    assert p.max_header_bytes(*small, p.Kind.PREFILL_REQUEST) == p.max_header_bytes(p.Kind.PREFILL_REQUEST)
    query = p.KVQuery([bytes(HASH_BYTES)] * (p.MAX_CONTEXT_TOKENS // p.MIN_BLOCK_SIZE), WIDEST_INT)
    assert len(p.encode(query, NAME, TRACE)[0]) <= p.max_header_bytes(p.Kind.KV_QUERY)
    register = p.Register(1, NAME, NAME, "bfloat16", 32, WIDEST_INT, WIDEST_INT, NAME, "int8", NAME)
    heartbeat = p.Heartbeat(NAME, p.WorkerStats(*[WIDEST_INT] * len(dataclasses.fields(p.WorkerStats))), False)
    for message in (register, heartbeat, p.KVAck(False, "r" * 4096, False, WIDEST_INT, True)):
        assert len(p.encode(message, NAME, TRACE)[0]) <= p.max_header_bytes(message.KIND)


# -- CacheUpdate in chunks -----------------------------------------------------------------------------------
def apply(cached: set, update: p.CacheUpdate) -> None:
    """What the gateway's registry does with one CacheUpdate (services/gateway/registry.py)."""
    if update.full:
        cached.clear()
        cached.update(update.stored)
    else:
        cached.difference_update(update.evicted)
        cached.update(update.stored)


def hashes(n: int, start: int = 0) -> list[bytes]:
    return [i.to_bytes(HASH_BYTES, "big") for i in range(start, start + n)]


def test_a_full_cache_update_goes_in_chunks_that_each_fit_and_together_are_the_set():
    everything = hashes(3 * p.MAX_CACHE_UPDATE_HASHES + 5)
    chunks = p.cache_update_chunks("w", everything, full=True)
    assert len(chunks) == 4
    assert [c.full for c in chunks] == [True, False, False, False]  # the first replaces, the rest add
    for chunk in chunks:
        assert len(p.encode(chunk, "", TRACE)[0]) <= p.max_header_bytes(p.Kind.CACHE_UPDATE)
    cached = set(hashes(10, start=10**9))  # stale: the full update replaces it
    for chunk in chunks:
        apply(cached, chunk)
    assert cached == set(everything)
    # A lost chunk leaves a gap until the next full sync, which heals it.
    cached = set()
    for i, chunk in enumerate(chunks):
        if i != 2:
            apply(cached, chunk)
    assert cached == set(everything) - set(chunks[2].stored)
    for chunk in p.cache_update_chunks("w", everything, full=True):
        apply(cached, chunk)
    assert cached == set(everything)


def test_an_empty_full_update_still_clears_and_an_incremental_one_is_chunked_too():
    [only] = p.cache_update_chunks("w", [], full=True)
    assert only.full and only.stored == []
    assert p.cache_update_chunks("w", [], []) == []
    stored, evicted = hashes(p.MAX_CACHE_UPDATE_HASHES), hashes(p.MAX_CACHE_UPDATE_HASHES + 1, start=10**6)
    chunks = p.cache_update_chunks("w", stored, evicted)
    assert not any(c.full for c in chunks) and len(chunks) == 3
    assert all(len(c.stored) + len(c.evicted) <= p.MAX_CACHE_UPDATE_HASHES for c in chunks)
    cached = set(evicted)
    for chunk in chunks:
        apply(cached, chunk)
    assert cached == set(stored)


class FakeEngine:
    caching_enabled = True

    def __init__(self, cached: list[bytes]):
        self.cached = cached
        self.events = ([], [])

    def cached_block_hashes(self):
        return list(self.cached)

    def take_cache_events(self):
        events, self.events = self.events, ([], [])
        return events


class FakeChannel:
    def __init__(self):
        self.sent = []

    def send(self, message, *args, **kwargs):
        p.encode(message)  # what the real channel does first: raises on an oversized message
        self.sent.append(message)


class FakeLink:
    def __init__(self):
        self.registered, self.cache_sync_at, self.channel = True, 0.0, FakeChannel()


def test_a_worker_with_a_big_cache_sends_its_full_set_in_chunks_that_each_fit():
    """Past about 58k blocks one full CacheUpdate passed the old 1 MiB limit and was dropped."""
    worker = Worker.__new__(Worker)  # the cache-update logic alone: no model, no sockets
    worker.worker_id, worker.engine, worker.links = "decode-0", FakeEngine(hashes(100_000)), [FakeLink()]
    worker.send_cache_updates()
    sent = worker.links[0].channel.sent
    assert len(sent) == 7 and sent[0].full and not any(c.full for c in sent[1:])
    cached = set()
    for update in sent:
        apply(cached, update)
    assert cached == set(worker.engine.cached)
    assert worker.links[0].cache_sync_at > time.monotonic() + CACHE_SYNC_S - 5
    sent.clear()
    worker.engine.events = (hashes(p.MAX_CACHE_UPDATE_HASHES + 1, start=10**6), [])  # a big step's stores
    worker.send_cache_updates()
    assert len(sent) == 2 and not any(c.full for c in sent)


# -- socket limits -------------------------------------------------------------------------------------------
def test_limit_socket_caps_messages_and_turns_on_heartbeats():
    ctx = zmq.Context.instance()
    router, dealer, other = ctx.socket(zmq.ROUTER), ctx.socket(zmq.DEALER), ctx.socket(zmq.DEALER)
    try:
        limit_socket(router, 4096)
        assert 4096 <= router.getsockopt(zmq.MAXMSGSIZE) <= 4096 + 64 * 1024
        assert router.getsockopt(zmq.HEARTBEAT_IVL) > 0
        assert router.getsockopt(zmq.HEARTBEAT_TIMEOUT) >= router.getsockopt(zmq.HEARTBEAT_IVL)
        assert router.getsockopt(zmq.HEARTBEAT_TTL) > 0
        port = router.bind_to_random_port("tcp://127.0.0.1")
        for sock in (dealer, other):
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(f"tcp://127.0.0.1:{port}")
        dealer.send(bytes(router.getsockopt(zmq.MAXMSGSIZE) + 1))  # its connection is dropped at the length prefix
        other.send(b"small")
        assert router.poll(5000)
        assert router.recv_multipart()[1] == b"small"
        assert not router.poll(300)
    finally:
        for sock in (router, dealer, other):
            sock.close(linger=0)


def test_the_heartbeat_timeout_covers_the_largest_message_on_a_slow_link():
    """ZeroMQ restarts a heartbeat's timeout only when a whole frame arrives: a socket that takes or sends big
    frames must wait longer than one takes to cross."""
    ctx = zmq.Context.instance()
    small, big = ctx.socket(zmq.DEALER), ctx.socket(zmq.DEALER)
    try:
        limit_socket(small, 4096)
        limit_socket(big, 1 << 30)
        assert big.getsockopt(zmq.HEARTBEAT_TIMEOUT) > small.getsockopt(zmq.HEARTBEAT_TIMEOUT) + 10_000
        base_ttl = small.getsockopt(zmq.HEARTBEAT_TTL)
        limit_socket(small, 4096, max_send_bytes=1 << 30)  # the peer, pinged, may wait for our biggest frame
        assert small.getsockopt(zmq.HEARTBEAT_TTL) > base_ttl + 10_000
    finally:
        small.close(linger=0)
        big.close(linger=0)


def test_the_kv_ingress_limit_is_one_layer_group_of_every_block():
    """The largest legal KV frame a decode worker can take: its biggest layer group, with all its blocks."""

    class Engine:  # SmolLM2's layout: 30 layers in groups of 5
        layout = KVCacheLayout(num_layers=30, num_kv_heads=3, head_dim=64, block_size=16, dtype_bytes=4)
        num_layers, num_blocks, bytes_per_block = 30, 364, layout.bytes_per_block
        layer_groups = layer_groups(30)

    lo, hi = max(Engine.layer_groups, key=lambda g: g[1] - g[0])
    transfer = dataclasses.replace(
        largest_kv_transfer(), dtype="float32", shape=[hi - lo, Engine.num_blocks, 16, 2, 3, 64]
    )
    assert max_kv_frame_bytes(Engine) == p.kv_frame_bytes(transfer)


# -- what workers make stays within the limits ---------------------------------------------------------------
def test_a_worker_whose_context_is_past_the_protocols_bound_refuses_to_start(monkeypatch):
    import kvferry.services.worker as worker_module
    from kvferry.common.errors import ConfigError

    class LongEngine:
        def __init__(self, config, connector=None):
            self.max_model_len = p.MAX_CONTEXT_TOKENS + 1

    monkeypatch.setattr(worker_module, "LLMEngine", LongEngine)
    with pytest.raises(ConfigError, match="max_model_len .* set --max-model-len"):
        Worker(None, "tcp://127.0.0.1:1", worker_id="w")


def test_a_failure_told_to_a_gateway_is_cut_to_fit():
    """An exception's text can quote a whole input (a choices list, a prompt): the RequestFailed carrying it still
    fits the small limit, instead of failing to encode."""
    worker, link = Worker.__new__(Worker), FakeLink()
    worker.worker_id = "w"
    worker.send_failure(link, "r", 0, None, "bad: " + "x" * 200_000, code=400)
    [failure] = link.channel.sent
    assert failure.message.startswith("bad: x") and len(failure.message) <= 2000 and failure.code == 400

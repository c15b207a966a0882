"""Wire messages: one small typed class per kind, a msgpack header and raw frames.

A message is a ZeroMQ multipart message `[header, frame, ...]`: the header is msgpack `[kind, version, request_id,
trace, body]`, and each tensor is a raw frame (described in the body: dtype, shape) sent without copying. No pickle.

Decoding is strict: anything unexpected (unknown kind, other version, missing, extra or mistyped field, a frame count
or size unlike its description, an oversized header or frame) raises ProtocolError and nothing else.

Sizes are bounded per kind: `max_header_bytes(kind)` is what its largest legal content packs to (a whole context of
tokens for a PrefillRequest or KVTransfer, of logprobs for a FirstToken; a small allowance for control messages).
encode refuses what decode would (MessageTooLarge, naming the field), so an oversized message fails where it is made,
not silently at the receiver; sockets are capped at the same sizes (transport.limit_socket), so it is not even
buffered.
"""

import enum
import functools
import math
import types
import typing
from dataclasses import MISSING, dataclass, field, fields

import msgpack

from kvferry.common.block_hash import HASH_BYTES
from kvferry.common.constraint import MAX_CONSTRAINT_BYTES, MAX_FIELD_CHARS, STRUCTURAL_TAG, Constraint
from kvferry.common.errors import InvalidRequest
from kvferry.common.gateway_config import GatewayConfig
from kvferry.common.sampling import (
    MAX_LOGIT_BIAS,
    MAX_LOGPROBS,
    MAX_SEED,
    MAX_STOP_TOKEN_IDS,
    MAX_TOP_K,
    SamplingParams,
    TokenLogprobs,
)

# 12: sampling parameters carry a structured-output constraint. 13: sampling stream 2 (model/sampler.py), seeded
# draws keyed by (seed, output position): a prefill worker samples output 0 and a decode worker the rest, so the
# two must draw the same stream; a mixed pair would splice two. 14: TokenBatch, a decode step's tokens for one gateway
# in one message (RegisterReply.token_batches). 15: sampling stream 3, the plain rows' weights by the CPU's C kernel.
# 16: sampling stream 4, a filtered row's tries from its whole distribution before its kept set.
PROTOCOL_VERSION = 16
MAX_FRAME_BYTES = 1 << 31
# Tokens in one sequence, prompt and output: a bound on the max_model_len of any worker (one with a longer one
# refuses to start). It covers 256k-context models; the big messages' limits follow from it.
MAX_CONTEXT_TOKENS = 1 << 18
MAX_CHOICES = 128  # n per request: a bound on what one message can make a worker do
MIN_BLOCK_SIZE = 8  # the smallest block_size setting: the most block hashes one prompt has
MAX_CACHE_UPDATE_HASHES = 1 << 14  # block hashes (stored and evicted) in one CacheUpdate: more go in chunks
SMALL_HEADER_BYTES = 64 << 10  # names, addresses, trace ids, numbers, error text and msgpack's framing: any kind's


class ProtocolError(Exception):
    """A message that does not follow the protocol; the receiver counts it, logs it and moves on."""


class MessageTooLarge(ProtocolError):
    """A header past its kind's limit (or a frame past MAX_FRAME_BYTES). From encode, `field` names what made it
    so large (dotted into a nested dataclass: "sampling.stop_token_ids")."""

    def __init__(self, kind: str, size: int, limit: int, field: str = ""):
        self.kind, self.size, self.limit, self.field = kind, size, limit, field
        what = f"; its largest field is {field}" if field else ""
        super().__init__(f"{kind} of {size} bytes exceeds its limit of {limit}{what}")


UNKNOWN_WORKER = "unknown worker: register again"  # a gateway's RegisterReply to a worker it does not know
# A worker's heartbeat socket connects as its id plus this: the gateway takes heartbeats from that connection too.
HEARTBEAT_SUFFIX = b"/heartbeat"


class Kind(enum.IntEnum):
    REGISTER = 1
    REGISTER_REPLY = 2
    HEARTBEAT = 3
    PREFILL_REQUEST = 4
    FIRST_TOKEN = 5
    KV_TRANSFER = 6
    KV_ACK = 7
    TOKENS = 8
    ABORT = 9
    REQUEST_FAILED = 10
    DEREGISTER = 11
    CACHE_UPDATE = 12
    KV_QUERY = 13
    KV_HELD = 14
    TOKEN_BATCH = 15


class Role(enum.IntEnum):
    PREFILL = 0
    DECODE = 1


@dataclass
class TraceContext:
    """W3C-style ids (hex): the request's trace, this message's (or span's) own id, and the span that caused it."""

    trace_id: str = ""
    span_id: str = ""
    parent_id: str = ""


@dataclass
class WorkerStats:
    num_free_blocks: int
    num_total_blocks: int
    num_running: int
    num_waiting: int
    queued_prompt_tokens: int
    num_preemptions: int = 0
    num_protocol_errors: int = 0
    num_prompts_prefilled: int = 0  # prefill workers: prompts computed (once per request, whatever its n)
    num_prompt_tokens_computed: int = 0  # prompt tokens run through the model
    num_prompt_tokens_cached: int = 0  # prompt tokens whose KV the prefix cache supplied instead
    num_cached_blocks: int = 0  # blocks in the prefix cache, in use or free
    num_kv_bytes_sent: int = 0  # prefill workers: KV bytes shipped to decode workers
    num_kv_bytes_skipped: int = 0  # and the bytes left out because the decode worker held those blocks
    num_kv_bytes_sent_early: int = 0  # of the bytes shipped, those sent while the prompt was still computing
    num_grammar_compiles: int = 0  # structured-output constraints compiled (cache misses)
    num_grammar_cache_hits: int = 0  # constraints found compiled in the cache
    grammar_compile_s: float = 0.0  # seconds spent compiling, all compiles together


# --- messages -------------------------------------------------------------------------------------------------
MESSAGES: dict[int, type] = {}  # every message class, by its kind


def message(kind: Kind):
    """A message class: a dataclass with its KIND, registered in MESSAGES."""

    def make(cls: type) -> type:
        cls.KIND, MESSAGES[kind] = kind, cls
        return dataclass(cls)

    return make


@message(Kind.REGISTER)
class Register:
    role: int
    worker_id: str
    model: str
    dtype: str
    block_size: int
    num_blocks: int
    max_model_len: int
    kv_address: str = ""  # decode workers: where prefill workers send KV
    quantization: str = "none"  # or "int8", "int4": prefill and decode workers must compute alike
    # New with every process start: a gateway that sees a known worker id with a new instance knows the old
    # process is gone, and moves its requests at once instead of waiting for their deadlines.
    instance_id: str = ""


@message(Kind.REGISTER_REPLY)
class RegisterReply:
    accepted: bool
    reason: str = ""
    heartbeat_interval_s: float = GatewayConfig.heartbeat_interval
    gateway_id: str = ""  # the gateway's name for itself: replies about its requests go back to it
    # The gateway takes TokenBatch: a decode worker sends each step's tokens for it as one (else a Tokens each).
    token_batches: bool = False


@message(Kind.HEARTBEAT)
class Heartbeat:
    worker_id: str
    stats: WorkerStats
    healthy: bool = True  # False: the process is alive but its step loop has not come round in time


@message(Kind.DEREGISTER)
class Deregister:
    """A worker that is shutting down: route nothing new to it; with final, it is gone and what it still
    held must be moved elsewhere."""

    worker_id: str
    final: bool = False


@message(Kind.CACHE_UPDATE)
class CacheUpdate:
    """What a worker's prefix cache holds, for cache-aware routing: the block hashes stored and evicted since its
    last update, or with full, every hash it holds (sent on registration and now and then, so a lost update
    heals). At most MAX_CACHE_UPDATE_HASHES hashes each: a bigger update goes in chunks (cache_update_chunks), a
    full one as a full first chunk (the set is replaced) followed by plain ones (added to it)."""

    worker_id: str
    stored: list[bytes]
    evicted: list[bytes] = field(default_factory=list)
    full: bool = False


@message(Kind.PREFILL_REQUEST)
class PrefillRequest:
    prompt_token_ids: list[int]
    sampling: SamplingParams
    decode_worker_id: str
    decode_address: str
    deadline_s: float  # wall-clock time after which the request is given up
    n: int = 1  # choices: the prompt is prefilled once, each choice samples its own first token
    # A request moved off a failed worker: its attempt number, and the tokens one choice had generated,
    # which are prefilled with the prompt so that generation continues where it stopped.
    attempt: int = 0
    resume_token_ids: list[int] = field(default_factory=list)
    choice: int = 0  # the resumed choice (a resume carries exactly one)


@message(Kind.FIRST_TOKEN)
class FirstToken:
    token_id: int
    finish_reason: int = -1  # -1: goes on to decode; else a FinishReason
    queue_s: float = 0.0  # arrival at the prefill worker to its first scheduled chunk
    prefill_s: float = 0.0  # first chunk to the sampled first token
    logprobs: list[TokenLogprobs] = field(default_factory=list)  # the token's, when asked for
    prompt_logprobs: list[TokenLogprobs | None] = field(default_factory=list)  # when asked for (echo); entry 0 is None
    choice: int = 0
    attempt: int = 0
    start: int = 0  # the token's index in its choice's output (more than 0 on a resume)


@message(Kind.KV_TRANSFER)
class KVTransfer:
    """One frame: the K and V of one group of layers, [layers, blocks, block_size, 2, kv_heads, head_dim] (K and V of
    a token side by side, as the cache holds them). A transfer is one message per group, in layer order, alike but for
    the layers and the first tokens: groups sent while the prompt still computes carry no output_token_ids. The last
    always carries them, for the choices that go on decoding (a subset of the first group's; none left: the sender
    aborts instead)."""

    prefill_worker_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]  # one first token per choice still to decode
    choices: list[int]  # which choices those are
    sampling: SamplingParams
    num_computed_tokens: int
    dtype: str
    shape: list[int]  # of the one frame
    deadline_s: float
    gather_s: float = 0.0  # time the prefill worker spent copying the blocks out after the prompt's compute
    sent_at: float = 0.0  # wall clock at send: the receiver times the hop (same-host clocks agree)
    attempt: int = 0
    resume_token_ids: list[int] = field(default_factory=list)  # outputs before the first token, already in the KV
    gateway_id: str = ""  # the gateway the request came from: the decode worker streams the tokens there
    num_skipped_blocks: int = 0  # the first blocks, held by the receiver for this request (KVHeld): not in the frames
    layer_start: int = 0  # the frames hold layers [layer_start, layer_start + shape[0]): one message per layer group


@message(Kind.KV_QUERY)
class KVQuery:
    """Prefill to decode worker, when a prompt starts computing: which of these leading full blocks (chained
    hashes) do you hold? The receiver keeps those it holds for the request until its KVTransfer comes (or it ends)."""

    block_hashes: list[bytes]
    attempt: int = 0


@message(Kind.KV_HELD)
class KVHeld:
    """The answer: the first num_blocks of the query's blocks are held here; the transfer may leave them out."""

    num_blocks: int
    attempt: int = 0


@message(Kind.KV_ACK)
class KVAck:
    accepted: bool
    reason: str = ""
    retry: bool = True  # a refusal that may pass later (no room) rather than never (bad request)
    attempt: int = 0
    resend_all: bool = False  # the blocks the transfer left out are no longer held: send every block


@message(Kind.TOKENS)
class Tokens:
    token_ids: list[int]
    finish_reason: int = -1
    kv_transfer_s: float = 0.0  # on a sequence's first Tokens message only
    kv_transfer_bytes: int = 0
    logprobs: list[TokenLogprobs] = field(default_factory=list)  # one per token, when asked for
    choice: int = 0
    attempt: int = 0
    start: int = 0  # the first token's index in its choice's output: the gateway drops repeats, spots gaps


@message(Kind.TOKEN_BATCH)
class TokenBatch:
    """One decode step's Tokens for one gateway, each with its request's id, in the order the step made them: one
    message (one receive, one decode) per step in place of one per sequence. A step whose Tokens would pass the
    kind's size limit goes as several (token_batches)."""

    sequences: list[tuple[str, Tokens]]


@message(Kind.ABORT)
class Abort:
    choice: int = -1  # -1: the whole request; else only that choice (it ended early: a stop string)
    attempt: int = 0


@message(Kind.REQUEST_FAILED)
class RequestFailed:
    message: str
    code: int = 500
    attempt: int = 0
    retry: bool = False  # the worker gave up on something another worker may do (a transfer nobody took)


FRAMED = {Kind.KV_TRANSFER: 1}  # kinds that carry raw frames, and how many
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def kv_frame_bytes(message: "KVTransfer") -> int:
    """The exact size a KVTransfer's frame must have."""
    if message.dtype not in DTYPE_BYTES:
        raise ProtocolError(f"KVTransfer.dtype {message.dtype!r} is not one of {sorted(DTYPE_BYTES)}")
    if len(message.shape) != 6 or message.shape[3] != 2 or any(n < 0 for n in message.shape):
        raise ProtocolError(
            f"KVTransfer.shape {message.shape} is not [layers, blocks, block_size, 2, kv_heads, head_dim]"
        )
    return DTYPE_BYTES[message.dtype] * math.prod(message.shape)


@dataclass
class Envelope:
    """A decoded message with what travels around it."""

    message: object
    request_id: str = ""
    trace: TraceContext = field(default_factory=TraceContext)
    frames: list = field(default_factory=list)  # zmq.Frame or bytes-like, zero-copy


# --- encoding -----------------------------------------------------------------------------------------------------
_NO_DEFAULT = object()


def _default(f) -> object:
    if f.default is not MISSING:
        return f.default
    return _NO_DEFAULT if f.default_factory is MISSING else f.default_factory()


@functools.cache
def _wire_fields(cls) -> tuple[tuple[str, object], ...]:
    """(name, default) per field of a message class, _NO_DEFAULT for a required one."""
    return tuple((f.name, _default(f)) for f in fields(cls))


def _wire_dict(value) -> dict:
    """A dataclass as encode's msgpack hook takes it: its fields not at their default, each as it is, for msgpack to
    pack (and to hand back here where it is a dataclass). What _to_wire makes, a level at a time: msgpack walks the
    lists in C, where _to_wire's recursion made a Python call per item (most of a TokenBatch's encode)."""
    try:
        wire_fields = _wire_fields(type(value))
    except TypeError:  # no dataclass: msgpack's own error, as packing without the hook raised it
        if isinstance(value, int):  # msgpack hands the hook an int it cannot pack (past 64 bits)
            raise OverflowError("Integer value out of range") from None
        raise TypeError(f"can not serialize {type(value).__name__!r} object") from None
    values = value.__dict__
    out = {}
    for name, default in wire_fields:
        v = values[name]
        if type(v) is type(default) and v == default:
            continue
        out[name] = v
    return out


def _to_wire(value, omit_defaults: bool = True):
    """A message as msgpack takes it. A field at its default is left out (the receiver fills it in): most of a
    token message's fields are, and both ends pay for every byte."""
    if hasattr(value, "__dataclass_fields__"):
        out = {}
        for name, default in _wire_fields(type(value)):
            v = getattr(value, name)
            if omit_defaults and type(v) is type(default) and v == default:
                continue
            out[name] = _to_wire(v, omit_defaults)
        return out
    if isinstance(value, (list, tuple)):
        if value and type(value[0]) is int:  # token ids: nothing inside to convert
            return value
        return [_to_wire(v, omit_defaults) for v in value]
    return value


def _packed_bytes(value) -> int:
    """What value packs to with every field present (as a bound on the size of messages holding it)."""
    return len(msgpack.packb(_to_wire(value, omit_defaults=False), use_bin_type=True))


# --- size limits ----------------------------------------------------------------------------------------------
# Each kind's largest legal content, measured by packing its widest items: token ids below 2**32 (a vocabulary is
# smaller), sampling parameters at their caps, logprobs with every alternative.
_WIDEST_INT, _WIDEST_TOKEN = 2**64 - 1, 2**32 - 1
_TOKEN_BYTES = _packed_bytes(_WIDEST_TOKEN)
_HASH_BYTES = _packed_bytes(bytes(HASH_BYTES))
_LOGPROBS_BYTES = _packed_bytes(
    TokenLogprobs(_WIDEST_TOKEN, -1.0, (_WIDEST_TOKEN,) * MAX_LOGPROBS, (-1.0,) * MAX_LOGPROBS)
)
_SAMPLING_BYTES = _packed_bytes(
    SamplingParams(
        max_tokens=_WIDEST_INT,
        min_tokens=_WIDEST_INT,
        top_k=MAX_TOP_K,
        seed=MAX_SEED,
        stop_token_ids=(_WIDEST_INT,) * MAX_STOP_TOKEN_IDS,
        logit_bias=((_WIDEST_INT, -1.0),) * MAX_LOGIT_BIAS,
        logprobs=MAX_LOGPROBS,
        prompt_logprobs=MAX_LOGPROBS,
        constraint=Constraint(STRUCTURAL_TAG, "x" * MAX_CONSTRAINT_BYTES, "\U0001f600" * MAX_FIELD_CHARS),
    )
)
_CONTENT_BYTES = {  # beyond SMALL_HEADER_BYTES; a kind not named carries nothing but small fields
    Kind.PREFILL_REQUEST: _SAMPLING_BYTES + MAX_CONTEXT_TOKENS * _TOKEN_BYTES,  # prompt and resumed tokens together
    # ... and one first token and choice number per choice.
    Kind.KV_TRANSFER: _SAMPLING_BYTES + (MAX_CONTEXT_TOKENS + 2 * MAX_CHOICES) * _TOKEN_BYTES,
    Kind.FIRST_TOKEN: (MAX_CONTEXT_TOKENS + 1) * _LOGPROBS_BYTES,  # the prompt's logprobs (echo), and the token's
    Kind.TOKENS: MAX_CONTEXT_TOKENS * (_TOKEN_BYTES + _LOGPROBS_BYTES),
    # As much as one Tokens carries at most (TOKEN_BATCH_BYTES, what token_batches fills a batch up to): a batch is
    # cut before the entry that would take it past that; SMALL_HEADER_BYTES' allowance covers the framing.
    Kind.TOKEN_BATCH: MAX_CONTEXT_TOKENS * (_TOKEN_BYTES + _LOGPROBS_BYTES),
    Kind.KV_QUERY: MAX_CONTEXT_TOKENS // MIN_BLOCK_SIZE * _HASH_BYTES,
    Kind.CACHE_UPDATE: MAX_CACHE_UPDATE_HASHES * _HASH_BYTES,
}


# What token_batches fills a batch up to (its entries' bounds together): as much as one Tokens may carry.
TOKEN_BATCH_BYTES = _CONTENT_BYTES[Kind.TOKEN_BATCH]
# An entry's bound but for its request id and lists' items: its widest small fields, and the widest headers of the
# id's string and the two lists.
_ENTRY_BYTES = 4 + 2 * 4 + _packed_bytes(("", Tokens([], _WIDEST_INT, -1.0, _WIDEST_INT, [], *(3 * [_WIDEST_INT]))))


def token_batch_entry_bytes(request_id: str, tokens: Tokens) -> int:
    """At least what one (request id, Tokens) packs to inside a TokenBatch."""
    num_tokens, num_logprobs = len(tokens.token_ids), len(tokens.logprobs)
    return _ENTRY_BYTES + len(request_id.encode()) + num_tokens * _TOKEN_BYTES + num_logprobs * _LOGPROBS_BYTES


def token_batches(sequences: list[tuple[str, Tokens]], max_bytes: int = TOKEN_BATCH_BYTES) -> list[TokenBatch]:
    """One step's (request id, Tokens) for one gateway as TokenBatch messages, in order: one, unless together they
    could pass max_bytes; then each batch is cut before the entry that would take it past. An entry alone past it
    (as large as a Tokens may be, with a long request id) goes alone, and encode refuses it if it is too large,
    as it would the Tokens."""
    batches, batch, size = [], [], 0
    for request_id, tokens in sequences:
        num_bytes = token_batch_entry_bytes(request_id, tokens)
        if batch and size + num_bytes > max_bytes:
            batches.append(TokenBatch(batch))
            batch, size = [], 0
        batch.append((request_id, tokens))
        size += num_bytes
    if batch:
        batches.append(TokenBatch(batch))
    return batches


def max_header_bytes(*kinds: Kind) -> int:
    """The largest legal header of these kinds: what encode lets out, what decode takes, and (with a margin) what a
    socket receiving them lets in."""
    return SMALL_HEADER_BYTES + max(_CONTENT_BYTES.get(kind, 0) for kind in kinds)


MAX_HEADER_BYTES = max_header_bytes(*Kind)
# Which kinds arrive on which socket: its limit is the largest of theirs.
GATEWAY_RECEIVES = (
    Kind.REGISTER,
    Kind.HEARTBEAT,
    Kind.DEREGISTER,
    Kind.CACHE_UPDATE,
    Kind.FIRST_TOKEN,
    Kind.TOKENS,
    Kind.TOKEN_BATCH,
    Kind.REQUEST_FAILED,
)
WORKER_RECEIVES = (Kind.REGISTER_REPLY, Kind.PREFILL_REQUEST, Kind.ABORT)  # on a worker's control socket
KV_INGRESS_RECEIVES = (Kind.KV_TRANSFER, Kind.KV_QUERY, Kind.ABORT)  # a decode worker's, from prefill workers
KV_SENDER_RECEIVES = (Kind.KV_HELD, Kind.KV_ACK)  # a prefill worker's, from decode workers


def frame_bytes(frame) -> int:
    if hasattr(frame, "nbytes"):
        return frame.nbytes
    return len(frame.buffer) if hasattr(frame, "buffer") else len(frame)


def _largest_field(wire: dict, prefix: str = "") -> str:
    """The field of a message (as _to_wire made it) that packs largest, dotted into a nested one."""
    name = max(wire, key=lambda n: _packed_bytes(wire[n]))
    if isinstance(wire[name], dict) and wire[name]:
        return _largest_field(wire[name], f"{prefix}{name}.")
    return prefix + name


def shorten(text: str, limit: int) -> str:
    """Text a message carries (a failure's reason), cut to limit characters: an exception's message can quote a whole
    input, and the message must stay within its kind's header limit."""
    return text if len(text) <= limit else text[: limit - 3] + "..."


def cache_update_chunks(worker_id: str, stored: list[bytes], evicted: list[bytes] = (), full: bool = False) -> list:
    """One cache update as CacheUpdates of at most MAX_CACHE_UPDATE_HASHES hashes each, meaning together what it
    would: a full one's first chunk replaces the receiver's set (an empty full update still clears it) and the rest
    add to it; an incremental one's evictions go first, as one message's are applied first. A lost chunk leaves
    the receiver's view short until the next full update, which replaces it."""
    n = MAX_CACHE_UPDATE_HASHES
    if full:
        return [CacheUpdate(worker_id, list(stored[i : i + n]), full=i == 0) for i in range(0, max(len(stored), 1), n)]
    items = [(h, True) for h in evicted] + [(h, False) for h in stored]
    return [
        CacheUpdate(
            worker_id,
            [h for h, gone in items[i : i + n] if not gone],
            [h for h, gone in items[i : i + n] if gone],
        )
        for i in range(0, len(items), n)
    ]


def encode(message, request_id: str = "", trace: TraceContext | None = None, frames: list | None = None) -> list:
    """-> [header bytes, *frames]; frames are passed through untouched (zero-copy on send). MessageTooLarge for a
    message decode would refuse for its size."""
    frames = list(frames or [])
    name = type(message).__name__
    _check_frames(message.KIND, frames, "frames")
    trace = trace or TraceContext()
    header = msgpack.packb(
        [int(message.KIND), PROTOCOL_VERSION, request_id, trace, message], default=_wire_dict, use_bin_type=True
    )
    limit = max_header_bytes(message.KIND)
    if len(header) > limit:
        field = _largest_field({**_to_wire(message), "request_id": request_id, "trace": _to_wire(trace)})
        raise MessageTooLarge(name, len(header), limit, field)
    return [header, *frames]


# --- strict decoding ------------------------------------------------------------------------------------------
def _checker(annotation, where: str):
    """A function that validates a decoded msgpack value against a field annotation and returns the typed value,
    worked out once per field (where: its dotted name, for the error): looking the annotation over at every value
    took most of a token message's decode, and the gateway decodes one per step."""
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        return _union_checker(annotation, where)
    if origin in (list, tuple):  # list[X], tuple[X, ...] or a fixed tuple[X, Y]: msgpack carries all as lists
        return _sequence_checker(origin, typing.get_args(annotation), where)
    if hasattr(annotation, "__dataclass_fields__"):
        return _builder(annotation, where)
    if annotation is float:

        def check_float(value):
            if type(value) is not float and (isinstance(value, bool) or not isinstance(value, int)):
                raise ProtocolError(f"{where}: expected a number, got {type(value).__name__}")
            return float(value)

        return check_float
    if annotation is int:

        def check_int(value):
            if type(value) is not int:  # msgpack makes no other int type but bool
                raise ProtocolError(f"{where}: expected an int, got {type(value).__name__}")
            return value

        return check_int
    if annotation in (str, bool, bytes):

        def check_exact(value):
            if type(value) is not annotation:
                raise ProtocolError(f"{where}: expected {annotation.__name__}, got {type(value).__name__}")
            return value

        return check_exact
    raise ProtocolError(f"{where}: unsupported field type {annotation}")


def _union_checker(annotation, where: str):
    options = typing.get_args(annotation)
    nullable = type(None) in options
    checks = [_checker(option, where) for option in options if option is not type(None)]

    def check_union(value):
        if value is None and nullable:
            return None
        for check in checks:
            try:
                return check(value)
            except ProtocolError:
                pass
        raise ProtocolError(f"{where}: {type(value).__name__} is not {annotation}")

    return check_union


def _sequence_checker(origin, args: tuple, where: str):
    if origin is list or args[1:] == (Ellipsis,):
        as_tuple = origin is tuple
        if args[0] is int:  # token ids: the values' types checked in one pass

            def check_ints(value):
                if type(value) is not list:
                    raise ProtocolError(f"{where}: expected a list, got {type(value).__name__}")
                kinds = set(map(type, value))
                if kinds - {int}:
                    bad = next(iter(kinds - {int}))
                    raise ProtocolError(f"{where}[]: expected an int, got {bad.__name__}")
                return tuple(value) if as_tuple else value

            return check_ints
        check_item = _checker(args[0], f"{where}[]")

        def check_items(value):
            if type(value) is not list:
                raise ProtocolError(f"{where}: expected a list, got {type(value).__name__}")
            items = [check_item(v) for v in value]
            return tuple(items) if as_tuple else items

        return check_items
    checks = [_checker(arg, f"{where}[]") for arg in args]

    def check_fixed(value):
        if type(value) is not list or len(value) != len(checks):
            what = f"a list of {len(value)}" if type(value) is list else type(value).__name__
            raise ProtocolError(f"{where}: expected a list of {len(checks)}, got {what}")
        if len(checks) == 2:  # a TokenBatch's (request id, Tokens), at every token
            return checks[0](value[0]), checks[1](value[1])
        return tuple([check(v) for check, v in zip(checks, value)])

    return check_fixed


@functools.cache
def _builder(cls, where: str):
    """A function that builds a message class (or a dataclass inside one) from its decoded map, at where."""
    hints, known = typing.get_type_hints(cls), fields(cls)
    checks = {f.name: _checker(hints[f.name], f"{where}.{f.name}") for f in known}
    names = frozenset(checks)
    required = frozenset(f.name for f in known if f.default is MISSING and f.default_factory is MISSING)

    def build(body):
        if type(body) is not dict:
            raise ProtocolError(f"{where}: expected a map, got {type(body).__name__}")
        keys = body.keys()
        if not keys <= names:
            raise ProtocolError(f"{where}: unknown fields {sorted(map(str, keys - names))}")
        if not required <= keys:
            raise ProtocolError(f"{where}: missing field {min(required - keys)!r}")
        try:
            return cls(**{name: checks[name](value) for name, value in body.items()})
        except InvalidRequest as exc:  # a type that validates itself (SamplingParams): out-of-range values
            raise ProtocolError(f"{where}: {exc}") from None

    return build


def _build(cls, body, where: str):
    return _builder(cls, where)(body)


def _check_frames(kind: int, frames: list, field: str = "") -> None:
    name, expected = MESSAGES[kind].__name__, FRAMED.get(kind, 0)
    if len(frames) != expected:
        raise ProtocolError(f"{name} carries {expected} frames, got {len(frames)}")
    for frame in frames:
        if frame_bytes(frame) > MAX_FRAME_BYTES:
            raise MessageTooLarge(f"{name}'s frame", frame_bytes(frame), MAX_FRAME_BYTES, field)


def _check_size(kind, size: int) -> None:
    if kind in MESSAGES and size > max_header_bytes(kind):
        raise MessageTooLarge(f"{MESSAGES[kind].__name__} header", size, max_header_bytes(kind))


def decode(parts: list) -> Envelope:
    """[header, *frames] as received -> Envelope, or ProtocolError."""
    if not parts:
        raise ProtocolError("empty message")
    view = memoryview(parts[0].buffer if hasattr(parts[0], "buffer") else parts[0])
    if view.nbytes > MAX_HEADER_BYTES:
        raise MessageTooLarge("header", view.nbytes, MAX_HEADER_BYTES)
    # The kind's own limit before unpacking, when the header starts as a packer writes it: a 5-item array, then
    # the kind as a one-byte integer. Any other start is held to it after unpacking.
    if view.nbytes > SMALL_HEADER_BYTES and view[0] == 0x95 and view[1] < 0x80:
        _check_size(view[1], view.nbytes)
    header = bytes(view)
    try:
        decoded = msgpack.unpackb(header, raw=False, strict_map_key=True)
    except Exception as exc:  # msgpack raises several types for bad bytes: one error for all
        raise ProtocolError(f"undecodable header: {exc.__class__.__name__}") from None
    if not isinstance(decoded, list) or len(decoded) != 5:
        raise ProtocolError("header must be [kind, version, request_id, trace, body]")
    kind, version, request_id, trace, body = decoded
    if version != PROTOCOL_VERSION:
        raise ProtocolError(f"protocol version {version!r}, expected {PROTOCOL_VERSION}")
    if isinstance(kind, bool) or not isinstance(kind, int) or kind not in MESSAGES:
        raise ProtocolError(f"unknown message kind {kind!r}")
    _check_size(kind, len(header))
    if not isinstance(request_id, str):
        raise ProtocolError("request_id must be a string")
    cls = MESSAGES[kind]
    message = _build(cls, body, cls.__name__)
    frames = list(parts[1:])
    _check_frames(kind, frames)
    for frame in frames:
        if kind == Kind.KV_TRANSFER and frame_bytes(frame) != kv_frame_bytes(message):
            raise ProtocolError(f"KV frame of {frame_bytes(frame)} bytes, its header says {kv_frame_bytes(message)}")
    return Envelope(message, request_id, _build(TraceContext, trace, "trace"), frames)

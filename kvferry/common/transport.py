"""ZeroMQ plumbing for protocol messages: send, receive, trace, and count what cannot be decoded.

ROUTER sockets prefix every message with the peer's identity frame; DEALER sockets do not. Raw frames (KV tensors)
go with copy=False both ways, so neither side copies the tensor's memory.

Each message sent gets its own span id, a child of the context that caused it, which the process's tracer records
(with the receive) when tracing is on. That span id is also the message's id: a receiver drops a message whose id it
has just seen, so resending is always safe. The fault-injection hook (common/faults.py, for tests) makes send drop,
duplicate and delay messages.
"""

import asyncio
import logging
import time
from collections import OrderedDict

import zmq

from kvferry.common import faults, protocol, tracing
from kvferry.common.protocol import Envelope, ProtocolError, TraceContext

log = logging.getLogger("kvferry.transport")
MAX_SEEN_IDS = 8192  # covers any duplicate's delay: copies leave back to back, resends carry new ids
SIZE_MARGIN_BYTES = 64 << 10  # a message a little past its kind's limit still arrives, to be refused and counted
HEARTBEAT_IVL_S = 2.0  # ZeroMQ's own pings on every connection
HEARTBEAT_TIMEOUT_S = 6.0  # a peer silent this long after a ping (past any frame still arriving) is disconnected
SLOW_LINK_BYTES_PER_S = 50e6  # the slowest link a big frame is allowed for before its connection times out


def limit_socket(sock: zmq.Socket, max_message_bytes: int, max_send_bytes: int = 0) -> None:
    """Cap what one frame arriving on sock may weigh, and turn on ZeroMQ's heartbeats.

    ZeroMQ buffers a whole frame before the application sees it: without a cap, one frame of a few GB exhausts the
    process. With it, a frame past max_message_bytes (the largest legal one this socket receives; a small margin
    is added) is refused at its length prefix, and its peer disconnected, while the socket serves its other peers.
    The heartbeats drop a peer that vanished without closing (a crashed host, a partition) and what it was sending.
    ZeroMQ restarts their timeout only when a whole frame arrives, so the timeout (ours, and the one our pings ask
    of the peer: max_send_bytes, the largest frame sent here) covers the largest frame crossing a slow link."""
    sock.setsockopt(zmq.MAXMSGSIZE, max_message_bytes + SIZE_MARGIN_BYTES)
    sock.setsockopt(zmq.HEARTBEAT_IVL, int(HEARTBEAT_IVL_S * 1000))
    timeout_s = HEARTBEAT_TIMEOUT_S + max_message_bytes / SLOW_LINK_BYTES_PER_S
    sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, int(timeout_s * 1000))
    ttl_s = HEARTBEAT_TIMEOUT_S + max_send_bytes / SLOW_LINK_BYTES_PER_S
    sock.setsockopt(zmq.HEARTBEAT_TTL, min(int(ttl_s * 1000), 6_553_500))  # ZeroMQ's ceiling: 0xFFFF deciseconds


def peer_label(identity: bytes) -> str:
    """A ZeroMQ identity as text: worker ids are readable; ZeroMQ's own random ids are shown in hex."""
    text = identity.decode("utf-8", "replace")
    return text if text.isprintable() and "\ufffd" not in text else "0x" + identity.hex()


class Channel:
    """One socket with protocol-aware, traced send and receive: pack/unpack encode, decode and trace, send/recv add
    the socket calls (the gateway's asyncio socket uses pack/unpack around its own awaits)."""

    def __init__(self, socket: zmq.Socket, name: str, peer_name: str = "", tracer=None):
        self.socket = socket
        self.name = name
        self.peer_name = peer_name  # who is at the other end of a DEALER socket
        self.is_router = socket.type == zmq.ROUTER
        self.tracer = tracer or tracing.tracer()
        self.num_protocol_errors = 0
        self.num_duplicates = 0
        self.num_unsent = 0
        self._seen_ids: OrderedDict[str, None] = OrderedDict()  # the latest message ids received, oldest first
        spec = faults.from_env()
        self.faults = faults.MessageFaults(spec, name) if spec and spec.touches_messages else None

    def pack(
        self,
        message,
        request_id: str = "",
        parent: TraceContext | None = None,
        frames: list | None = None,
        to: bytes | None = None,
        entries: list | None = None,
    ) -> tuple[list, TraceContext]:
        """-> (multipart message, the message's own trace context). entries: a batch message's, traced with it
        (trace_entries)."""
        ctx = tracing.child_of(parent)
        parts = protocol.encode(message, request_id, ctx, frames)
        if self.tracer.enabled:
            self.tracer.message(
                "send",
                type(message).__name__,
                peer_label(to) if to else self.peer_name,
                request_id,
                ctx,
                len(parts[0]),
                sum(protocol.frame_bytes(f) for f in parts[1:]),
            )
            if entries:  # before it leaves: a send traced after its receive would skew the clocks' reconciliation
                self.trace_entries("send", "Tokens", to, ctx, entries)
        if self.is_router:
            if to is None:
                raise ValueError(f"{self.name}: a ROUTER send needs the peer identity")
            parts = [to, *parts]
        return parts, ctx

    def send(
        self,
        message,
        request_id: str = "",
        parent: TraceContext | None = None,
        frames: list | None = None,
        to: bytes | None = None,
        entries: list | None = None,
    ) -> TraceContext:
        parts, ctx = self.pack(message, request_id, parent, frames, to, entries)
        copies = 1
        if self.faults:
            copies, wait_s = self.faults.plan()
            time.sleep(wait_s)
        for _ in range(copies):
            try:
                # Frames after the header go zero-copy; the header is small and copied. Never blocking: a peer that
                # is gone or not yet connected (a failed CURVE handshake) must not stop the loop; a message that
                # cannot leave is lost like one dropped on the way, and the deadlines above deal with it.
                self.socket.send_multipart(parts, copy=False, flags=zmq.NOBLOCK)
            except zmq.Again:
                self.num_unsent += 1
                log.debug("%s: %s not sent: no peer ready", self.name, type(message).__name__)
        return ctx

    async def send_async(self, parts: list) -> None:
        """Send what pack made on an asyncio socket, with the same faults as send. Never waits for the peer: a
        stopped peer whose queue is full raises zmq.Again at once, and must not hold up what goes to the others."""
        copies = 1
        if self.faults:
            copies, wait_s = self.faults.plan()
            await asyncio.sleep(wait_s)
        for _ in range(copies):
            await self.socket.send_multipart(parts, copy=False, flags=zmq.DONTWAIT)

    def trace_entries(self, direction: str, kind: str, peer: bytes | None, batch: TraceContext, entries) -> None:
        """With tracing on, a batch message's entries as the messages they stand for (a TokenBatch's Tokens): each
        under its request's id and trace (entries: (request id, its trace context or None)), with the batch's span
        id, which pairs a send with its receive."""
        if not self.tracer.enabled:
            return
        who = peer_label(peer) if peer else self.peer_name
        for request_id, ctx in entries:
            trace_id, parent_id = (ctx.trace_id, ctx.span_id) if ctx is not None else (batch.trace_id, "")
            self.tracer.message(direction, kind, who, request_id, TraceContext(trace_id, batch.span_id, parent_id), 0)

    def is_duplicate(self, message_id: str) -> bool:
        """Remember message_id; True when it was seen among the latest MAX_SEEN_IDS."""
        if not message_id:
            return False
        if message_id in self._seen_ids:
            self.num_duplicates += 1
            return True
        self._seen_ids[message_id] = None
        if len(self._seen_ids) > MAX_SEEN_IDS:
            self._seen_ids.popitem(last=False)
        return False

    def unpack(self, parts: list) -> tuple[bytes | None, Envelope] | None:
        """(peer identity or None, envelope); None for a message that broke the protocol, which is counted
        and logged, never raised: one bad peer must not stop the loop."""
        peer = None
        if self.is_router:
            peer, parts = parts[0].bytes, parts[1:]
        try:
            env = protocol.decode(parts)
        except ProtocolError as exc:
            self.num_protocol_errors += 1
            log.warning("%s: protocol error from %s: %s", self.name, peer_label(peer) if peer else self.peer_name, exc)
            return None
        if self.is_duplicate(env.trace.span_id):
            log.debug("%s: dropped a duplicate %s", self.name, type(env.message).__name__)
            return None
        if self.tracer.enabled:
            self.tracer.message(
                "recv",
                type(env.message).__name__,
                peer_label(peer) if peer else self.peer_name,
                env.request_id,
                env.trace,
                protocol.frame_bytes(parts[0]),
                sum(protocol.frame_bytes(f) for f in parts[1:]),
            )
        return peer, env

    def recv(self, flags: int = 0) -> tuple[bytes | None, Envelope] | None:
        return self.unpack(self.socket.recv_multipart(flags=flags, copy=False))

    def close(self) -> None:
        self.socket.close(linger=0)

"""ZeroMQ plumbing for protocol messages: send, receive, and count what cannot be decoded.

ROUTER sockets prefix every message with the peer's identity frame; DEALER sockets do not.
Raw frames (KV tensors) are sent with copy=False, so ZeroMQ reads the tensor's memory in
place, and received with copy=False, so the receiver can view them without a copy.
"""
import logging

import zmq

from kvferry.common import protocol
from kvferry.common.protocol import Envelope, ProtocolError, TraceContext

log = logging.getLogger("kvferry.transport")


class Channel:
    """One socket with protocol-aware send and receive."""

    def __init__(self, socket: zmq.Socket, name: str):
        self.socket = socket
        self.name = name
        self.is_router = socket.socket_type == zmq.ROUTER
        self.num_protocol_errors = 0

    def send(self, message, request_id: str = "", trace: TraceContext | None = None, frames: list | None = None,
             to: bytes | None = None) -> None:
        parts = protocol.encode(message, request_id, trace, frames)
        if self.is_router:
            if to is None:
                raise ValueError(f"{self.name}: a ROUTER send needs the peer identity")
            parts = [to, *parts]
        # Frames after the header go zero-copy; the header is small and copied.
        self.socket.send_multipart(parts, copy=False)

    def recv(self, flags: int = 0) -> tuple[bytes | None, Envelope] | None:
        """Next valid message as (peer identity or None, envelope); None for a message that broke the
        protocol, which is counted and logged, never raised: one bad peer must not stop the loop."""
        parts = self.socket.recv_multipart(flags=flags, copy=False)
        peer = None
        if self.is_router:
            peer, parts = parts[0].bytes, parts[1:]
        try:
            return peer, protocol.decode(parts)
        except ProtocolError as exc:
            self.num_protocol_errors += 1
            log.warning("%s: protocol error from %r: %s", self.name, peer, exc)
            return None

    def close(self) -> None:
        self.socket.close(linger=0)

"""A worker's connection to one gateway: its control socket, and whether (and when next) it must register. A worker
serves every gateway it is given (gateways behind one load balancer share one pool); each names itself in its
RegisterReply, a request's replies go back over its gateway's link, and a KV transfer carries that name.
"""

import logging
from dataclasses import dataclass

import zmq

from kvferry.common import protocol as p
from kvferry.common import settings
from kvferry.common.curve import CurveKeys
from kvferry.common.errors import FatalError
from kvferry.common.transport import Channel, limit_socket

log = logging.getLogger("kvferry.worker")
REGISTER_RETRY_S = (0.5, 1.0, 2.0, 5.0)  # waits between registration attempts; the last repeats


class Refused(FatalError):
    """A gateway refused this worker for good (a reason but "unknown worker": a model mismatch, a bad block size)."""


class GatewayLink:
    def __init__(self, ctx: zmq.Context, address: str, worker_id: str, curve: CurveKeys | None = None):
        self.address, self.curve, self.worker_id = address, curve, worker_id
        sock = self._socket(ctx, b"", p.max_header_bytes(*p.WORKER_RECEIVES), p.max_header_bytes(*p.GATEWAY_RECEIVES))
        self.channel = Channel(sock, f"{worker_id}/control", peer_name="gateway")
        self.gateway_id = ""  # the gateway's name for itself, once it has accepted us
        self.token_batches = False  # it takes a step's tokens as one TokenBatch
        self.registered = False
        self.num_attempts = 0
        self.next_attempt_at = 0.0  # monotonic
        self.cache_sync_at = 0.0  # monotonic time of the next full CacheUpdate (0: at once)

    def must_register(self) -> None:
        """The gateway forgot us (it restarted, or dropped us after a silence): register again, at once."""
        self.registered, self.num_attempts, self.next_attempt_at = False, 0, 0.0

    def register_if_due(self, message: p.Register, now: float) -> None:
        if self.registered or now < self.next_attempt_at:
            return
        wait_s = REGISTER_RETRY_S[min(self.num_attempts, len(REGISTER_RETRY_S) - 1)]
        if self.num_attempts:
            log.warning(
                "%s: no answer from the gateway at %s (attempt %d); trying again in %.1f s. If this goes "
                "on, check %s: is the gateway up, and reachable from here?",
                message.worker_id,
                self.address,
                self.num_attempts,
                wait_s,
                settings.label("gateway"),
            )
        self.channel.send(message)
        self.num_attempts += 1
        self.next_attempt_at = now + wait_s

    def answered(self, reply: p.RegisterReply) -> None:
        """The gateway's answer to a registration: accepted, forgot us (register again), or refused for good."""
        if reply.accepted:
            self.accepted(reply)
        elif reply.reason == p.UNKNOWN_WORKER:
            self.must_register()  # it forgot us (a restart, or a silence it took for death)
        else:
            raise Refused(f"the gateway at {self.address} refused {self.worker_id}: {reply.reason}")

    def accepted(self, reply: p.RegisterReply) -> None:
        self.registered, self.gateway_id, self.token_batches = True, reply.gateway_id, reply.token_batches
        self.cache_sync_at = 0.0  # a gateway that (re)admits us knows nothing of our cache yet
        log.info("%s registered with the gateway at %s", self.worker_id, self.address)

    def heartbeat_socket(self, ctx: zmq.Context) -> zmq.Socket:
        """A second socket to the same gateway, for the heartbeat thread (ZeroMQ sockets are not thread-safe). Its
        name, derived from the worker's, is the one the gateway takes this worker's heartbeats from."""
        max_recv, max_send = p.max_header_bytes(p.Kind.REGISTER_REPLY), p.max_header_bytes(p.Kind.HEARTBEAT)
        return self._socket(ctx, p.HEARTBEAT_SUFFIX, max_recv, max_send)

    def _socket(self, ctx: zmq.Context, suffix: bytes, max_recv: int, max_send: int) -> zmq.Socket:
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.IDENTITY, self.worker_id.encode() + suffix)
        sock.setsockopt(zmq.LINGER, 0)
        limit_socket(sock, max_recv, max_send)
        if self.curve:
            self.curve.connect(sock)
        sock.connect(self.address)
        return sock

    def close(self) -> None:
        self.channel.close()


def link_named(links: list[GatewayLink], gateway_id: str) -> GatewayLink | None:
    """The link to the gateway of that name; with one gateway, that one (a peer may not name it)."""
    if len(links) == 1:
        return links[0]
    return next((link for link in links if link.registered and link.gateway_id == gateway_id), None)


def parse_gateways(text: str | list[str]) -> list[str]:
    """--gateway a,b or a list: each gateway's control address, in order, without repeats."""
    items = text.split(",") if isinstance(text, str) else text
    return list(dict.fromkeys(item.strip() for item in items if item.strip()))


@dataclass
class Failure:
    """A request attempt that failed on this worker, for Worker.report to tell the gateway that sent it."""

    link: GatewayLink
    request_id: str
    attempt: int
    trace: p.TraceContext | None
    error: str
    exc: Exception | None = None
    code: int | None = None
    retry: bool = False

"""The prefill worker's sockets to decode workers, on a thread of their own (ZeroMQ sockets are not thread-safe).

The engine's layer hook runs inside the forward pass, where no socket may be touched: `send` only queues a message
and writes a byte to a pipe, and this thread puts it on the wire while the next layers compute. Answers come back
the same way: the loop polls `wake_fd` and takes them with `received()`.
"""

import collections
import logging
import os
import queue
import threading
import time
from dataclasses import dataclass

import zmq

from kvferry.common import protocol as p
from kvferry.common.model.kv_blocks import ready_frames
from kvferry.common.transport import Channel, limit_socket
from kvferry.services.wake_pipe import clear, pipe, signal

log = logging.getLogger("kvferry.prefill")
PEER_IDLE_S = 60.0  # a decode worker's socket unused this long is closed: workers come and go, sockets must not pile up
CONNECT_WAIT_MS = 2000  # a new decode worker's connection (and CURVE handshake) is given this long to come up
UNREACHABLE_S = 5.0  # after a connection did not come up, sends there fail at once for this long: no wait per message


@dataclass
class Outgoing:
    address: str
    peer: str  # the decode worker's id, for traces
    message: object
    request_id: str
    trace: p.TraceContext
    frames: list | None = None


@dataclass
class SendFailed:
    """A message that could not go out (the decode worker's address does not connect): its request fails."""

    outgoing: Outgoing
    error: str


@dataclass
class SenderDied:
    """The sender thread ended on an error of its own: no KV can leave any more, so the worker must end."""

    error: str


class KVSender:
    def __init__(self, ctx: zmq.Context, worker_id: str, curve=None):
        self.ctx, self.worker_id, self.curve = ctx, worker_id, curve
        self._outbox: queue.SimpleQueue[Outgoing | None] = queue.SimpleQueue()
        self._inbox: collections.deque = collections.deque()  # (address, Envelope) or SendFailed
        self._outbox_read, self._outbox_write = pipe()
        self.wake_fd, self._inbox_write = pipe()  # readable when received() has something
        self._channels: dict[str, Channel] = {}
        self._last_used: dict[str, float] = {}  # address -> monotonic time of its latest send or answer
        self._unreachable_until: dict[str, float] = {}  # address -> until when sends there fail without waiting
        self._thread = threading.Thread(target=self._run, name="kv-sender", daemon=True)
        self._thread.start()

    # -- any thread -------------------------------------------------------------------------------------------
    def send(self, outgoing: Outgoing) -> None:
        self._outbox.put(outgoing)
        signal(self._outbox_write)

    def received(self) -> list:
        """What came back from decode workers since the last call, in order."""
        clear(self.wake_fd)
        items = []
        while self._inbox:
            items.append(self._inbox.popleft())
        return items

    @property
    def num_protocol_errors(self) -> int:
        return sum(c.num_protocol_errors for c in list(self._channels.values()))

    def close(self) -> None:
        self._outbox.put(None)
        signal(self._outbox_write)
        self._thread.join(timeout=5)
        if not self._thread.is_alive():  # a thread still in a send must not find its pipes gone
            for fd in (self._outbox_read, self._outbox_write, self.wake_fd, self._inbox_write):
                os.close(fd)

    # -- the sender thread ------------------------------------------------------------------------------------
    def _deliver(self, item) -> None:
        self._inbox.append(item)
        signal(self._inbox_write)

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._outbox_read, zmq.POLLIN)
        address_of: dict = {}
        try:
            self._loop(poller, address_of)
        except Exception as exc:  # not one message's fault (those are caught below): the worker is told, and ends
            log.exception("%s: the KV sender thread failed", self.worker_id)
            self._deliver(SenderDied(f"{type(exc).__name__}: {exc}"))
        finally:
            for channel in self._channels.values():
                channel.close()

    def _close_idle(self, poller: zmq.Poller, address_of: dict) -> None:
        """Close the sockets of decode workers unused for PEER_IDLE_S (a new send reconnects)."""
        now = time.monotonic()
        for address in [a for a, t in self._last_used.items() if now - t > PEER_IDLE_S]:
            self._close_channel(address, poller, address_of)
        self._unreachable_until = {a: t for a, t in self._unreachable_until.items() if t > now}

    def _close_channel(self, address: str, poller: zmq.Poller, address_of: dict) -> None:
        channel = self._channels.pop(address)
        self._last_used.pop(address, None)
        poller.unregister(channel.socket)
        address_of.pop(channel.socket, None)
        channel.close()

    def _ready_channel(self, out: Outgoing, poller: zmq.Poller, address_of: dict) -> Channel:
        """The channel to out's decode worker, connected and with room; else ConnectionError (with IMMEDIATE the
        message would be dropped silently). A socket that lost its peer is replaced (its reconnect may wait out
        TCP's retries); a new socket gets CONNECT_WAIT_MS to connect."""
        now = time.monotonic()
        if now < self._unreachable_until.get(out.address, 0.0):
            raise ConnectionError(f"did not connect within {CONNECT_WAIT_MS} ms, moments ago")
        if out.address in self._channels and not self._channels[out.address].socket.poll(0, zmq.POLLOUT):
            self._close_channel(out.address, poller, address_of)
        new = out.address not in self._channels
        if new:
            sock = self.ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.IDENTITY, self.worker_id.encode())
            # Queue only for a connected peer: KV for a decode worker that is gone (or stopped long enough for the
            # ZeroMQ heartbeat to drop it) fails at once, and its request moves, instead of piling up here.
            sock.setsockopt(zmq.IMMEDIATE, 1)
            limit_socket(sock, p.max_header_bytes(*p.KV_SENDER_RECEIVES), max_send_bytes=p.MAX_FRAME_BYTES)
            if self.curve:
                self.curve.connect(sock)
            try:
                sock.connect(out.address)
            except zmq.ZMQError:
                sock.close(linger=0)
                raise
            poller.register(sock, zmq.POLLIN)
            self._channels[out.address] = Channel(sock, f"{self.worker_id}->{out.address}", peer_name=out.peer)
        channel = self._channels[out.address]
        address_of[channel.socket] = out.address
        self._last_used[out.address] = now
        if not channel.socket.poll(CONNECT_WAIT_MS if new else 0, zmq.POLLOUT):
            if new:  # the thread does not wait again for this address for a while: other transfers go on
                self._unreachable_until[out.address] = time.monotonic() + UNREACHABLE_S
            raise ConnectionError("not connected, or its send queue is full")
        self._unreachable_until.pop(out.address, None)
        return channel

    def _loop(self, poller: zmq.Poller, address_of: dict) -> None:
        """Until close(): send what is queued, and hand on what decode workers answer."""
        while True:
            self._close_idle(poller, address_of)
            for sock, _ in poller.poll(PEER_IDLE_S * 1000 / 4):
                if sock == self._outbox_read:
                    clear(self._outbox_read)
                    while True:
                        try:
                            out = self._outbox.get_nowait()
                        except queue.Empty:
                            break
                        if out is None:
                            return
                        try:
                            channel = self._ready_channel(out, poller, address_of)
                            # KV copied from a CUDA cache may still be arriving: waited for here, off the step loop.
                            frames = ready_frames(out.frames) if out.frames else out.frames
                            channel.send(out.message, out.request_id, out.trace, frames=frames)
                        except Exception as exc:  # one request's bad address must not stop the others'
                            log.warning("%s: cannot send to %r: %s", self.worker_id, out.address, exc)
                            self._deliver(SendFailed(out, str(exc)))
                    continue
                address = address_of.get(sock)
                if address is None:  # closed above, in this same turn, to be replaced
                    continue
                self._last_used[address] = time.monotonic()
                channel = self._channels[address]
                while sock.poll(0):
                    received = channel.recv()
                    if received is not None:
                        self._deliver((address, received[1]))

"""What the two synthetic workers (TEST DOUBLES) share: registration and heartbeats over the real GatewayLink, the
loop, and a send that waits for room.

The send is where a double is not a real worker. A real one never blocks on a send (common/transport.py) and loses
what finds the queue to the gateway full: the gateway sees the gap, waits for it, then moves the request to a new
attempt. A double waits for room instead (up to SEND_TIMEOUT_MS), so that the gateway's pace holds a saturated bench
back and every stream is whole. So a saturated `kvferry bench gateway` measures a backpressure that a real stack
does not have: each send of a double that waited is a message a real worker would have dropped. The doubles count
the sends that waited and those never sent (send_counts.py), and the bench reports them with its figures.

Like a real worker (services/worker.py), one refused by a gateway for any reason but "unknown worker" stops with that
reason (gateway_link.Refused: exit status 2), and one the gateway forgot registers again; unlike one, it serves no
CURVE keys (loopback benchmarks and tests only) and has no drain.
"""

import logging
import time
import uuid

import zmq

from kvferry.common import protocol as p
from kvferry.common.errors import FatalError
from kvferry.common.text_tokenizer import TextTokenizer
from kvferry.common.transport import Channel
from kvferry.services.gateway_link import GatewayLink, parse_gateways
from kvferry.tools.bench.synthetic.model_folder import (
    SYNTHETIC_MODEL_NAME,
    check_model_folder,
    finish_rules,
    token_cycle,
)
from kvferry.tools.bench.synthetic.send_counts import SENT, UNSENT, WAITED, SendCounts

log = logging.getLogger("kvferry.synthetic")
NUM_BLOCKS = 1 << 20  # what the doubles report: never short of room, so the gateway's routing never waits on them
SEND_TIMEOUT_MS = 2000  # a send to a gateway that takes nothing this long is dropped (the gateway is gone or stuck)
NOT_A_TOKEN = -1  # what finish_reason judges in place of a token the sampler would have masked
FINAL_LINGER_MS = 1000  # what is queued to a gateway, the final Deregister last, has this long to go out at exit
IDLE_POLL_MS = 50  # the loop's longest sleep: heartbeats and a SIGTERM are seen this soon


class SyntheticWorker:
    role: p.Role

    def __init__(
        self, gateways: str | list[str], model_folder, worker_id: str | None = None, block_size: int = 16,
        counts_file: str | None = None,
    ):  # fmt: skip
        self.ctx = zmq.Context.instance()
        self.worker_id = worker_id or f"synthetic-{self.role.name.lower()}-{uuid.uuid4().hex[:8]}"
        self.instance_id = uuid.uuid4().hex[:12]
        folder = check_model_folder(model_folder)
        self.cycle = token_cycle(TextTokenizer(folder))
        self.rules = finish_rules(folder)
        self.max_model_len = self.rules.max_model_len
        self.block_size = block_size
        self.links = [GatewayLink(self.ctx, address, self.worker_id) for address in parse_gateways(gateways)]
        if not self.links:
            raise FatalError("a synthetic worker needs at least one gateway address (--gateway)")
        self.heartbeats: dict[zmq.Socket, tuple[GatewayLink, Channel]] = {}
        self.poller = zmq.Poller()
        self.readers: dict = {}  # socket -> what reads it
        for link in self.links:
            link.channel.socket.setsockopt(zmq.SNDTIMEO, SEND_TIMEOUT_MS)
            sock = link.heartbeat_socket(self.ctx)
            self.heartbeats[sock] = (link, Channel(sock, f"{self.worker_id}/heartbeat", peer_name="gateway"))
            self.watch(link.channel.socket, lambda link=link: self.read_control(link))
            self.watch(sock, lambda sock=sock: self.read_heartbeat_replies(sock))
        self.heartbeat_interval_s = 1.0
        self.heartbeat_due = 0.0
        self.running = True
        self.send_counts = SendCounts(counts_file)

    def watch(self, sock: zmq.Socket, reader) -> None:
        self.readers[sock] = reader
        self.poller.register(sock, zmq.POLLIN)

    # -- gateways -----------------------------------------------------------------------------------------------
    def kv_address(self) -> str:
        return ""

    def register_message(self) -> p.Register:
        return p.Register(
            role=int(self.role),
            worker_id=self.worker_id,
            model=SYNTHETIC_MODEL_NAME,
            dtype="float32",
            block_size=self.block_size,
            num_blocks=NUM_BLOCKS,
            max_model_len=self.max_model_len,
            kv_address=self.kv_address(),
            instance_id=self.instance_id,
        )

    def finish_reason(self, params: p.SamplingParams, token: int, position: int, num_prompt_tokens: int) -> int:
        """How token, a choice's output at index position, ends it (-1: it goes on), by the real engine's rules
        (common/finish_rules.py). Before min_tokens the real sampler masks the stop and EOS tokens; a double cannot
        draw another token, so a stop token there goes out and ends nothing."""
        judged = token if position >= params.min_tokens else NOT_A_TOKEN
        reason = self.rules.finish_reason(params, judged, position + 1, num_prompt_tokens + position + 1)
        return -1 if reason is None else int(reason)

    def on_register_reply(self, link: GatewayLink, reply: p.RegisterReply) -> None:
        link.answered(reply)  # as a real worker: a gateway serving a real model refuses (Refused, "model mismatch")
        if reply.accepted:
            self.heartbeat_interval_s = reply.heartbeat_interval_s

    def stats(self) -> p.WorkerStats:
        return p.WorkerStats(NUM_BLOCKS, NUM_BLOCKS, self.num_running(), 0, 0, num_protocol_errors=self.num_errors())

    def num_running(self) -> int:
        return 0

    def num_errors(self) -> int:
        return sum(link.channel.num_protocol_errors for link in self.links)

    def send_heartbeats(self, now: float) -> None:
        if now < self.heartbeat_due:
            return
        self.heartbeat_due = now + self.heartbeat_interval_s
        stats = self.stats()
        for link, channel in self.heartbeats.values():
            if link.registered:
                channel.send(p.Heartbeat(self.worker_id, stats))

    def read_heartbeat_replies(self, sock: zmq.Socket) -> None:
        link, channel = self.heartbeats[sock]
        while sock.poll(0):
            received = channel.recv()
            reply = received[1].message if received else None
            if isinstance(reply, p.RegisterReply) and reply.reason == p.UNKNOWN_WORKER:
                link.must_register()

    def read_control(self, link: GatewayLink) -> None:
        while link.channel.socket.poll(0):
            received = link.channel.recv()
            if received is None:
                continue  # counted and logged
            env = received[1]
            if isinstance(env.message, p.RegisterReply):
                self.on_register_reply(link, env.message)
            else:
                self.on_gateway_message(link, env)

    def send_waiting(self, channel: Channel, message, request_id: str, trace, frames: list | None = None) -> None:
        """Send, waiting for room (at most SEND_TIMEOUT_MS) where a real worker would drop the message (see the
        module's docstring); each wait counted."""
        parts, _ = channel.pack(message, request_id, trace, frames)
        counts = self.send_counts.counts
        counts[SENT] += 1
        try:
            channel.socket.send_multipart(parts, copy=False, flags=zmq.NOBLOCK)
            return
        except zmq.Again:  # nothing of it went: a multipart message is queued whole or not at all
            counts[WAITED] += 1
        try:
            channel.socket.send_multipart(parts, copy=False)
        except zmq.Again:
            counts[UNSENT] += 1
            log.warning("%s: a %s for %s could not be sent", self.worker_id, type(message).__name__, request_id)

    # -- the loop ----------------------------------------------------------------------------------------------
    def serve_forever(self) -> None:
        try:
            while self.running:
                self.turn()
        finally:
            for link in self.links:
                if link.registered:  # its last word, after whatever is queued before it
                    self.send_waiting(link.channel, p.Deregister(self.worker_id, final=True), "", None)
                    link.channel.socket.close(linger=FINAL_LINGER_MS)  # not the sockets' 0: that drops the queue
            self.close()

    def turn(self) -> None:
        """One round of the loop: register where due, heartbeat where due, read what came, work."""
        now = time.monotonic()
        if any(not link.registered for link in self.links):
            register = self.register_message()
            for link in self.links:
                link.register_if_due(register, now)
        self.send_heartbeats(now)
        for sock, _ in self.poller.poll(self.poll_timeout_ms(now)):
            self.readers[sock]()
        self.work()

    def poll_timeout_ms(self, now: float) -> int:
        return IDLE_POLL_MS

    def work(self) -> None:
        """A role's own work, once a loop."""

    def on_gateway_message(self, link: GatewayLink, env: p.Envelope) -> None:
        raise NotImplementedError

    def close(self) -> None:
        for link, channel in self.heartbeats.values():
            channel.close()
            link.close()
        self.send_counts.close()

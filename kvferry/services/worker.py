"""What prefill and decode workers share: the engine, the gateway links, registration and heartbeats.

A worker registers with each gateway it is given (services/gateway_link.py) over a DEALER socket, and replies to
whichever sent the request. Heartbeats come from their own thread, so a long step does not look like death; a loop
that has not come round for `stall_timeout_s` is reported unhealthy. On SIGTERM a worker drains: the gateway routes
nothing new to it, it finishes what it holds within `drain_timeout_s`, then deregisters for good.
"""

import dataclasses
import logging
import socket
import threading
import time
import uuid

import zmq

from kvferry.common import faults, settings, tracing
from kvferry.common import protocol as p
from kvferry.common.config import EngineConfig
from kvferry.common.curve import CurveKeys
from kvferry.common.engine import LLMEngine
from kvferry.common.errors import ConfigError, FatalError, KvferryError
from kvferry.common.model_files import served_model_name
from kvferry.common.process_config import ProcessConfig
from kvferry.common.request_failure import fails_alone, failure_code
from kvferry.common.startup_heap import freeze_startup_objects
from kvferry.common.transport import Channel
from kvferry.common.worker_config import WorkerConfig
from kvferry.services.constraint_compiles import Compiled, ConstraintCompiles
from kvferry.services.gateway_link import Failure, GatewayLink, link_named, parse_gateways
from kvferry.services.worker_timings import CACHE_SYNC_S

log = logging.getLogger("kvferry.worker")
MAX_CHOICES = p.MAX_CHOICES  # n per request: a bound on what one message can make a worker do
MAX_ERROR_CHARS = 2000  # of a failure's text told to a gateway: an exception's message can quote a whole input
MAX_FAILED_STEPS = 100  # a step loop failing this many times in a row is broken, not unlucky


def advertised_host(explicit: str | None = None) -> str:
    """The address other machines reach this worker at: advertise_host (in Kubernetes, the pod IP), else this
    host's IP as its name resolves."""
    if explicit:
        return explicit
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return "127.0.0.1"


class Worker:
    role: p.Role

    def __init__(
        self,
        config: EngineConfig,
        gateway: str | list[str],
        worker_id: str | None = None,
        connector=None,
        worker_config: WorkerConfig | None = None,
        process: ProcessConfig | None = None,
        curve: CurveKeys | None = None,
    ):
        """connector: makes the role's KV connector from the worker id. curve: read before the model loads."""
        worker_config, process = worker_config or WorkerConfig(), process or ProcessConfig()
        self.worker_id = worker_id or f"{self.role.name.lower()}-{uuid.uuid4().hex[:8]}"
        self.instance_id = uuid.uuid4().hex[:12]  # this process's: a restart under the same worker id gets another
        self.ctx = zmq.Context.instance()
        self.tracer = tracing.tracer()
        self.engine = LLMEngine(config, connector(self.worker_id) if connector else None)
        if self.engine.max_model_len > p.MAX_CONTEXT_TOKENS:  # its longest requests' messages would not fit
            raise ConfigError(
                f"max_model_len {self.engine.max_model_len} is past the {p.MAX_CONTEXT_TOKENS} tokens the protocol "
                f"carries: set {settings.label('max_model_len')} to at most that"
            )
        self.links = [GatewayLink(self.ctx, address, self.worker_id, curve) for address in parse_gateways(gateway)]
        if not self.links:
            raise KvferryError("a worker needs at least one gateway address (--gateway)")
        self.poller = zmq.Poller()
        self.watched: dict = {}  # fd -> what reads it (watch)
        for link in self.links:
            self.poller.register(link.channel.socket, zmq.POLLIN)
        grammars = self.engine.grammars
        grammars.max_bytes = worker_config.grammar_cache_bytes
        grammars.isolated = True  # compiles in a child process, which a compile's timeout kills
        self.compiles = ConstraintCompiles(grammars, worker_config.grammar_compile_timeout)
        self.watch(self.compiles.wake_fd, lambda: None)  # the loop takes the finished compiles after every poll
        self.heartbeat_interval_s = 1.0
        self.running = True
        self.latest_stats: p.WorkerStats | None = None
        self.stall_timeout_s, self.drain_timeout_s = worker_config.stall_timeout, process.drain_timeout
        self.loop_at = time.monotonic()  # the step loop's latest turn, read by the heartbeat thread
        self.stop_requested = False  # set by SIGTERM: drain, then exit
        self.fault_spec = faults.from_env()
        self.num_loop_steps = 0
        self.num_failed_steps = 0

    # -- gateways ------------------------------------------------------------------------------------------
    def kv_address(self) -> str:
        return ""

    def register_message(self) -> p.Register:
        engine = self.engine
        return p.Register(
            role=int(self.role),
            worker_id=self.worker_id,
            model=served_model_name(engine.config.model),
            dtype=str(engine.dtype).removeprefix("torch."),
            block_size=engine.block_size,
            num_blocks=engine.num_blocks,
            max_model_len=engine.max_model_len,
            kv_address=self.kv_address(),
            quantization=engine.config.quantization or "none",
            instance_id=self.instance_id,
        )

    def link_of(self, channel: Channel) -> GatewayLink | None:
        return next((link for link in self.links if link.channel is channel), None)

    def link_named(self, gateway_id: str) -> GatewayLink | None:
        return link_named(self.links, gateway_id)

    def on_register_reply(self, link: GatewayLink, reply: p.RegisterReply) -> None:
        link.answered(reply)  # a refusal for good raises Refused, a FatalError
        if reply.accepted:
            self.heartbeat_interval_s = reply.heartbeat_interval_s  # gateways sharing workers set the same

    def stats(self) -> p.WorkerStats:
        engine_counters = dataclasses.asdict(self.engine.stats())
        grammars = self.engine.grammars
        return p.WorkerStats(
            **engine_counters,
            num_protocol_errors=self.num_protocol_errors(),
            num_grammar_compiles=grammars.num_compiles,
            num_grammar_cache_hits=grammars.num_cache_hits,
            grammar_compile_s=grammars.compile_s,
            **self.kv_counters(),
        )

    def kv_counters(self) -> dict:  # a role's own WorkerStats counters
        return {}

    def send_cache_updates(self) -> None:
        """Tell each gateway what the prefix cache stored and evicted; every CACHE_SYNC_S (and after each
        registration) all of it, which heals lost updates. In chunks: a big cache's set would not fit one message."""
        engine = self.engine
        if not engine.caching_enabled:
            return
        stored, evicted = engine.take_cache_events()
        now = time.monotonic()
        for link in self.links:
            if not link.registered:
                continue
            if now >= link.cache_sync_at:
                updates = p.cache_update_chunks(self.worker_id, engine.cached_block_hashes(), full=True)
                link.cache_sync_at = now + CACHE_SYNC_S
            else:
                updates = p.cache_update_chunks(self.worker_id, stored, evicted)
            for update in updates:
                link.channel.send(update)

    def num_protocol_errors(self) -> int:
        return sum(link.channel.num_protocol_errors for link in self.links)

    def _heartbeat_loop(self) -> None:
        """Own thread, own sockets: a long step must not look like a dead worker. It reads the loop's stats snapshot."""
        channels = {
            link: Channel(link.heartbeat_socket(self.ctx), f"{self.worker_id}/heartbeat", peer_name="gateway")
            for link in self.links
        }
        link_of = {channel.socket: link for link, channel in channels.items()}
        poller = zmq.Poller()
        for channel in channels.values():
            poller.register(channel.socket, zmq.POLLIN)
        try:
            while self.running:
                healthy = time.monotonic() - self.loop_at < self.stall_timeout_s
                if not healthy:
                    log.error(
                        "%s: the step loop has not come round for %.0f s: reporting unhealthy",
                        self.worker_id,
                        time.monotonic() - self.loop_at,
                    )
                for link, channel in channels.items():
                    if link.registered:
                        channel.send(p.Heartbeat(self.worker_id, self.latest_stats, healthy))
                due = time.monotonic() + self.heartbeat_interval_s
                while (left := due - time.monotonic()) > 0:
                    for sock, _ in poller.poll(int(left * 1000) + 1):
                        link = link_of[sock]
                        received = channels[link].recv()
                        reply = received[1].message if received else None
                        # The gateway dropped us (say, after a network partition): register again.
                        if isinstance(reply, p.RegisterReply) and reply.reason == p.UNKNOWN_WORKER:
                            link.must_register()
        finally:
            for channel in channels.values():
                channel.close()

    # -- loop ----------------------------------------------------------------------------------------------
    def has_work(self) -> bool:
        return self.engine.has_unfinished()

    def idle_wait_ms(self) -> int:
        return int(self.heartbeat_interval_s * 1000 / 2)

    def poll_timeout_ms(self) -> int:
        """0 with work to do; else the role's idle wait, cut short by the next compile timeout."""
        if self.has_work():
            return 0
        deadline_in = self.compiles.next_deadline_in()
        idle = self.idle_wait_ms()
        return idle if deadline_in is None else min(idle, int(deadline_in * 1000) + 1)

    def tidy(self) -> None:
        """Once a loop, busy or idle: let go of what has outlived its time."""

    def serve_forever(self) -> None:
        freeze_startup_objects()  # a full collection would walk the loaded model's objects mid-step
        register = self.register_message()
        self.latest_stats, stats_due = self.stats(), 0.0
        heartbeats = threading.Thread(target=self._heartbeat_loop, name="heartbeat", daemon=True)
        heartbeats.start()
        drain_until = None
        try:
            while self.running:
                now = self.loop_at = time.monotonic()
                if not self.stop_requested:
                    for link in self.links:
                        link.register_if_due(register, now)
                for sock, _ in self.poller.poll(self.poll_timeout_ms()):
                    self.read_socket(sock)
                self.take_compiled()
                if self.has_work():
                    self.step_isolated()
                    self.maybe_stall()
                self.send_cache_updates()
                self.tidy()
                now = time.monotonic()
                if now >= stats_due:  # the heartbeat thread only needs a fresh snapshot each half interval
                    self.latest_stats, stats_due = self.stats(), now + self.heartbeat_interval_s / 2
                if self.stop_requested and drain_until is None:
                    log.info("%s: draining (at most %.0f s)", self.worker_id, self.drain_timeout_s)
                    self.tell_gateways(p.Deregister(self.worker_id))
                    drain_until = now + self.drain_timeout_s
                if drain_until is not None and (not self.holds_requests() or now >= drain_until):
                    if self.holds_requests():
                        log.warning("%s: drain timed out; the gateway moves what is left", self.worker_id)
                    break
        finally:
            self.running = False
            if drain_until is not None:
                self.tell_gateways(p.Deregister(self.worker_id, final=True))
            heartbeats.join(timeout=5)
            self.close()

    def take_compiled(self) -> None:
        """Hand each finished (or timed-out) constraint compile back to its role; a failure stays with its request."""
        for done in self.compiles.take_finished():
            with fails_alone(lambda exc: log.exception("%s: after a constraint's compile", self.worker_id)):
                self.on_compiled(done)

    def on_compiled(self, done: Compiled) -> None:
        """A role's request whose constraint was compiling: done.error empty means it compiled."""

    def trace_compile(self, request_id: str, trace, constraint, started_at: float = 0.0, ended_at: float = 0.0):
        """The constraint's compile as a span of the request's trace; without times, a cache hit (an instant)."""
        cached = not started_at
        if cached:
            started_at = ended_at = time.time()
        if self.tracer.enabled:
            self.tracer.span(
                "grammar.compile",
                started_at,
                ended_at,
                request_id,
                tracing.child_of(trace),
                kind=constraint.kind,
                field=constraint.field,
                cached=cached,
            )

    def step_isolated(self) -> None:
        """A failure that escaped the engine's and the records' own handling (a bug) is logged and the loop goes on;
        only a FatalError, or MAX_FAILED_STEPS in a row, ends the worker."""
        with fails_alone(self.step_failed):
            self.step()
            self.num_failed_steps = 0

    def step_failed(self, exc: Exception) -> None:
        self.num_failed_steps += 1
        log.exception("%s: a step failed (%d in a row)", self.worker_id, self.num_failed_steps)
        if self.num_failed_steps >= MAX_FAILED_STEPS:
            raise FatalError(f"{MAX_FAILED_STEPS} steps in a row failed; the last: {exc!r}") from exc

    def tell_gateways(self, message) -> None:
        for link in self.links:
            if link.registered:
                link.channel.send(message)

    def holds_requests(self) -> bool:
        """Whether something here would be lost if the process ended now."""
        return self.engine.has_unfinished()

    def maybe_stall(self) -> None:
        """Tests' fault hook (faults.ENV): stall_after_steps and stall_s, a stuck engine; step_delay_ms, a slow one."""
        self.num_loop_steps += 1
        spec = self.fault_spec
        if spec and spec.step_delay_ms:
            time.sleep(spec.step_delay_ms / 1000)
        if spec and spec.stall_s and self.num_loop_steps == spec.stall_after_steps:
            log.warning("%s: %s: stalling the step loop for %.1f s", self.worker_id, faults.ENV, spec.stall_s)
            time.sleep(spec.stall_s)

    def read_socket(self, sock) -> None:
        """Handle every message waiting on sock; a message's failure stays with its request (on_message_failed)."""
        on_ready = self.watched.get(sock)
        if on_ready is not None:
            # What it could pin on a request, it failed alone already; what escapes is a bug: the loop goes on.
            with fails_alone(lambda exc: log.exception("%s: while reading a socket", self.worker_id)):
                on_ready()
            return
        channel = self.channel_for(sock)
        while sock.poll(0):
            received = channel.recv()
            if received is None:
                continue
            peer, env = received
            with fails_alone(lambda exc: self.on_message_failed(channel, env, exc)):
                if not isinstance(env.message, p.RegisterReply):
                    self.handle(channel, peer, env)
                elif (link := self.link_of(channel)) is not None:
                    self.on_register_reply(link, env.message)

    def watch(self, fd: int, on_ready) -> None:
        """Poll a file descriptor that its owner reads itself (a connector's wake-up pipe): on_ready() when readable."""
        self.watched[fd] = on_ready
        self.poller.register(fd, zmq.POLLIN)

    def on_message_failed(self, channel: Channel, env: p.Envelope, exc: Exception) -> None:
        """A message whose handling raised: when it came from a gateway about a request, that request fails."""
        name = type(env.message).__name__
        log.exception("%s: while handling %s", self.worker_id, name, extra={"request_id": env.request_id})
        link = self.link_of(channel)
        if link is None or not env.request_id or isinstance(env.message, (p.Abort, p.RequestFailed)):
            return
        attempt = getattr(env.message, "attempt", 0)
        self.send_failure(link, env.request_id, attempt, env.trace, f"{self.worker_id} failed on {name}: {exc}", exc)
        self.forget_request(env.request_id, attempt)

    def send_failure(self, link: GatewayLink, request_id: str, attempt: int, trace, error: str, exc=None,
                     code: int | None = None, retry: bool = False) -> None:  # fmt: skip
        """Tell a request's gateway that its attempt failed here (code: else as failure_code(exc) says)."""
        code = code or failure_code(exc)
        log.warning("%s: request failed (%d): %s", self.worker_id, code, error, extra={"request_id": request_id})
        failed = p.RequestFailed(p.shorten(error, MAX_ERROR_CHARS), code, attempt, retry=retry)
        link.channel.send(failed, request_id, trace)

    def report(self, f: Failure) -> None:
        self.send_failure(f.link, f.request_id, f.attempt, f.trace, f.error, f.exc, f.code, f.retry)

    def forget_request(self, request_id: str, attempt: int) -> None:
        """End whatever this worker holds for an attempt that failed."""

    def channel_for(self, sock) -> Channel:
        return next(link.channel for link in self.links if link.channel.socket is sock)

    def handle(self, channel: Channel, peer, env: p.Envelope) -> None:
        raise NotImplementedError

    def step(self) -> None:
        raise NotImplementedError

    def close(self) -> None:
        self.compiles.close()
        for link in self.links:
            link.close()

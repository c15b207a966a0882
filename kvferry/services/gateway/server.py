"""The gateway's core: the control socket, the registry, and each request's life from routing to its last token.

It routes a request to one prefill and one decode worker and turns their messages into a stream of events for the
HTTP layer. Every wait is bounded: a request whose worker dies, stalls, loses a message or gives up moves to other
workers (a new attempt prefills the prompt plus the tokens delivered, so the stream continues where it stopped), at
most `max_moves` times; then it fails with a clear error.
"""

import asyncio
import dataclasses
import logging
import time
import uuid
from collections import OrderedDict
from dataclasses import dataclass

import zmq
import zmq.asyncio

from kvferry.common import protocol as p
from kvferry.common import settings, tracing
from kvferry.common.bind_check import bind_zmq, check_exposed
from kvferry.common.block_hash import block_hashes
from kvferry.common.curve import CurveKeys, KeyHolder
from kvferry.common.errors import InvalidRequest
from kvferry.common.gateway_config import GatewayConfig
from kvferry.common.peer_address import check_peer_address
from kvferry.common.sampling import SamplingParams
from kvferry.common.sequence import FinishReason
from kvferry.common.transport import Channel, limit_socket, peer_label
from kvferry.services.gateway.flight import Event, Flight, Lost
from kvferry.services.gateway.registry import MISSED_HEARTBEATS, Registry, WorkerInfo

log = logging.getLogger("kvferry.gateway")
MAX_TOLD_TO_ABORT = 4096  # remembered (request, attempt) pairs an Abort was repeated for
RECEIVE_SLICE_S = 0.002  # the longest the control socket's backlog holds the event loop at a time
UNKNOWN = "unknown"  # a worker's message about a request (attempt) this gateway no longer runs
FINISH_REASONS = tuple(sorted(FinishReason))  # by value, which indexes it: no enum call per token
assert [int(r) for r in FINISH_REASONS] == list(range(len(FINISH_REASONS)))


class NoWorkers(Exception):
    pass


@dataclass
class Deadlines:
    """How long a request may wait for each thing, and how often it may move: the gateway's settings, and two waits
    of its own."""

    config: GatewayConfig = dataclasses.field(default_factory=GatewayConfig)
    gap_s: float = 2.0  # tokens held back for a message that has not come
    no_workers_s: float = 10.0  # a request that must move waits this long for a live worker

    first_token_s = property(lambda self: self.config.first_token_timeout)
    step_s = property(lambda self: self.config.step_timeout)
    request_s = property(lambda self: self.config.request_timeout)
    max_moves = property(lambda self: self.config.max_moves)


class GatewayCore:
    def __init__(
        self,
        control_address: str,
        model_name: str,
        block_size: int,
        heartbeat_interval_s: float = GatewayConfig.heartbeat_interval,
        deadlines: Deadlines | None = None,
        curve: CurveKeys | None = None,
        insecure: bool = False,
    ):
        self.ctx = zmq.asyncio.Context.instance()
        self.auth = curve.authenticator(self.ctx) if curve else None  # then each message comes with its sender's key
        sock = self.ctx.socket(zmq.ROUTER)
        if curve:
            curve.serve(sock)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)  # a send to a vanished worker fails loudly, not silently
        # A worker's sockets are named after it: one that reconnects before its old connection is seen to die takes
        # the name over (ZeroMQ would ignore it otherwise). Not under CURVE, where any admitted key could then take a
        # live worker's name and the prompts routed to it; there the worker retries its registration until ZeroMQ's
        # heartbeat (transport.HEARTBEAT_TIMEOUT_S) drops the old connection.
        sock.setsockopt(zmq.ROUTER_HANDOVER, 0 if curve else 1)
        # Before the bind, which copies them into the listener: a size cap on worker frames, and ZeroMQ heartbeats, so
        # that a peer gone without closing is dropped (not mistaken for a second one when it reconnects).
        limit_socket(sock, p.max_header_bytes(*p.GATEWAY_RECEIVES), p.max_header_bytes(*p.WORKER_RECEIVES))
        bind_zmq(sock, control_address, settings.label("control"))
        check_exposed(control_address, "the gateway's control socket", curve=curve is not None, insecure=insecure)
        self.control_endpoint = sock.getsockopt(zmq.LAST_ENDPOINT).decode()
        self.control = Channel(sock, "gateway/control")  # asyncio socket: used through pack and send_async
        self.registry = Registry(heartbeat_interval_s, expected_model=model_name, expected_block_size=block_size)
        self.deadlines = deadlines or Deadlines()
        self.flights: dict[str, Flight] = {}
        self.tasks: list[asyncio.Task] = []
        self.gateway_id = f"gw-{uuid.uuid4().hex[:16]}"  # shared workers route replies by it: 64 bits, never two alike
        self.draining = False
        self.num_moves = 0
        self._told_to_abort: OrderedDict[tuple[str, int], float] = OrderedDict()  # (request id, attempt) -> when
        self.num_forged = 0  # worker messages dropped: from a connection that may not send them

    def start(self) -> None:
        self.tasks = [asyncio.create_task(self._receive_loop()), asyncio.create_task(self._expire_loop())]

    async def stop(self) -> None:
        for task in self.tasks:
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)  # their pending receive ends before the socket
        self.control.close()
        if self.auth:
            self.auth.stop()

    def num_waiting(self) -> int:
        return sum(not f.got_first_token for f in self.flights.values())

    # -- control messages -------------------------------------------------------------------------------------
    async def _receive_loop(self) -> None:
        # Messages already waiting are taken one after another, so that a stream behind by several steps gets their
        # tokens together (one write for them all); the loop is let go at least every RECEIVE_SLICE_S, so that
        # the streams and new requests never wait long behind a backlog.
        waiting = zmq.Socket.shadow(self.control.socket.underlying)  # the plain side: what is there already
        slice_ends = 0.0  # time.monotonic: uvloop's loop.time() stands still while a callback runs
        while True:
            try:
                parts = waiting.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                parts = await self.control.socket.recv_multipart(copy=False)
                slice_ends = time.monotonic() + RECEIVE_SLICE_S
            received = self.control.unpack(parts)
            if received is not None:  # else counted and logged
                peer, env = received
                try:
                    await self._handle(peer, env, self._key_of(parts[-1]))
                except Exception:  # one bad message must not stop the gateway
                    log.exception("while handling %s from %r", type(env.message).__name__, peer)
            if time.monotonic() >= slice_ends:
                await asyncio.sleep(0)
                slice_ends = time.monotonic() + RECEIVE_SLICE_S

    async def _send(self, message, identity: bytes, request_id: str = "", parent=None) -> bool:
        parts, _ = self.control.pack(message, request_id, parent, to=identity)
        try:
            await self.control.send_async(parts)
            return True
        except zmq.ZMQError as exc:  # EHOSTUNREACH: the worker is gone
            log.warning("send to %s failed: %s", peer_label(identity), exc)
            return False

    def _key_of(self, frame: zmq.Frame) -> KeyHolder | None:
        """Whose CURVE key a message came in under (None without CURVE: on loopback there is no key to bind)."""
        if self.auth is None:
            return None
        try:
            return KeyHolder.of(frame)
        except zmq.ZMQError:  # no User-Id: a key of no known holder, which may speak for no worker
            return KeyHolder(None, "")

    async def _handle(self, peer: bytes, env: p.Envelope, key: KeyHolder | None = None) -> None:
        msg, rid, now = env.message, env.request_id, time.time()
        user_id = key.user_id if key else ""
        if isinstance(msg, p.Register):
            refused = self._check_registration(msg, peer, key) or self.registry.register(msg, peer, now, user_id)
            if refused:
                log.warning("refused worker %s: %s", msg.worker_id, refused)
            else:
                log.info("worker %s joined as %s", msg.worker_id, p.Role(msg.role).name.lower())
            await self._register_reply(refused, peer, env.trace)
        elif isinstance(msg, p.Heartbeat):
            worker = self.registry.workers.get(msg.worker_id)
            if self._spoofed(msg, peer, user_id, worker, p.HEARTBEAT_SUFFIX):
                return
            if not msg.healthy and worker is not None:
                self._lose_worker(self.registry.workers.pop(msg.worker_id), "its step loop is stuck")
            if not self.registry.heartbeat(msg, now):
                log.warning("heartbeat from unregistered worker %s: asking it to register", msg.worker_id)
                await self._register_reply(p.UNKNOWN_WORKER, peer, env.trace)
        elif isinstance(msg, p.CacheUpdate):
            # (A worker the gateway dropped learns so from its next heartbeat: the registry ignores its update.)
            if not self._spoofed(msg, peer, user_id, self.registry.workers.get(msg.worker_id)):
                self.registry.cache_update(msg)
        elif isinstance(msg, p.Deregister):
            worker = self.registry.workers.get(msg.worker_id)
            if worker is not None and not self._spoofed(msg, peer, user_id, worker):
                if msg.final:
                    self._lose_worker(self.registry.workers.pop(msg.worker_id), "it shut down")
                else:
                    worker.draining = True
                    log.info("worker %s is draining: nothing new goes to it", msg.worker_id)
        elif isinstance(msg, p.TokenBatch):
            # One sender for all: the connection's worker, under its key (as below, once for the batch).
            if self._spoofed(msg, peer, user_id, self.registry.workers.get(peer.decode(errors="replace"))):
                return
            taken, unknown = [], []
            for request_id, tokens in msg.sequences:
                flight = self._assigned(peer, request_id, tokens)
                if flight is UNKNOWN:
                    unknown.append((request_id, tokens.attempt))
                elif flight is not None:
                    taken.append((request_id, tokens, flight))
            self.control.trace_entries("recv", "Tokens", peer, env.trace, [(r, f.trace) for r, _, f in taken])
            for _, tokens, flight in taken:
                flight.post(self._event(tokens, flight))
            for request_id, attempt in unknown:
                await self._abort_unknown(peer, request_id, attempt, env.trace)
        elif isinstance(msg, (p.FirstToken, p.Tokens, p.RequestFailed)):
            flight = self._assigned(peer, rid, msg)
            if flight is UNKNOWN:
                await self._abort_unknown(peer, rid, msg.attempt, env.trace)
            if not isinstance(flight, Flight):
                return
            # The connection is the assigned worker's (by name): and its key, the one that registered that worker.
            if self._spoofed(msg, peer, user_id, self.registry.workers.get(peer.decode(errors="replace"))):
                return
            if isinstance(msg, p.FirstToken) and flight.pending_prefill_tokens:
                # Its prompt is computed: the prefill worker's queue is that much shorter before it next says so.
                self.registry.prefilled(flight.prefill_worker_id, flight.pending_prefill_tokens)
                flight.pending_prefill_tokens = 0
            flight.post(self._event(msg, flight))

    def _assigned(self, peer: bytes, rid: str, msg):
        """The flight a worker's message about request rid is for; UNKNOWN when the request ended or moved on to
        another attempt (the caller tells the worker to abort it), None when peer is not one of its workers
        (forged)."""
        flight = self.flights.get(rid)
        if flight is None or msg.attempt != flight.attempt:  # a worker still busy with an attempt left behind
            return UNKNOWN
        if peer not in (flight.prefill_identity, flight.decode_identity):
            self._forged(msg, peer, "a request's message from a connection it is not assigned to")
            return None
        return flight

    async def _register_reply(self, refused: str | None, peer: bytes, trace) -> None:
        reply = p.RegisterReply(
            refused is None, refused or "", self.registry.heartbeat_interval_s, self.gateway_id, token_batches=True
        )
        await self._send(reply, peer, parent=trace)

    def _check_registration(self, msg: p.Register, peer: bytes, key: KeyHolder | None) -> str | None:
        """Why a registration is refused before the registry's own checks (None: it is not). A worker registers from
        its control socket, named after its id; with CURVE, as the role its key was admitted for, and a worker id
        registered under one key stays that key's while it lives. A known id with a new instance id (under the
        same key) is a restart: the old process is gone, and what it held moves at once."""
        if peer != msg.worker_id.encode():
            self._forged(msg, peer, "a registration from a socket not named after the worker id")
            return f"a worker registers from its control socket, whose identity is its id ({msg.worker_id!r})"
        known = self.registry.workers.get(msg.worker_id)
        if key is not None:
            refused = self._check_key(msg, peer, key, known)
            if refused:
                return refused
        if msg.role == p.Role.DECODE:
            try:
                check_peer_address(msg.kv_address)
            except InvalidRequest as exc:
                return f"its KV ingress address is unusable: {exc}"
        if known is not None and known.instance_id != msg.instance_id:
            self._lose_worker(self.registry.workers.pop(msg.worker_id), "it restarted (a new instance registered)")
        return None

    def _check_key(self, msg: p.Register, peer: bytes, key: KeyHolder, known: WorkerInfo | None) -> str | None:
        """Why a registration is refused for the CURVE key it came under (None: it is not)."""
        try:
            claimed = p.Role(msg.role).name.lower()
        except ValueError:
            return None  # the registry refuses an unknown role
        if key.role is None:
            return (
                f"its CURVE key {key.name!r} records no role, so it may register as no worker: re-admit it at the "
                f"gateway with `kvferry keys DIR --revoke {key.name}` then `--client {key.name} --role {claimed}`"
            )
        if key.role != claimed:
            self._forged(msg, peer, f"CURVE key {key.name!r} is a {key.role} worker's, and it registers as {claimed}")
            return f"its CURVE key {key.name!r} is admitted for a {key.role} worker: it cannot register as {claimed}"
        if known is not None and known.key != key.user_id:
            self._forged(msg, peer, f"worker {msg.worker_id} is registered under another CURVE key")
            return (
                f"worker id {msg.worker_id!r} is registered under another key, and stays its until that worker "
                f"deregisters or misses {MISSED_HEARTBEATS} heartbeats: give this worker an id of its own"
            )
        return None

    def _spoofed(self, msg, peer: bytes, key: str, worker: WorkerInfo | None, suffix: bytes = b"") -> bool:
        """Whether msg speaks for a registered worker from a connection other than the one that registered it (or its
        identity plus suffix: the heartbeat socket's), or under another CURVE key. Such a message is counted as
        forged; the caller drops it."""
        if worker is None:
            return False
        if peer not in (worker.identity, worker.identity + suffix):
            self._forged(msg, peer, f"it names worker {worker.worker_id}, registered from another connection")
            return True
        if key != worker.key:
            self._forged(msg, peer, f"it comes from worker {worker.worker_id}'s connection, under another CURVE key")
            return True
        return False

    def _forged(self, msg, peer: bytes, why: str) -> None:
        """A worker message from a connection that may not send it: dropped, counted and logged, never acted on."""
        self.num_forged += 1
        log.warning("dropped %s from %s: %s", type(msg).__name__, peer_label(peer), why)

    @staticmethod
    def _event(msg, flight: Flight) -> Event:
        kind = type(msg)
        if kind is p.RequestFailed:
            return Event(error=msg.message, error_code=msg.code, retry=msg.retry, attempt=msg.attempt)
        if msg.finish_reason >= len(FINISH_REASONS) or not 0 <= msg.choice < flight.n or msg.start < 0:
            return Event(
                error=f"a worker sent finish reason {msg.finish_reason}, choice {msg.choice} and start "
                f"{msg.start} for a request with {flight.n} choices",
                attempt=msg.attempt,
            )
        reason = FINISH_REASONS[msg.finish_reason] if msg.finish_reason >= 0 else None
        if kind is p.Tokens:  # at every step: the rest is for first tokens
            return Event(list(msg.token_ids), reason, msg.choice, msg.start, msg.attempt, list(msg.logprobs), msg)
        if msg.token_id < 0 and reason != FinishReason.DEAD_END:
            return Event(error=f"a worker sent the first token {msg.token_id}", attempt=msg.attempt)
        # A choice whose constraint allowed no token at all ends with no token: the first token says -1.
        token_ids = [msg.token_id] if msg.token_id >= 0 else []
        return Event(token_ids, reason, msg.choice, msg.start, msg.attempt, list(msg.logprobs), message=msg)

    async def _abort_unknown(self, peer: bytes, rid: str, attempt: int, trace) -> None:
        """A worker works on something this gateway no longer wants (its Abort was lost, or the request moved):
        tell it again, at most once a second, so that it frees the blocks."""
        now = time.monotonic()
        if now - self._told_to_abort.get((rid, attempt), 0.0) < 1.0:
            return
        self._told_to_abort[(rid, attempt)] = now
        self._told_to_abort.move_to_end((rid, attempt))
        if len(self._told_to_abort) > MAX_TOLD_TO_ABORT:
            self._told_to_abort.popitem(last=False)  # the least recently told: O(1), not a rebuild
        await self._send(p.Abort(attempt=attempt), peer, rid, trace)

    def _lose_worker(self, worker: WorkerInfo, why: str) -> None:
        log.warning("worker %s dropped: %s", worker.worker_id, why)
        for flight in self.flights.values():
            if flight.involves(worker.identity):
                flight.post(Lost(f"worker {worker.worker_id} is gone ({why})", flight.attempt))

    async def _expire_loop(self) -> None:
        # Checked five times an interval: a silent worker is dropped soon after its third missed heartbeat.
        while True:
            await asyncio.sleep(self.registry.heartbeat_interval_s / 5)
            try:
                for worker in self.registry.expire(time.time()):
                    self._lose_worker(worker, f"no heartbeat for {MISSED_HEARTBEATS} intervals")
                await self._watch_flights()
            except Exception:  # the loop must outlive anything one turn meets: worker expiry depends on it
                log.exception("while expiring workers and requests")

    async def _watch_flights(self) -> None:
        """Deadlines enforced whether or not anybody reads: a request past its end-to-end deadline, or whose
        reader fell too far behind (a client that stopped reading its stream), is aborted on its workers and
        forgotten here. Its reader, when it comes back, gets the failure."""
        now = time.monotonic()
        for flight in list(self.flights.values()):
            if flight.failure is None and now >= flight.deadline:
                flight.fail(self._too_long())
            if flight.failure is not None:
                self.flights.pop(flight.request_id, None)
                await self.abort(flight)

    def _too_long(self) -> Event:
        return Event(error=f"the request took longer than {self.deadlines.request_s:.0f} s", error_code=504)

    # -- requests -----------------------------------------------------------------------------------------
    async def generate(self, *args, **kwargs):
        """generate_batches' Events one at a time."""
        batches = self.generate_batches(*args, **kwargs)
        try:
            async for events in batches:
                for event in events:
                    yield event
        finally:
            await batches.aclose()

    async def generate_batches(
        self,
        prompt_token_ids: list[int],
        params: SamplingParams,
        request_id: str | None = None,
        trace: p.TraceContext | None = None,
        n: int = 1,
        flights: list | None = None,
    ):
        """Route one request and yield its Events, in order and each token once, until it finishes or fails: in
        lists, each what came since the last (one, unless its consumer fell behind: it then catches up in one go).
        Raises NoWorkers when it cannot be routed at all. trace: the request's own span (the HTTP request's);
        the messages it causes are its children. flights: a list that gets the request's Flight."""
        rid = request_id or f"cmpl-{uuid.uuid4().hex}"
        flight = self.flights[rid] = Flight(rid, prompt_token_ids, params, trace or tracing.child_of(None), n)
        if flights is not None:
            flights.append(flight)
        deadline = flight.deadline = time.monotonic() + self.deadlines.request_s
        try:
            if not await self._dispatch(flight):  # inside the try: a client gone meanwhile must not leave the flight
                raise NoWorkers(self.missing() or "the chosen workers are gone")
            while not flight.done:
                ready = []
                for item in await self._next(flight, deadline):
                    if item.attempt != flight.attempt:
                        continue  # about an attempt already left behind
                    if isinstance(item, Lost) or item.retry:
                        failure = await self._move(flight, item.reason if isinstance(item, Lost) else item.error)
                        if failure is None:
                            continue
                        item = failure
                    if item.error is not None:
                        if ready:
                            yield ready
                        yield [item]
                        return
                    ready += flight.accept(item)
                    if flight.done:
                        break
                if ready:
                    yield ready
        finally:
            flight.inbox.close()
            self.flights.pop(rid, None)
            if not flight.done:  # an error, a timeout, a stop string or a client gone: free it everywhere
                # Shielded: a disconnect cancels this task, and the Abort must still go out.
                await asyncio.shield(self.abort(flight))

    async def _next(self, flight: Flight, deadline: float) -> list:
        """The flight's messages since the last call (at least one), or one Lost when the wait for the next runs
        past its bound."""
        d = self.deadlines
        while True:
            now = time.monotonic()
            if flight.failure is None and now >= deadline:
                flight.failure = self._too_long()
            if flight.failure is not None:
                return [dataclasses.replace(flight.failure, attempt=flight.attempt)]
            items = flight.inbox.take()
            if items:
                return items
            limit = d.step_s if flight.got_first_token else d.first_token_s
            waits = [(flight.last_progress + limit, "no word"), (deadline, "")]
            if flight.early:
                waits.append((flight.early_since + d.gap_s, "gap"))
            until, why = min(waits)
            if now >= until:
                if why == "no word":
                    what = "a decode step" if flight.got_first_token else "the first token"
                    return [Lost(f"no word for {limit:.0f} s waiting for {what}", flight.attempt)]
                if why == "gap":
                    return [Lost(f"a message was lost (tokens waited {d.gap_s:.0f} s)", flight.attempt)]
                return [dataclasses.replace(self._too_long(), attempt=flight.attempt)]
            await flight.inbox.wait(until)

    async def _dispatch(self, flight: Flight) -> bool:
        """Route the flight's current attempt to a prefill and a decode worker; False if none are live or the
        send failed."""
        resume = flight.resume_token_ids() if flight.attempt else []
        tokens = flight.prompt_token_ids + resume
        hashes = block_hashes(tokens, self.registry.expected_block_size)  # cheap next to a step (docs/benchmarks.md)
        avoid = frozenset(flight.failed_on)
        prefill, num_cached_blocks = self.registry.pick_prefill(hashes, len(tokens), avoid)
        decode = self.registry.pick_decode(avoid)
        if prefill is None or decode is None:
            return False
        params = flight.params
        if flight.attempt:
            params = dataclasses.replace(params, prompt_logprobs=None)  # given with the first attempt's first token
        flight.pending_prefill_tokens = len(tokens) - num_cached_blocks * prefill.block_size
        self.registry.assign(
            prefill, decode, flight.pending_prefill_tokens, -(-len(tokens) // decode.block_size), hashes
        )
        flight.prefill_identity, flight.decode_identity = prefill.identity, decode.identity
        flight.prefill_worker_id = prefill.worker_id
        flight.routes.append({"prefill": prefill.worker_id, "decode": decode.worker_id})
        request = p.PrefillRequest(
            flight.prompt_token_ids,
            params,
            decode.worker_id,
            decode.kv_address,
            time.time() + self.deadlines.request_s,
            flight.n,
            flight.attempt,
            resume,
        )
        try:
            return await self._send(request, prefill.identity, flight.request_id, flight.trace)
        except p.MessageTooLarge:  # nothing went out: there is nothing to abort
            flight.prefill_identity = flight.decode_identity = b""
            raise

    async def _move(self, flight: Flight, reason: str) -> Event | None:
        """Move the flight to other workers after a failure; an error Event when it cannot move."""
        if not flight.can_resume():
            return Event(error=f"{reason}; a request with n > 1 cannot move once tokens were sent", error_code=503)
        if flight.num_moves >= self.deadlines.max_moves:
            return Event(error=f"{reason}; gave up after moving the request {flight.num_moves} times", error_code=503)
        await self.abort(flight)  # the old attempt, wherever it still runs
        flight.failed_on.update((flight.prefill_identity, flight.decode_identity))  # others first, from now on
        flight.next_attempt()
        self.num_moves += 1
        log.warning(
            "moving request %s (attempt %d, %d tokens delivered): %s",
            flight.request_id,
            flight.attempt,
            sum(map(len, flight.outputs)),
            reason,
            extra={"request_id": flight.request_id},
        )
        give_up_at = time.monotonic() + self.deadlines.no_workers_s
        while not await self._dispatch(flight):
            if time.monotonic() >= give_up_at:
                return Event(
                    error=f"{reason}; no live workers to move the request to within "
                    f"{self.deadlines.no_workers_s:.0f} s ({self.missing() or 'sends failed'})",
                    error_code=503,
                )
            await asyncio.sleep(0.1)
        return None

    async def abort(self, flight: Flight) -> None:
        for identity in {flight.prefill_identity, flight.decode_identity} - {b""}:
            await self._send(p.Abort(attempt=flight.attempt), identity, flight.request_id, flight.trace)

    async def abort_choice(self, rid: str, choice: int) -> None:
        """One choice of a request still running ended at the gateway (a stop string): free it on decode."""
        flight = self.flights.get(rid)
        if flight is not None:
            await self._send(p.Abort(choice, flight.attempt), flight.decode_identity, rid, flight.trace)

    def missing(self) -> str:
        lacking = [role.name.lower() for role in p.Role if not self.registry.routable(role)]
        return "no live " + " or ".join(lacking) + " worker" if lacking else ""

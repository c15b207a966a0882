"""The gateway's core: the control socket, the registry, and each request's life from routing to its last token.

The gateway never runs the model. It owns the tokenizer, routes a request to one prefill and
one decode worker, and turns their messages (first token, token batches, failures) into a
stream of events for the HTTP layer.
"""
import asyncio
import logging
import time
import uuid
from dataclasses import dataclass, field

import zmq
import zmq.asyncio

from kvferry.common import protocol as p
from kvferry.common import tracing
from kvferry.common.sampling import SamplingParams
from kvferry.common.sequence import FinishReason
from kvferry.common.transport import Channel, peer_label
from kvferry.services.gateway.registry import Registry
from kvferry.services.worker import UNKNOWN_WORKER, sampling_to_wire

log = logging.getLogger("kvferry.gateway")
REQUEST_TIMEOUT_S = 600.0  # the longest a request may take end to end
EVENT_TIMEOUT_S = 120.0    # the longest the gateway waits for a request's next message


class NoWorkers(Exception):
    pass


@dataclass
class Event:
    token_ids: list[int] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    error: str | None = None
    error_code: int = 500
    queue_s: float = 0.0          # on the first token: time queued and computing on the prefill worker
    prefill_s: float = 0.0
    kv_transfer_s: float = 0.0    # on the first decode tokens: the KV hop
    kv_transfer_bytes: int = 0
    choice: int = 0
    logprobs: list = field(default_factory=list)         # p.Logprob per token, when asked for
    prompt_logprobs: list = field(default_factory=list)  # with the first token, when asked for (echo)


@dataclass
class Flight:
    """A request on its way: where it went and where its events arrive."""
    prefill_identity: bytes
    decode_identity: bytes
    trace: p.TraceContext
    n: int = 1
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)


class GatewayCore:
    def __init__(self, control_address: str, model_name: str, block_size: int, heartbeat_interval_s: float = 1.0):
        self.ctx = zmq.asyncio.Context.instance()
        sock = self.ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)  # a send to a vanished worker fails loudly, not silently
        sock.bind(control_address)
        self.control_endpoint = sock.getsockopt(zmq.LAST_ENDPOINT).decode()
        self.control = Channel(sock, "gateway/control")  # asyncio socket: used through pack and unpack
        self.registry = Registry(heartbeat_interval_s, expected_model=model_name, expected_block_size=block_size)
        self.flights: dict[str, Flight] = {}
        self.tasks: list[asyncio.Task] = []

    def start(self) -> None:
        self.tasks = [asyncio.create_task(self._receive_loop()), asyncio.create_task(self._expire_loop())]

    async def stop(self) -> None:
        for task in self.tasks:
            task.cancel()
        self.control.close()

    # -- control messages -------------------------------------------------------------------------------------
    async def _receive_loop(self) -> None:
        while True:
            received = self.control.unpack(await self.control.socket.recv_multipart(copy=False))
            if received is None:
                continue  # counted and logged
            peer, env = received
            try:
                await self._handle(peer, env)
            except Exception:  # one bad message must not stop the gateway
                log.exception("while handling %s from %r", type(env.message).__name__, peer)

    async def _send(self, message, identity: bytes, request_id: str = "", parent=None) -> bool:
        parts, _ = self.control.pack(message, request_id, parent, to=identity)
        try:
            await self.control.socket.send_multipart(parts)
            return True
        except zmq.ZMQError as exc:  # EHOSTUNREACH: the worker is gone
            log.warning("send to %s failed: %s", peer_label(identity), exc)
            return False

    async def _handle(self, peer: bytes, env: p.Envelope) -> None:
        msg, rid, now = env.message, env.request_id, time.time()
        if isinstance(msg, p.Register):
            refused = self.registry.register(msg, peer, now)
            if refused:
                log.warning("refused worker %s: %s", msg.worker_id, refused)
            else:
                log.info("worker %s joined as %s", msg.worker_id, p.Role(msg.role).name.lower())
            await self._send(p.RegisterReply(refused is None, refused or "", self.registry.heartbeat_interval_s), peer,
                             parent=env.trace)
        elif isinstance(msg, p.Heartbeat):
            if not self.registry.heartbeat(msg, now):
                log.warning("heartbeat from unregistered worker %s: asking it to register", msg.worker_id)
                await self._send(p.RegisterReply(False, UNKNOWN_WORKER, self.registry.heartbeat_interval_s), peer,
                                 parent=env.trace)
        elif isinstance(msg, (p.FirstToken, p.Tokens, p.RequestFailed)):
            flight = self.flights.get(rid)
            if flight is None:
                return  # finished or aborted already
            if isinstance(msg, p.RequestFailed):
                flight.queue.put_nowait(Event(error=msg.message, error_code=msg.code))
                return
            ids = [msg.token_id] if isinstance(msg, p.FirstToken) else msg.token_ids
            if msg.finish_reason >= len(FinishReason):
                flight.queue.put_nowait(Event(error=f"a worker sent finish reason {msg.finish_reason}"))
                return
            reason = FinishReason(msg.finish_reason) if msg.finish_reason >= 0 else None
            if isinstance(msg, p.FirstToken):
                event = Event(ids, reason, queue_s=msg.queue_s, prefill_s=msg.prefill_s, choice=msg.choice,
                              logprobs=msg.logprobs, prompt_logprobs=msg.prompt_logprobs)
            else:
                event = Event(ids, reason, kv_transfer_s=msg.kv_transfer_s, kv_transfer_bytes=msg.kv_transfer_bytes,
                              choice=msg.choice, logprobs=msg.logprobs)
            if not 0 <= event.choice < flight.n:
                event = Event(error=f"a worker sent choice {event.choice} of a request with {flight.n}")
            flight.queue.put_nowait(event)

    async def _expire_loop(self) -> None:
        while True:
            await asyncio.sleep(self.registry.heartbeat_interval_s)
            for worker in self.registry.expire(time.time()):
                log.warning("worker %s dropped: no heartbeat for %d intervals", worker.worker_id, 3)
                # Its requests fail now rather than after a long silence (moving them is issue 6's work).
                for flight in self.flights.values():
                    if worker.identity in (flight.prefill_identity, flight.decode_identity):
                        flight.queue.put_nowait(Event(error=f"worker {worker.worker_id} stopped responding",
                                                      error_code=503))

    # -- requests -----------------------------------------------------------------------------------------
    async def generate(self, prompt_token_ids: list[int], params: SamplingParams, request_id: str | None = None,
                       trace: p.TraceContext | None = None, n: int = 1):
        """Route one request and yield its Events until it finishes. Raises NoWorkers when it cannot be routed.
        trace: the request's own span (the HTTP request's); the messages it causes are its children."""
        prefill, decode = self.registry.pick_prefill(), self.registry.pick_decode()
        if prefill is None or decode is None:
            raise NoWorkers(self.missing())
        rid = request_id or f"cmpl-{uuid.uuid4().hex}"
        trace = trace or tracing.child_of(None)
        self.registry.assign(prefill, decode, len(prompt_token_ids), -(-len(prompt_token_ids) // decode.block_size))
        flight = self.flights[rid] = Flight(prefill.identity, decode.identity, trace, n)
        deadline = time.time() + REQUEST_TIMEOUT_S
        request = p.PrefillRequest(prompt_token_ids, sampling_to_wire(params), decode.worker_id, decode.kv_address,
                                   deadline, n)
        completed = False  # every choice ended by a finish reason: nothing left on the workers
        num_finished = 0
        try:
            if not await self._send(request, prefill.identity, rid, trace):
                raise NoWorkers("the chosen prefill worker is gone")
            while True:
                try:
                    event = await asyncio.wait_for(flight.queue.get(), EVENT_TIMEOUT_S)
                except asyncio.TimeoutError:
                    event = Event(error=f"no word from the workers for {EVENT_TIMEOUT_S:.0f} s", error_code=504)
                num_finished += event.error is None and event.finish_reason is not None
                completed = num_finished == n
                yield event
                if completed or event.error is not None:
                    return
        finally:
            self.flights.pop(rid, None)
            if not completed:  # an error, a timeout, a stop string or a client gone: free it everywhere
                # Shielded: a disconnect cancels this task, and the Abort must still go out.
                await asyncio.shield(self.abort(rid, flight))

    async def abort(self, rid: str, flight: Flight) -> None:
        for identity in {flight.prefill_identity, flight.decode_identity}:
            await self._send(p.Abort(), identity, rid, flight.trace)

    async def abort_choice(self, rid: str, choice: int) -> None:
        """One choice of a request still running ended at the gateway (a stop string): free it on decode."""
        flight = self.flights.get(rid)
        if flight is not None:
            await self._send(p.Abort(choice), flight.decode_identity, rid, flight.trace)

    def missing(self) -> str:
        lacking = [role.name.lower() for role in p.Role if not self.registry.live(role)]
        return "no live " + " or ".join(lacking) + " worker" if lacking else ""

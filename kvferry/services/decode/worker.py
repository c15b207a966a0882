"""The decode worker: receives prompts' KV from prefill workers into its own block pool, and batches
generation continuously, streaming each step's tokens to the gateway."""

import logging
import time
from dataclasses import dataclass

import zmq

from kvferry.common import protocol as p
from kvferry.common import tracing
from kvferry.common.bind_check import bind_zmq, warn_if_exposed
from kvferry.common.errors import InvalidRequest
from kvferry.common.model.kv_blocks import frame_tensor
from kvferry.common.sampling import for_choice
from kvferry.common.transport import Channel
from kvferry.services.gateway_link import GatewayLink
from kvferry.services.prefill.worker import attempt_key
from kvferry.services.worker import Worker, advertised_host

log = logging.getLogger("kvferry.decode")
MAX_CHOICES = 128
TOMBSTONE_S = 600.0  # as long as a request may live at the gateway
HOLD_S = 20.0  # how long cached blocks stay held for a transfer announced by a KVQuery (a lost Abort
#                must not pin them for long; a later transfer is asked for every block)
INCOMING_S = 10.0  # a transfer whose next layer group has not come this long after the one before is dropped


def check_choices(msg: p.KVTransfer, announced: list[int] | None = None) -> None:
    """Distinct choice numbers in range, each with a first token where the group carries them (the last group
    must); the last group's choices must be among those its first group announced."""
    choices, tokens = msg.choices, msg.output_token_ids
    if (
        not choices
        or len(set(choices)) != len(choices)
        or not all(0 <= c < MAX_CHOICES for c in choices)
        or (tokens or announced is not None)
        and len(tokens) != len(choices)
    ):
        raise InvalidRequest(
            "a KV transfer needs distinct choice numbers, and its last layer group one first token per choice"
        )
    if announced is not None and not set(choices) <= set(announced):
        raise InvalidRequest(f"the last layer group names choices {choices}, the first announced {announced}")


@dataclass
class Incoming:
    """A transfer whose layer groups are arriving: its blocks are allocated and filled group by group."""

    first: p.KVTransfer  # the first group's message: the request's fields
    link: GatewayLink
    engine_ids: list[str]  # one per choice the first group announced (cancelled ones left out)
    choices: list[int]
    params: list
    held: list[int]  # cached blocks it leaves out, referenced for it
    blocks: list[int]  # allocated for the rest, referenced for it
    received_at: float  # wall clock of the first group
    expires_at: float  # monotonic
    next_layer: int = 0
    num_bytes: int = 0


class DecodeWorker(Worker):
    role = p.Role.DECODE

    def __init__(
        self,
        config,
        gateway,
        worker_id=None,
        kv_bind: str = "tcp://127.0.0.1:0",
        advertise_host: str | None = None,
        **kwargs,
    ):
        # Bound before the model loads (in Worker.__init__): a taken port fails at once.
        curve = kwargs.get("curve")
        self.auth = curve.authenticator(zmq.Context.instance()) if curve else None
        sock = zmq.Context.instance().socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        if curve:
            curve.serve(sock)
        bind_zmq(sock, kv_bind, "--kv-bind (KVFERRY_KV_BIND)")
        super().__init__(config, gateway, worker_id, **kwargs)
        warn_if_exposed(kv_bind, f"{self.worker_id}'s KV ingress", curve=self.curve is not None)
        endpoint = sock.getsockopt(zmq.LAST_ENDPOINT).decode()
        host, port = endpoint.rsplit(":", 1)
        if host.endswith("0.0.0.0") or host.endswith("*"):
            host = "tcp://" + advertised_host(advertise_host)
        self.advertised_kv = f"{host}:{port}"
        self.kv_in = Channel(sock, f"{self.worker_id}/kv")
        self.poller.register(sock, zmq.POLLIN)
        # Keyed by attempt (attempt_key): a request moved off a failed decode worker can come back here.
        self.traces: dict[str, p.TraceContext] = {}
        self.origin: dict[str, tuple[str, int]] = {}  # attempt key -> (request id, attempt), for its messages
        self.link_for: dict[str, GatewayLink] = {}  # attempt key -> the gateway its tokens go to
        # A request's choices run as sequences of their own: engine id -> (attempt key, choice), and back.
        self.choice_of: dict[str, tuple[str, int]] = {}
        self.engine_ids: dict[str, list[str]] = {}
        self.cancelled_choices: dict[str, set[int]] = {}  # ended before their KV arrived
        self.transfer_s: dict[str, tuple[float, int]] = {}  # (seconds, bytes), told with the first Tokens
        self.num_steps = 0
        # Requests finished or aborted here, with when to forget them: KV for one of them that arrives
        # late (an Abort can overtake its transfer; a resend can follow an ack) is acknowledged and dropped.
        self.tombstones: dict[str, float] = {}
        # Cached blocks a prefill worker was told this worker holds (KVHeld), kept from eviction until the
        # request's KV comes, which leaves them out: attempt key -> (block ids, monotonic expiry).
        self.held: dict[str, tuple[list[int], float]] = {}
        self.incoming: dict[str, Incoming] = {}  # attempt key -> a transfer whose layer groups are arriving

    def kv_address(self) -> str:
        return self.advertised_kv

    def channel_for(self, sock) -> Channel:
        return self.kv_in if sock is self.kv_in.socket else super().channel_for(sock)

    def num_protocol_errors(self) -> int:
        return super().num_protocol_errors() + self.kv_in.num_protocol_errors

    def handle(self, channel, peer, env: p.Envelope) -> None:
        msg = env.message
        if isinstance(msg, p.KVTransfer):
            self.receive_kv(peer, env)
        elif isinstance(msg, p.KVQuery):
            self.hold_blocks(peer, env)
        elif isinstance(msg, p.Abort):
            key = attempt_key(env.request_id, msg.attempt)
            if msg.choice >= 0:
                self.abort_choice(key, msg.choice)
                return
            for engine_id in self.engine_ids.get(key, [key]):
                self.engine.abort(engine_id)
            self.bury(key)

    def abort_choice(self, rid: str, choice: int) -> None:
        """One choice ended at the gateway (a stop string) while the others go on; if its KV has not come yet,
        it is left out when it does."""
        if rid in self.tombstones:
            return
        if rid not in self.engine_ids:
            self.cancelled_choices.setdefault(rid, set()).add(choice)
            return
        engine_id = next((e for e in self.engine_ids[rid] if self.choice_of.get(e) == (rid, choice)), None)
        if engine_id is None:
            return  # finished already
        self.engine.abort(engine_id)
        self.drop_choice(rid, engine_id)

    def drop_choice(self, rid: str, engine_id: str) -> None:
        """A choice's sequence ended here (finished or aborted); the request is buried with its last choice."""
        self.choice_of.pop(engine_id, None)
        self.engine_ids[rid] = [e for e in self.engine_ids.get(rid, []) if e != engine_id]
        if not self.engine_ids[rid]:
            self.bury(rid)

    def hold_blocks(self, peer: bytes, env: p.Envelope) -> None:
        """Answer a KVQuery: how many of its leading blocks sit in this worker's prefix cache, held from now on
        for the request's transfer."""
        msg = env.message
        key = attempt_key(env.request_id, msg.attempt)
        self.let_go(key)
        bm = self.engine.block_manager
        ids = []
        if key not in self.traces and key not in self.tombstones:
            ids = bm.match_prefix(msg.block_hashes[: bm.num_blocks_for(self.engine.max_model_len)])
            bm.take_cached(ids)
            if ids:
                self.held[key] = (ids, time.monotonic() + HOLD_S)
        self.kv_in.send(p.KVHeld(len(ids), msg.attempt), env.request_id, env.trace, to=peer)

    def let_go(self, key: str, keep: int = 0) -> list[int]:
        """Stop holding a request's blocks but its first `keep`, which are returned: their references pass to
        the caller."""
        ids, _ = self.held.pop(key, ([], 0.0))
        self.engine.block_manager.free(ids[keep:])
        return ids[:keep]

    def tidy(self) -> None:
        now = time.monotonic()
        for key in [k for k, incoming in self.incoming.items() if incoming.expires_at < now]:
            self.drop_incoming(key)
        for key in [k for k, (_, until) in self.held.items() if until < now]:
            self.let_go(key)  # its transfer, if it ever comes, is asked to send every block

    def bury(self, rid: str) -> None:
        self.drop_incoming(rid)
        self.let_go(rid)
        self.cancelled_choices.pop(rid, None)
        for engine_id in self.engine_ids.pop(rid, []):
            self.choice_of.pop(engine_id, None)
        self.traces.pop(rid, None)
        self.origin.pop(rid, None)
        self.link_for.pop(rid, None)
        self.transfer_s.pop(rid, None)
        now = time.monotonic()
        self.tombstones[rid] = now + TOMBSTONE_S
        if len(self.tombstones) > 1024:
            self.tombstones = {r: t for r, t in self.tombstones.items() if t > now}

    def receive_kv(self, peer: bytes, env: p.Envelope) -> None:
        """One layer group of a transfer. The first checks the request and allocates its blocks; each group is
        placed into them as it comes; the last admits the sequences and is acknowledged."""
        msg = env.message
        rid = attempt_key(env.request_id, msg.attempt)  # this worker's key for the attempt

        def ack(accepted: bool, reason: str = "", retry: bool = True, resend_all: bool = False) -> None:
            self.kv_in.send(
                p.KVAck(accepted, reason, retry, msg.attempt, resend_all), env.request_id, env.trace, to=peer
            )

        if msg.layer_start > 0:
            self.receive_layers(rid, env, ack)
            return
        self.drop_incoming(rid)  # a resend starts over
        if rid in self.traces or rid in self.tombstones:  # placed already, or no longer wanted
            self.let_go(rid)
            ack(True)
            return
        held = self.let_go(rid, keep=msg.num_skipped_blocks)
        if len(held) < msg.num_skipped_blocks:  # the hold expired, or this worker restarted meanwhile
            self.engine.block_manager.free(held)
            ack(False, "the blocks the transfer leaves out are no longer held here", resend_all=True)
            return
        link = self.link_named(msg.gateway_id)
        if link is None:  # a gateway this worker does not serve: nobody would read the tokens
            self.engine.block_manager.free(held)
            ack(False, f"{self.worker_id} is not registered with gateway {msg.gateway_id!r}", retry=False)
            return
        try:
            check_choices(msg)
            params = msg.sampling
            cancelled = self.cancelled_choices.get(rid, set())
            choices = [c for c in msg.choices if c not in cancelled]
            if not choices:  # every choice ended before its KV came
                self.engine.block_manager.free(held)
                self.bury(rid)
                ack(True)
                return
            engine_ids = [rid] if choices == [0] else [f"{rid}#{c}" for c in choices]
            choice_params = [for_choice(params, c) for c in choices]
            blocks = self.engine.begin_prefilled(
                engine_ids, msg.prompt_token_ids, choice_params, msg.resume_token_ids, held
            )
        except (InvalidRequest, KeyError, RuntimeError) as exc:
            self.engine.block_manager.free(held)
            self.refuse(rid, msg, env, link, exc, ack)
            return
        if blocks is None:
            self.hold_again(rid, held)
            ack(False, "no free blocks")
            return
        self.incoming[rid] = Incoming(
            msg, link, engine_ids, choices, choice_params, held, blocks, received_at=time.time(), expires_at=0.0
        )
        self.receive_layers(rid, env, ack)

    def receive_layers(self, rid: str, env: p.Envelope, ack) -> None:
        msg = env.message
        incoming = self.incoming.get(rid)
        last = msg.layer_start + (msg.shape[0] if msg.shape else 0) >= self.engine.runner.layout.num_layers
        if incoming is None or msg.layer_start != incoming.next_layer:
            # After a refused first group, or a group lost on the way: the sender's resend starts over. Its last
            # group is answered, so that the sender need not wait for its ack timeout: done if the request ended
            # here meanwhile, else send again.
            self.drop_incoming(rid)
            if last and (rid in self.tombstones or rid in self.traces):
                ack(True)
            elif last:
                ack(False, "the transfer's first layer groups were not placed here")
            return
        try:
            kv = frame_tensor(env.frames[0], msg.dtype, msg.shape)  # [layers, blocks, block_size, 2, kvh, d]
            self.engine.write_prefilled(incoming.blocks, kv, msg.layer_start)
            if last:
                check_choices(msg, announced=incoming.first.choices)
        except (InvalidRequest, KeyError, RuntimeError) as exc:
            del self.incoming[rid]
            self.engine.block_manager.free(incoming.blocks + incoming.held)
            self.refuse(rid, msg, env, incoming.link, exc, ack)
            return
        incoming.next_layer += msg.shape[0]
        incoming.num_bytes += kv.nbytes
        incoming.expires_at = time.monotonic() + INCOMING_S
        if not last:
            return
        del self.incoming[rid]
        # The last group names the choices that go on (those whose first token did not end them) and their tokens;
        # the gateway may have ended more since the first group came (a stop string in a first token).
        first_token = dict(zip(msg.choices, msg.output_token_ids))
        cancelled = self.cancelled_choices.get(rid, set())
        going_on = [i for i, c in enumerate(incoming.choices) if c in first_token and c not in cancelled]
        if not going_on:
            self.engine.block_manager.free(incoming.blocks + incoming.held)
            self.bury(rid)
            ack(True)
            return
        engine_ids = [incoming.engine_ids[i] for i in going_on]
        choices = [incoming.choices[i] for i in going_on]
        first = incoming.first
        try:
            placed = self.engine.finish_prefilled(
                engine_ids,
                first.prompt_token_ids,
                [first_token[c] for c in choices],
                [incoming.params[i] for i in going_on],
                incoming.blocks,
                first.resume_token_ids,
                incoming.held,
            )
        except InvalidRequest as exc:
            self.engine.block_manager.free(incoming.blocks + incoming.held)
            self.refuse(rid, msg, env, incoming.link, exc, ack)
            return
        if not placed:
            self.engine.block_manager.free(incoming.blocks)
            self.hold_again(rid, incoming.held)
            ack(False, "no free blocks")
            return
        self.traces[rid] = env.trace
        self.origin[rid] = (env.request_id, msg.attempt)
        self.link_for[rid] = incoming.link
        self.engine_ids[rid] = engine_ids
        self.choice_of.update({e: (rid, c) for e, c in zip(engine_ids, choices)})
        self.cancelled_choices.pop(rid, None)
        placed_at = time.time()
        # What the transfer adds after the prompt's compute: copy-out on the prefill worker, then the wire and placing
        # the blocks here, from the first group, or from the last one when the others came during the compute.
        since = first.sent_at if first.output_token_ids else msg.sent_at
        hop_s = max(0.0, placed_at - since) if since else placed_at - incoming.received_at
        self.transfer_s[rid] = (msg.gather_s + hop_s, incoming.num_bytes)
        if self.tracer.enabled:
            self.tracer.span(
                "kv.transfer_in",
                incoming.received_at,
                placed_at,
                env.request_id,
                tracing.child_of(env.trace),
                bytes=incoming.num_bytes,
                num_blocks=len(incoming.blocks),
                num_held_blocks=len(incoming.held),
                prefill=msg.prefill_worker_id,
                attempt=msg.attempt,
            )
        ack(True)

    def refuse(self, rid: str, msg, env: p.Envelope, link: GatewayLink, exc: Exception, ack) -> None:
        """A transfer that can never be placed: the request ends here, and its gateway is told why."""
        self.bury(rid)
        ack(False, f"refused: {exc}", retry=False)
        code = 400 if isinstance(exc, InvalidRequest) else 500  # the request's fault, or ours
        link.channel.send(
            p.RequestFailed(f"decode worker refused the KV: {exc}", code, msg.attempt), env.request_id, env.trace
        )

    def hold_again(self, rid: str, held: list[int]) -> None:
        """Keep held blocks for a transfer's retry, which leaves them out again."""
        if held:
            self.held[rid] = (held, time.monotonic() + HOLD_S)

    def drop_incoming(self, rid: str) -> None:
        """Forget a transfer whose groups stopped coming (or start again): free its blocks, keep its held ones."""
        incoming = self.incoming.pop(rid, None)
        if incoming is not None:
            self.engine.block_manager.free(incoming.blocks)
            self.hold_again(rid, incoming.held)

    def step(self) -> None:
        started = time.time()
        outputs = self.engine.step()
        if self.engine.last_plan.chunks:
            self.num_steps += 1
            if self.tracer.enabled:
                self.trace_step(self.engine.last_plan, started)
        for out in outputs:
            key, choice = self.choice_of.get(out.request_id, (out.request_id, 0))
            rid, attempt = self.origin.get(key, (key, 0))
            reason = int(out.finish_reason) if out.finished else -1
            transfer_s, transfer_bytes = self.transfer_s.pop(key, (0.0, 0))
            start = len(out.output_token_ids) - len(out.new_token_ids)
            tokens = p.Tokens(
                out.new_token_ids,
                reason,
                transfer_s,
                transfer_bytes,
                list(out.new_logprobs),
                choice,
                attempt,
                start,
            )
            link = self.link_for.get(key)
            if link is not None:
                link.channel.send(tokens, rid, self.traces.get(key))
            if out.finished:
                self.drop_choice(key, out.request_id)

    def trace_step(self, plan, started: float) -> None:
        """The step as a span, naming the requests (not their choices' engine ids) that rode in it."""
        keys = (self.choice_of.get(c.seq.request_id, (c.seq.request_id,))[0] for c in plan.chunks)
        rids = dict.fromkeys(self.origin.get(k, (k,))[0] for k in keys)
        self.tracer.span(
            "decode.step" if not plan.is_prefill else "decode.recompute",
            started,
            time.time(),
            step=self.num_steps,
            batch_size=len(plan.chunks),
            num_tokens=plan.num_tokens,
            num_preempted=len(plan.preempted),
            rids=list(rids),
        )

    def close(self) -> None:
        self.kv_in.close()
        super().close()
        if self.auth:
            self.auth.stop()

"""The decode worker: receives prompts' KV from prefill workers into its own block pool, and batches generation
continuously, streaming each step's tokens to the gateway.

Each request attempt is one DecodeAttempt record (services/decode/record.py); each of its choices runs as an
engine sequence keyed by ChoiceKey. A step is `engine.step()` with the DecodeConnector plugged in.
"""

import dataclasses
import logging
import time

import zmq

from kvferry.common import protocol as p
from kvferry.common import settings, tracing
from kvferry.common.bind_check import bind_zmq, check_exposed
from kvferry.common.errors import InvalidRequest, KvferryError
from kvferry.common.model.kv_blocks import frame_tensor, layer_groups
from kvferry.common.model_files import read_config, resolve_model
from kvferry.common.request_failure import fails_alone, failure_text
from kvferry.common.sampling import for_choice
from kvferry.common.transport import Channel, limit_socket
from kvferry.services.decode.connector import DecodeConnector
from kvferry.services.decode.record import (
    INCOMING_S,
    TOMBSTONE_S,
    DecodeAttempt,
    DecodeRecords,
    DecodeState,
    Incoming,
)
from kvferry.services.gateway_link import GatewayLink
from kvferry.services.request_keys import AttemptKey
from kvferry.services.worker import MAX_CHOICES, Worker, advertised_host

log = logging.getLogger("kvferry.decode")
S = DecodeState
TIDY_EVERY_S = 0.25  # how often expired holds, stalled transfers and old tombstones are looked for
MAX_REASON_CHARS = 500  # of a refusal's text in a KVAck: an exception's message can quote a whole input


def max_kv_frame_bytes(engine) -> int:
    """The largest legal KV frame this engine can take: its largest layer group, of every block in its pool."""
    largest_group = max(hi - lo for lo, hi in engine.layer_groups)
    return largest_group * engine.num_blocks * (engine.bytes_per_block // engine.num_layers)


def kv_frame_bound(config) -> int:
    """max_kv_frame_bytes, or a hair above, before the engine exists: ZeroMQ takes a socket's size limit when it
    binds, and the KV port is bound before the model loads. The largest layer group's share of the KV cache budget
    (its blocks fill the budget but for less than one); of the model, only its layer count is read."""
    num_layers = read_config(resolve_model(config.model))["num_hidden_layers"]
    largest_group = max(hi - lo for lo, hi in layer_groups(num_layers))
    return largest_group * config.kv_cache_memory // num_layers


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
        # A prefill worker that reconnects before its old connection died takes its name over; not under CURVE, where
        # another prefill key could take a live worker's name, and the acks sent to it (as at the gateway).
        sock.setsockopt(zmq.ROUTER_HANDOVER, 0 if curve else 1)
        # A frame past one layer group of the whole pool is no transfer: refused before ZeroMQ buffers it.
        frame_limit = max(kv_frame_bound(config), p.max_header_bytes(*p.KV_INGRESS_RECEIVES))
        limit_socket(sock, frame_limit)
        if curve:
            curve.serve(sock)
        bind_zmq(sock, kv_bind, settings.label("kv_bind"))
        exposed_as = f"{worker_id or 'the decode worker'}'s KV ingress"
        check_exposed(kv_bind, exposed_as, curve=curve is not None, insecure=kwargs.get("insecure", False))
        super().__init__(config, gateway, worker_id, connector=lambda _: DecodeConnector(), **kwargs)
        if max_kv_frame_bytes(self.engine) > frame_limit:  # the bound's reasoning no longer holds: a bug
            raise KvferryError(f"a KV frame may be {max_kv_frame_bytes(self.engine)} bytes, past {frame_limit}")
        endpoint = sock.getsockopt(zmq.LAST_ENDPOINT).decode()
        host, port = endpoint.rsplit(":", 1)
        if host.endswith("0.0.0.0") or host.endswith("*"):
            host = "tcp://" + advertised_host(advertise_host)
        self.advertised_kv = f"{host}:{port}"
        self.kv_in = Channel(sock, f"{self.worker_id}/kv")
        self.poller.register(sock, zmq.POLLIN)
        # Keyed by attempt: a request moved off a failed decode worker can come back here as a new attempt.
        self.records = DecodeRecords()
        self.num_steps = 0
        self.tidy_at = 0.0

    def kv_address(self) -> str:
        return self.advertised_kv

    def channel_for(self, sock) -> Channel:
        return self.kv_in if sock is self.kv_in.socket else super().channel_for(sock)

    def num_protocol_errors(self) -> int:
        return super().num_protocol_errors() + self.kv_in.num_protocol_errors

    def record_for(self, key: AttemptKey) -> DecodeAttempt:
        return self.records.get_or_new(key)

    def end_record(self, record: DecodeAttempt) -> None:
        self.compiles.forget(record.key)
        if record.state is not S.DONE:
            record.end(self.engine)
            self.records.file(record)

    def forget_request(self, request_id: str, attempt: int) -> None:
        record = self.records.get(AttemptKey(request_id, attempt))
        if record is not None:
            self.end_record(record)

    # -- messages -------------------------------------------------------------------------------------------
    def handle(self, channel, peer, env: p.Envelope) -> None:
        key = AttemptKey(env.request_id, getattr(env.message, "attempt", 0))
        try:
            self.handle_message(key, peer, env)
        finally:  # whatever the message changed, the record is filed where its new state says
            record = self.records.get(key)
            if record is not None:
                self.records.file(record)

    def handle_message(self, key: AttemptKey, peer, env: p.Envelope) -> None:
        msg = env.message
        if isinstance(msg, p.KVTransfer):
            with fails_alone(lambda exc: self.transfer_failed(key, peer, env, exc)):
                self.receive_kv(key, peer, env)
        elif isinstance(msg, p.KVQuery):
            self.hold_blocks(key, peer, env)
        elif isinstance(msg, p.Abort):
            if msg.choice >= 0:
                self.abort_choice(key, msg.choice)
            else:
                self.end_record(self.record_for(key))

    def transfer_failed(self, key: AttemptKey, peer: bytes, env: p.Envelope, exc: Exception) -> None:
        """What escaped a transfer's own refusals (a bug, or a message this code did not foresee): it is refused."""
        log.exception("%s: KV transfer", self.worker_id, extra={"request_id": env.request_id})
        self.refuse(self.record_for(key), env, peer, self.link_named(env.message.gateway_id), exc)

    def abort_choice(self, key: AttemptKey, choice: int) -> None:
        """One choice ended at the gateway (a stop string) while the others go on; if its KV has not come yet,
        it is left out when it does."""
        if choice >= MAX_CHOICES:
            return  # no transfer can name it: nothing to leave out, and nothing to remember
        record = self.record_for(key)
        if record.state is S.DONE:
            return
        if record.state is not S.RUNNING:
            record.cancelled.add(choice)
            record.tombstone_until = record.tombstone_until or time.monotonic() + TOMBSTONE_S  # its KV may never come
            return
        choice_key = record.running.get(choice)
        if choice_key is None:
            return  # finished already
        self.engine.abort(choice_key)
        if record.choice_ended(choice):
            self.end_record(record)

    def hold_blocks(self, key: AttemptKey, peer: bytes, env: p.Envelope) -> None:
        """Answer a KVQuery: how many of its leading blocks sit in this worker's prefix cache, held from now on
        for the request's transfer."""
        record = self.record_for(key)
        ids = []
        if record.state in (S.NEW, S.HOLDING):
            record.let_go(self.engine)
            ids = self.engine.connector.matched_blocks(env.message.block_hashes)
            if ids:
                record.hold(ids)
        self.kv_in.send(p.KVHeld(len(ids), key.attempt), env.request_id, env.trace, to=peer)

    def ack(self, env: p.Envelope, peer: bytes, accepted: bool, reason="", retry=True, resend_all=False) -> None:
        msg = env.message
        reply = p.KVAck(accepted, p.shorten(reason, MAX_REASON_CHARS), retry, msg.attempt, resend_all)
        self.kv_in.send(reply, env.request_id, env.trace, to=peer)

    def receive_kv(self, key: AttemptKey, peer: bytes, env: p.Envelope) -> None:
        """One layer group of a transfer. The first checks the request and allocates its blocks; each group is
        placed into them as it comes; the last admits the sequences and is acknowledged."""
        msg = env.message
        if msg.layer_start > 0:
            self.receive_layers(key, peer, env)
            return
        record = self.record_for(key)
        if record.state in (S.RUNNING, S.DONE):  # placed already, or no longer wanted
            self.ack(env, peer, True)
            return
        if record.state is S.RECEIVING:
            record.put_back(self.engine)  # a resend starts over
        held = record.let_go(self.engine, keep=msg.num_skipped_blocks)
        if len(held) < msg.num_skipped_blocks:  # the hold expired, or this worker restarted meanwhile
            self.engine.free_blocks(held)
            self.ack(env, peer, False, "the blocks the transfer leaves out are no longer held here", resend_all=True)
            return
        link = self.link_named(msg.gateway_id)
        if link is None:  # a gateway this worker does not serve: nobody would read the tokens
            self.engine.free_blocks(held)
            self.ack(env, peer, False, f"{self.worker_id} is not registered with gateway {msg.gateway_id!r}", False)
            return
        try:
            check_choices(msg)
            choices = [c for c in msg.choices if c not in record.cancelled]
            if not choices:  # every choice ended before its KV came
                self.engine.free_blocks(held)
                self.end_record(record)
                self.ack(env, peer, True)
                return
            params = [for_choice(msg.sampling, c) for c in choices]
            blocks = self.engine.begin_prefilled(
                [key.choice(c) for c in choices], msg.prompt_token_ids, params, msg.resume_token_ids, held
            )
        except Exception as exc:  # InvalidRequest: the request's fault (400); anything else is ours (500)
            self.engine.free_blocks(held)
            self.refuse(record, env, peer, link, exc)
            return
        if blocks is None:
            if held:
                record.hold(held)
            self.ack(env, peer, False, "no free blocks")
            return
        incoming = Incoming(msg, link, choices, params, blocks, trace=env.trace)
        record.start_receiving(incoming, held)
        constraint = msg.sampling.constraint
        if constraint is not None and not self.compiles.waiting(key):  # compiled while the KV comes
            incoming.grammar = self.compiles.ready(key, constraint)
            if incoming.grammar is not None:
                self.trace_compile(key.request_id, env.trace, constraint)  # a cache hit
        self.receive_layers(key, peer, env)

    def receive_layers(self, key: AttemptKey, peer: bytes, env: p.Envelope) -> None:
        msg = env.message
        record = self.records.get(key)
        incoming = record.incoming if record is not None and record.state is S.RECEIVING else None
        last = msg.layer_start + (msg.shape[0] if msg.shape else 0) >= self.engine.num_layers
        if incoming is None or msg.layer_start != incoming.next_layer:
            # After a refused first group, or a group lost on the way: the sender's resend starts over. Its last
            # group is answered, so that the sender need not wait for its ack timeout: done if the request ended
            # here meanwhile, else send again.
            if incoming is not None:
                record.put_back(self.engine)
            if last and record is not None and record.state in (S.RUNNING, S.DONE):
                self.ack(env, peer, True)
            elif last:
                self.ack(env, peer, False, "the transfer's first layer groups were not placed here")
            return
        try:
            kv = frame_tensor(env.frames[0], msg.dtype, msg.shape)  # [layers, blocks, block_size, 2, kvh, d]
            self.engine.write_prefilled(incoming.blocks, kv, msg.layer_start)
            if last:
                check_choices(msg, announced=incoming.first.choices)
        except Exception as exc:
            self.refuse(record, env, peer, incoming.link, exc)
            return
        incoming.next_layer += msg.shape[0]
        incoming.num_bytes += kv.nbytes
        incoming.expires_at = time.monotonic() + INCOMING_S
        if last and self.compiles.waiting(key):
            incoming.awaiting_grammar = (peer, dataclasses.replace(env, frames=[]))  # admitted by on_compiled
        elif last:
            self.admit(record, peer, env)

    def on_compiled(self, done) -> None:
        record = self.records.get(done.owner)
        incoming = record.incoming if record is not None and record.state is S.RECEIVING else None
        if incoming is None:
            return  # ended, or put back: a resend finds the grammar in the cache
        key = record.key
        self.trace_compile(key.request_id, incoming.trace, done.constraint, done.started_at, done.ended_at)
        incoming.grammar, incoming.grammar_error = done.grammar, done.error
        if incoming.awaiting_grammar is not None:
            peer, env = incoming.awaiting_grammar
            incoming.awaiting_grammar = None
            try:
                self.admit(record, peer, env)
            finally:
                self.records.file(record)

    def admit(self, record: DecodeAttempt, peer: bytes, env: p.Envelope) -> None:
        """The last group came: the choices that go on (those whose first token did not end them, and that the
        gateway has not ended since) join the running batch."""
        msg, incoming = env.message, record.incoming
        if incoming.grammar_error:
            # Not the request's fault: its prefill worker compiled the constraint. Another worker may: a 503 to move.
            error = incoming.grammar_error
            self.refuse(record, env, peer, incoming.link, KvferryError(error), told=error, code=503, retry=True)
            return
        first_token = dict(zip(msg.choices, msg.output_token_ids))
        going_on = [i for i, c in enumerate(incoming.choices) if c in first_token and c not in record.cancelled]
        if not going_on:
            self.end_record(record)
            self.ack(env, peer, True)
            return
        choices = [incoming.choices[i] for i in going_on]
        first = incoming.first
        try:
            placed = self.engine.finish_prefilled(
                [record.key.choice(c) for c in choices],
                first.prompt_token_ids,
                [first_token[c] for c in choices],
                [incoming.params[i] for i in going_on],
                incoming.blocks,
                first.resume_token_ids,
                record.held,
                incoming.grammar,
            )
        except Exception as exc:  # admission is all or nothing: the record still owns every block
            self.refuse(record, env, peer, incoming.link, exc)
            return
        if not placed:
            record.put_back(self.engine)
            self.ack(env, peer, False, "no free blocks")
            return
        placed_at = time.time()
        # What the transfer adds after the prompt's compute: copy-out on the prefill worker, then the wire and
        # placing the blocks here, from the first group, or from the last one when the others came during the compute.
        since = first.sent_at if first.output_token_ids else msg.sent_at
        hop_s = max(0.0, placed_at - since) if since else placed_at - incoming.received_at
        num_held = len(record.held)
        running = {c: record.key.choice(c) for c in choices}
        record.start_running(incoming.link, env.trace, running, (msg.gather_s + hop_s, incoming.num_bytes))
        if self.tracer.enabled:
            self.tracer.span(
                "kv.transfer_in",
                incoming.received_at,
                placed_at,
                env.request_id,
                tracing.child_of(env.trace),
                bytes=incoming.num_bytes,
                num_blocks=len(incoming.blocks),
                num_held_blocks=num_held,
                prefill=msg.prefill_worker_id,
                attempt=msg.attempt,
            )
        self.ack(env, peer, True)

    def refuse(self, record: DecodeAttempt, env: p.Envelope, peer: bytes, link: GatewayLink | None, exc,
               told: str = "", code: int | None = None, retry: bool = False) -> None:  # fmt: skip
        """A transfer that can never be placed here: the request ends here, and its gateway is told why (told: in
        those words; code and retry: as send_failure takes them)."""
        self.end_record(record)
        self.ack(env, peer, False, f"refused: {exc}", retry=False)
        if link is not None:
            error = told or f"decode worker refused the KV: {exc}"
            self.send_failure(link, env.request_id, env.message.attempt, env.trace, error, exc, code, retry)

    def tidy(self) -> None:
        """Let go of what ran out: the records' queues give the expired ones (and those past a cap) without a walk
        over the others; old tombstones, and NEW records whose cancelled choices are old, are simply forgotten."""
        now = time.monotonic()
        if now < self.tidy_at:
            return
        self.tidy_at = now + TIDY_EVERY_S
        for record in self.records.expired(now):
            if record.state is S.RECEIVING:
                record.put_back(self.engine)  # its groups stopped coming
            elif record.state is S.HOLDING:
                record.let_go(self.engine)  # its transfer, if it ever comes, is asked to send every block
            self.records.file(record)

    # -- a step -----------------------------------------------------------------------------------------------
    def step(self) -> None:
        started = time.time()
        outputs = self.engine.step()
        if self.engine.last_plan.chunks:
            self.num_steps += 1
            if self.tracer.enabled:
                self.trace_step(self.engine.last_plan, started)
        for out in outputs:
            record = self.records.get(out.request_id.attempt_key)
            if record is None or record.state is not S.RUNNING:
                continue
            with fails_alone(lambda exc: self.output_failed(record, exc)):  # the batch's other outputs still go out
                self.deliver(record, out)

    def deliver(self, record: DecodeAttempt, out) -> None:
        """One choice's new tokens to its gateway; the record ends with its last choice."""
        key, choice = record.key, out.request_id.choice
        if out.error:
            self.fail(record, f"the decode step failed: {out.error}")
            return
        reason = int(out.finish_reason) if out.finished else -1
        transfer_s, transfer_bytes = record.transfer or (0.0, 0)
        record.transfer = None
        start = len(out.output_token_ids) - len(out.new_token_ids)
        tokens = p.Tokens(
            out.new_token_ids, reason, transfer_s, transfer_bytes, list(out.new_logprobs), choice, key.attempt, start
        )
        record.link.channel.send(tokens, key.request_id, record.trace)
        if out.finished and record.choice_ended(choice):
            self.end_record(record)

    def output_failed(self, record: DecodeAttempt, exc: Exception) -> None:
        """Delivering an output raised: its request alone fails (500)."""
        log.exception("%s: an output", self.worker_id, extra={"request_id": record.key.request_id})
        self.fail(record, failure_text(exc))

    def fail(self, record: DecodeAttempt, error: str) -> None:
        if record.state is S.DONE:
            return
        link, trace = record.link, record.trace
        self.end_record(record)
        self.send_failure(link, record.key.request_id, record.key.attempt, trace, error, code=500)

    def trace_step(self, plan, started: float) -> None:
        """The step as a span, naming the requests (not their choices' engine ids) that rode in it."""
        rids = dict.fromkeys(c.seq.request_id.request_id for c in plan.chunks)
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

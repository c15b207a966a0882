"""The transfer-receiving half of DecodeConnector (services/decode/connector.py): the first layer group checks the
request and allocates its blocks (received_kv.reserve), each group is placed as it comes, and the last admits the
choices (`LLMEngine.admit_prefilled`) once their constraint has compiled."""

import dataclasses
import time

from kvferry.common import protocol as p
from kvferry.common import received_kv, tracing
from kvferry.common.errors import InvalidRequest, KvferryError
from kvferry.common.model.kv_blocks import frame_tensor
from kvferry.common.sampling import for_choice
from kvferry.services.decode.record import INCOMING_S, DecodeAttempt, DecodeState, Incoming
from kvferry.services.request_keys import AttemptKey
from kvferry.services.worker import MAX_CHOICES

S = DecodeState


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


class Receiving:
    def receive_kv(self, key: AttemptKey, peer: bytes, env: p.Envelope) -> None:
        msg = env.message
        if msg.layer_start > 0:
            self.receive_layers(key, peer, env)
            return
        record = self.records.get_or_new(key)
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
        link = self.gateway_named(msg.gateway_id)
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
            blocks = received_kv.reserve(
                self.engine, [key.choice(c) for c in choices], msg.prompt_token_ids, params, msg.resume_token_ids, held
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
            # After a refused first group, or one lost on the way, the sender's resend starts over; its last group
            # is answered (done if the request ended here meanwhile, else send again), so it need not time out.
            if incoming is not None:
                record.put_back(self.engine)
            if last and record is not None and record.state in (S.RUNNING, S.DONE):
                self.ack(env, peer, True)
            elif last:
                self.ack(env, peer, False, "the transfer's first layer groups were not placed here")
            return
        try:
            kv = frame_tensor(env.frames[0], msg.dtype, msg.shape)  # [layers, blocks, block_size, 2, kvh, d]
            received_kv.check_layers(self.engine.runner.layout, incoming.blocks, kv, msg.layer_start)
            self.load_blocks(incoming.blocks, kv, msg.layer_start)
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
        """A transfer's constraint compiled (or failed): a transfer whose last group waited for it is admitted now."""
        record = self.records.get(done.owner)
        incoming = record.incoming if record is not None and record.state is S.RECEIVING else None
        if incoming is None:
            return  # ended, or put back: a resend finds the grammar in the cache
        with self.filing(record.key):
            key = record.key
            self.trace_compile(key.request_id, incoming.trace, done.constraint, done.started_at, done.ended_at)
            incoming.grammar, incoming.grammar_error = done.grammar, done.error
            if incoming.awaiting_grammar is not None:
                peer, env = incoming.awaiting_grammar
                incoming.awaiting_grammar = None
                self.admit(record, peer, env)

    def admit(self, record: DecodeAttempt, peer: bytes, env: p.Envelope) -> None:
        """The last group came: the choices not ended (by their first token, or the gateway) join the batch."""
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
            placed = self.engine.admit_prefilled(
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

"""The decode side of the KV connector: it owns the worker's records (DecodeRecords) and every transition of them:
blocks held for a KVQuery, a transfer's layer groups placed as they come, its choices admitted through
`LLMEngine.admit_prefilled` once the last is in, choices and attempts ended, what ran out let go. Each entry point
files the record it changed (DecodeRecords.file) on its way out, whatever happened (on_outputs: see there).

The loop hands it peer messages (`on_message`), finished compiles (`on_compiled`), the step's outputs (`on_outputs`)
and the time (`tidy`). It touches no socket: what it has to say waits in its outbox for the loop (`take_outbox`).
Engine side (KVConnector): `matched_blocks` holds a prompt's cached leading blocks; `load_blocks` places a group.
"""

import contextlib
import logging
import time
from dataclasses import dataclass

from kvferry.common import protocol as p
from kvferry.common.kv_connector import KVConnector
from kvferry.common.request_failure import fails_alone, failure_text
from kvferry.services.decode.receiving import Receiving
from kvferry.services.decode.record import TOMBSTONE_S, DecodeAttempt, DecodeRecords, DecodeState
from kvferry.services.gateway_link import Failure, GatewayLink
from kvferry.services.request_keys import AttemptKey
from kvferry.services.worker import MAX_CHOICES

log = logging.getLogger("kvferry.decode")
S = DecodeState
TIDY_EVERY_S = 0.25  # how often expired holds, stalled transfers and old tombstones are looked for
MAX_REASON_CHARS = 500  # of a refusal's text in a KVAck: an exception's message can quote a whole input


@dataclass
class Reply:
    """A message for a prefill worker, on the KV ingress socket."""

    peer: bytes
    message: object
    request_id: str
    trace: p.TraceContext | None


class DecodeConnector(Receiving, KVConnector):
    def __init__(self, worker_id: str, tracer):
        self.worker_id, self.tracer = worker_id, tracer
        # Keyed by attempt: a request moved off a failed decode worker can come back here as a new attempt.
        self.records = DecodeRecords()
        self.outbox: list[Reply | Failure] = []
        self.tidy_at = 0.0
        self.gateway_named = self.compiles = self.trace_compile = None

    def serve(self, gateway_named, compiles, trace_compile) -> None:
        """What the worker lends it once it exists (the engine, which needs the connector, is made first)."""
        self.gateway_named, self.compiles, self.trace_compile = gateway_named, compiles, trace_compile

    # -- engine side ------------------------------------------------------------------------------------------
    def matched_blocks(self, block_hashes: list[bytes]) -> list[int]:
        return self.engine.hold_prefix(block_hashes)

    # -- the loop's entry points ------------------------------------------------------------------------------
    def take_outbox(self) -> list[Reply | Failure]:
        out, self.outbox = self.outbox, []
        return out

    @contextlib.contextmanager
    def filing(self, key: AttemptKey):
        """Whatever the body changed, the record is filed where its new state says."""
        try:
            yield
        finally:
            record = self.records.get(key)
            if record is not None:
                self.records.file(record)

    def on_message(self, peer, env: p.Envelope) -> None:
        """A KVQuery or KV layer group from a prefill worker, or an Abort from a gateway."""
        msg = env.message
        key = AttemptKey(env.request_id, getattr(msg, "attempt", 0))
        with self.filing(key):
            if isinstance(msg, p.KVTransfer):
                with fails_alone(lambda exc: self.transfer_failed(key, peer, env, exc)):
                    self.receive_kv(key, peer, env)
            elif isinstance(msg, p.KVQuery):
                self.hold_blocks(key, peer, env)
            elif isinstance(msg, p.Abort):
                if msg.choice >= 0:
                    self.abort_choice(key, msg.choice)
                else:
                    self.end_record(self.records.get_or_new(key))

    def end(self, key: AttemptKey) -> None:
        """End whatever is held for an attempt (its handling failed at the loop)."""
        record = self.records.get(key)
        if record is not None:
            self.end_record(record)

    def on_outputs(self, outputs: list) -> dict[GatewayLink, list[tuple[AttemptKey, p.Tokens, p.TraceContext | None]]]:
        """A step's outputs, one per choice: the Tokens messages to send, by the gateway they go to, each with its
        attempt and trace, in the step's order. A record ends with its last choice; a failed step's output fails its
        request, and an output that fails here fails its request alone. Not `filing`: a RUNNING record is filed
        nowhere, and every path that changes its state (end_record) files it."""
        by_gateway: dict[GatewayLink, list] = {}
        records = self.records
        for out in outputs:
            key = out.request_id.attempt_key
            record = records.get(key)
            if record is None or record.state is not S.RUNNING:
                continue
            sent = None
            with fails_alone(lambda exc, record=record: self.output_failed(record, exc)):
                sent = self.tokens_of(record, out)
            if sent is not None:
                link, tokens, trace = sent
                by_gateway.setdefault(link, []).append((key, tokens, trace))
        return by_gateway

    def tokens_of(self, record: DecodeAttempt, out):
        key, choice = record.key, out.request_id.choice
        if out.error:
            self.fail(record, f"the decode step failed: {out.error}")
            return None
        reason = int(out.finish_reason) if out.finished else -1
        transfer_s, transfer_bytes = record.transfer or (0.0, 0)
        record.transfer = None
        start = len(out.output_token_ids) - len(out.new_token_ids)
        tokens = p.Tokens(
            out.new_token_ids, reason, transfer_s, transfer_bytes, list(out.new_logprobs), choice, key.attempt, start
        )
        link, trace = record.link, record.trace
        if out.finished and record.choice_ended(choice):
            self.end_record(record)
        return link, tokens, trace

    def output_failed(self, record: DecodeAttempt, exc: Exception) -> None:
        log.exception("%s: an output", self.worker_id, extra={"request_id": record.key.request_id})
        self.fail(record, failure_text(exc))

    def unsent(self, key: AttemptKey, link: GatewayLink, trace, exc: Exception) -> None:
        """A choice's Tokens could not be sent: its request fails, and its gateway is told, even if the record ended."""
        log.exception("%s: sending tokens", self.worker_id, extra={"request_id": key.request_id})
        record = self.records.get(key)
        if record is not None:
            self.end_record(record)
        error = f"sending its tokens failed: {failure_text(exc)}"
        self.outbox.append(Failure(link, key.request_id, key.attempt, trace, error, exc))

    def tidy(self) -> None:
        """Let go of what ran out (DecodeRecords.expired)."""
        now = time.monotonic()
        if now < self.tidy_at:
            return
        self.tidy_at = now + TIDY_EVERY_S
        for record in self.records.expired(now):
            with self.filing(record.key):
                if record.state is S.RECEIVING:
                    record.put_back(self.engine)  # its groups stopped coming
                elif record.state is S.HOLDING:
                    record.let_go(self.engine)  # its transfer, if it ever comes, is asked to send every block

    # -- holds, aborts, ends ----------------------------------------------------------------------------------
    def hold_blocks(self, key: AttemptKey, peer: bytes, env: p.Envelope) -> None:
        """Answer a KVQuery: how many of its leading blocks are cached here, held from now on for the transfer."""
        record = self.records.get_or_new(key)
        ids = []
        if record.state in (S.NEW, S.HOLDING):
            record.let_go(self.engine)
            ids = self.matched_blocks(env.message.block_hashes)
            if ids:
                record.hold(ids)
        self.outbox.append(Reply(peer, p.KVHeld(len(ids), key.attempt), env.request_id, env.trace))

    def abort_choice(self, key: AttemptKey, choice: int) -> None:
        """One choice ended at the gateway (a stop string); if its KV has not come yet, it is left out when it does."""
        if choice >= MAX_CHOICES:
            return  # no transfer can name it: nothing to leave out, and nothing to remember
        record = self.records.get_or_new(key)
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

    def end_record(self, record: DecodeAttempt) -> None:
        self.compiles.forget(record.key)
        if record.state is not S.DONE:
            record.end(self.engine)
            self.records.file(record)

    def fail(self, record: DecodeAttempt, error: str) -> None:
        if record.state is S.DONE:
            return
        link, trace = record.link, record.trace
        self.end_record(record)
        self.outbox.append(Failure(link, record.key.request_id, record.key.attempt, trace, error, code=500))

    def ack(self, env: p.Envelope, peer: bytes, accepted: bool, reason="", retry=True, resend_all=False) -> None:
        reply = p.KVAck(accepted, p.shorten(reason, MAX_REASON_CHARS), retry, env.message.attempt, resend_all)
        self.outbox.append(Reply(peer, reply, env.request_id, env.trace))

    def refuse(self, record: DecodeAttempt, env: p.Envelope, peer: bytes, link: GatewayLink | None, exc,
               told: str = "", code: int | None = None, retry: bool = False) -> None:  # fmt: skip
        """A transfer that can never be placed here: the request ends, and its gateway is told (told: in those words;
        code and retry: as send_failure takes them)."""
        self.end_record(record)
        self.ack(env, peer, False, f"refused: {exc}", retry=False)
        if link is not None:
            error = told or f"decode worker refused the KV: {exc}"
            self.outbox.append(Failure(link, env.request_id, env.message.attempt, env.trace, error, exc, code, retry))

    def transfer_failed(self, key: AttemptKey, peer: bytes, env: p.Envelope, exc: Exception) -> None:
        """What escaped a transfer's own refusals (a bug, or an unforeseen message): it is refused."""
        log.exception("%s: KV transfer", self.worker_id, extra={"request_id": env.request_id})
        self.refuse(self.records.get_or_new(key), env, peer, self.gateway_named(env.message.gateway_id), exc)

"""The prefill side of the KV connector: asks the decode worker which blocks it already holds, ships each
computed prompt's KV blocks to it in layer groups, and keeps the blocks until it acknowledges.

When a prompt starts computing (on_scheduled) it asks the decode worker (KVQuery) which of the prompt's
leading blocks that worker's prefix cache holds; the transfer leaves those out. A transfer goes as one message
per group of layers. In the step that finishes a prompt, each group but the last is queued for the sender
thread as soon as its layers are stored (save_layers), so it is on the wire while the following layers
compute; the last group follows the first tokens. Nothing here touches a socket: KVSender does.
"""

import logging
import time

from kvferry.common import protocol as p
from kvferry.common import tracing
from kvferry.common.block_hash import block_hashes
from kvferry.common.errors import FatalError
from kvferry.common.kv_connector import KVConnector
from kvferry.common.model.kv_blocks import as_frames
from kvferry.common.request_failure import fails_alone, failure_text
from kvferry.services.prefill.kv_sender import KVSender, Outgoing, SenderDied
from kvferry.services.prefill.record import PrefillAttempt, PrefillState
from kvferry.services.request_keys import AttemptKey
from kvferry.services.worker_timings import GIVE_UP_TRANSFER_S, RETRY_FULL_AFTER_S

log = logging.getLogger("kvferry.prefill")
ACK_TIMEOUT_S = 10.0  # a transfer not acknowledged by then is sent again
HELD_ANSWER_WAIT_S = 0.1  # a finished prompt's transfer waits this long at most for the decode worker's KVHeld


class PrefillConnector(KVConnector):
    keeps_finished_blocks = True  # until the decode worker acknowledges the transfer

    def __init__(self, records: dict[AttemptKey, PrefillAttempt], sender: KVSender, worker_id: str, tracer, end):
        self.records, self.sender, self.worker_id, self.tracer = records, sender, worker_id, tracer
        self.end = end  # end(record, error="", code=500, retry=False): the worker ends a request, telling its gateway
        self.deferred: list = []  # replies taken during a forward pass, acted on after it
        # Bytes shipped, left out as held by the decode worker, and shipped while the prompt was still computing.
        self.num_kv_bytes_sent = self.num_kv_bytes_skipped = self.num_kv_bytes_sent_early = 0

    def bind(self, engine) -> None:
        super().bind(engine)
        # On CUDA each group's gather is queued on a side stream into pinned memory (`KVCache.read_blocks`), so it
        # overlaps the next group's layers as the CPU's gather thread does.
        self.wants_layer_events = engine.device.type in ("cpu", "cuda") and engine.num_layers > 1

    # -- scheduler side ---------------------------------------------------------------------------------------
    def on_scheduled(self, plan) -> None:
        """Prompts whose first chunk is scheduled start computing, and ask their decode worker which of their
        leading blocks it holds: asked now, not on arrival, since a prompt queued behind one with the same
        prefix finds that prefix at the decode worker by then, and the answer comes during the compute."""
        for chunk in plan.chunks:
            record = self.records.get(chunk.seq.request_id)
            if record is not None and record.state is PrefillState.QUEUED:
                record.start_computing()
                self.ask_held_blocks(record)

    def ask_held_blocks(self, record: PrefillAttempt) -> None:
        engine = self.engine
        if not engine.caching_enabled:
            return
        request = record.request
        tokens = request.prompt_token_ids + request.resume_token_ids
        cacheable = engine.num_cacheable_blocks(len(tokens)) * engine.block_size
        hashes = block_hashes(tokens[:cacheable], engine.block_size)
        if hashes:
            self.queue(record, p.KVQuery(hashes, request.attempt))
            record.asked = True

    # -- worker side ------------------------------------------------------------------------------------------
    def save_layers(self, plan, layers: tuple[int, int]) -> None:
        """A group of layers but the last is stored: that group of each finishing prompt's blocks is queued for
        its decode worker, once the blocks to send are settled (the decode worker's KVHeld came, or was never
        asked); a prompt that misses the first group goes whole after the compute."""
        lo, hi = layers
        if hi == self.engine.num_layers:
            return  # the last group follows the first tokens
        self.take_replies(during_forward=True)  # KVHeld answers settle which blocks go
        for chunk in plan.chunks:
            record = self.records.get(chunk.seq.request_id)
            if record is None or not chunk.samples or record.early_layers != lo or record.error:
                continue
            with fails_alone(lambda exc: self.early_group_failed(record, lo, hi, exc)):
                if lo == 0:
                    if record.answer_due:
                        continue
                    request = record.request
                    record.choices = [request.choice] if request.resume_token_ids else list(range(request.n))
                    self.settle(record, chunk.seq.block_table)
                self.send_group(record, lo, hi, chunk.seq.block_table, early=True)
                record.early_layers = hi

    def early_group_failed(self, record: PrefillAttempt, lo: int, hi: int, exc: Exception) -> None:
        """Shipping a group during the compute raised: the request alone fails, once the step is over (the batch
        computes on)."""
        log.exception("%s: shipping layers %d-%d of %s", self.worker_id, lo, hi, record.key.request_id)
        record.error = failure_text(exc)

    def take_replies(self, during_forward: bool = False) -> None:
        """Act on what decode workers sent back (KVHeld, KVAck), and on messages that could not go out. During a
        forward pass only KVHeld answers are acted on (they settle which blocks go); the rest waits, since acting
        on it may mean telling a gateway."""
        items, self.deferred = self.deferred + self.sender.received(), []
        for item in items:
            if isinstance(item, SenderDied):
                raise FatalError(f"{self.worker_id}: the KV sender thread failed: {item.error}")
            if during_forward and not (isinstance(item, tuple) and isinstance(item[1].message, p.KVHeld)):
                self.deferred.append(item)
                continue
            request_id, message = (item[1].request_id, item[1].message) if isinstance(item, tuple) else (
                item.outgoing.request_id, item.outgoing.message)  # fmt: skip
            record = self.records.get(AttemptKey(request_id, getattr(message, "attempt", 0)))
            with fails_alone(lambda exc: self.reply_failed(item, record, during_forward, exc)):
                if isinstance(item, tuple):
                    self.on_reply(item[1])
                elif record is not None:
                    out = item.outgoing
                    self.end(record, f"cannot reach decode worker {out.peer} at {out.address}: {item.error}", 503, True)

    def reply_failed(self, item, record: PrefillAttempt | None, during_forward: bool, exc: Exception) -> None:
        """Acting on a reply raised: this request's transfer alone fails; during a forward, once it is over (the
        item is acted on again then)."""
        if during_forward:
            self.deferred.append(item)
        elif record is not None and record.state is not PrefillState.DONE:
            log.exception("%s: a reply about %s", self.worker_id, record.key.request_id)
            self.end(record, failure_text(exc), 500)

    def on_reply(self, env: p.Envelope) -> None:
        msg = env.message
        record = self.records.get(AttemptKey(env.request_id, getattr(msg, "attempt", 0)))
        if record is None:
            return  # a duplicate, or an answer about a request that ended here
        if isinstance(msg, p.KVHeld):
            if record.asked and record.held_answer is None:
                record.held_answer = msg.num_blocks
                if record.state is PrefillState.SHIPPING and not record.settled:
                    record.retry_at = time.monotonic()  # the transfer waited for this answer: due now
        elif isinstance(msg, p.KVAck):
            if record.state is PrefillState.COMPUTING:
                record.early_answer = record.early_answer or msg  # to its first groups: acted on after the compute
            elif msg.accepted or not msg.retry:  # done, or refused for good (the decode worker told the gateway)
                if record.state in (PrefillState.SHIPPING, PrefillState.AWAITING_ACK):
                    self.end_transfer(record, msg.accepted)
            elif record.state is PrefillState.AWAITING_ACK:
                self.resend(record, msg.resend_all)

    def start_transfer(self, record: PrefillAttempt, block_ids: list[int], continuing: list[tuple[int, int]]) -> bool:
        """After the compute: the transfer of a prompt whose choices go on decoding. Which blocks go is settled at
        once, or, while the decode worker's answer to KVQuery is still due, when it comes (at most
        HELD_ANSWER_WAIT_S). Returns False when nothing goes on (the caller ends the record)."""
        early, answer = record.early_layers > 0, record.early_answer
        if not continuing:
            if early:
                self.queue(record, p.Abort(attempt=record.request.attempt))  # drop the groups that came
            return False
        record.start_shipping(continuing)
        if early and answer is not None:
            if answer.accepted or not answer.retry:  # ended at the decode worker meanwhile, or refused for good
                return False
            self.resend(record, answer.resend_all)  # the first groups were not placed: the whole transfer again
            return True
        if early:  # the rest of the groups now, the last with the first tokens
            for lo, hi in self.engine.layer_groups:
                if lo >= record.early_layers:
                    self.send_group(record, lo, hi, block_ids)
            record.all_sent()
            return True
        if record.answer_due:
            record.retry_at = time.monotonic() + HELD_ANSWER_WAIT_S
        else:
            self.settle(record, block_ids)
        return True

    def settle(self, record: PrefillAttempt, block_ids: list[int]) -> None:
        """Fix which blocks go: those the decode worker does not hold. They are gathered as they are sent."""
        held = record.held_answer or 0
        record.num_skipped_blocks = min(held, self.engine.num_cacheable_blocks(record.num_kv_tokens))
        record.parts, record.settled = {}, True
        bytes_per_block = self.engine.bytes_per_block
        record.num_bytes = (len(block_ids) - record.num_skipped_blocks) * bytes_per_block
        self.num_kv_bytes_skipped += record.num_skipped_blocks * bytes_per_block

    def resend(self, record: PrefillAttempt, resend_all: bool) -> None:
        """After a failure answer: every block at once if the decode worker let go of those it held, else the same
        transfer after a short wait (it had no room)."""
        if resend_all and record.num_skipped_blocks:
            self.num_kv_bytes_skipped -= record.num_skipped_blocks * self.engine.bytes_per_block
            record.held_answer = 0
            self.settle(record, self.engine.kept_block_ids(record.key))  # every block, this time
            record.send_again(0.0)
        else:
            record.send_again(RETRY_FULL_AFTER_S)

    def end_transfer(self, record: PrefillAttempt, accepted: bool) -> None:
        """The decode worker took the KV, or refused it for good (and told the gateway): the blocks go."""
        if self.tracer.enabled:
            self.tracer.span(
                "kv.transfer_out",
                record.first_sent_at,
                time.time(),
                record.key.request_id,
                tracing.child_of(record.trace),
                bytes=record.num_bytes,
                sends=record.num_sends,
                accepted=accepted,
                decode=record.request.decode_worker_id,
            )
        self.end(record)

    def send_group(self, record: PrefillAttempt, lo: int, hi: int, block_ids: list[int], early: bool = False) -> None:
        """One group of layers of a transfer, gathered on its first send and kept for resends. early: sent while
        the prompt computes, so without first tokens."""
        request = record.request
        if lo not in record.parts:
            blocks = block_ids[record.num_skipped_blocks :]
            started = time.time()
            record.parts[lo] = self.engine.read_kv(blocks, (lo, hi))
            if not early:  # a gather during the compute delays the first token instead, as part of the step
                record.gather_s += time.time() - started
            if self.tracer.enabled:
                self.tracer.span(
                    "kv.gather",
                    started,
                    time.time(),
                    record.key.request_id,
                    tracing.child_of(record.trace),
                    num_blocks=len(blocks),
                    num_held_by_decode=record.num_skipped_blocks,
                    layers=[lo, hi],
                    during_compute=early,
                )
        kv = record.parts[lo]  # [layers, blocks, block_size, 2, kvh, d]
        msg = p.KVTransfer(
            prefill_worker_id=self.worker_id,
            prompt_token_ids=request.prompt_token_ids,
            output_token_ids=[] if early else record.first_token_ids,
            choices=record.choices,
            sampling=request.sampling,
            num_computed_tokens=record.num_kv_tokens,
            dtype=str(kv.dtype).removeprefix("torch."),
            shape=list(kv.shape),
            deadline_s=request.deadline_s,
            gather_s=record.gather_s,
            sent_at=time.time(),
            attempt=request.attempt,
            resume_token_ids=request.resume_token_ids,
            gateway_id=record.link.gateway_id,
            num_skipped_blocks=record.num_skipped_blocks,
            layer_start=lo,
        )
        self.queue(record, msg, frames=as_frames(kv))
        record.first_sent_at = record.first_sent_at or msg.sent_at
        self.num_kv_bytes_sent += kv.nbytes
        if early:
            self.num_kv_bytes_sent_early += kv.nbytes

    def queue(self, record: PrefillAttempt, message, frames=None) -> None:
        request = record.request
        self.sender.send(
            Outgoing(
                request.decode_address, request.decode_worker_id, message, record.key.request_id, record.trace, frames
            )
        )

    def next_transfer_due(self) -> float:
        """Monotonic time at which some transfer needs sending (again) (inf: none)."""
        due = [
            r.retry_at if r.state is PrefillState.SHIPPING else r.sent_at + ACK_TIMEOUT_S
            for r in self.records.values()
            if r.state in (PrefillState.SHIPPING, PrefillState.AWAITING_ACK)
        ]
        return min(due, default=float("inf"))

    def send_due_transfers(self) -> None:
        for record in list(self.records.values()):
            with fails_alone(lambda exc: self.transfer_failed(record, exc)):
                self._send_if_due(record, time.monotonic())

    def transfer_failed(self, record: PrefillAttempt, exc: Exception) -> None:
        """Sending a transfer raised: it alone fails (500)."""
        log.exception("%s: sending the KV of %s", self.worker_id, record.key.request_id)
        if record.state is not PrefillState.DONE:
            self.end(record, failure_text(exc), 500)

    def _send_if_due(self, record: PrefillAttempt, now: float) -> None:
        """Send a transfer whose time came: due, or not acknowledged in time; give it up past its bounds."""
        if record.state is PrefillState.AWAITING_ACK and now >= record.sent_at + ACK_TIMEOUT_S:
            record.send_again(0.0)  # not acknowledged in time: lost on the way, or the peer restarted
        if record.state is not PrefillState.SHIPPING or now < record.retry_at:
            return
        if now > record.ready_at + GIVE_UP_TRANSFER_S or time.time() > record.request.deadline_s:
            message = (
                f"decode worker {record.request.decode_worker_id} did not take the KV in {GIVE_UP_TRANSFER_S:.0f} s"
            )
            self.end(record, message, 503, True)
            return
        block_ids = self.engine.kept_block_ids(record.key)
        if not record.settled:
            self.settle(record, block_ids)
        for lo, hi in self.engine.layer_groups:
            self.send_group(record, lo, hi, block_ids)
        record.all_sent()

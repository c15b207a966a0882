"""The half of PrefillConnector (services/prefill/connector.py) that puts a transfer on the way: which blocks go,
each layer group gathered and queued for the sender thread (kept for resends), a resend, and a transfer's end."""

import time

from kvferry.common import protocol as p
from kvferry.common import tracing
from kvferry.common.model.kv_blocks import as_frames
from kvferry.services.prefill.kv_sender import Outgoing
from kvferry.services.prefill.record import PrefillAttempt
from kvferry.services.worker_timings import RETRY_FULL_AFTER_S


class Shipping:
    def settlement(self, record: PrefillAttempt, block_ids: list[int]) -> tuple[int, int]:
        """Which blocks go (those the decode worker does not hold): (blocks left out, bytes of one whole send)."""
        num_skipped = min(record.held_answer, self.engine.num_cacheable_blocks(record.num_kv_tokens))
        bytes_per_block = self.engine.bytes_per_block
        self.num_kv_bytes_skipped += num_skipped * bytes_per_block
        return num_skipped, (len(block_ids) - num_skipped) * bytes_per_block

    def resend(self, record: PrefillAttempt, resend_all: bool) -> None:
        """After a failure answer: every block at once if the decode worker let go of those it held, else the same
        transfer after a short wait (it had no room)."""
        record.send_again(0.0 if resend_all and record.num_skipped_blocks else RETRY_FULL_AFTER_S)
        if resend_all and record.num_skipped_blocks:
            self.num_kv_bytes_skipped -= record.num_skipped_blocks * self.engine.bytes_per_block
            record.held_answer = 0
            record.settle(*self.settlement(record, self.engine.kept_block_ids(record.key)))  # every block, this time

    def send_all(self, record: PrefillAttempt, block_ids: list[int], from_layer: int = 0) -> None:
        """Every layer group from from_layer on (those before went during the compute)."""
        for lo, hi in self.engine.layer_groups:
            if lo >= from_layer:
                self.send_group(record, lo, hi, block_ids)
        record.all_sent()

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
        self.records.pop(record.key, None)
        record.end()
        (self.released if accepted else self.failed).append(record.key)

    def send_group(self, record: PrefillAttempt, lo: int, hi: int, block_ids: list[int], early: bool = False) -> None:
        """One layer group, gathered on its first send and kept for resends. early: during the compute, no tokens."""
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

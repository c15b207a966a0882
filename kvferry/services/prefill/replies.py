"""The half of PrefillConnector (services/prefill/connector.py) that acts on what decode workers answer (KVHeld,
KVAck), and on messages that could not go out."""

import logging

from kvferry.common import protocol as p
from kvferry.common.errors import FatalError
from kvferry.common.request_failure import fails_alone, failure_text
from kvferry.services.prefill.kv_sender import SenderDied
from kvferry.services.prefill.record import PrefillAttempt, PrefillState
from kvferry.services.request_keys import AttemptKey

log = logging.getLogger("kvferry.prefill")
S = PrefillState


class Replies:
    def take_replies(self, during_forward: bool = False) -> None:
        """Act on what decode workers sent back, and on messages that could not go out. During a forward pass only
        KVHeld answers are acted on (they settle which blocks go); the rest waits for the next call."""
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
                    error = f"cannot reach decode worker {out.peer} at {out.address}: {item.error}"
                    self.end(record.key, error, 503, True)

    def reply_failed(self, item, record: PrefillAttempt | None, during_forward: bool, exc: Exception) -> None:
        """Acting on a reply raised: its transfer alone fails; during a forward, the item is tried again after it."""
        if during_forward:
            self.deferred.append(item)
        elif record is not None and record.state is not S.DONE:
            log.exception("%s: a reply about %s", self.worker_id, record.key.request_id)
            self.end(record.key, failure_text(exc), 500)

    def on_reply(self, env: p.Envelope) -> None:
        msg = env.message
        record = self.records.get(AttemptKey(env.request_id, getattr(msg, "attempt", 0)))
        if record is None:
            return  # a duplicate, or an answer about a request that ended here
        if isinstance(msg, p.KVHeld):
            if record.state in (S.ASKING, S.AWAITING_HELD):
                record.answered(msg.num_blocks)
            if record.state is S.AWAITING_HELD:  # the transfer waited for this answer: due now
                record.settle(*self.settlement(record, self.engine.kept_block_ids(record.key)))
        elif isinstance(msg, p.KVAck):
            if record.state is S.SENDING_EARLY:
                record.early_answered(msg)  # to its first groups: acted on after the compute
            elif msg.accepted or not msg.retry:  # done, or refused for good (the decode worker told the gateway)
                if record.state in (S.AWAITING_HELD, S.DUE, S.AWAITING_ACK):
                    self.end_transfer(record, msg.accepted)
            elif record.state is S.AWAITING_ACK:
                self.resend(record, msg.resend_all)

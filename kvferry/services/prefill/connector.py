"""The prefill side of the KV connector: it owns the worker's request records (PrefillAttempt), its KV sender
thread, and every ask, send, retry and acknowledgement of a transfer. Nothing here touches a socket: KVSender does.

Engine side (KVConnector): `get_finished` acts on what decode workers answered, sends what is due, and hands the
engine the attempts whose blocks go; `on_scheduled` asks each starting prompt's decode worker which leading blocks
it holds (KVQuery); `save_layers` ships each stored layer group but the last of a finishing prompt while the next
layers compute; `request_finished` keeps a finished prompt's blocks for its transfer.

The loop: `add`, `compiled`, `end` a record; `computed` once a prompt's first tokens are out (the rest of its
transfer starts then); `take_replies` when `wake_fd` is readable; `take_failures` to tell gateways.
"""

import logging
import time

import zmq

from kvferry.common import protocol as p
from kvferry.common.block_hash import block_hashes
from kvferry.common.kv_connector import KVConnector
from kvferry.common.request_failure import fails_alone, failure_text
from kvferry.services.gateway_link import Failure
from kvferry.services.prefill.kv_sender import KVSender
from kvferry.services.prefill.record import COMPUTING_STATES, SHIPPING_STATES, PrefillAttempt, PrefillState
from kvferry.services.prefill.replies import Replies
from kvferry.services.prefill.shipping import Shipping
from kvferry.services.request_keys import AttemptKey
from kvferry.services.worker_timings import GIVE_UP_TRANSFER_S

log = logging.getLogger("kvferry.prefill")
S = PrefillState
ACK_TIMEOUT_S = 10.0  # a transfer not acknowledged by then is sent again
HELD_ANSWER_WAIT_S = 0.1  # a finished prompt's transfer waits this long at most for the decode worker's KVHeld


class PrefillConnector(Replies, Shipping, KVConnector):
    keeps_finished_blocks = True  # until the decode worker acknowledges the transfer

    def __init__(self, worker_id: str, ctx: zmq.Context, curve, tracer):
        self.worker_id, self.tracer = worker_id, tracer
        self.sender = KVSender(ctx, worker_id, curve)
        self.records: dict[AttemptKey, PrefillAttempt] = {}
        self.released: list[AttemptKey] = []  # transfers acknowledged since get_finished: their blocks go
        self.failed: list[AttemptKey] = []  # attempts ended otherwise: their sequences go, wherever they are
        self.failures: list[Failure] = []  # for their gateways
        self.deferred: list = []  # replies taken during a forward pass, acted on after it
        # Bytes shipped, left out as held by the decode worker, and shipped while the prompt was still computing.
        self.num_kv_bytes_sent = self.num_kv_bytes_skipped = self.num_kv_bytes_sent_early = 0

    def bind(self, engine) -> None:
        super().bind(engine)
        # On CUDA each group's gather runs on a side stream (kv_gather.py), overlapping the next group's layers.
        self.wants_layer_events = engine.device.type in ("cpu", "cuda") and engine.num_layers > 1

    # -- the loop's side --------------------------------------------------------------------------------------
    @property
    def wake_fd(self) -> int:
        """Readable when decode workers answered: the loop then calls take_replies."""
        return self.sender.wake_fd

    @property
    def num_protocol_errors(self) -> int:
        return self.sender.num_protocol_errors

    def __contains__(self, key: AttemptKey) -> bool:
        return key in self.records

    def get(self, key: AttemptKey) -> PrefillAttempt | None:
        return self.records.get(key)

    def holds_requests(self) -> bool:
        return bool(self.records or self.released or self.failed)

    def add(self, record: PrefillAttempt) -> None:
        """A request attempt the worker admitted (QUEUED) or whose constraint compiles (COMPILING)."""
        self.records[record.key] = record

    def compiled(self, key: AttemptKey) -> None:
        self.records[key].compiled()

    def end(self, key: AttemptKey, error: str = "", code: int = 500, retry: bool = False) -> None:
        """End an attempt here: its sequence and blocks go at the engine's next get_finished, and with an error its
        gateway is told (take_failures)."""
        record = self.records.pop(key, None)
        if record is None:
            return
        record.end()
        self.failed.append(key)
        if error:
            self.failures.append(
                Failure(record.link, key.request_id, key.attempt, record.trace, error, code=code, retry=retry)
            )

    def take_failures(self) -> list[Failure]:
        failures, self.failures = self.failures, []
        return failures

    def has_work(self) -> bool:
        return bool(self.released or self.failed or self.deferred) or self.next_due() <= time.monotonic()

    def next_due(self) -> float:
        """Monotonic time at which some transfer needs sending (again) or giving up (inf: none)."""
        due = [
            r.sent_at + ACK_TIMEOUT_S if r.state is S.AWAITING_ACK else r.due_at
            for r in self.records.values()
            if r.state in SHIPPING_STATES
        ]
        return min(due, default=float("inf"))

    def close(self) -> None:
        self.sender.close()

    # -- engine side ------------------------------------------------------------------------------------------
    def get_finished(self) -> tuple[list[AttemptKey], list[AttemptKey]]:
        """Before a step: act on the answers, send what is due, and hand the engine (released, failed)."""
        self.take_replies()
        now = time.monotonic()
        for record in list(self.records.values()):
            if record.state in SHIPPING_STATES:
                with fails_alone(lambda exc: self.transfer_failed(record, "sending a transfer", exc)):
                    self.send_if_due(record, now)
        released, failed, self.released, self.failed = self.released, self.failed, [], []
        return released, failed

    def on_scheduled(self, plan) -> None:
        """Prompts whose first chunk is scheduled ask their decode worker which leading blocks it holds: now, not
        on arrival, so that a prompt queued behind one with the same prefix finds it there, and the answer comes
        during the compute."""
        for chunk in plan.chunks:
            record = self.records.get(chunk.seq.request_id)
            if record is not None and record.state is S.QUEUED:
                record.start_computing(asked=self.ask_held_blocks(record))

    def ask_held_blocks(self, record: PrefillAttempt) -> bool:
        engine = self.engine
        if not engine.caching_enabled:
            return False
        request = record.request
        tokens = request.prompt_token_ids + request.resume_token_ids
        cacheable = engine.num_cacheable_blocks(len(tokens)) * engine.block_size
        hashes = block_hashes(tokens[:cacheable], engine.block_size)
        if hashes:
            self.queue(record, p.KVQuery(hashes, request.attempt))
        return bool(hashes)

    def save_layers(self, plan, layers: tuple[int, int]) -> None:
        """A group of layers but the last is stored: that group of each finishing prompt whose blocks to send are
        settled (KVHeld came, or was never asked) is queued; a prompt that misses the first group goes whole later."""
        lo, hi = layers
        if hi == self.engine.num_layers:
            return  # the last group follows the first tokens
        self.take_replies(during_forward=True)  # KVHeld answers settle which blocks go
        for chunk in plan.chunks:
            record = self.records.get(chunk.seq.request_id)
            if record is None or not chunk.samples:
                continue
            starts = lo == 0 and record.state is S.COMPUTING
            if not starts and not (record.state is S.SENDING_EARLY and record.early_layers == lo):
                continue
            shipping = f"shipping layers {lo}-{hi}"
            with fails_alone(lambda exc: self.transfer_failed(record, shipping, exc, "the prefill step failed: ")):
                if starts:
                    request = record.request
                    choices = [request.choice] if request.resume_token_ids else list(range(request.n))
                    record.start_early(choices, *self.settlement(record, chunk.seq.block_table))
                self.send_group(record, lo, hi, chunk.seq.block_table, early=True)
                record.sent_early(hi)

    def transfer_failed(self, record: PrefillAttempt, doing: str, exc: Exception, prefix: str = "") -> None:
        """Something about one transfer raised: its request alone fails, with a 500 (during the compute, the batch
        computes on; its blocks go at the next get_finished)."""
        log.exception("%s: %s", self.worker_id, doing, extra={"request_id": record.key.request_id})
        self.end(record.key, prefix + failure_text(exc), 500)

    # -- after the compute ------------------------------------------------------------------------------------
    def computed(self, key: AttemptKey, continuing: list[tuple[int, int]]) -> None:
        """A prompt's first tokens are out; these (choice, first token) go on: the rest of its transfer starts, or
        waits HELD_ANSWER_WAIT_S at most for a KVHeld still due. With none going on, the attempt ends."""
        record = self.records.get(key)
        if record is None or record.state not in COMPUTING_STATES:
            return
        with fails_alone(lambda exc: self.transfer_failed(record, "starting a transfer", exc)):
            self.start_transfer(record, continuing)

    def start_transfer(self, record: PrefillAttempt, continuing: list[tuple[int, int]]) -> None:
        early = record.state in (S.SENDING_EARLY, S.EARLY_ANSWERED)
        if not continuing:
            if early:
                self.queue(record, p.Abort(attempt=record.request.attempt))  # drop the groups that came
            self.end(record.key)
            return
        if record.state in (S.ASKING, S.SENDING_EARLY):
            # What came during the compute: the KVHeld answer, or the decode worker's KVAck to the early groups
            # (placed, refused for good, or not placed: then the whole transfer goes again, not the rest of it).
            self.take_replies()
        record.computed(continuing, HELD_ANSWER_WAIT_S)
        if record.state is S.EARLY_ANSWERED:
            answer = record.early_answer
            if answer.accepted or not answer.retry:  # ended at the decode worker meanwhile, or refused for good
                self.end(record.key)
            else:
                self.resend(record, answer.resend_all)  # the first groups were not placed: the whole transfer again
            return
        block_ids = self.engine.kept_block_ids(record.key)
        if record.state is S.SENDING_EARLY:  # the rest of the groups now, the last with the first tokens
            self.send_all(record, block_ids, record.early_layers)
        elif record.state is S.COMPUTING:
            record.settle(*self.settlement(record, block_ids))
            self.send_all(record, block_ids)

    def send_if_due(self, record: PrefillAttempt, now: float) -> None:
        """Send a transfer whose time came (due, unacknowledged, done waiting for KVHeld); give up past its bounds."""
        if record.state is S.AWAITING_ACK and now >= record.sent_at + ACK_TIMEOUT_S:
            record.send_again(0.0)  # not acknowledged in time: lost on the way, or the peer restarted
        if record.state not in (S.DUE, S.AWAITING_HELD) or now < record.due_at:
            return
        if now > record.ready_at + GIVE_UP_TRANSFER_S or time.time() > record.request.deadline_s:
            decode = record.request.decode_worker_id
            self.end(record.key, f"decode worker {decode} did not take the KV in {GIVE_UP_TRANSFER_S:.0f} s", 503, True)
            return
        block_ids = self.engine.kept_block_ids(record.key)
        if record.state is S.AWAITING_HELD:  # its answer did not come in time: every block goes
            record.settle(*self.settlement(record, block_ids))
        self.send_all(record, block_ids)

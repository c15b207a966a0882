"""The prefill worker: computes prompts' KV into its paged cache, samples the first token, sends it to the
gateway at once, then ships the prompt's blocks straight to the chosen decode worker and frees them
when that worker acknowledges.

When a prompt starts computing it asks the decode worker (KVQuery) which of the prompt's leading blocks
that worker's prefix cache holds; the transfer leaves those out (the second turn of a chat ships only the
new turn's blocks). A transfer goes as one message per group of layers. In the step that finishes a prompt,
each group but the last goes out as soon as its layers are computed, while the following layers compute;
the last group follows the first tokens. Resends gather each group while the one before is on the wire."""

import dataclasses
import logging
import time

import zmq

from kvferry.common import protocol as p
from kvferry.common import tracing
from kvferry.common.block_hash import block_hashes
from kvferry.common.errors import InvalidRequest
from kvferry.common.model.kv_blocks import as_frames, layer_groups
from kvferry.common.sampling import for_choice
from kvferry.common.sequence import Sequence
from kvferry.common.transport import Channel
from kvferry.services.gateway_link import GatewayLink
from kvferry.services.worker import Worker

log = logging.getLogger("kvferry.prefill")
RETRY_FULL_AFTER_S = 0.05  # a decode worker with no room is asked again after this long
MAX_CHOICES = 128  # n per request: a bound on what one message can make this worker do
ACK_TIMEOUT_S = 10.0  # a transfer not acknowledged by then is sent again
GIVE_UP_TRANSFER_S = 60.0  # a transfer no decode worker took by then is dropped; the gateway moves the request
HELD_ANSWER_WAIT_S = 0.1  # a finished prompt's transfer waits this long at most for the decode worker's KVHeld


def attempt_key(request_id: str, attempt: int) -> str:
    """A worker's own id for one attempt at a request: a moved request can come back to the same worker."""
    return request_id if attempt == 0 else f"{request_id}~{attempt}"


@dataclasses.dataclass
class Transfer:
    request_id: str
    link: GatewayLink  # the gateway the request came from
    seq: Sequence
    request: p.PrefillRequest
    trace: p.TraceContext
    first_token_ids: list[int]  # of the choices that go on to decode
    choices: list[int]
    sent_at: float = 0.0  # monotonic time of the latest send; 0: not in flight
    retry_at: float = 0.0
    first_sent_at: float = 0.0  # wall clock, for the transfer's span
    num_sends: int = 0
    ready_at: float = dataclasses.field(default_factory=time.monotonic)
    ready: bool = False  # whether the blocks to send are settled (the decode worker's KVHeld came, or is late)
    num_skipped_blocks: int = 0  # leading blocks the decode worker holds: not sent
    parts: dict = dataclasses.field(default_factory=dict)  # layer start -> its K and V gathered, kept for resends
    gather_s: float = 0.0  # copying the blocks out after the compute (the part a transfer adds to decode's wait)
    early_answer: p.KVAck | None = None  # the decode worker's answer to groups sent during the compute, if any
    num_bytes: int = 0  # of one send


@dataclasses.dataclass
class Arrival:
    request_id: str
    link: GatewayLink
    request: p.PrefillRequest
    trace: p.TraceContext
    arrived_at: float  # wall clock
    started_at: float = 0.0  # wall clock of its first scheduled chunk


class PrefillWorker(Worker):
    role = p.Role.PREFILL

    def __init__(self, config, gateway, worker_id=None, **kwargs):
        super().__init__(config, gateway, worker_id, keep_finished_blocks=True, **kwargs)
        self.requests: dict[str, Arrival] = {}
        self.transfers: dict[str, Transfer] = {}  # sent (or waiting to be sent), not yet acknowledged
        self.decode_channels: dict[str, Channel] = {}
        self.decode_held: dict[str, int] = {}  # attempt key -> leading blocks its decode worker holds (KVHeld)
        self.asked: set[str] = set()  # attempt keys whose KVQuery went out
        self.shipping: dict[str, Transfer] = {}  # transfers whose first groups go out during this step's compute
        self.num_prompts_prefilled = 0  # each prompt once, however many choices it has

    def next_transfer_due(self) -> float:
        """Monotonic time at which some transfer needs sending again (inf: none)."""
        return min(
            (t.retry_at if not t.sent_at else t.sent_at + ACK_TIMEOUT_S for t in self.transfers.values()),
            default=float("inf"),
        )

    def holds_requests(self) -> bool:
        return bool(self.engine.has_unfinished() or self.requests or self.transfers)

    def has_work(self) -> bool:
        return self.engine.has_unfinished() or self.next_transfer_due() <= time.monotonic()

    def idle_wait_ms(self) -> int:
        # Sleep until the next retry is due, not in a busy loop: the decode worker needs the core.
        until_due = self.next_transfer_due() - time.monotonic()
        return max(1, int(min(until_due, self.heartbeat_interval_s / 2) * 1000))

    def num_protocol_errors(self) -> int:
        return super().num_protocol_errors() + sum(c.num_protocol_errors for c in self.decode_channels.values())

    def channel_for(self, sock) -> Channel:
        for channel in self.decode_channels.values():
            if channel.socket is sock:
                return channel
        return super().channel_for(sock)

    def decode_channel(self, address: str, peer: str) -> Channel:
        if address not in self.decode_channels:
            sock = self.ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.IDENTITY, self.worker_id.encode())
            if self.curve:
                self.curve.connect(sock)
            sock.connect(address)
            self.poller.register(sock, zmq.POLLIN)
            self.decode_channels[address] = Channel(sock, f"{self.worker_id}->{address}", peer_name=peer)
        return self.decode_channels[address]

    def handle(self, channel, peer, env: p.Envelope) -> None:
        msg, rid = env.message, env.request_id
        key = attempt_key(rid, getattr(msg, "attempt", 0))
        if isinstance(msg, p.PrefillRequest):
            link = self.link_of(channel)
            if link is None or key in self.requests or key in self.transfers:
                return  # not from a gateway, or a copy of one being served already
            try:
                if not 1 <= msg.n <= MAX_CHOICES:
                    raise InvalidRequest(f"n must be between 1 and {MAX_CHOICES}, got {msg.n}")
                if msg.resume_token_ids and (msg.n != 1 or msg.choice < 0):
                    raise InvalidRequest("a resumed request continues exactly one choice")
                params = msg.sampling
                # The prefill worker samples only the next token; the decode worker does the rest.
                num_done = len(msg.resume_token_ids)
                next_only = dataclasses.replace(
                    params, max_tokens=num_done + 1, min_tokens=min(params.min_tokens, num_done + 1)
                )
                self.engine.add_request(
                    msg.prompt_token_ids, next_only, request_id=key, resume_token_ids=msg.resume_token_ids
                )
            except InvalidRequest as exc:
                link.channel.send(p.RequestFailed(str(exc), 400, msg.attempt), rid, env.trace)
                return
            self.requests[key] = Arrival(rid, link, msg, env.trace, time.time())
        elif isinstance(msg, p.KVHeld):
            transfer = self.transfers.get(key)
            if key in self.asked:  # its prompt computes, or has just finished
                self.decode_held[key] = msg.num_blocks
            elif transfer is not None and not transfer.ready:  # the transfer waits for this answer: due now
                self.decode_held[key] = msg.num_blocks
                transfer.retry_at = time.monotonic()
            # else its transfer went out whole already, or it ended
        elif isinstance(msg, p.KVAck):
            transfer = self.transfers.get(key)
            shipping = self.shipping.get(key)
            if shipping is not None and shipping.early_answer is None:
                shipping.early_answer = msg  # to its first groups: finish_shipping acts on it
            if transfer is None:
                return  # a duplicate, a request given up meanwhile, or an answer to groups still being shipped
            if msg.accepted or not msg.retry:  # done, or refused for good (the decode worker told the gateway)
                self.end_transfer(key, msg.accepted)
            else:
                self.send_again(key, transfer, msg.resend_all)
        elif isinstance(msg, p.Abort) and msg.choice < 0:  # one choice ends on the decode worker
            self.engine.abort(key)
            self.requests.pop(key, None)
            self.decode_held.pop(key, None)
            self.asked.discard(key)
            transfer = self.transfers.pop(key, None)
            if transfer is not None:
                self.engine.scheduler.release(transfer.seq)

    def ask_held_blocks(self, rid: str, request: p.PrefillRequest, trace) -> None:
        """Ask the request's decode worker which leading full blocks of its KV that worker already holds. Asked
        when the prompt starts computing (not on arrival: a prompt queued behind one with the same prefix finds
        that prefix at the decode worker by then), so the answer comes during the compute. The block holding the
        last token is always sent."""
        if not self.engine.config.enable_prefix_caching:
            return
        bm = self.engine.block_manager
        tokens = request.prompt_token_ids + request.resume_token_ids
        hashes = block_hashes(tokens[: bm.num_cacheable_blocks(len(tokens)) * bm.block_size], bm.block_size)
        if hashes:
            channel = self.decode_channel(request.decode_address, request.decode_worker_id)
            channel.send(p.KVQuery(hashes, request.attempt), rid, trace)
            self.asked.add(attempt_key(rid, request.attempt))

    def step(self) -> None:
        self.send_due_transfers()  # before a long compute: transfers whose held answer came meanwhile
        if self.engine.has_unfinished():
            plan = self.engine.scheduler.schedule()
            if plan.chunks:
                started = time.time()
                for chunk in plan.chunks:
                    arrival = self.requests.get(chunk.seq.request_id)
                    if arrival is not None and not arrival.started_at:
                        arrival.started_at = started
                        self.ask_held_blocks(arrival.request_id, arrival.request, arrival.trace)
                sampled = self.engine.runner.execute(plan, after_layer=self.layer_shipper(plan))
                logprobs = {id(c.seq): lp for c, lp in zip(plan.chunks, self.engine.runner.last_logprobs)}
                if self.tracer.enabled:
                    self.tracer.span(
                        "prefill.step",
                        started,
                        time.time(),
                        batch_size=len(plan.chunks),
                        num_tokens=plan.num_tokens,
                        rids=[c.seq.request_id for c in plan.chunks],
                    )
                done = [
                    (seq, self.send_first_tokens(seq, logprobs.get(id(seq))))
                    for seq in self.engine.scheduler.update(plan, sampled)
                ]
                for channel in list(self.decode_channels.values()):
                    self.drain(channel.socket)  # the KVHeld answers that came during the compute
                # Every first token of the step goes out before the gathers that follow the compute: TTFT waits
                # only on the groups shipped during it.
                for seq, (arrival, continuing) in done:
                    self.start_transfer(seq, arrival, continuing)
        self.send_due_transfers()

    def layer_shipper(self, plan):
        """The step's after_layer callback (None when no prompt finishes in it): as each group of layers but the
        last lands in the cache, that group of the finishing prompts' blocks goes to their decode workers, on the
        wire while the following layers compute."""
        finishing = [c.seq for c in plan.chunks if c.samples and c.seq.request_id in self.requests]
        groups = layer_groups(self.engine.runner.layout.num_layers)
        # Not on CUDA yet: the gather's copy to the host would wait for every queued layer, a stall, not an overlap
        # (that needs a copy into pinned memory on a side stream).
        if not finishing or len(groups) < 2 or self.engine.device.type != "cpu":
            return None
        group_ending = {hi: (lo, hi) for lo, hi in groups[:-1]}

        def after_layer(layer: int) -> None:
            group = group_ending.get(layer + 1)
            if group is None:
                return
            for channel in list(self.decode_channels.values()):
                self.drain(channel.socket)  # KVHeld answers settle which blocks go
            for seq in finishing:
                self.ship_group(seq, *group)

        return after_layer

    def ship_group(self, seq: Sequence, lo: int, hi: int) -> None:
        """One group of layers of a prompt still computing. Its transfer starts with the first group once the
        blocks to send are settled (the decode worker's KVHeld came, or was never asked); a prompt that misses
        the first group goes whole after the compute."""
        key = seq.request_id
        t = self.shipping.get(key)
        if t is None:
            arrival = self.requests[key]
            if lo != 0 or (key in self.asked and key not in self.decode_held):
                return
            request = arrival.request
            announced = [request.choice] if request.resume_token_ids else list(range(request.n))
            t = self.shipping[key] = Transfer(
                arrival.request_id, arrival.link, seq, request, arrival.trace, [], announced
            )
            self.asked.discard(key)
            self.settle(key, t)
        self.send_group(t, lo, hi, early=True)

    def send_first_tokens(self, seq: Sequence, logprobs) -> tuple[Arrival, list[tuple[int, int]]]:
        """Send a finished prompt's first token of each choice; returns its arrival and the (choice, token) of
        the choices that go on decoding."""
        key = seq.request_id
        arrival = self.requests.pop(key)
        request, trace, done_at = arrival.request, arrival.trace, time.time()
        rid, num_done = arrival.request_id, len(request.resume_token_ids)
        tracer = self.tracer
        if tracer.enabled:
            tracer.span("queue", arrival.arrived_at, arrival.started_at, rid, tracing.child_of(trace))
            tracer.span(
                "prefill",
                arrival.started_at,
                done_at,
                rid,
                tracing.child_of(trace),
                num_prompt_tokens=len(seq.prompt_token_ids),
                num_resumed_tokens=num_done,
                attempt=request.attempt,
            )
        self.num_prompts_prefilled += 1
        params = request.sampling
        # Choice 0 was sampled with the prompt; the others draw from the same logits, each with its own seed.
        extra = [dataclasses.replace(for_choice(seq.params, i), logprobs=params.logprobs) for i in range(1, request.n)]
        firsts = [(seq.output_token_ids[-1], logprobs), *self.engine.runner.sample_choices(seq, extra)]
        prompt_logprobs = list(self.engine.runner.prompt_logprobs.get(key) or ())
        continuing = []
        for i, (token, token_logprobs) in enumerate(firsts):
            choice = request.choice if request.resume_token_ids else i
            # Judged with the request's own parameters: the engine ran the prompt for its next token alone.
            ended = self.engine.scheduler.finish_reason(params, token, num_done + 1, seq.num_tokens)
            reason = -1 if ended is None else int(ended)
            first = p.FirstToken(
                token,
                reason,
                queue_s=arrival.started_at - arrival.arrived_at,
                prefill_s=done_at - arrival.started_at,
                logprobs=[token_logprobs] if token_logprobs else [],
                prompt_logprobs=prompt_logprobs if choice == 0 else [],
                choice=choice,
                attempt=request.attempt,
                start=num_done,
            )
            arrival.link.channel.send(first, rid, trace)
            if reason < 0:
                continuing.append((choice, token))
        return arrival, continuing

    def start_transfer(self, seq: Sequence, arrival: Arrival, continuing: list[tuple[int, int]]) -> None:
        """Set up the transfer of a prompt whose choices go on decoding. Which blocks go is settled at once, or,
        while the decode worker's answer to KVQuery is still due, when the answer comes (at most
        HELD_ANSWER_WAIT_S); they are gathered as they are sent."""
        key, request = seq.request_id, arrival.request
        answer_due = key in self.asked and key not in self.decode_held
        self.asked.discard(key)
        shipped = self.shipping.pop(key, None)
        if shipped is not None:
            self.finish_shipping(key, shipped, continuing)
            return
        if not continuing:
            self.decode_held.pop(key, None)
            self.engine.scheduler.release(seq)
            self.engine.forget(key)
            return
        transfer = Transfer(
            arrival.request_id,
            arrival.link,
            seq,
            request,
            arrival.trace,
            [t for _, t in continuing],
            [c for c, _ in continuing],
        )
        self.transfers[key] = transfer
        if answer_due:
            transfer.retry_at = time.monotonic() + HELD_ANSWER_WAIT_S
        else:
            self.settle(key, transfer)
        self.engine.forget(key)

    def finish_shipping(self, key: str, t: Transfer, continuing: list[tuple[int, int]]) -> None:
        """After the compute, a transfer whose first groups went out during it: the last group, with the first
        tokens of the choices that go on; if none does, the decode worker is told to drop what came. If the decode
        worker already answered the first groups (it could not place them, or the request ended there), that
        answer is acted on instead."""
        channel = self.decode_channel(t.request.decode_address, t.request.decode_worker_id)
        self.engine.forget(key)
        answer = t.early_answer
        if not continuing or (answer is not None and (answer.accepted or not answer.retry)):
            if not continuing:
                channel.send(p.Abort(attempt=t.request.attempt), t.request_id, t.trace)
            self.engine.scheduler.release(t.seq)
            return
        t.first_token_ids, t.choices = [tok for _, tok in continuing], [c for c, _ in continuing]
        t.num_sends = 1
        self.transfers[key] = t
        if answer is not None:  # the first groups were not placed: the whole transfer again, as after any failure
            self.send_again(key, t, answer.resend_all)
            return
        for lo, hi in layer_groups(self.engine.runner.layout.num_layers):
            if lo not in t.parts:
                self.send_group(t, lo, hi)
        t.sent_at = time.monotonic()

    def end_transfer(self, key: str, accepted: bool) -> None:
        """The decode worker took the KV, or refused it for good (and told the gateway): the blocks go."""
        t = self.transfers.pop(key)
        self.engine.scheduler.release(t.seq)
        if self.tracer.enabled:
            self.tracer.span(
                "kv.transfer_out",
                t.first_sent_at,
                time.time(),
                t.request_id,
                tracing.child_of(t.trace),
                bytes=t.num_bytes,
                sends=t.num_sends,
                accepted=accepted,
                decode=t.request.decode_worker_id,
            )

    def send_again(self, key: str, t: Transfer, resend_all: bool) -> None:
        """After a failure answer: every block at once if the decode worker let go of those it held, else the same
        transfer after a short wait (it had no room)."""
        if resend_all and t.num_skipped_blocks:
            self.num_kv_bytes_skipped -= t.num_skipped_blocks * self.engine.runner.layout.bytes_per_block
            self.settle(key, t)  # every block, this time
            t.sent_at, t.retry_at = 0.0, time.monotonic()
        else:
            t.sent_at, t.retry_at = 0.0, time.monotonic() + RETRY_FULL_AFTER_S

    def settle(self, key: str, t: Transfer) -> None:
        """Fix which blocks go: those the decode worker does not hold. They are gathered as they are sent."""
        num_kv_tokens = len(t.request.prompt_token_ids) + len(t.request.resume_token_ids)
        t.num_skipped_blocks = min(
            self.decode_held.pop(key, 0), self.engine.block_manager.num_cacheable_blocks(num_kv_tokens)
        )
        t.parts, t.ready = {}, True
        block_bytes = self.engine.runner.layout.bytes_per_block
        t.num_bytes = (len(t.seq.block_table) - t.num_skipped_blocks) * block_bytes
        self.num_kv_bytes_skipped += t.num_skipped_blocks * block_bytes

    def send_kv(self, t: Transfer) -> None:
        """Send a transfer's blocks, a message per group of layers: each group is gathered (unless it was before)
        while the one before is on the wire."""
        for lo, hi in layer_groups(self.engine.runner.layout.num_layers):
            self.send_group(t, lo, hi)

    def send_group(self, t: Transfer, lo: int, hi: int, early: bool = False) -> None:
        """One group of layers of a transfer, gathered on its first send and kept for resends. early: sent while
        the prompt computes, so without first tokens."""
        runner, resumed = self.engine.runner, t.request.resume_token_ids
        if lo not in t.parts:
            blocks = t.seq.block_table[t.num_skipped_blocks :]
            started = time.time()
            t.parts[lo] = runner.read_blocks(blocks, (lo, hi))
            if not early:  # a gather during the compute delays the first token instead, as part of the step
                t.gather_s += time.time() - started
            if self.tracer.enabled:
                self.tracer.span(
                    "kv.gather",
                    started,
                    time.time(),
                    t.request_id,
                    tracing.child_of(t.trace),
                    num_blocks=len(blocks),
                    num_held_by_decode=t.num_skipped_blocks,
                    layers=[lo, hi],
                    during_compute=early,
                )
        kv = t.parts[lo]  # [layers, blocks, block_size, 2, kvh, d]
        msg = p.KVTransfer(
            prefill_worker_id=self.worker_id,
            prompt_token_ids=t.request.prompt_token_ids,
            output_token_ids=t.first_token_ids,
            choices=t.choices,
            sampling=t.request.sampling,
            num_computed_tokens=len(t.request.prompt_token_ids) + len(resumed),
            dtype=str(kv.dtype).removeprefix("torch."),
            shape=list(kv.shape),
            deadline_s=t.request.deadline_s,
            gather_s=t.gather_s,
            sent_at=time.time(),
            attempt=t.request.attempt,
            resume_token_ids=resumed,
            gateway_id=t.link.gateway_id,
            num_skipped_blocks=t.num_skipped_blocks,
            layer_start=lo,
        )
        channel = self.decode_channel(t.request.decode_address, t.request.decode_worker_id)
        channel.send(msg, t.request_id, t.trace, frames=as_frames(kv))
        t.first_sent_at = t.first_sent_at or msg.sent_at
        self.num_kv_bytes_sent += kv.nbytes
        if early:
            self.num_kv_bytes_sent_early += kv.nbytes

    def send_due_transfers(self) -> None:
        now = time.monotonic()
        for key, t in list(self.transfers.items()):
            if now < (t.sent_at + ACK_TIMEOUT_S if t.sent_at else t.retry_at):
                continue  # in flight and not yet overdue, or waiting for its retry time (or its held answer)
            if not t.ready:
                self.settle(key, t)
            rid, attempt = t.request_id, t.request.attempt
            if now > t.ready_at + GIVE_UP_TRANSFER_S or time.time() > t.request.deadline_s:
                t.link.channel.send(
                    p.RequestFailed(
                        f"decode worker {t.request.decode_worker_id} did not take the KV in {GIVE_UP_TRANSFER_S:.0f} s",
                        503,
                        attempt,
                        retry=True,
                    ),
                    rid,
                    t.trace,
                )
                self.engine.scheduler.release(self.transfers.pop(key).seq)
                continue
            self.send_kv(t)
            t.sent_at, t.num_sends = now, t.num_sends + 1

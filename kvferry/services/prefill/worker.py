"""The prefill worker: computes prompts' KV, sends each choice's first token to the gateway at once, and its
PrefillConnector (services/prefill/connector.py) ships the blocks to the chosen decode worker; the engine frees
them when that worker acknowledges. The loop owns the gateway sockets and admits requests; the connector owns each
attempt's record (PrefillAttempt) and its transfer. A step: the engine's step, the first tokens, the failures.
"""

import dataclasses
import logging
import time

import zmq

from kvferry.common import protocol as p
from kvferry.common import tracing
from kvferry.common.errors import InvalidRequest
from kvferry.common.peer_address import check_peer_address
from kvferry.common.request_failure import fails_alone, failure_code, failure_text
from kvferry.common.sampling import for_choice
from kvferry.services.prefill.connector import PrefillConnector
from kvferry.services.prefill.record import PrefillAttempt, PrefillState
from kvferry.services.request_keys import AttemptKey
from kvferry.services.worker import MAX_CHOICES, Worker

log = logging.getLogger("kvferry.prefill")


class PrefillWorker(Worker):
    role = p.Role.PREFILL

    def __init__(self, config, gateway, worker_id=None, **kwargs):
        def connector(worker_id: str) -> PrefillConnector:
            return PrefillConnector(worker_id, zmq.Context.instance(), kwargs.get("curve"), tracing.tracer())

        super().__init__(config, gateway, worker_id, connector=connector, **kwargs)
        self.connector: PrefillConnector = self.engine.connector
        self.watch(self.connector.wake_fd, self.connector.take_replies)  # decode workers' answers, from its sender
        self.num_prompts_prefilled = 0  # each prompt once, however many choices it has

    # -- the loop's questions ---------------------------------------------------------------------------------
    def holds_requests(self) -> bool:
        return self.engine.has_unfinished() or self.connector.holds_requests()

    def has_work(self) -> bool:
        return self.engine.has_unfinished() or self.connector.has_work()

    def idle_wait_ms(self) -> int:
        # Sleep until the next retry is due, not in a busy loop: the decode worker needs the core.
        until_due = self.connector.next_due() - time.monotonic()
        return max(1, int(min(until_due, self.heartbeat_interval_s / 2) * 1000))

    def num_protocol_errors(self) -> int:
        return super().num_protocol_errors() + self.connector.num_protocol_errors

    def kv_counters(self) -> dict:
        c = self.connector
        return dict(
            num_prompts_prefilled=self.num_prompts_prefilled,
            num_kv_bytes_sent=c.num_kv_bytes_sent,
            num_kv_bytes_skipped=c.num_kv_bytes_skipped,
            num_kv_bytes_sent_early=c.num_kv_bytes_sent_early,
        )

    # -- messages from gateways -------------------------------------------------------------------------------
    def handle(self, channel, peer, env: p.Envelope) -> None:
        msg = env.message
        key = AttemptKey(env.request_id, getattr(msg, "attempt", 0))
        if isinstance(msg, p.PrefillRequest):
            link = self.link_of(channel)
            if link is None or key in self.connector:
                return  # not from a gateway, or a copy of one being served already
            constraint = msg.sampling.constraint
            grammar = self.compiles.ready(key, constraint) if constraint is not None else None
            compiling = constraint is not None and grammar is None
            try:
                check_peer_address(msg.decode_address)
            except InvalidRequest as exc:  # the decode worker's fault, not the request's: the gateway moves it
                self.compiles.forget(key)
                error = f"decode worker {msg.decode_worker_id}: {exc}"
                self.send_failure(link, key.request_id, key.attempt, env.trace, error, code=503, retry=True)
                return
            if not compiling:
                if constraint is not None:
                    self.trace_compile(key.request_id, env.trace, constraint)  # a cache hit
                try:
                    self.admit(key, msg, grammar)
                except InvalidRequest as exc:
                    self.send_failure(link, key.request_id, key.attempt, env.trace, str(exc), code=400)
                    return
            state = PrefillState.COMPILING if compiling else PrefillState.QUEUED  # COMPILING: see on_compiled
            self.connector.add(PrefillAttempt(key, link, msg, env.trace, state=state))
        elif isinstance(msg, p.Abort) and msg.choice < 0:  # the request ended (or left this worker)
            self.forget_request(key.request_id, key.attempt)

    def on_compiled(self, done) -> None:
        record = self.connector.get(done.owner)
        if record is None or record.state is not PrefillState.COMPILING:
            return
        key = record.key
        self.trace_compile(key.request_id, record.trace, done.constraint, done.started_at, done.ended_at)
        if done.error:
            self.end_request(key, done.error, 503 if done.retry else 400, retry=done.retry)
            return
        try:
            self.admit(key, record.request, done.grammar)
        except InvalidRequest as exc:
            self.end_request(key, str(exc), 400)
            return
        self.connector.compiled(key)

    def forget_request(self, request_id: str, attempt: int) -> None:
        self.end_request(AttemptKey(request_id, attempt))

    def admit(self, key: AttemptKey, msg: p.PrefillRequest, grammar=None) -> None:
        """Check what could fail later, so that a bad request fails here, alone, with a 400; then queue its prompt."""
        if not 1 <= msg.n <= MAX_CHOICES:
            raise InvalidRequest(f"n must be between 1 and {MAX_CHOICES}, got {msg.n}")
        if msg.resume_token_ids and (msg.n != 1 or msg.choice < 0):
            raise InvalidRequest("a resumed request continues exactly one choice")
        for choice in range(msg.n):
            for_choice(msg.sampling, choice)  # each choice's own seed must be valid
        # The prefill worker samples only the next token; the decode worker does the rest.
        num_next, params = len(msg.resume_token_ids) + 1, msg.sampling
        next_only = dataclasses.replace(params, max_tokens=num_next, min_tokens=min(params.min_tokens, num_next))
        self.engine.add_request(
            msg.prompt_token_ids, next_only, request_id=key, resume_token_ids=msg.resume_token_ids, grammar=grammar
        )

    def end_request(self, key: AttemptKey, error: str = "", code: int = 500, retry: bool = False) -> None:
        """End an attempt here: the connector ends its record (the engine aborts its sequence at the next step, as
        for every attempt the connector ends), and with an error its gateway is told."""
        self.compiles.forget(key)
        self.connector.end(key, error, code, retry)
        self.report_failures()

    def report_failures(self) -> None:
        for f in self.connector.take_failures():
            self.report(f)

    # -- a step -----------------------------------------------------------------------------------------------
    def step(self) -> None:
        started = time.time()
        outputs = self.engine.step()
        self.trace_step(started)
        self.send_first_tokens(outputs)
        self.report_failures()

    def trace_step(self, started: float) -> None:
        plan = self.engine.last_plan
        if self.tracer.enabled and plan is not None and plan.chunks:
            self.tracer.span(
                "prefill.step",
                started,
                time.time(),
                batch_size=len(plan.chunks),
                num_tokens=plan.num_tokens,
                rids=[c.seq.request_id.request_id for c in plan.chunks],
            )

    def send_first_tokens(self, outputs) -> None:
        """Each finished prompt's first tokens to its gateway; only once all are out, the rest of the transfers
        (TTFT waits only on the groups shipped during the compute)."""
        computed = []
        for out in outputs:
            record = self.connector.get(out.request_id)
            if record is None:
                continue  # ended meanwhile (its failure, if any, is reported)
            if out.error:
                self.connector.end(record.key, f"the prefill step failed: {out.error}", 500)
                continue
            with fails_alone(lambda exc: self.first_tokens_failed(record, exc)):
                computed.append((record.key, self.first_tokens_of(record, out)))
        for key, continuing in computed:
            self.connector.computed(key, continuing)

    def first_tokens_failed(self, record: PrefillAttempt, exc: Exception) -> None:
        log.exception("%s: first tokens", self.worker_id, extra={"request_id": record.key.request_id})
        self.connector.end(record.key, failure_text(exc), failure_code(exc))

    def first_tokens_of(self, record: PrefillAttempt, out) -> list[tuple[int, int]]:
        """Send a finished prompt's first token of each choice; returns (choice, token) of those that go on."""
        request, trace, done_at = record.request, record.trace, time.time()
        rid, num_done = record.key.request_id, len(request.resume_token_ids)
        if self.tracer.enabled:
            self.tracer.span("queue", record.arrived_at, record.started_at, rid, tracing.child_of(trace))
            self.tracer.span(
                "prefill",
                record.started_at,
                done_at,
                rid,
                tracing.child_of(trace),
                num_prompt_tokens=len(request.prompt_token_ids),
                num_resumed_tokens=num_done,
                attempt=request.attempt,
                constraint=request.sampling.constraint.kind if request.sampling.constraint else "",
            )
        self.num_prompts_prefilled += 1
        params = request.sampling
        # Choice 0 was sampled with the prompt; the others draw from the same logits, each with its own seed.
        extra = [dataclasses.replace(for_choice(params, i), logprobs=params.logprobs) for i in range(1, request.n)]
        prompt_logprobs = self.engine.prompt_logprobs_of(record.key)
        continuing = []
        # Judged with the request's own parameters: the engine ran the prompt for its next token alone.
        for i, (token, token_logprobs, ended) in enumerate(self.engine.first_tokens(out, params, extra)):
            choice = request.choice if request.resume_token_ids else i
            reason = -1 if ended is None else int(ended)
            first = p.FirstToken(
                token,
                reason,
                queue_s=record.started_at - record.arrived_at,
                prefill_s=done_at - record.started_at,
                logprobs=[token_logprobs] if token_logprobs else [],
                prompt_logprobs=prompt_logprobs if choice == 0 else [],
                choice=choice,
                attempt=request.attempt,
                start=num_done,
            )
            record.link.channel.send(first, rid, trace)
            if reason < 0:
                continuing.append((choice, token))
        return continuing

    def close(self) -> None:
        self.connector.close()
        super().close()

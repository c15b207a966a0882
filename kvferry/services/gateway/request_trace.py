"""One HTTP request's observation at the gateway, as the API reports each event, detokenization and its finish: the
Prometheus figures, its closing log line and, with tracing on, its `arrival`, `http`, `detokenize` and `finish` spans.
"""

import logging
import time

from kvferry.common import tracing
from kvferry.common.protocol import TraceContext

log = logging.getLogger("kvferry.gateway")


class RequestTrace:
    def __init__(self, metrics, request_id: str, ctx: TraceContext, path: str, arrived_at: float, capture=None):
        self.metrics, self.request_id, self.ctx, self.path = metrics, request_id, ctx, path
        self.capture = capture  # a CapturedRequest with --capture-dir, else None
        self.tracer = tracing.tracer()
        self.arrived_at = arrived_at
        self.last_token_at: dict[int, float] = {}  # per choice, as inter-token latency is
        self.num_prompt = self.num_out = 0
        self.n = 1
        self.finished = False

    def admitted(self, num_prompt: int, n: int = 1, constraint: str = "") -> None:
        """Routed to workers (a request refused before this counts no prompt tokens). constraint: the kind of the
        output's constraint, "" for none."""
        self.num_prompt, self.n = num_prompt, n
        self.metrics.prompt_tokens.inc(num_prompt)
        at = self.arrived_at
        self._child_span("arrival", at, at, path=self.path, prompt_tokens=num_prompt, constraint=constraint)

    def _child_span(self, name: str, start: float, end: float, **attrs) -> None:
        if self.tracer.enabled:
            self.tracer.span(name, start, end, self.request_id, tracing.child_of(self.ctx), **attrs)

    def tokens(self, event) -> None:
        """A worker's event with tokens arrived."""
        now, n = time.time(), len(event.token_ids)
        if not n:
            return
        previous = self.last_token_at.get(event.choice)
        gap = (now - previous) / n if previous is not None else None  # each of the n tokens waited this long
        if self.capture is not None:
            self.capture.tokens(event.choice, event.token_ids, now - self.arrived_at, gap)
        m = self.metrics
        if not self.last_token_at:
            m.ttft.observe(now - self.arrived_at)
        first = event.first_token
        if first is not None and event.choice % self.n == 0 and event.choice not in self.last_token_at:
            m.queue.observe(first.queue_s)  # each prompt's first token: one prefill per prompt of a batch
            m.prefill.observe(first.prefill_s)
        if gap is not None:
            m.itl.observe(gap, n)
        self.last_token_at[event.choice] = now
        decoded = event.decode_tokens
        if decoded is not None and decoded.kv_transfer_bytes:
            m.kv_time.observe(decoded.kv_transfer_s)
            m.kv_bytes.observe(decoded.kv_transfer_bytes)
        self.num_out += n
        m.generation_tokens.inc(n)

    def detokenized(self, started: float, num_tokens: int) -> None:
        self._child_span("detokenize", started, time.time(), num_tokens=num_tokens)

    def finish(self, status: int, reason: str | None = None, error: str | None = None) -> None:
        """The response is complete (reason; with n choices, theirs joined by commas), failed (error), or the client
        left (no reason: "abort")."""
        if self.finished:
            return
        self.finished = True
        now = time.time()
        if self.capture is not None:
            self.capture.finish(status, reason, error, now - self.arrived_at)
        if error is None:
            for one in (reason or "abort").split(","):  # each choice counts, as vLLM counts its child requests
                self.metrics.request_success.labels(one).inc()
            if self.last_token_at and reason:  # not for a client that left
                self.metrics.e2e.observe(now - self.arrived_at)
        else:
            self.metrics.request_errors.labels(str(status)).inc()
            log.warning("request failed (%d): %s", status, error)
        if self.tracer.enabled:
            attrs = {
                "path": self.path,
                "status": status,
                "prompt_tokens": self.num_prompt,
                "completion_tokens": self.num_out,
                "finish_reason": reason or "",
                "error": error or "",
            }
            # http first: a reader that sees `finish` in a file then sees the http span too.
            self.tracer.span("http", self.arrived_at, now, self.request_id, self.ctx, **attrs)
            self._child_span("finish", now, now, **attrs)

"""Prometheus metrics of the gateway, `GET /metrics`: its own request figures, plus what workers heartbeat. Names
follow vLLM's (`vllm:time_to_first_token_seconds` -> `kvferry:time_to_first_token_seconds`). Worker figures are read
from the registry at scrape time, so a worker that leaves leaves the output with it.
"""

from prometheus_client import CollectorRegistry, Counter, Histogram, disable_created_metrics, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from kvferry.common import protocol as p
from kvferry.services.gateway.loop_metrics import LoopCounter, LoopHistogram

LATENCY_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
    160.0,
    640.0,
)
STEP_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0)
BYTE_BUCKETS = tuple(float(4**k * 1024) for k in range(11))  # 1 KiB .. 1 GiB
# From 0.1 ms, an idle loop's own wake-up jitter, to a minute (a saturated gateway's lag runs to seconds,
# docs/benchmarks.md): 1-2-5 steps, so a quantile's estimate stays close, then 10, 30 and 60 s.
LOOP_LAG_BUCKETS = tuple(m * 10.0**e for e in range(-4, 1) for m in (1, 2, 5)) + (10.0, 30.0, 60.0)
disable_created_metrics()  # no `_created` series beside each counter and histogram (vLLM does the same)


class WorkerFigures:
    """Scrape-time view of the registry and the gateway's live counts."""

    def __init__(self, core):
        self.core = core

    def collect(self):
        workers = list(self.core.registry.workers.values())
        gauges = {
            name: GaugeMetricFamily(f"kvferry:{name}", doc, labels=["worker", "role"])
            for name, doc in (
                ("num_requests_running", "Requests in a worker's running batch."),
                ("num_requests_waiting", "Requests queued on a worker."),
                (
                    "queued_prompt_tokens",
                    "Prompt tokens routed to a worker and not yet computed (what prefill autoscaling reads).",
                ),
                ("kv_cache_usage_perc", "Fraction of a worker's KV cache blocks in use (0 to 1)."),
            )
        }
        preemptions = CounterMetricFamily(
            "kvferry:num_preemptions", "Sequences preempted by a worker.", labels=["worker", "role"]
        )
        grammar = {
            name: CounterMetricFamily(f"kvferry:{name}", doc, labels=["worker", "role"])
            for name, doc in (
                ("grammar_compiles", "Structured-output constraints a worker compiled (its grammar cache missed)."),
                ("grammar_cache_hits", "Structured-output constraints a worker found compiled in its cache."),
                ("grammar_compile_seconds", "Seconds a worker spent compiling structured-output constraints."),
            )
        }
        errors = CounterMetricFamily(
            "kvferry:protocol_errors", "Messages that broke the wire protocol.", labels=["process"]
        )
        errors.add_metric(["gateway"], self.core.control.num_protocol_errors)
        for w in workers:
            labels, stats = [w.worker_id, w.role.name.lower()], w.stats
            gauges["num_requests_running"].add_metric(labels, stats.num_running)
            gauges["num_requests_waiting"].add_metric(labels, stats.num_waiting)
            gauges["queued_prompt_tokens"].add_metric(labels, w.num_queued_prompt_tokens)
            used = 1 - stats.num_free_blocks / stats.num_total_blocks if stats.num_total_blocks else 0.0
            gauges["kv_cache_usage_perc"].add_metric(labels, used)
            preemptions.add_metric(labels, stats.num_preemptions)
            grammar["grammar_compiles"].add_metric(labels, stats.num_grammar_compiles)
            grammar["grammar_cache_hits"].add_metric(labels, stats.num_grammar_cache_hits)
            grammar["grammar_compile_seconds"].add_metric(labels, stats.grammar_compile_s)
            errors.add_metric([w.worker_id], stats.num_protocol_errors)
        live = GaugeMetricFamily("kvferry:num_workers", "Live workers per role.", labels=["role"])
        for role in p.Role:
            live.add_metric([role.name.lower()], sum(1 for w in workers if w.role == role))
        core = self.core
        yield from gauges.values()
        yield from grammar.values()
        yield from (preemptions, errors, live)
        yield GaugeMetricFamily(
            "kvferry:gateway_requests_in_flight", "Requests the gateway is serving.", len(core.flights)
        )
        waiting = "Requests routed but without their first token (bounded by --max-waiting)."
        yield GaugeMetricFamily("kvferry:gateway_requests_waiting", waiting, core.num_waiting())
        moves = "Requests moved to other workers after a failure."
        yield CounterMetricFamily("kvferry:request_moves", moves, core.num_moves)
        duplicates = "Repeated messages the gateway dropped."
        yield CounterMetricFamily("kvferry:duplicate_messages", duplicates, core.control.num_duplicates)
        forged = "Worker messages dropped: from a connection that may not send them."
        yield CounterMetricFamily("kvferry:forged_messages", forged, core.num_forged)


class GatewayLabel:
    """A registry's series, each with one more label, gateway="<its index>". With several gateway processes behind one
    port (--gateways), a scrape reaches whichever of them the kernel picks: the label says which one answered, by
    the index its logs and traces carry (0 to N-1). Not by its id, new at each start: each restart would begin new
    series, and a dashboard's legend would change with it."""

    def __init__(self, registry: CollectorRegistry, gateway_index: int):
        self.registry, self.value = registry, str(gateway_index)

    def collect(self):
        for metric in self.registry.collect():
            labelled = Metric(metric.name, metric.documentation, metric.type, metric.unit)
            labelled.samples = [s._replace(labels={**s.labels, "gateway": self.value}) for s in metric.samples]
            yield labelled


class GatewayMetrics:
    def __init__(self, core, gateway_index: int | None = None):
        """gateway_index: this process's among several behind one port (--gateways), which every series then carries."""
        self.registry = registry = CollectorRegistry()
        self.exposed = registry if gateway_index is None else GatewayLabel(registry, gateway_index)
        registry.register(WorkerFigures(core))
        self.prompt_tokens = Counter("kvferry:prompt_tokens", "Prompt tokens of requests admitted.", registry=registry)
        # Updated at every token: kinds without a lock (loop_metrics.py).
        self.generation_tokens = LoopCounter("kvferry:generation_tokens", "Tokens generated.")
        self.itl = LoopHistogram(
            "kvferry:inter_token_latency_seconds", "Time between a request's tokens.", STEP_BUCKETS
        )
        registry.register(self.generation_tokens)
        registry.register(self.itl)
        self.request_success = Counter(
            "kvferry:request_success", "Requests finished, by finish reason.", ["finished_reason"], registry=registry
        )
        self.request_errors = Counter(
            "kvferry:request_errors", "Requests that ended in an error, by HTTP status.", ["code"], registry=registry
        )

        def histogram(name, doc, buckets):
            return Histogram(f"kvferry:{name}", doc, buckets=buckets, registry=registry)

        self.ttft = histogram("time_to_first_token_seconds", "Arrival to the first token.", LATENCY_BUCKETS)
        self.e2e = histogram("e2e_request_latency_seconds", "Arrival to the last token.", LATENCY_BUCKETS)
        self.queue = histogram("request_queue_time_seconds", "Waiting on the prefill worker.", LATENCY_BUCKETS)
        self.prefill = histogram("request_prefill_time_seconds", "Prefill compute.", LATENCY_BUCKETS)
        self.kv_time = histogram("kv_transfer_time_seconds", "Prefill to decode KV transfer.", LATENCY_BUCKETS)
        self.kv_bytes = histogram("kv_transfer_bytes", "Bytes of one request's KV transfer.", BYTE_BUCKETS)
        self.loop_lag = histogram(
            "gateway_event_loop_lag_seconds",
            "How late the gateway's event loop ran a wake-up it had asked for, once per period of time: a stall also "
            "counts the wake-ups it held up (services/gateway/loop_lag.py).",
            LOOP_LAG_BUCKETS,
        )

    def exposition(self) -> bytes:
        return generate_latest(self.exposed)

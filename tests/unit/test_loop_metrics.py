"""The per-token counter and histogram read out exactly as prometheus_client's own kinds do, given the same updates."""

from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry, Counter, Histogram, disable_created_metrics, generate_latest

from kvferry.services.gateway.loop_metrics import LoopCounter, LoopHistogram
from kvferry.services.gateway.metrics import STEP_BUCKETS

disable_created_metrics()  # as the gateway's metrics do: no _created series beside prometheus_client's kinds


@settings(max_examples=100, deadline=None)
@given(
    values=st.lists(st.one_of(st.floats(0, 20), st.sampled_from([0.0, *STEP_BUCKETS])), max_size=50),
    amounts=st.lists(st.integers(0, 1000), max_size=20),
)
def test_the_same_updates_read_out_as_prometheus_clients(values, amounts):
    theirs, ours = CollectorRegistry(), CollectorRegistry()
    histogram = Histogram("kvferry:inter_token_latency_seconds", "Gaps.", buckets=STEP_BUCKETS, registry=theirs)
    counter = Counter("kvferry:generation_tokens", "Tokens.", registry=theirs)
    loop_histogram = LoopHistogram("kvferry:inter_token_latency_seconds", "Gaps.", STEP_BUCKETS)
    loop_counter = LoopCounter("kvferry:generation_tokens", "Tokens.")
    ours.register(loop_histogram)
    ours.register(loop_counter)
    for value in values:
        histogram.observe(value)
        loop_histogram.observe(value)
    for amount in amounts:
        counter.inc(amount)
        loop_counter.inc(amount)
    assert generate_latest(ours) == generate_latest(theirs)


def test_a_value_observed_several_times_counts_each_time():
    histogram = LoopHistogram("h", "A histogram.", (0.1, 1.0))
    histogram.observe(0.5, 3)
    [family] = histogram.collect()
    samples = {(s.name, s.labels.get("le")): s.value for s in family.samples}
    assert samples[("h_bucket", "0.1")] == 0 and samples[("h_bucket", "1.0")] == 3 and samples[("h_count", None)] == 3
    assert samples[("h_sum", None)] == 1.5

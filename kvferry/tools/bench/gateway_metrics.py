"""`kvferry bench gateway`'s readings of the gateways' /metrics: each gateway's event-loop lag histogram and the
requests it has finished. Several gateway processes share one port (--gateways), and the kernel hands each new
connection to one of them, so one scrape reads one process: the bench scrapes over fresh connections until every
gateway has answered. Each reading is taken with no load running, so a gateway's first answer stands for all.

The loop lag over a load is the delta of its histogram between two readings: p50 and p99 interpolated within its
buckets (as Prometheus' histogram_quantile), the max as the upper bound of the highest bucket reached. Several
gateways' histograms add up, bucket by bucket, into one of all their periods (the gateway observes its lag once a
period of time, services/gateway/loop_lag.py).
"""

import time
import urllib.request
from collections.abc import Collection
from dataclasses import dataclass

from kvferry.common.errors import KvferryError

LAG_METRIC = "kvferry:gateway_event_loop_lag_seconds"
FINISHED_METRIC = "kvferry:request_success"  # requests finished (a stream finished for its length counts once)
SCRAPE_TIMEOUT_S = 30.0


@dataclass
class Reading:
    lag: list[tuple[float, float]]  # (upper bound, cumulative count) per bucket, +Inf last
    num_finished: float


def read_gateways(url: str, ids: Collection[str]) -> dict[str, Reading]:
    """Every gateway's reading, by its id: /metrics scraped over a fresh connection each time until each of ids (in
    the order of the gateways' indexes, as stack.gateways holds them) has answered."""
    readings: dict[str, Reading] = {}
    deadline = time.monotonic() + SCRAPE_TIMEOUT_S
    while len(readings) < len(ids):
        if time.monotonic() > deadline:
            missing = sorted(set(ids) - set(readings))
            raise KvferryError(
                f"gateway(s) {', '.join(missing)} never answered /metrics at {url} in {SCRAPE_TIMEOUT_S} s"
            )
        with urllib.request.urlopen(url + "/metrics", timeout=10) as reply:  # urllib: a new connection each call
            gateway_id, reading = parse_reading(reply.read().decode(), ids)
        readings.setdefault(gateway_id, reading)
    return readings


def parse_reading(text: str, ids: Collection[str]) -> tuple[str, Reading]:
    """The gateway that answered with text, and its reading. ids: the gateways' ids in the order of their index,
    which a group's processes label their series with (`gateway="0"` to N-1; one gateway labels nothing)."""
    from prometheus_client.parser import text_string_to_metric_families

    families = {family.name: family for family in text_string_to_metric_families(text)}
    if LAG_METRIC not in families:
        raise KvferryError(f"a gateway's /metrics has no {LAG_METRIC}")
    buckets = [s for s in families[LAG_METRIC].samples if s.name.endswith("_bucket")]
    label = buckets[0].labels.get("gateway") if buckets else None
    in_order = list(ids)
    if label is None and len(in_order) == 1:
        label = "0"
    if label is None or not label.isdigit() or int(label) >= len(in_order):
        raise KvferryError(f"/metrics answered for gateway {label!r}, not one of the {len(in_order)} indexes")
    gateway_id = in_order[int(label)]
    finished = families.get(FINISHED_METRIC)
    num_finished = sum(s.value for s in finished.samples if s.name.endswith("_total")) if finished else 0.0
    return gateway_id, Reading([(float(s.labels["le"]), s.value) for s in buckets], num_finished)


def merged_lag(readings: Collection[Reading]) -> list[tuple[float, float]]:
    """The gateways' lag histograms as one: their counts added, bucket by bucket (they share their bounds)."""
    lags = [r.lag for r in readings]
    return [(bound, sum(lag[i][1] for lag in lags)) for i, (bound, _) in enumerate(lags[0])]


def lag_figures(before: list, after: list) -> dict:
    """p50, p99 (linear within a bucket, as Prometheus' histogram_quantile) and max (the highest bucket reached's
    bound) of the lag between two readings, in ms; loop_lag_samples: the periods observed. Past the top finite bucket
    no bound is known: the max is None and loop_lag_past_top_bucket says why, and a quantile there reads as that
    bucket's bound (a floor, as Prometheus gives it). Never inf: the report is JSON."""
    bounds = [b for b, _ in after]
    counts = [a - b for (_, a), (_, b) in zip(after, before)]
    total = counts[-1]
    figures = {"loop_lag_samples": int(total)}
    for name, q in (("p50", 0.5), ("p99", 0.99)):
        figures[f"loop_lag_{name}_ms"] = None if not total else round(1000 * _quantile(bounds, counts, q), 3)
    reached = next((i for i, c in enumerate(counts) if c == total), len(counts) - 1)
    past_top = bool(total) and bounds[reached] == float("inf")
    figures["loop_lag_max_ms"] = None if not total or past_top else round(1000 * bounds[reached], 3)
    figures["loop_lag_past_top_bucket"] = past_top
    return figures


def _quantile(bounds: list[float], counts: list[float], q: float) -> float:
    rank = q * counts[-1]
    lower_bound, lower_count = 0.0, 0.0
    for bound, count in zip(bounds, counts):
        if count >= rank:
            if bound == float("inf"):
                return lower_bound
            return lower_bound + (bound - lower_bound) * (rank - lower_count) / max(count - lower_count, 1e-9)
        lower_bound, lower_count = bound, count
    return lower_bound

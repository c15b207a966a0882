"""A counter and a histogram that the gateway updates for every token, from its event loop alone: plain numbers,
without prometheus_client's lock and calls per update, read out as the same series when /metrics is scraped (on the
same loop). prometheus_client's own kinds serve the rest, which change once per request or less.
"""

import math
from bisect import bisect_left

from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily
from prometheus_client.utils import floatToGoString


class LoopCounter:
    def __init__(self, name: str, documentation: str):
        self.name, self.documentation = name, documentation
        self.value = 0

    def inc(self, amount: int = 1) -> None:
        self.value += amount

    def collect(self):
        yield CounterMetricFamily(self.name, self.documentation, self.value)


class LoopHistogram:
    def __init__(self, name: str, documentation: str, buckets: tuple[float, ...]):
        self.name, self.documentation = name, documentation
        self.bounds = list(buckets)  # each bucket counts the values up to and including its bound, as Prometheus's
        self.counts = [0] * (len(buckets) + 1)  # the last: past every bound
        self.sum = 0.0

    def observe(self, value: float, times: int = 1) -> None:
        """value, observed times times."""
        self.counts[bisect_left(self.bounds, value)] += times
        self.sum += value * times

    def collect(self):
        cumulative, buckets = 0, []
        for bound, count in zip([*self.bounds, math.inf], self.counts):
            cumulative += count
            buckets.append((floatToGoString(bound), cumulative))
        yield HistogramMetricFamily(self.name, self.documentation, buckets=buckets, sum_value=self.sum)

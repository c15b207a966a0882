"""The latency objectives the planner sizes pools for (p90 of TTFT and of inter-token gaps), and the distributions
a simulation reports. Percentiles interpolate between sorted values (tools/percentiles.py), so once enough values
are over a bound (`certainly_over`), nothing later brings the p90 back under: a planner's run can stop early.
"""

import math
from dataclasses import dataclass

from kvferry.tools.percentiles import summary


def distribution(values: list[float]) -> dict:
    """p50, p90, p99 and the mean (None without values)."""
    return summary(values) | {"mean": sum(values) / len(values) if values else None}


def certainly_over(num_over: int, num_values: int, q: float) -> bool:
    """Whether the q-th percentile of num_values values exceeds a bound when num_over of them are known to: the
    sorted position floor(h) it interpolates from is then among the ones over it."""
    if num_values <= 0:
        return False
    return num_over >= num_values - math.floor((num_values - 1) * q / 100)


@dataclass(frozen=True)
class SLO:
    ttft_p90_s: float
    itl_p90_s: float
    quantile: float = 90

    def missed(self, summary: dict) -> list[str]:
        """The objectives a simulation's summary misses, as words ("TTFT p90 1200.00 ms > 1000 ms"); a request
        refused or failed misses them all."""
        out = []
        if summary["refused"] or summary["failed"]:
            out.append(f"{summary['refused'] + summary['failed']} requests refused or failed")
        for name, key, bound in (("TTFT", "ttft", self.ttft_p90_s), ("ITL", "itl", self.itl_p90_s)):
            value = summary[key]["p90"]
            if value is not None and value > bound:
                out.append(f"{name} p90 {value * 1000:.2f} ms > {bound * 1000:g} ms")
        return out

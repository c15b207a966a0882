"""The one percentile definition of every tool's figures (bench, replay, the simulator), and the summary they print.

Linear interpolation at (n - 1) * q / 100, numpy's default: what the benchmarks printed with np.percentile, and what
sim/slo.certainly_over relies on, so that measured and predicted figures read the same way.
"""

import math

QUANTILES = (50, 90, 99)


def percentile(sorted_values: list[float], q: float) -> float | None:
    """The q-th percentile (0 <= q <= 100) of values already sorted; None without values."""
    if not sorted_values:
        return None
    h = (len(sorted_values) - 1) * q / 100
    lo = math.floor(h)
    hi = min(lo + 1, len(sorted_values) - 1)
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (h - lo)


def summary(
    values, quantiles=QUANTILES, scale: float = 1.0, digits: int | None = None, key: str = "{}"
) -> dict[str, float | None]:
    """Each percentile of values (in any order) times scale, rounded to digits (None: not rounded), under the key
    key.format("p50") ("max" for q 100)."""
    ordered = sorted(values)
    out = {}
    for q in quantiles:
        value = percentile(ordered, q)
        if value is not None:
            value = value * scale if digits is None else round(value * scale, digits)
        out[key.format("max" if q == 100 else f"p{q:g}")] = value
    return out

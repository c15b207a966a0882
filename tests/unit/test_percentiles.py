"""The tools' one percentile definition: numpy's default (linear between the sorted values around (n - 1) * q / 100),
which every benchmark printed its figures with before, and the summary's keys, scale and rounding."""

import numpy as np
from hypothesis import given
from hypothesis import strategies as st

from kvferry.tools.percentiles import percentile, summary

values = st.lists(st.floats(min_value=-1e6, max_value=1e6, allow_nan=False), min_size=1, max_size=50)


@given(values, st.floats(min_value=0, max_value=100))
def test_a_percentile_is_numpys_default_one(xs, q):
    assert np.isclose(percentile(sorted(xs), q), np.percentile(xs, q), rtol=1e-9, atol=1e-6)


@given(values)
def test_the_100th_percentile_is_the_largest_value_and_the_0th_the_smallest(xs):
    assert percentile(sorted(xs), 100) == max(xs)
    assert percentile(sorted(xs), 0) == min(xs)


def test_a_percentile_between_two_values_interpolates():
    assert percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.5
    assert percentile([0.0, 10.0], 90) == 9.0


def test_the_summary_names_scales_and_rounds_each_percentile_in_the_order_asked():
    got = summary([0.004, 0.001, 0.003, 0.002], (50, 99, 100), scale=1000, digits=2, key="ttft_{}_ms")
    assert list(got) == ["ttft_p50_ms", "ttft_p99_ms", "ttft_max_ms"]
    assert got == {"ttft_p50_ms": 2.5, "ttft_p99_ms": 3.97, "ttft_max_ms": 4.0}
    assert summary([1.0, 2.0]) == {"p50": 1.5, "p90": 1.9, "p99": 1.99}


def test_without_values_every_figure_is_none():
    assert summary([], (50, 99), digits=3) == {"p50": None, "p99": None}

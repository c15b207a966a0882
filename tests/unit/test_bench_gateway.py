"""`kvferry bench gateway`'s arithmetic: the loop lag's quantiles from two readings of a histogram, and a py-spy
profile's top functions."""

from kvferry.tools.bench.gateway import lag_figures, profile_top

INF = float("inf")


def test_lag_figures_take_the_wake_ups_between_the_readings():
    bounds = [0.001, 0.01, 0.1, INF]
    before = list(zip(bounds, [5, 5, 6, 6]))  # earlier wake-ups, one of them slow: not in the window
    # In the window: 50 within 1 ms, 48 in (1, 10] ms, 2 in (10, 100] ms.
    after = list(zip(bounds, [55, 103, 106, 106]))
    figures = lag_figures(before, after)
    assert figures["loop_lag_samples"] == 100
    assert figures["loop_lag_p50_ms"] == 1.0  # the 50th wake-up is the last of the first bucket
    assert figures["loop_lag_p99_ms"] == 55.0  # halfway into (10, 100]: 99 of 100 is 1 of the bucket's 2
    assert figures["loop_lag_max_ms"] == 100.0  # the highest bucket reached, as a bound


def test_lag_figures_without_wake_ups_say_so():
    reading = list(zip([0.001, INF], [3, 3]))
    figures = lag_figures(reading, reading)
    assert figures == {"loop_lag_samples": 0, "loop_lag_p50_ms": None, "loop_lag_p99_ms": None, "loop_lag_max_ms": None}


def test_profile_top_ranks_functions_by_self_and_by_cumulative_samples(tmp_path):
    loop = "<module> (kvferry/services/commands.py:1);run_forever (/usr/lib/asyncio/base_events.py:600)"
    stacks = tmp_path / "stacks.txt"
    stacks.write_text(
        f"{loop};_handle (/x/kvferry/services/gateway/server.py:10);decode (/x/kvferry/common/protocol.py:5) 6\n"
        f"{loop};_handle (/x/kvferry/services/gateway/server.py:12) 2\n"
        f"{loop};_stream (/x/kvferry/services/gateway/response_consumer.py:7);dumps (/usr/lib/json/__init__.py:9) 2\n"
    )
    top = profile_top(str(stacks))
    assert top["samples"] == 10
    assert top["self"] == [
        ["decode (common/protocol.py)", 0.6],
        ["_handle (gateway/server.py)", 0.2],  # its lines merge: one function
        ["dumps (json/__init__.py)", 0.2],
    ]
    # The frames on every sample (the module, the loop) say nothing and are left out.
    assert top["cumulative"] == [
        ["_handle (gateway/server.py)", 0.8],
        ["decode (common/protocol.py)", 0.6],
        ["_stream (gateway/response_consumer.py)", 0.2],
        ["dumps (json/__init__.py)", 0.2],
    ]

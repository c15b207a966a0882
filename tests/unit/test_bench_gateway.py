"""`kvferry bench gateway`'s arithmetic: the loop lag's quantiles from two readings of a histogram, a gateway's
reading of its own /metrics (which of several answered), the rounds pooled and set against one gateway, and a py-spy
profile's top functions."""

import json

import pytest
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest

from kvferry.common.errors import KvferryError
from kvferry.services.gateway.metrics import GatewayLabel
from kvferry.tools.bench.gateway_metrics import LAG_METRIC, lag_figures, merged_lag, parse_reading
from kvferry.tools.bench.gateway_profile import profile_top
from kvferry.tools.bench.gateway_report import balanced, comparisons, pool_runs

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
    assert figures == {
        "loop_lag_samples": 0,
        "loop_lag_p50_ms": None,
        "loop_lag_p99_ms": None,
        "loop_lag_max_ms": None,
        "loop_lag_past_top_bucket": False,
    }


def test_lag_figures_past_the_top_bucket_give_no_max_and_say_so_in_valid_json():
    bounds = [0.001, 60.0, INF]
    before = list(zip(bounds, [0, 0, 0]))
    after = list(zip(bounds, [90, 98, 100]))  # 2 periods past a minute: no bound is known
    figures = lag_figures(before, after)
    assert figures["loop_lag_max_ms"] is None and figures["loop_lag_past_top_bucket"] is True
    assert figures["loop_lag_p99_ms"] == 60000.0  # in the +Inf bucket: its lower bound, a floor
    assert json.loads(json.dumps(figures, allow_nan=False)) == figures
    assert lag_figures(before, list(zip(bounds, [90, 100, 100])))["loop_lag_past_top_bucket"] is False


def test_profile_top_ranks_functions_by_self_and_by_cumulative_samples(tmp_path):
    loop = "<module> (kvferry/services/commands.py:1);run_forever (/usr/lib/asyncio/base_events.py:600)"
    handle = "Handle._run (/usr/lib/python3.11/asyncio/events.py:84)"
    server, decode = "_handle (/x/kvferry/services/gateway/server.py:10)", "decode (/x/kvferry/common/protocol.py:5)"
    stream = "_stream (/x/kvferry/services/gateway/response_consumer.py:7)"
    stacks = tmp_path / "stacks.txt"
    stacks.write_text(
        f"{loop};{handle};{server};{decode} 60\n"
        f"{loop};{handle};_handle (/x/kvferry/services/gateway/server.py:12) 18\n"
        f"{loop};{handle};{stream};dumps (/usr/lib/json/__init__.py:9) 20\n"
        f"{loop};select (/usr/lib/selectors.py:468) 2\n"  # the loop's poll: Handle._run is on 98 of 100 samples
    )
    top = profile_top(str(stacks))
    assert top["samples"] == 100
    assert top["self"][:3] == [
        ["decode (common/protocol.py)", 0.6],
        ["dumps (json/__init__.py)", 0.2],
        ["_handle (gateway/server.py)", 0.18],  # its lines merge: one function
    ]
    # The frames on every sample (the module, the loop) and the loop's dispatch (Handle._run, on 98%) say nothing.
    assert top["cumulative"] == [
        ["_handle (gateway/server.py)", 0.78],
        ["decode (common/protocol.py)", 0.6],
        ["_stream (gateway/response_consumer.py)", 0.2],
        ["dumps (json/__init__.py)", 0.2],
        ["select (lib/selectors.py)", 0.02],
    ]


def exposition(gateway_index: int | None, finished: dict[str, int], lags: list[float]) -> str:
    """A gateway's /metrics text: its loop-lag histogram and its finished requests by reason; labelled with its
    index as one of several processes labels them (None: one gateway, unlabelled)."""
    registry = CollectorRegistry()
    lag = Histogram(LAG_METRIC, "lag", buckets=[0.001, 0.01], registry=registry)
    for seconds in lags:
        lag.observe(seconds)
    success = Counter("kvferry:request_success", "finished", ["finished_reason"], registry=registry)
    for reason, n in finished.items():
        success.labels(reason).inc(n)
    return generate_latest(registry if gateway_index is None else GatewayLabel(registry, gateway_index)).decode()


def test_a_reading_says_which_gateway_answered_and_counts_its_finished_requests():
    text = exposition(1, {"length": 5, "stop": 2}, [0.0005, 0.005, 0.5])
    gateway_id, reading = parse_reading(text, ["gw-0000000a", "gw-0000000b"])  # the ids in index order
    assert gateway_id == "gw-0000000b"
    assert reading.num_finished == 7  # every reason, the counter's _total only (not its _created)
    assert reading.lag == [(0.001, 1), (0.01, 2), (INF, 3)]
    # One gateway labels nothing: the one id it was asked for stands for it; none finished yet reads 0.
    assert parse_reading(exposition(None, {}, []), {"gw-0000000a"})[1].num_finished == 0
    with pytest.raises(KvferryError, match="not one of the 1 indexes"):
        parse_reading(text, ["gw-0000000a"])


def test_merged_lag_adds_the_gateways_buckets():
    bounds = [0.001, 0.01, INF]
    first = parse_reading(exposition(0, {}, [0.0005, 0.5]), ["a", "b"])[1]
    second = parse_reading(exposition(1, {}, [0.005]), ["a", "b"])[1]
    assert merged_lag([first, second]) == list(zip(bounds, [1, 2, 3]))


def run(streams_by_gateway: dict[str, int], cpu_s: dict[str, float], tok_per_s: float, tokens_each: int = 10) -> dict:
    """A run as run_load reports it, the figures pool_runs and comparisons read."""
    counted = sum(streams_by_gateway.values())
    per_gateway = [
        {"id": gid, "streams": n, "cpu_s": cpu_s[gid], "share": n / counted} for gid, n in streams_by_gateway.items()
    ]
    tokens = counted * tokens_each
    return {
        "streams": counted,
        "gateways": len(per_gateway),
        "tokens_each": tokens_each,
        "tokens": tokens,
        "tok_per_s": tok_per_s,
        "gateway_cpu_us_per_token": round(sum(cpu_s.values()) / tokens * 1e6, 1),
        "per_gateway": per_gateway,
    }


def test_rounds_pool_into_shares_of_all_streams_and_a_ratio_against_one_gateway():
    one = pool_runs([run({"g1": 100}, {"g1": 0.1}, 900.0), run({"g1": 100}, {"g1": 0.3}, 1000.0)])
    two = pool_runs(
        [
            run({"a": 35, "b": 65}, {"a": 0.07, "b": 0.065}, 800.0),  # 35%: outside 40 to 60
            run({"a": 55, "b": 45}, {"a": 0.11, "b": 0.045}, 700.0),
        ]
    )
    assert one["tok_per_s"] == 1000.0 and one["all_tok_per_s"] == [900.0, 1000.0]  # the fastest run's figures
    assert one["pooled"]["gateway_cpu_us_per_token"] == 200.0  # 0.4 s over 2,000 tokens
    assert two["pooled"]["shares"] == {"a": 0.45, "b": 0.55}  # 90 and 110 of all 200 streams
    assert two["pooled"]["per_process_cpu_us_per_token"] == {"a": 200.0, "b": 100.0}  # 0.18 s / 900, 0.11 / 1,100 tok
    assert two["pooled"]["rounds_balanced"] == 1
    [against] = comparisons([one, two], [1, 2])
    assert against["cpu_per_token_ratio"] == 0.725  # 0.29 s against 0.4 over 2,000 tokens each
    assert against["per_round_ratios"] == [1.35, 0.517]  # 135 against 100 µs, 155 against 300: side by side
    assert against["shares"] == [0.45, 0.55] and (against["rounds_balanced"], against["rounds"]) == (1, 2)


def test_balanced_is_every_share_within_ten_points_of_an_even_one():
    assert balanced([0.4, 0.6]) and balanced([0.5, 0.5]) and balanced([1.0])
    assert not balanced([0.39, 0.61]) and not balanced([0.5, None])
    assert balanced([0.3, 0.3, 0.4]) and not balanced([0.2, 0.4, 0.4])

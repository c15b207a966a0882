"""The gateway's loop-lag watch (services/gateway/loop_lag.py) on a real event loop: a stall counts once for every
period it held up, each as late as that wake-up would have been, so the histogram's quantiles are of time; the
watch ends on cancellation, and a watch that fails is logged as it fails."""

import asyncio
import logging
import time

import pytest

from kvferry.services.gateway import loop_lag


class Lags:
    """What a prometheus_client Histogram is told: each observation."""

    def __init__(self):
        self.seen: list[float] = []

    def observe(self, value: float) -> None:
        self.seen.append(value)


def test_a_lag_stands_for_every_period_it_missed():
    lags = Lags()
    loop_lag.observe_lag(lags, 0.35, 0.1)
    assert lags.seen == pytest.approx([0.35, 0.25, 0.15, 0.05])  # due at 0, 0.1, 0.2 and 0.3 s
    lags.seen.clear()
    loop_lag.observe_lag(lags, 0.004, 0.1)  # on time, give or take: one observation
    assert lags.seen == [0.004]
    lags.seen.clear()
    loop_lag.observe_lag(lags, 3600.0, 1.0)  # a suspended machine: counted up to the top bucket, not an hour
    assert len(lags.seen) == 1 + loop_lag.MAX_COUNTED_S


def test_a_stall_of_the_loop_counts_its_missed_periods_and_cancel_ends_the_watch():
    period_s, stall_s = 0.01, 0.2

    async def main() -> list[float]:
        lags = Lags()
        watch = loop_lag.start_watch(lags, period_s)
        await asyncio.sleep(0)  # the watch asks for its first wake-up
        time.sleep(stall_s)  # the loop holds: every wake-up due in these 0.2 s waits
        await asyncio.sleep(3 * period_s)
        await loop_lag.stop_watch(watch)
        assert watch.cancelled()
        return lags.seen

    seen = asyncio.run(main())
    late = max(seen)  # the stalled wake-up's: at least 0.19 s, as time.sleep never returns early
    assert late >= stall_s - period_s
    # It, then one for each period it held up (about 19), each a period less late: in order, as observed.
    num_missed = int(late // period_s)
    at = seen.index(late)
    assert seen[at : at + num_missed + 1] == pytest.approx([late - k * period_s for k in range(num_missed + 1)])


def test_a_watch_that_fails_is_logged_and_stopping_it_then_raises_nothing(caplog):
    class Broken:
        def observe(self, value: float) -> None:
            raise RuntimeError("broken histogram")

    async def main() -> None:
        watch = loop_lag.start_watch(Broken(), 0.001)
        while not watch.done():
            await asyncio.sleep(0.001)
        await loop_lag.stop_watch(watch)

    with caplog.at_level(logging.ERROR, logger="kvferry.gateway"):
        asyncio.run(main())
    assert "no longer measured" in caplog.text and "broken histogram" in caplog.text

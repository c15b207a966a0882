"""The event loop's own lateness, always measured: a task asks to wake every LAG_PERIOD_S and records how late it
woke. Every stream's chunks, every worker message and every new request wait on this one loop, so its lag is what a
busy gateway adds to each of them (`kvferry:gateway_event_loop_lag_seconds` on /metrics; `kvferry bench gateway`
reads it around its load)."""

import asyncio

LAG_PERIOD_S = 0.01  # a hundred wake-ups a second: a few microseconds each, and enough samples for a p99 in seconds


async def watch_loop_lag(histogram, period_s: float = LAG_PERIOD_S) -> None:
    """Runs until cancelled: observes into histogram (a prometheus_client Histogram) each wake-up's lateness."""
    loop = asyncio.get_running_loop()
    while True:
        due = loop.time() + period_s
        await asyncio.sleep(period_s)
        histogram.observe(max(0.0, loop.time() - due))

"""The event loop's own lateness, always measured: a task asks to wake every LAG_PERIOD_S and records how late it
woke. Every stream's chunks, every worker message and every new request wait on this one loop, so its lag is what a
busy gateway adds to each of them (`kvferry:gateway_event_loop_lag_seconds` on /metrics; `kvferry bench gateway`
reads it around its load).

The histogram holds one observation per period of time, not per wake-up: a wake-up that came lag late also stands
for the wake-ups the stalled loop never made, one every period, each as late as it would have been (lag - k *
period). Else a 5 s stall would count once beside the hundreds of punctual wake-ups around it, and the quantiles
would be of wake-ups, which a stall makes fewer; these are of time.
"""

import asyncio
import contextlib
import logging

log = logging.getLogger("kvferry.gateway")
# 20 wake-ups a second. Each (a timer, the loop's wake-up, the observation) costs a fraction of a millisecond of
# CPU, not microseconds (docs/benchmarks.md has the figures). A stall shorter than a period is still sampled, in
# proportion to its length.
LAG_PERIOD_S = 0.05
MAX_COUNTED_S = 60.0  # a stall's missed periods are counted up to this: the histogram's top bucket


def observe_lag(histogram, lag_s: float, period_s: float) -> None:
    """One wake-up's lag, and for each whole period it missed, the lag a wake-up then would have had."""
    histogram.observe(lag_s)
    for k in range(1, int(min(lag_s, MAX_COUNTED_S) // period_s) + 1):
        histogram.observe(lag_s - k * period_s)


async def watch_loop_lag(histogram, period_s: float = LAG_PERIOD_S) -> None:
    """Runs until cancelled: observes into histogram (a prometheus_client Histogram) the loop's lag, once a period."""
    loop = asyncio.get_running_loop()
    while True:
        due = loop.time() + period_s
        await asyncio.sleep(period_s)
        observe_lag(histogram, max(0.0, loop.time() - due), period_s)


def start_watch(histogram, period_s: float = LAG_PERIOD_S) -> asyncio.Task:
    """watch_loop_lag as a task whose failure is logged when it happens, not when (if ever) it is awaited."""
    task = asyncio.create_task(watch_loop_lag(histogram, period_s), name="loop-lag")
    task.add_done_callback(_log_failure)
    return task


async def stop_watch(task: asyncio.Task) -> None:
    """Cancel the watch and wait for it to end. One that failed already was logged as it did."""
    if task.done():
        return
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task


def _log_failure(task: asyncio.Task) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.error("the event loop's lag is no longer measured", exc_info=task.exception())

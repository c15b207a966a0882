"""A request's inbox at the gateway: the workers' messages its consumer has not taken yet, taken all at once, and a
wait for the next one that ends at a given time at the latest.

The wait's bound moves with every token (no word from a worker for so long), so an armed timer is kept while it
would ring in time and moved only when it would ring too late: one timer per request and bound, not one per wait. A
timer that rings early wakes the consumer, which looks again and waits on.
"""

import asyncio
import math
import time


class Inbox:
    def __init__(self, max_items: int):
        self.max_items = max_items
        self.items: list = []
        self.waiter: asyncio.Future | None = None
        self.timer: asyncio.TimerHandle | None = None
        self.timer_at = math.inf  # monotonic time the armed timer rings

    def put(self, item) -> bool:
        """Queue item for the consumer; False (and it is dropped) when max_items wait already."""
        if len(self.items) >= self.max_items:
            return False
        self.items.append(item)
        self.wake()
        return True

    def take(self) -> list:
        """Everything put since the last take, in order."""
        items, self.items = self.items, []
        return items

    def wake(self) -> None:
        """End the consumer's wait, if it waits."""
        waiter = self.waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def wait(self, until: float) -> None:
        """Until something is put (or wake is called), or until the monotonic time until at the latest; perhaps
        sooner (a timer armed for an earlier bound)."""
        if self.items:
            return
        loop = asyncio.get_running_loop()
        if until < self.timer_at:
            self.close()
            self.timer = loop.call_later(max(0.0, until - time.monotonic()), self._ring)
            self.timer_at = until
        self.waiter = loop.create_future()
        try:
            await self.waiter
        finally:
            self.waiter = None

    def _ring(self) -> None:
        self.timer, self.timer_at = None, math.inf
        self.wake()

    def close(self) -> None:
        """Disarm the timer (the request ended)."""
        if self.timer is not None:
            self.timer.cancel()
        self.timer, self.timer_at = None, math.inf

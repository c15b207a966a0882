"""Several prompts' flights merged into one stream (gateway/fanout.py)."""

import asyncio

from kvferry.services.gateway import fanout
from kvferry.services.gateway.flight import Event


class Source:
    """A flight's stream of event lists: one token a list, for ever, counting what was taken from it."""

    def __init__(self):
        self.taken = 0

    def __aiter__(self):
        return self

    async def __anext__(self):
        await asyncio.sleep(0)
        self.taken += 1
        return [Event(token_ids=[self.taken], start=self.taken - 1)]

    async def aclose(self):
        pass


def test_a_reader_that_stops_leaves_the_events_in_the_flights():
    """While the merged stream is not read, its pumps take at most a few lists from each flight: the rest wait in
    the flight's bounded inbox (which fails a client that falls behind), not in an unbounded queue."""

    async def run():
        sources = [Source(), Source()]
        firsts = [await s.__anext__() for s in sources]
        stream = fanout.merged(sources, firsts, n=1)
        first = await stream.__anext__()
        await asyncio.sleep(0.2)  # the client does not read: thousands of turns of the loop
        taken = [s.taken for s in sources]
        rest = await stream.__anext__()
        await stream.aclose()
        return first, rest, taken

    first, rest, taken = asyncio.run(run())
    assert max(taken) <= 4, taken
    assert {e.choice for e in first + rest} == {0, 1}  # prompt p's choice c is choice p * n + c


def test_every_event_comes_through_in_its_flights_order():
    class Finite(Source):
        async def __anext__(self):
            if self.taken == 50:
                raise StopAsyncIteration
            return await super().__anext__()

    async def run():
        sources = [Finite(), Finite(), Finite()]
        firsts = [await s.__anext__() for s in sources]
        seen: dict[int, list[int]] = {0: [], 1: [], 2: []}
        stream = fanout.merged(sources, firsts, n=1)
        async for events in stream:
            for e in events:
                seen[e.choice] += e.token_ids
            if all(len(v) == 50 for v in seen.values()):
                break
        await stream.aclose()
        return seen

    assert asyncio.run(run()) == {c: list(range(1, 51)) for c in range(3)}

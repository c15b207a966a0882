"""Several prompts in one completions request: one flight per prompt (<request id>/p<p>), their event lists merged
into one stream, choice c of prompt p as choice p * n + c. Closing it closes every flight, aborting what still runs.
"""

import asyncio

from kvferry.services.gateway.flight import Event


async def start(streams: list) -> list:
    """Each flight's first events, the flights started together (routing errors surface here); on an error every
    flight is closed and the first error raised."""
    firsts = await asyncio.gather(*(stream.__anext__() for stream in streams), return_exceptions=True)
    error = next((f for f in firsts if isinstance(f, BaseException)), None)
    if error is not None:
        for stream in streams:
            await stream.aclose()
        raise error
    return firsts


async def merged(streams: list, firsts: list, n: int):
    # Bounded: a pump waits while its lists are unread, so a client that stops reading leaves the events in each
    # flight's own bounded inbox, which fails the request with a 408, rather than in here, without end.
    queue: asyncio.Queue = asyncio.Queue(maxsize=len(streams))

    async def pump(prompt: int, stream, events: list) -> None:
        try:
            while True:
                for event in events:
                    event.choice += prompt * n
                await queue.put(events)
                events = await stream.__anext__()
        except StopAsyncIteration:
            pass
        except Exception as exc:  # the reader waits on the queue: it must hear of it
            await queue.put([Event(error=f"prompt {prompt}: {exc}", error_code=500)])

    tasks = [asyncio.create_task(pump(p, s, f)) for p, (s, f) in enumerate(zip(streams, firsts))]
    try:
        while True:  # the reader stops once every choice is done, or at the first error
            events = await queue.get()
            while not queue.empty():
                events = events + queue.get_nowait()
            yield events
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for stream in streams:
            await stream.aclose()

"""Several prompts in one completions request: one flight per prompt, their events merged into one stream.

Prompt p's choice c becomes choice p * n + c. Closing the merged stream closes every flight, which
aborts whatever is still running on the workers.
"""
import asyncio


async def start(streams: list) -> list:
    """Each flight's first event (routing errors surface here); on an error the flights started are closed."""
    firsts = []
    try:
        for stream in streams:
            firsts.append(await stream.__anext__())
    except BaseException:
        for stream in streams:
            await stream.aclose()
        raise
    return firsts


async def merged(streams: list, firsts: list, n: int):
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(prompt: int, stream, event) -> None:
        try:
            while True:
                event.choice += prompt * n
                await queue.put(event)
                event = await stream.__anext__()
        except StopAsyncIteration:
            pass

    tasks = [asyncio.create_task(pump(p, s, f)) for p, (s, f) in enumerate(zip(streams, firsts))]
    try:
        while True:
            yield await queue.get()  # the reader stops once every choice is done, or at the first error
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for stream in streams:
            await stream.aclose()

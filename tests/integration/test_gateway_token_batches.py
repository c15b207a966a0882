"""A decode worker's TokenBatch at the real GatewayCore (raw DEALER sockets on loopback as the workers): each entry
reaches its own request, in order and once, whatever the batches repeat or reorder; an entry about a request the
gateway no longer runs is answered with an Abort; entries from a worker the requests are not assigned to are
dropped; a consumer behind by several messages gets them in one list."""

import asyncio

from kvferry.common import protocol as p
from kvferry.common.sampling import SamplingParams
from tests.integration.test_gateway_peers import FakeWorker, pair, run

GREEDY = SamplingParams(max_tokens=4, temperature=0)


async def started(core, prefill, request_id: str, first_token: int):
    """A request routed, its first token sent from prefill: its event lists (generate_batches)."""
    stream = core.generate_batches([1, 2, 3], GREEDY, request_id)
    pending = asyncio.ensure_future(stream.__anext__())
    _, rid = await prefill.next(p.PrefillRequest)
    assert rid == request_id
    prefill.send(p.FirstToken(first_token), rid)
    assert [e.token_ids for e in await asyncio.wait_for(pending, 10)] == [[first_token]]
    return stream


async def rest(stream) -> list[int]:
    return [t for events in [e async for e in stream] for e in events for t in e.token_ids]


def test_each_entry_reaches_its_request_in_order_and_once():
    async def test(core):
        prefill, decode = await pair(core)
        a, b = await started(core, prefill, "req-a", 10), await started(core, prefill, "req-b", 20)
        decode.send(p.TokenBatch([("req-b", p.Tokens([22], start=2)), ("req-a", p.Tokens([11], start=1))]))
        decode.send(p.TokenBatch([("req-a", p.Tokens([11, 12], start=1)), ("req-b", p.Tokens([21], start=1))]))
        done = p.TokenBatch([("req-a", p.Tokens([13], 1, start=3)), ("req-b", p.Tokens([23], 1, start=3))])
        decode.send(done)
        decode.send(done)  # a repeat (a resent step): nothing twice
        assert await rest(a) == [11, 12, 13] and await rest(b) == [21, 22, 23]
        assert core.num_forged == 0 and not core.flights

    run(test)


def test_an_entry_for_a_request_that_ended_is_aborted_and_the_others_delivered():
    async def test(core):
        prefill, decode = await pair(core)
        stream = await started(core, prefill, "req-a", 10)
        decode.send(p.TokenBatch([("gone", p.Tokens([5], start=7, attempt=2)), ("req-a", p.Tokens([11], 1, start=1))]))
        assert await rest(stream) == [11]
        abort, rid = await decode.next(p.Abort)
        assert (rid, abort.attempt, abort.choice) == ("gone", 2, -1)

    run(test)


def test_entries_from_a_worker_the_request_is_not_assigned_to_are_dropped():
    async def test(core):
        prefill, decode = await pair(core)
        other = FakeWorker(core, "decode-b", p.Role.DECODE)
        other.register()
        assert (await other.next(p.RegisterReply))[0].token_batches
        stream = await started(core, prefill, "req-a", 10)
        other.send(p.TokenBatch([("req-a", p.Tokens([99], 1, start=1))]))
        await asyncio.sleep(0.2)
        assert core.num_forged == 1
        decode.send(p.TokenBatch([("req-a", p.Tokens([11], 1, start=1))]))
        assert await rest(stream) == [11]

    run(test)


def test_a_consumer_behind_by_several_messages_gets_them_in_one_list():
    async def test(core):
        prefill, decode = await pair(core)
        stream = await started(core, prefill, "req-a", 10)
        for start in (1, 2, 3):
            decode.send(p.TokenBatch([("req-a", p.Tokens([10 + start], 1 if start == 3 else -1, start=start))]))
        while len(core.flights["req-a"].inbox.items) < 3:  # all three in, none taken yet
            await asyncio.sleep(0.01)
        events = await stream.__anext__()
        assert [e.token_ids for e in events] == [[11], [12], [13]]

    run(test)

"""A request's inbox at the gateway: messages taken in order, all at once; a wait that ends at a message or at its
bound; one timer kept across waits whose bound only moves later."""

import asyncio

from kvferry.services.gateway.inbox import Inbox


def run(test) -> None:
    asyncio.run(asyncio.wait_for(test(), 10))  # a hang guard only


def test_what_is_put_is_taken_in_order_all_at_once_up_to_its_bound():
    inbox = Inbox(3)
    assert [inbox.put(i) for i in range(4)] == [True, True, True, False]
    assert inbox.take() == [0, 1, 2] and inbox.take() == []
    assert inbox.put(3) and inbox.take() == [3]


def test_a_wait_ends_when_something_is_put():
    async def test():
        inbox = Inbox(8)
        loop = asyncio.get_running_loop()
        waiting = asyncio.ensure_future(inbox.wait(loop.time() + 3600))
        await asyncio.sleep(0.01)
        assert not waiting.done()
        inbox.put("tokens")
        await waiting
        assert inbox.take() == ["tokens"]
        inbox.close()

    run(test)


def test_a_wait_ends_at_its_bound_with_nothing_put():
    async def test():
        inbox = Inbox(8)
        await inbox.wait(asyncio.get_running_loop().time() + 0.05)
        assert inbox.take() == [] and inbox.timer is None

    run(test)


def test_a_later_bound_keeps_the_armed_timer_and_an_earlier_one_moves_it():
    async def test():
        inbox, now = Inbox(8), asyncio.get_running_loop().time()
        for until in (now + 100, now + 200):  # each wait ended by a message: the bound moved on, the timer stayed
            waiting = asyncio.ensure_future(inbox.wait(until))
            await asyncio.sleep(0)
            inbox.put(until)
            await waiting
        assert inbox.timer_at == now + 100 and inbox.take() == [now + 100, now + 200]
        first = inbox.timer
        waiting = asyncio.ensure_future(inbox.wait(now + 50))
        await asyncio.sleep(0)
        assert inbox.timer is not first and first.cancelled() and inbox.timer_at == now + 50
        inbox.wake()
        await waiting
        inbox.close()
        assert inbox.timer is None

    run(test)


def test_a_wait_with_something_there_already_returns_at_once():
    async def test():
        inbox = Inbox(8)
        inbox.put(1)
        await inbox.wait(0.0)
        assert inbox.timer is None and inbox.take() == [1]

    run(test)

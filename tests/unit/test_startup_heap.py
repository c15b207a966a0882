"""A started process freezes its start-up objects (common/startup_heap.py): the collector's full walks leave them
out from then on, and what serving allocates afterwards is still collected."""

import gc

from kvferry.common import startup_heap


def test_start_up_objects_leave_the_collectors_walks_and_later_garbage_is_still_collected():
    try:
        built = [[i] for i in range(10_000)]  # containers the collector tracks, as a loaded model's modules are
        frozen = startup_heap.freeze_startup_objects()
        assert frozen >= len(built)  # (frozen objects still go when their last reference does: the count may fall)
        walked = {id(o) for o in gc.get_objects()}
        assert not any(id(o) in walked for o in built)
        cycle = []
        cycle.append(cycle)  # garbage made while serving, reachable only from itself
        del cycle
        assert gc.collect() >= 1
    finally:
        gc.unfreeze()

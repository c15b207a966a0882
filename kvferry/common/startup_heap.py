"""The garbage collector once a process has started: what it built to serve (a model's modules and tensors' Python
objects, the tokenizer, the web app) is moved out of the collector's sight.

Python's full collection walks every tracked object, which in a worker with a model loaded takes tens of milliseconds
(docs/benchmarks.md) and comes now and then in the middle of a step, stalling every stream. Frozen, those objects are
never walked again: a full collection scans only what serving allocated since.
"""

import gc
import logging

log = logging.getLogger("kvferry.heap")


def freeze_startup_objects() -> int:
    """Collect once, then freeze what is left; returns how many objects were frozen. Call it when start-up is done,
    before serving."""
    gc.collect()
    gc.freeze()
    frozen = gc.get_freeze_count()
    log.debug("froze %d start-up objects out of the garbage collector's walks", frozen)
    return frozen

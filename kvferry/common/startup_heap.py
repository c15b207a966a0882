"""The garbage collector once a process has started: what it built to serve (a model's modules and tensors' Python
objects, the tokenizer, the web app), some 300,000 objects in a worker, is moved out of the collector's sight.

Python's full collection walks every tracked object. In a worker with the default model loaded it took 90-100 ms
(docs/benchmarks.md), and it comes now and then on its own, in the middle of a step: every stream on that worker
stalls for it. Frozen, those objects are never walked again; a full collection then scans only what serving has
allocated since, and takes about nothing.
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

"""The garbage collector once a process has started: what it built to serve (a model's modules and tensors' Python
objects, the tokenizer, the web app) is moved out of the collector's sight.

Python's full collection walks every tracked object, which in a worker with a model loaded takes tens of milliseconds
(docs/benchmarks.md) and comes now and then in the middle of a step, stalling every stream. Frozen, those objects are
never walked again: a full collection scans only what serving allocated since.

A gateway streaming tens of thousands of tokens a second allocates a few short-lived containers per token (a message's
maps, an event, a delta), which set off a collection of the youngest generation every few hundred tokens: at the
default thresholds the collector took a large share of its CPU (docs/benchmarks.md). Those objects die by their
reference counts (a collection finds a few cycles per request), so the gateway collects far less often.
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


GATEWAY_THRESHOLDS = (50_000, 20, 100)  # young objects before a collection, then collections before an older one's


def collect_less_often() -> None:
    """The gateway's thresholds (GATEWAY_THRESHOLDS) in place of Python's (700, 10, 10)."""
    gc.set_threshold(*GATEWAY_THRESHOLDS)

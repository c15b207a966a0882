"""The seam between the one engine core and a worker's role: what differs between prefill, decode and offline.

Every role drives the same `LLMEngine.step()`; what a role adds sits behind this interface, after vLLM V1's KV
connector, in two halves:
- scheduler side: which leading blocks of a prompt are already here (`matched_blocks`), its turn before each step
  and the requests whose blocks go (`get_finished`), a scheduled step (`on_scheduled`), and whether a finished
  sequence keeps its blocks (`request_finished`; `keeps_finished_blocks` says up front that a role keeps any);
- worker side: a group of layers of the step's KV is stored (`save_layers`), and received blocks are written into
  the cache (`load_blocks`).

The role's loop talks to its connector through the connector's own methods; the engine never does. A connector never
touches a socket: a hook with something to send queues it for the role's sender. The base class is the offline
engine's null connector: nothing kept, shipped or held.
"""

from __future__ import annotations

import typing

from kvferry.common.sequence import FinishReason

if typing.TYPE_CHECKING:
    from kvferry.common.engine import LLMEngine
    from kvferry.common.scheduler import StepPlan
    from kvferry.common.sequence import Sequence


class KVConnector:
    # Scheduler side: a finished sequence keeps its blocks until `LLMEngine.release` (a prefill worker ships them).
    keeps_finished_blocks: bool = False
    # Worker side: whether `save_layers` wants each layer group of a step as it lands (costs a hook per layer).
    wants_layer_events: bool = False

    def bind(self, engine: LLMEngine) -> None:
        """Called once by the engine that plugs this connector in, before its first step."""
        self.engine = engine

    # -- scheduler side ---------------------------------------------------------------------------------------
    def matched_blocks(self, block_hashes: list[bytes]) -> list[int]:
        """Of a prompt's leading full blocks (chained hashes), the ids of those already here, referenced for the
        caller; none for the null connector."""
        return []

    def get_finished(self) -> tuple[list[str], list[str]]:
        """Before each step (a step with nothing to schedule too): the connector's turn to act on what came in, and
        the requests whose kept blocks go since the last call: (released: their transfer is done, so the engine
        releases them; failed: ended by the connector, so the engine aborts them wherever they are)."""
        return [], []

    def on_scheduled(self, plan: StepPlan) -> None:
        """A step was scheduled and is about to compute."""

    def request_finished(self, seq: Sequence) -> bool:
        """A sequence finished in a step: whether its blocks stay (kept in the engine's index, Sequence.kept) until
        `LLMEngine.release`. Only a connector with keeps_finished_blocks may say yes; an aborted one never keeps."""
        return self.keeps_finished_blocks and seq.finish_reason != FinishReason.ABORT

    # -- worker side ------------------------------------------------------------------------------------------
    def save_layers(self, plan: StepPlan, layers: tuple[int, int]) -> None:
        """Layers [lo, hi) of the step's K/V are in the cache (only with wants_layer_events, and eager steps)."""

    def load_blocks(self, block_ids: list[int], kv, layer_start: int) -> None:
        """Write received K and V ([layers, blocks, block_size, 2, kvh, d]) of layers from layer_start into blocks
        that the engine allocated for a transfer."""
        self.engine.runner.write_blocks(block_ids, kv, (layer_start, layer_start + kv.shape[0]))

"""A simulated decode worker's admission of transferred KV: the real ReceivedKV, on a stand-in for the engine.

ReceivedKV (common/received_kv.py) is the decode worker's own code for a transfer: `begin_prefilled` checks and
allocates the blocks when the first layer group comes, `finish_prefilled` admits the choices (sharing the prompt's
full blocks, a copy of its partial last block each) when the last one is in. It is a mixin of LLMEngine; this class
gives it what it reads of the engine, with nothing to check (the capture's server checked the requests) and no
tensors to copy.
"""

import sys
from types import SimpleNamespace

from kvferry.common.block_manager import BlockManager
from kvferry.common.received_kv import ReceivedKV
from kvferry.common.scheduler import Scheduler


class SimReceivedKV(ReceivedKV):
    vocab_size = sys.maxsize  # captured token ids are the model's own
    runner = SimpleNamespace(copy_block=lambda src, dst: None)  # the copy of a partial block: no data here

    def __init__(self, scheduler: Scheduler):
        self.scheduler = scheduler
        self.block_manager: BlockManager = scheduler.block_manager
        self.max_model_len = scheduler.max_model_len
        self._live: dict = {}  # request id -> its sequence, as the engine keeps them

    def validate_prompt(self, token_ids) -> None:
        """Prompts longer than the worker takes are refused before they are routed (Simulator._arrive)."""

    def validate_params(self, params) -> None:
        pass

    def constraint_state(self, params, token_ids, grammar=None):
        return None  # constraints change which tokens come, not how many: the capture fixed that

    def sequence(self, request_id):
        return self._live[request_id]

    def forget(self, request_id) -> None:
        self._live.pop(request_id, None)

    def hold_prefix(self, block_hashes: list[bytes]) -> list[int]:
        """LLMEngine.hold_prefix: the leading cached blocks holding these hashes, referenced for the caller (a
        KVQuery's answer)."""
        bm = self.block_manager
        ids = bm.match_prefix(block_hashes[: bm.num_blocks_for(self.max_model_len)])
        bm.take_cached(ids)
        return ids

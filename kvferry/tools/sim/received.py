"""A simulated decode worker's admission of transferred KV: the real common/received_kv.py (`reserve` when the
first layer group comes, `admit_choices` when the last is in) on a stand-in for the engine, with nothing to check
(the capture's server checked the requests) and no tensors to copy.
"""

import sys
from types import SimpleNamespace

from kvferry.common import received_kv
from kvferry.common.block_manager import BlockManager
from kvferry.common.scheduler import Scheduler


class SimReceivedKV:
    vocab_size = sys.maxsize  # captured token ids are the model's own
    runner = SimpleNamespace(copy_block=lambda src, dst: None)  # the copy of a partial block: no data here

    def __init__(self, scheduler: Scheduler):
        self.scheduler = scheduler
        self.block_manager: BlockManager = scheduler.block_manager
        self.max_model_len = scheduler.max_model_len
        self._live: dict = {}  # request id -> its sequence, as the engine keeps them (LLMEngine._live)

    reserve = received_kv.reserve  # as DecodeConnector.receive_kv calls it, on this stand-in
    admit_prefilled = received_kv.admit_choices  # as LLMEngine binds it

    def validate_prompt(self, token_ids) -> None:
        """Too long a prompt is refused before it is routed (Simulator._arrive)."""

    def validate_params(self, params) -> None:
        pass

    def has_request(self, request_id) -> bool:
        return request_id in self._live

    def constraint_state(self, params, token_ids, grammar=None):
        return None  # constraints change which tokens come, not how many: the capture fixed that

    def sequence(self, request_id):
        return self._live[request_id]

    def forget(self, request_id) -> None:
        self._live.pop(request_id, None)

    def hold_prefix(self, block_hashes: list[bytes]) -> list[int]:
        """LLMEngine.hold_prefix: the leading cached blocks of these hashes, referenced for the caller."""
        bm = self.block_manager
        ids = bm.match_prefix(block_hashes[: bm.num_blocks_for(self.max_model_len)])
        bm.take_cached(ids)
        return ids

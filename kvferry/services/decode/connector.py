"""The decode side of the KV connector: which of a prompt's leading blocks are already here (held for its
transfer, which then leaves them out), and placing received blocks (the base class writes them into the cache).
Everything else a decode worker runs is the plain engine step."""

from kvferry.common.kv_connector import KVConnector


class DecodeConnector(KVConnector):
    def matched_blocks(self, block_hashes: list[bytes]) -> list[int]:
        return self.engine.hold_prefix(block_hashes)

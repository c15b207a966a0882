"""Content hashes of full KV blocks, chained: a block's hash covers its tokens and every token before it.

Two blocks with the same hash therefore hold the same KV (same model, same block size), whichever
process or machine computed them. Python's hash() is salted per process, so BLAKE2b it is; 16 bytes
make a collision (which would serve another prompt's KV) practically impossible.
"""

import hashlib
import struct

HASH_BYTES = 16
ROOT = b"\x00" * HASH_BYTES  # the parent of a sequence's first block


def hash_block(parent: bytes, token_ids) -> bytes:
    data = struct.pack(f"<{len(token_ids)}q", *token_ids)
    return hashlib.blake2b(parent + data, digest_size=HASH_BYTES).digest()


def block_hashes(token_ids: list[int], block_size: int, start: list[bytes] = ()) -> list[bytes]:
    """Hashes of every full block of token_ids. start: hashes already known for its first blocks."""
    hashes = list(start)
    for i in range(len(hashes), len(token_ids) // block_size):
        hashes.append(hash_block(hashes[-1] if hashes else ROOT, token_ids[i * block_size : (i + 1) * block_size]))
    return hashes

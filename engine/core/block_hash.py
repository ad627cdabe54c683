"""Hash chain for prefix caching (torch-free).

The hash of full block ``i`` of a request covers everything the KV in that block
depends on: the hash of block ``i - 1`` (so equal hashes mean equal prefixes, not
just equal blocks), the block's token ids, and extra keys. The first block also
carries the request's ``cache_salt``, which therefore separates whole chains: two
tenants with different salts never share a block. Every block of a request run under a
LoRA adapter carries the adapter's key (its name and checkpoint digest, as vLLM puts the
adapter name in each block's extra keys), so the same prompt under two adapters, or under
an adapter and the base model, never shares KV. The chain's root is derived from a
configurable seed plus a fingerprint of everything that changes the bytes in a block
(model, KV dtype, block size), so that hashes stay stable across restarts (the disk
and LMCache tiers rely on that) yet never match KV of another model or layout.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence

BlockHash = bytes


def root_hash(seed: str | None, fingerprint: str = "") -> BlockHash:
    """The parent hash of a chain's first block."""
    return hashlib.sha256(f"kvpilot-prefix-v1|{seed or ''}|{fingerprint}".encode()).digest()


def hash_block_tokens(
    parent: BlockHash,
    token_ids: Sequence[int],
    extra_keys: tuple[str, ...] = (),
) -> BlockHash:
    """sha256(parent || len || token ids as int64 || extra keys)."""
    h = hashlib.sha256(parent)
    h.update(len(token_ids).to_bytes(4, "little"))
    h.update(array("q", token_ids).tobytes())
    for key in extra_keys:
        data = key.encode()
        h.update(len(data).to_bytes(4, "little"))
        h.update(data)
    return h.digest()


def extend_block_hashes(
    block_hashes: list[BlockHash],
    token_ids: Sequence[int],
    block_size: int,
    root: BlockHash,
    cache_salt: str | None = None,
    *,
    first_token: int = 0,
    lora_key: str | None = None,
) -> None:
    """Append the hashes of newly full blocks of ``token_ids`` to ``block_hashes`` in place.

    ``token_ids[0]`` is the sequence's token number ``first_token`` (a block boundary no
    later than the first unhashed block), so a caller can pass just the tokens of the
    blocks still to hash: hashing a growing sequence then costs O(new tokens), not
    O(sequence) per filled block. ``lora_key``: the adapter's extra key for every block
    (``LoRARequest.hash_extra_key``), None for the base model.
    """
    start = len(block_hashes)
    if first_token % block_size or first_token > start * block_size:
        raise ValueError(f"first_token={first_token} must be a block boundary at or before "
                         f"the first unhashed block ({start})")
    num_full = (first_token + len(token_ids)) // block_size
    for i in range(start, num_full):
        parent = block_hashes[i - 1] if i > 0 else root
        extra = ("salt:" + cache_salt,) if (i == 0 and cache_salt) else ()
        if lora_key is not None:
            extra += (lora_key,)
        lo = i * block_size - first_token
        block_hashes.append(hash_block_tokens(parent, token_ids[lo:lo + block_size], extra))

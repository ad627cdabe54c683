"""Incremental prefix hashing: the same chain as hashing the whole sequence at once, at
O(new tokens) per update instead of O(sequence) each time a block fills."""

from __future__ import annotations

import random

import pytest

from kvpilot.engine.core.block_hash import extend_block_hashes, hash_block_tokens, root_hash
from kvpilot.engine.core.kv_cache_manager import KVCacheManager
from kvpilot.engine.core.request import Request
from kvpilot.engine.sampling_params import SamplingParams

BLOCK = 16


def _chain(tokens, root, salt=None):
    """Oracle: the definition, block by block from the start."""
    hashes = []
    for i in range(len(tokens) // BLOCK):
        extra = ("salt:" + salt,) if (i == 0 and salt) else ()
        hashes.append(hash_block_tokens(hashes[-1] if hashes else root, tokens[i * BLOCK:(i + 1) * BLOCK], extra))
    return hashes


@pytest.mark.parametrize("salt", [None, "tenant"])
def test_token_by_token_updates_give_the_whole_sequence_chain_and_read_only_new_tokens(salt, monkeypatch):
    rng = random.Random(0)
    root = root_hash("seed", "model")
    kv = KVCacheManager(8, BLOCK, enable_caching=True, hash_root=root)
    prompt = [rng.randrange(1000) for _ in range(1000)]
    request = Request("r", prompt, SamplingParams(max_tokens=300), cache_salt=salt, max_tokens=300)
    read = []
    real_slice = Request.token_ids_slice
    monkeypatch.setattr(Request, "token_ids_slice",
                        lambda self, a, b: read.append(b - a) or real_slice(self, a, b))
    kv.update_block_hashes(request)               # the prompt at admission
    for _ in range(300):                          # then one output token at a time
        request.output_token_ids.append(rng.randrange(1000))
        kv.update_block_hashes(request)
    monkeypatch.undo()
    assert request.block_hashes == _chain(prompt + request.output_token_ids, root, salt)
    assert sum(read) == len(request.block_hashes) * BLOCK   # every token read once


def test_extend_from_a_block_boundary():
    root = root_hash(None)
    tokens = list(range(100))
    hashes = []
    extend_block_hashes(hashes, tokens[:40], BLOCK, root)
    extend_block_hashes(hashes, tokens[32:], BLOCK, root, first_token=32)
    assert hashes == _chain(tokens, root)
    with pytest.raises(ValueError, match="block boundary"):
        extend_block_hashes(hashes, tokens[40:], BLOCK, root, first_token=40)
    with pytest.raises(ValueError, match="block boundary"):
        extend_block_hashes([], tokens[16:], BLOCK, root, first_token=16)   # skips block 0

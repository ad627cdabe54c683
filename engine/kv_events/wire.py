"""The events on the wire: vLLM's KV-event schema in its map form.

A message is three ZeroMQ frames: ``[topic, sequence number (8 bytes, big-endian),
payload]``. The payload is a msgpack array ``[ts, events, data_parallel_rank]`` (the
batch stays positional, as vLLM's ``EventBatch`` is ``array_like``); each event is a
msgpack *map* keyed by field name with the class name under ``"type"`` — vLLM's encoding
since it dropped ``array_like`` from its event structs (vllm-project/vllm#42892, 2026),
where older releases sent each event as a positional array. Fields left at their
default (None) after ``extra_keys`` are omitted, as vLLM's ``omit_defaults`` does;
``lora_id`` (deprecated there, always None here), ``medium`` and ``lora_name`` have no
default and are always sent.

Block hashes are ints: the low 64 bits of kvpilot's sha256 block digest read
big-endian, which is what vLLM publishes by default (``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES``).
"""

from __future__ import annotations

from typing import Any

import msgspec

HASH_BYTES = 8   # the low 64 bits of the digest


def external_hash(block_hash: bytes) -> int:
    """vLLM's external form of a block hash: ``int.from_bytes(digest, "big") & (2**64 - 1)``."""
    return int.from_bytes(block_hash[-HASH_BYTES:], "big")


class KVCacheEvent(msgspec.Struct, tag=True, omit_defaults=True, gc=False):
    """Base of the three events; ``tag=True`` writes the class name under ``"type"``."""


class BlockStored(KVCacheEvent):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[int]
    medium: str | None
    group_idx: int | None = None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]
    data_parallel_rank: int | None = None

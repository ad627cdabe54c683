"""vLLM's KV-event structs, written here field for field from vLLM's source (the oracle).

From ``vllm/distributed/kv_events.py`` after vllm-project/vllm#42892 ("Switch event structs
from array to map encoding", merged 2026-06): ``KVCacheEvent`` lost ``array_like=True``
(each event is a map keyed by field name, the class name under ``"type"``) while
``EventBatch`` stayed ``array_like`` (``[ts, events, data_parallel_rank]``), as vLLM's
router decodes it (``src/kv_index/wire.rs``: "a positional array [ts, events, (rank)?]").
``ExternalBlockHash`` is ``bytes | int`` (``vllm/v1/core/kv_cache_utils.py``). Later
upstream additions (``locality``, ``ownership``, ``session_id``, ``event_version``) are
optional with a None default, so a batch without them decodes the same under either.

Nothing here is imported from kvpilot: these tests decode kvpilot's payloads with vLLM's
schema, not with kvpilot's own.
"""

from __future__ import annotations

from typing import Any

import msgspec

ExternalBlockHash = bytes | int


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    """Base class for all KV cache-related events"""


MEDIUM_GPU = "GPU"


class BlockStored(KVCacheEvent):
    block_hashes: list[ExternalBlockHash]
    parent_block_hash: ExternalBlockHash | None
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
    block_hashes: list[ExternalBlockHash]
    medium: str | None
    group_idx: int | None = None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


EVENT_TYPES = {cls.__name__: cls for cls in (BlockStored, BlockRemoved, AllBlocksCleared)}
DECODER = msgspec.msgpack.Decoder(KVEventBatch)


def field_names(cls) -> set[str]:
    return {f.name for f in msgspec.structs.fields(cls)}


def required_fields(cls) -> set[str]:
    return {f.name for f in msgspec.structs.fields(cls) if f.required}


def decode_strict(payload: bytes) -> KVEventBatch:
    """Decodes with vLLM's structs and checks every event map's keys against vLLM's fields.

    msgspec ignores unknown keys and fills missing optional fields with None, so a renamed
    field would decode silently: this raises AssertionError for any key vLLM does not
    define and for a missing required one (the tests check the optional fields' values).
    The batch must be the positional array.
    """
    raw = msgspec.msgpack.decode(payload)
    assert isinstance(raw, list) and len(raw) == 3, f"the batch is not [ts, events, rank]: {raw!r}"
    batch = DECODER.decode(payload)
    for raw_event, event in zip(raw[1], batch.events, strict=True):
        assert isinstance(raw_event, dict), f"an event is not a map: {raw_event!r}"
        cls = EVENT_TYPES[raw_event["type"]]
        keys = set(raw_event) - {"type"}
        unknown = keys - field_names(cls)
        assert not unknown, f"{cls.__name__} carries fields vLLM does not define: {sorted(unknown)}"
        missing = required_fields(cls) - keys
        assert not missing, f"{cls.__name__} lacks vLLM's required fields {sorted(missing)}"
        assert type(event) is cls
    return batch

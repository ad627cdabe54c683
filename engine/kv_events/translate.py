"""Records of a step -> vLLM events, on the publisher's thread.

The translator keeps what the published events have announced, per (KV cache group,
medium): the set of blocks a subscriber holds if it applied every event so far. That
view is what lets it

- announce a block put into host memory or on disk (known by hash alone) with the tokens
  and parent the device pool announced it with earlier (``_info``; blocks that left every
  tier keep theirs in a bounded most-recent map, since a save can follow the device's
  eviction in the same step);
- drop removals of blocks it never announced (disk files of an earlier run, a save whose
  tokens were unknown);
- keep ``AllBlocksCleared`` true: consumers forget a worker's blocks in every tier on it,
  while kvpilot's prefix-cache reset clears only the device pool, so the blocks still in
  host memory and on disk are announced again right after it, parents first.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import NamedTuple

from kvpilot.engine.core.kv_event_log import CLEARED, MEDIUM_GPU, OFFLOADED, REMOVED, STORED
from kvpilot.engine.kv_events.wire import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVCacheEvent,
    external_hash,
)

MAX_RECENT_INFOS = 65_536


class BlockInfo(NamedTuple):
    parent: bytes | None
    token_ids: list[int]
    extra_keys: tuple | None
    position: int            # the block's index in its chain (parents come first)
    lora_name: str | None    # the adapter it was computed under (None: the base model)


class EventTranslator:
    """Turns ``KVEventLog`` records into events and follows what they announced.

    Args:
        block_size: tokens per block.
        group_specs: per KV cache group index, (kv_cache_spec_kind, sliding window or None).
    """

    def __init__(self, block_size: int, group_specs: dict[int, tuple[str, int | None]]) -> None:
        self.block_size = block_size
        self.group_specs = dict(group_specs)
        self.view: dict[tuple[int, str], set[bytes]] = {}
        self._info: dict[bytes, BlockInfo] = {}
        self._recent: OrderedDict[bytes, BlockInfo] = OrderedDict()
        self.num_unannounced = 0   # lower-tier blocks whose tokens were unknown

    def translate(self, records: list[tuple]) -> list[KVCacheEvent]:
        events: list[KVCacheEvent] = []
        previous = None
        for record in records:
            kind = record[0]
            if kind == STORED:
                self._stored(events, *record[1:])
            elif kind == OFFLOADED:
                self._offloaded(events, *record[1:])
            elif kind == REMOVED:
                self._removed(events, *record[1:])
            elif kind == CLEARED:
                if previous != CLEARED:     # a hybrid model's pools reset together: one clear
                    self._cleared(events)
            else:
                raise ValueError(f"unknown KV event record {kind!r}")
            previous = kind
        return events

    # ---- records --------------------------------------------------------------
    def _stored(self, events, group: int, medium: str, first: int, parent: bytes | None,
                hashes: list[bytes], token_ids: list[int], extra_keys: list,
                lora_name: str | None) -> None:
        held = self.view.setdefault((group, medium), set())
        bs = self.block_size
        for i, block_hash in enumerate(hashes):
            held.add(block_hash)
            self._info[block_hash] = BlockInfo(hashes[i - 1] if i else parent,
                                               token_ids[i * bs:(i + 1) * bs], extra_keys[i], first + i,
                                               lora_name)
            self._recent.pop(block_hash, None)
        events.append(self._event(group, medium, parent, hashes, token_ids, extra_keys, lora_name))

    def _offloaded(self, events, medium: str, block_hash: bytes) -> None:
        held = self.view.setdefault((0, medium), set())
        if block_hash in held:
            return
        info = self._lookup(block_hash)
        if info is None:
            self.num_unannounced += 1
            return
        held.add(block_hash)
        self._info.setdefault(block_hash, info)
        self._recent.pop(block_hash, None)
        last = events[-1] if events else None
        # Extend the previous event when this block continues its chain in the same tier.
        if (isinstance(last, BlockStored) and last.medium == medium and last.group_idx == 0
                and last.lora_name == info.lora_name
                and info.parent is not None and last.block_hashes[-1] == external_hash(info.parent)):
            last.block_hashes.append(external_hash(block_hash))
            last.token_ids.extend(info.token_ids)
            last.extra_keys.append(info.extra_keys)
            return
        events.append(self._event(0, medium, info.parent, [block_hash], list(info.token_ids),
                                  [info.extra_keys], info.lora_name))

    def _removed(self, events, group: int, medium: str, block_hash: bytes) -> None:
        held = self.view.get((group, medium))
        if held is None or block_hash not in held:
            return
        held.discard(block_hash)
        self._forget_if_gone(block_hash)
        last = events[-1] if events else None
        if isinstance(last, BlockRemoved) and last.medium == medium and last.group_idx == group:
            last.block_hashes.append(external_hash(block_hash))
        else:
            events.append(BlockRemoved(block_hashes=[external_hash(block_hash)], medium=medium,
                                       group_idx=group))

    def _cleared(self, events) -> None:
        events.append(AllBlocksCleared())
        for key in [k for k in self.view if k[1] == MEDIUM_GPU]:
            for block_hash in self.view.pop(key):
                self._forget_if_gone(block_hash)
        for (group, medium), held in sorted(self.view.items()):
            for block_hash in sorted(held, key=lambda h: self._info[h].position):
                info = self._info[block_hash]
                events.append(self._event(group, medium, info.parent, [block_hash],
                                          list(info.token_ids), [info.extra_keys], info.lora_name))

    # ---- helpers --------------------------------------------------------------
    def _event(self, group: int, medium: str, parent: bytes | None, hashes: list[bytes],
               token_ids: list[int], extra_keys: list, lora_name: str | None) -> BlockStored:
        kind, window = self.group_specs.get(group, (None, None))
        return BlockStored(
            block_hashes=[external_hash(h) for h in hashes],
            parent_block_hash=None if parent is None else external_hash(parent),
            token_ids=token_ids, block_size=self.block_size, lora_id=None, medium=medium,
            lora_name=lora_name, extra_keys=list(extra_keys), group_idx=group,
            kv_cache_spec_kind=kind, kv_cache_spec_sliding_window=window)

    def _lookup(self, block_hash: bytes) -> BlockInfo | None:
        info = self._info.get(block_hash)
        return info if info is not None else self._recent.get(block_hash)

    def _forget_if_gone(self, block_hash: bytes) -> None:
        """Moves a block's info to the recent map once no tier holds it."""
        if any(block_hash in held for held in self.view.values()):
            return
        info = self._info.pop(block_hash, None)
        if info is not None:
            self._recent[block_hash] = info
            if len(self._recent) > MAX_RECENT_INFOS:
                self._recent.popitem(last=False)

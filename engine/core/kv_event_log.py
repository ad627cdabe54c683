"""What the KV cache tiers did since the last step, as plain records (torch-free).

The block pool, the KV cache manager and the offload tiers append one record per change
here (a list append, nothing else, on the step's path); the engine hands the records of
each step to the KV-event publisher (``kvpilot.engine.kv_events``), which turns them into
vLLM's ``BlockStored`` / ``BlockRemoved`` / ``AllBlocksCleared`` events on its own thread.

Records, all tuples whose first item is the kind:

- ``(STORED, group_idx, medium, first_index, parent_hash, block_hashes, token_ids,
  extra_keys, lora_name)``: full blocks registered under their hashes, one run of a
  request's chain from block ``first_index`` on (``parent_hash`` is the hash of the block
  before the run, None for the chain's first block; ``token_ids`` the run's tokens;
  ``extra_keys`` one tuple or None per block, vLLM's form; ``lora_name`` the request's
  adapter, None for the base model).
- ``(OFFLOADED, medium, block_hash)``: a block put into a lower tier (host memory, disk),
  known by hash only; the publisher fills in its tokens from the device's earlier record.
- ``(REMOVED, group_idx, medium, block_hash)``: a block's hash left that tier.
- ``(CLEARED,)``: the device pool forgot every cached block (prefix-cache reset).

Hashes stay kvpilot's sha256 digests here; the publisher converts them to vLLM's
external form. Records from another thread (the disk tier's writer) go through
``record_threadsafe``; the engine's own thread appends with ``append`` and is the only
one that calls ``take``.
"""

from __future__ import annotations

import threading

STORED, OFFLOADED, REMOVED, CLEARED = "stored", "offloaded", "removed", "cleared"
# vLLM's names of the tiers a block can be in (``medium``); the device pool is "GPU" on
# every device, as vLLM names it.
MEDIUM_GPU, MEDIUM_CPU, MEDIUM_DISK = "GPU", "CPU", "DISK"
# vLLM's KV cache spec kinds (``kv_cache_spec_kind``) of kvpilot's two kinds of group.
FULL_ATTENTION, SLIDING_WINDOW = "full_attention", "sliding_window"


class KVEventLog:
    """An append-only list of records, taken once per step.

    Args:
        group_specs: per KV cache group index, its (kind, sliding window or None).
    """

    def __init__(self, group_specs: dict[int, tuple[str, int | None]]) -> None:
        self.group_specs = dict(group_specs)
        self._records: list[tuple] = []
        self.append = self._records.append
        self._lock = threading.Lock()

    def record_threadsafe(self, record: tuple) -> None:
        with self._lock:
            self._records.append(record)

    def take(self) -> list[tuple]:
        """The records since the last call, oldest first (empty list when nothing changed)."""
        if not self._records:
            return []
        with self._lock:
            records, self._records = self._records, []
            self.append = self._records.append
        return records

"""The disk tier: one file per KV block, written atomically, checksummed, LRU by size.

File ``<root>/<first 2 hex digits>/<block hash hex>.kvb``: a 72-byte header (magic,
format version, header size, payload size, the block hash, the KV-layout id and a
blake2b-128 digest of the payload), then the payload bytes. A file is written under a
temporary name and renamed into place, so a reader never sees a half-written block
under the final name. A file that is truncated, has trailing bytes, a bad header, a
different block hash or layout, or a digest mismatch is a miss: it is deleted and
logged at WARNING, never served.

Writes run on one background thread, off the engine step; a block queued for writing
is served from memory until its file exists. Any OSError while writing (ENOSPC, a
quota, a read-only or failing volume) stops the tier from taking new blocks, with one
WARNING: offload carries on with the host tier; files already written are still read.
``writable`` and ``num_corrupt`` (files dropped as corrupt) are exported as metrics.

Block hashes are stable across restarts, so a new engine on the same directory finds
the blocks of the previous one: the index is rebuilt from the file names at start-up,
oldest modification time first. Engines may share a directory (pods on one volume, with
the same PIDs in their containers): each temporary name is unique (``<block>.kvb.<random
hex>.tmp``), a start-up deletes only temporaries older than ``STALE_TMP_SECONDS`` (left
by a crash, never a live peer's write in progress), a file a peer evicted is a miss, and
a temporary that vanished before its rename loses that block only, not the tier.
"""

from __future__ import annotations

import hashlib
import logging
import os
import struct
import threading
import time
import uuid
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch

from kvpilot.engine.core.block_hash import BlockHash
from kvpilot.engine.core.kv_event_log import MEDIUM_DISK, OFFLOADED, REMOVED, KVEventLog

logger = logging.getLogger(__name__)

MAGIC = b"KVPB"
FORMAT_VERSION = 1
SUFFIX = ".kvb"
TMP_SUFFIX = ".tmp"
# A block file is written in well under a second: a temporary this old was left by a crash.
STALE_TMP_SECONDS = 3600.0
# magic, version, header size, payload bytes, block hash, layout id, payload digest
HEADER = struct.Struct("<4sHHQ32s8s16s")


class CorruptBlockError(Exception):
    """A block file that must not be served."""


def payload_digest(data: np.ndarray) -> bytes:
    return hashlib.blake2b(memoryview(data), digest_size=16).digest()


class DiskStore:
    """Block payloads in files under ``root``, at most ``capacity_bytes`` of them.

    Args:
        root: the tier's directory (created if missing).
        capacity_bytes: most bytes of block files kept; least recently used go first.
        bytes_per_block: payload size of one block.
        layout_id: 8 bytes naming the KV layout (dtypes, shapes); a file written for
            another layout is never served.
    """

    def __init__(self, root: str | os.PathLike, capacity_bytes: int, bytes_per_block: int,
                 layout_id: bytes) -> None:
        if len(layout_id) != 8:
            raise ValueError("layout_id must be 8 bytes")
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.capacity_bytes = capacity_bytes
        self.bytes_per_block = bytes_per_block
        self.layout_id = layout_id
        self.writable = True
        self.bytes_written = 0   # payload bytes, cumulative, counted once a file is in place
        self.bytes_read = 0      # payload bytes read back from files
        self.num_corrupt = 0
        self._lock = threading.Lock()
        self._index: OrderedDict[BlockHash, int] = OrderedDict()   # hash -> file size, LRU first
        self._used = 0
        self._pending: dict[BlockHash, torch.Tensor] = {}
        self._writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kv-disk-writer")
        self._closed = False
        # KV events (None = off): blocks whose file is in place, and files dropped. Set
        # after the start-up scan, so blocks of earlier runs are not announced (their
        # tokens are not known).
        self.events: KVEventLog | None = None
        self._scan()

    # ---- bookkeeping --------------------------------------------------------
    @property
    def used_bytes(self) -> int:
        return self._used

    def __len__(self) -> int:
        return len(self._index)

    def __contains__(self, block_hash: BlockHash) -> bool:
        with self._lock:
            return block_hash in self._pending or block_hash in self._index

    def path(self, block_hash: BlockHash) -> Path:
        name = block_hash.hex()
        return self.root / name[:2] / (name + SUFFIX)

    def _scan(self) -> None:
        found = []
        stale_before = time.time() - STALE_TMP_SECONDS
        for sub in os.scandir(self.root):
            if not sub.is_dir() or len(sub.name) != 2:
                continue          # not a block directory (lost+found, ...)
            try:
                entries = list(os.scandir(sub.path))
            except OSError:
                continue
            for entry in entries:
                if entry.name.endswith(TMP_SUFFIX):
                    self._drop_if_stale(entry, stale_before)
                    continue
                if not entry.name.endswith(SUFFIX):
                    continue
                try:
                    block_hash = bytes.fromhex(entry.name[:-len(SUFFIX)])
                    stat = entry.stat()
                except (ValueError, OSError):
                    continue
                found.append((stat.st_mtime, block_hash, stat.st_size))
        found.sort()
        with self._lock:
            for _, block_hash, size in found:
                self._index[block_hash] = size
                self._used += size
            self._evict_locked()
        if found:
            logger.info("KV offload disk tier %s: %d block files (%.1f MiB) from earlier runs",
                        self.root, len(self._index), self._used / 2**20)

    @staticmethod
    def _drop_if_stale(entry: os.DirEntry, stale_before: float) -> None:
        """Delete a temporary left by a crash mid-write; a peer's write in progress is younger."""
        try:
            if entry.stat().st_mtime < stale_before:
                Path(entry.path).unlink(missing_ok=True)
        except OSError:
            pass   # gone already (its writer renamed it), or not ours to delete

    def _evict_locked(self) -> None:
        while self._used > self.capacity_bytes and self._index:
            block_hash, size = self._index.popitem(last=False)
            self._used -= size
            self.path(block_hash).unlink(missing_ok=True)
            if self.events is not None:
                self.events.record_threadsafe((REMOVED, 0, MEDIUM_DISK, block_hash))

    def _forget(self, block_hash: BlockHash, delete: bool) -> None:
        with self._lock:
            size = self._index.pop(block_hash, None)
            if size is not None:
                self._used -= size
                if self.events is not None:
                    self.events.record_threadsafe((REMOVED, 0, MEDIUM_DISK, block_hash))
            if delete:
                self.path(block_hash).unlink(missing_ok=True)

    # ---- writing ------------------------------------------------------------
    def submit(self, block_hash: BlockHash, payload: torch.Tensor, ready=None) -> bool:
        """Queues a block for writing; False if it is already stored or the tier is off.

        ``ready``: an event (with ``synchronize()``) to wait for before reading the
        payload, when it is still being copied from the device.
        """
        if payload.numel() != self.bytes_per_block:
            raise ValueError(f"payload of {payload.numel()} bytes, expected {self.bytes_per_block}")
        with self._lock:
            if (self._closed or not self.writable or block_hash in self._pending
                    or block_hash in self._index):
                return False
            self._pending[block_hash] = payload
        self._writer.submit(self._write, block_hash, payload, ready)
        return True

    def _write(self, block_hash: BlockHash, payload: torch.Tensor, ready) -> None:
        final = self.path(block_hash)
        # unique per write: a PID is often the same in every container sharing the volume
        tmp = final.with_name(f"{final.name}.{uuid.uuid4().hex}{TMP_SUFFIX}")
        try:
            if not self.writable:
                return
            if ready is not None:
                ready.synchronize()
            data = payload.numpy()
            header = HEADER.pack(MAGIC, FORMAT_VERSION, HEADER.size, data.nbytes, block_hash,
                                 self.layout_id, payload_digest(data))
            final.parent.mkdir(exist_ok=True)
            with open(tmp, "wb") as f:
                f.write(header)
                f.write(memoryview(data))
            os.replace(tmp, final)
        except FileNotFoundError as exc:
            # The temporary (or its folder) went away under us: someone cleaned the shared
            # directory. This block is lost, the volume is fine: keep writing.
            logger.warning("KV offload disk tier %s: a block file vanished while being written (%s); "
                           "the block is not kept on disk", self.root, exc)
            return
        except OSError as exc:
            self._stop_writing(exc)
            tmp.unlink(missing_ok=True)
            return
        finally:
            with self._lock:
                self._pending.pop(block_hash, None)
        size = HEADER.size + data.nbytes
        with self._lock:
            self._index[block_hash] = size
            self._used += size
            if self.events is not None:
                self.events.record_threadsafe((OFFLOADED, MEDIUM_DISK, block_hash))
            self._evict_locked()
        self.bytes_written += data.nbytes

    def _stop_writing(self, exc: OSError) -> None:
        if self.writable:
            self.writable = False
            logger.warning("KV offload disk tier %s: writing a block failed (%s); the disk tier "
                           "takes no new blocks from now on and offload continues with the CPU "
                           "tier only. Free space on the volume or raise its size, then restart.",
                           self.root, exc)

    def flush(self) -> None:
        """Waits until every queued block is written (or dropped)."""
        if not self._closed:
            self._writer.submit(lambda: None).result()

    def close(self) -> None:
        if not self._closed:
            self.flush()
            self._closed = True
            self._writer.shutdown(wait=True)

    # ---- reading ------------------------------------------------------------
    def read(self, block_hash: BlockHash) -> tuple[torch.Tensor, bool] | None:
        """(payload, whether it came from a file) or None for a miss.

        A block still queued for writing is returned from memory.
        """
        with self._lock:
            payload = self._pending.get(block_hash)
            if payload is not None:
                return payload, False
            if block_hash not in self._index:
                return None
            self._index.move_to_end(block_hash)
        try:
            payload = self._read_file(block_hash)
        except FileNotFoundError:
            self._forget(block_hash, delete=False)
            return None
        except (OSError, CorruptBlockError) as exc:
            self.num_corrupt += 1
            logger.warning("KV offload disk tier: dropping %s (%s); the block is recomputed",
                           self.path(block_hash), exc)
            self._forget(block_hash, delete=True)
            return None
        self.bytes_read += payload.numel()
        return payload, True

    def _read_file(self, block_hash: BlockHash) -> torch.Tensor:
        with open(self.path(block_hash), "rb") as f:
            head = f.read(HEADER.size)
            if len(head) != HEADER.size:
                raise CorruptBlockError(f"truncated header ({len(head)} bytes)")
            magic, version, header_size, size, stored_hash, layout, digest = HEADER.unpack(head)
            if magic != MAGIC or version != FORMAT_VERSION or header_size != HEADER.size:
                raise CorruptBlockError("not a kvpilot block file of this format version")
            if stored_hash != block_hash:
                raise CorruptBlockError("the file holds another block")
            if layout != self.layout_id or size != self.bytes_per_block:
                raise CorruptBlockError("written for another KV layout")
            payload = torch.empty(size, dtype=torch.uint8)
            got = f.readinto(payload.numpy())
            if got != size:
                raise CorruptBlockError(f"truncated payload ({got} of {size} bytes)")
            if f.read(1):
                raise CorruptBlockError("trailing bytes after the payload")
        if payload_digest(payload.numpy()) != digest:
            raise CorruptBlockError("payload checksum mismatch")
        return payload

"""One engine's disk tier in its own process, for the shared-directory test (tests/offload).

``python -m support.shared_disk DIR ROLE COUNT`` (``tests/`` on PYTHONPATH): writes COUNT blocks (the first half shared with
the peer: same hashes, same bytes, as two engines serving one prefix would write; the rest
its own) into a ``DiskStore`` on DIR, re-opening the store (a restart: the start-up scan)
every ``RESTART_EVERY`` blocks, with ``os.getpid`` reporting 1 as it does for an engine
that is its container's first process. Prints one JSON line: whether the tier stayed
writable, the corrupt files it met, the blocks it wrote.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys

import torch

from kvpilot.engine.offload.disk_store import DiskStore

LAYOUT = b"sharedv1"
BLOCK_BYTES = 16 * 1024
RESTART_EVERY = 25


def block_hash(tag: str, i: int) -> bytes:
    return hashlib.sha256(f"{tag}/{i}".encode()).digest()


def payload(tag: str, i: int) -> torch.Tensor:
    seed = int.from_bytes(block_hash(tag, i)[:4], "little")
    return torch.randint(0, 256, (BLOCK_BYTES,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))


def blocks(role: str, count: int) -> list[tuple[str, int]]:
    return [("shared", i) for i in range(count // 2)] + [(role, i) for i in range(count - count // 2)]


def main(directory: str, role: str, count: int) -> None:
    os.getpid = lambda: 1   # every engine is PID 1 in its own container
    store, writable, corrupt = None, True, 0
    for n, (tag, i) in enumerate(blocks(role, count)):
        if n % RESTART_EVERY == 0:
            if store is not None:
                store.close()
                writable, corrupt = writable and store.writable, corrupt + store.num_corrupt
            store = DiskStore(directory, 1 << 34, BLOCK_BYTES, LAYOUT)
        store.submit(block_hash(tag, i), payload(tag, i))
        if n % 7 == 0:
            store.read(block_hash("shared", n % (count // 2)))
    store.close()
    print(json.dumps({"writable": writable and store.writable, "corrupt": corrupt + store.num_corrupt,
                      "written": count}), flush=True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]))

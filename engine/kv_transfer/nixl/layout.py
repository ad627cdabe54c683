"""Where an engine's KV blocks lie in memory, what engines tell each other of it at the
handshake, and the transfer descriptors between two such layouts.

The paged KV cache is ``[layers, 2, num_blocks, block_size, kv_heads, head_dim]`` (or one
``[2, num_blocks, ...]`` view per layer): for each layer and each of K and V, a *region* of
``num_blocks`` contiguous blocks of ``block_len`` bytes. One block of a request is one
descriptor per region (``2 x layers``), as vLLM's NixlConnector lays them out ("NHD": a
block holds ``block_size x kv_heads x head_dim`` elements, token-major). Runs of blocks
consecutive on both sides merge into one descriptor each.

``AgentInfo`` is the handshake: the producer's NIXL agent metadata and its regions' base
addresses, plus everything that must match for its bytes to mean the same KV here: block
size, KV dtype, layout, tensor-parallel size, region shapes, and the prefix-hash root
(which digests the model checkpoint, KV dtype, block size and hash seed). ``check_compatible``
names the first difference.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np
import torch

CONNECTOR_VERSION = 1      # bump on any change to AgentInfo or the side-channel messages
LAYOUT = "NHD"


@dataclass(frozen=True, slots=True)
class Regions:
    """Base address of each region, with the shape they share."""

    base_addrs: tuple[int, ...]
    block_len: tuple[int, ...]   # bytes of one block, per region
    num_blocks: int
    mem_type: str                # "DRAM" (CPU) or "VRAM" (GPU)
    device_id: int

    @property
    def bytes_per_block(self) -> int:
        return sum(self.block_len)


def kv_regions(kv_caches: torch.Tensor | list[torch.Tensor]) -> tuple[Regions, list[torch.Tensor]]:
    """The regions of a runner's KV cache, and the tensors to register with NIXL."""
    layers = list(kv_caches) if isinstance(kv_caches, list) else list(kv_caches.unbind(0))
    if not layers:
        raise ValueError("the KV cache has no layers")
    num_blocks = layers[0].shape[1]
    addrs, lens = [], []
    for layer in layers:
        if layer.shape[1] != num_blocks or not layer.is_contiguous():
            raise ValueError("NixlConnector needs one contiguous block count for every layer's KV cache")
        block_len = layer[0, 0].numel() * layer.element_size()
        for kv in range(2):
            addrs.append(layer[kv].data_ptr())
            lens.append(block_len)
    device = layers[0].device
    tensors = [kv_caches] if isinstance(kv_caches, torch.Tensor) else layers
    return (Regions(tuple(addrs), tuple(lens), num_blocks, "VRAM" if device.type == "cuda" else "DRAM",
                    device.index or 0), tensors)


@dataclass(frozen=True, slots=True)
class AgentInfo:
    """What a producer sends a consumer at the handshake (msgpack-able)."""

    version: int
    engine_id: str
    agent_metadata: bytes
    base_addrs: tuple[int, ...]
    block_len: tuple[int, ...]
    num_blocks: int
    mem_type: str
    device_id: int
    block_size: int
    kv_dtype: str
    layout: str
    tp_size: int
    hash_root: str

    def to_wire(self) -> dict:
        return asdict(self)

    @classmethod
    def from_wire(cls, data: dict) -> AgentInfo:
        try:
            data = dict(data)
            data["base_addrs"], data["block_len"] = tuple(data["base_addrs"]), tuple(data["block_len"])
            return cls(**data)
        except (KeyError, TypeError) as exc:
            raise HandshakeError(f"the peer's handshake is not a kvpilot NixlConnector's ({exc})") from None


class HandshakeError(RuntimeError):
    """The two engines' KV cannot be exchanged (or the peer did not answer); the message says why."""


def check_compatible(local: AgentInfo, remote: AgentInfo) -> None:
    """HandshakeError naming the first property that differs (``remote`` is the producer)."""
    where = f"prefill engine {remote.engine_id!r}"
    if remote.version != local.version:
        raise HandshakeError(f"NixlConnector versions differ: {local.version} here, {remote.version} on {where}")
    for name, what in (("block_size", "block size (tokens per block, --block-size)"),
                       ("kv_dtype", "KV cache dtype (--kv-cache-dtype)"),
                       ("layout", "KV cache layout"),
                       ("tp_size", "tensor-parallel size (--tensor-parallel-size)")):
        mine, theirs = getattr(local, name), getattr(remote, name)
        if mine != theirs:
            raise HandshakeError(f"{what} differs: {mine} here, {theirs} on {where}; both engines must "
                                 "lay KV blocks out alike")
    if len(remote.block_len) != len(local.block_len) or remote.block_len != local.block_len:
        raise HandshakeError(f"KV block shapes differ: {len(local.block_len) // 2} layers of "
                             f"{local.block_len[0]} bytes per K/V block here, {len(remote.block_len) // 2} of "
                             f"{remote.block_len[0] if remote.block_len else 0} on {where} (another model?)")
    if remote.hash_root != local.hash_root:
        raise HandshakeError(f"the engines' prefix-hash roots differ ({where}): they serve different model "
                             "checkpoints, or differ in --prefix-caching-hash-seed")


def transfer_descs(local: Regions, local_blocks: list[int], remote: AgentInfo,
                   remote_blocks: list[int]) -> tuple[np.ndarray, np.ndarray]:
    """(local, remote) descriptor rows ``(address, length, device id)`` reading
    ``remote_blocks`` into ``local_blocks``, pairwise; runs consecutive on both sides merge."""
    if len(local_blocks) != len(remote_blocks):
        raise ValueError(f"{len(local_blocks)} local blocks for {len(remote_blocks)} remote ones")
    runs = []   # (local start, remote start, length)
    for lb, rb in zip(local_blocks, remote_blocks, strict=True):
        if runs and runs[-1][0] + runs[-1][2] == lb and runs[-1][1] + runs[-1][2] == rb:
            runs[-1][2] += 1
        else:
            runs.append([lb, rb, 1])
    run = np.array(runs, dtype=np.int64).reshape(-1, 3)
    lbase = np.array(local.base_addrs, dtype=np.int64)[:, None]
    rbase = np.array(remote.base_addrs, dtype=np.int64)[:, None]
    blen = np.array(local.block_len, dtype=np.int64)[:, None]
    length = (blen * run[None, :, 2]).ravel()
    rows = len(length)
    local_rows = np.stack([(lbase + blen * run[None, :, 0]).ravel(), length,
                           np.full(rows, local.device_id, dtype=np.int64)], axis=1)
    remote_rows = np.stack([(rbase + blen * run[None, :, 1]).ravel(), length,
                            np.full(rows, remote.device_id, dtype=np.int64)], axis=1)
    return local_rows, remote_rows

"""Frozen KV-offload configuration (torch-free).

Built from the ``kv_offloading_*`` engine arguments (vLLM's names):

- ``kv_offloading_size`` (GiB): host memory for offloaded KV blocks. Offload is off when
  it is ``None``; ``0`` is allowed with a disk tier (disk-only; the native backend then
  keeps nothing in host memory beyond the blocks being moved).
- ``kv_offloading_backend``: ``native`` (this package's host and disk tiers) or
  ``lmcache`` (LMCache's engine and storage backends, configured through its own
  config file / ``LMCACHE_*`` variables; the sizes and disk path here override those).
- ``kv_offloading_disk_path`` / ``kv_offloading_disk_size`` (GiB): a disk tier below the
  host tier. Both or neither.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvpilot.contract.constants import OFFLOAD_BACKENDS

GIB = 1 << 30


@dataclass(frozen=True, slots=True)
class OffloadConfig:
    """Where offloaded KV blocks live.

    Args:
        backend: ``native`` or ``lmcache``.
        cpu_bytes: host-memory tier capacity in bytes (0 = no host tier).
        disk_path: directory of the disk tier, or None for none.
        disk_bytes: disk tier capacity in bytes (> 0 exactly when ``disk_path`` is set).
    """

    backend: str = "native"
    cpu_bytes: int = 0
    disk_path: str | None = None
    disk_bytes: int = 0

    def __post_init__(self) -> None:
        if self.backend not in OFFLOAD_BACKENDS:
            raise ValueError(f"kv_offloading_backend must be one of {OFFLOAD_BACKENDS}, "
                             f"got {self.backend!r}")
        if self.cpu_bytes < 0 or self.disk_bytes < 0:
            raise ValueError("KV offloading sizes must be >= 0")
        if (self.disk_path is None) != (self.disk_bytes == 0):
            raise ValueError("kv_offloading_disk_path and a positive kv_offloading_disk_size "
                             "go together: give both for a disk tier, or neither")
        if self.cpu_bytes == 0 and self.disk_path is None:
            raise ValueError("kv_offloading_size is 0 and there is no disk tier: nothing to "
                             "offload to (give a size in GiB, or a disk path and size)")
        if self.backend == "lmcache" and self.cpu_bytes == 0:
            raise ValueError("the lmcache backend needs kv_offloading_size > 0: LMCache stages "
                             "every transfer through its host-memory buffer")

    @classmethod
    def from_engine_args(cls, size_gib: float | None, backend: str, disk_path: str | None,
                         disk_size_gib: float | None) -> OffloadConfig | None:
        """The config for these ``kv_offloading_*`` values, or None when offload is off.

        Raises ValueError for disk settings given while offload is off.
        """
        if size_gib is None:
            if disk_path is not None or disk_size_gib is not None:
                raise ValueError("kv_offloading_disk_path / kv_offloading_disk_size need "
                                 "kv_offloading_size (use 0 for a disk-only tier)")
            return None
        if disk_path is not None and not disk_size_gib:
            raise ValueError("kv_offloading_disk_path needs a positive kv_offloading_disk_size (GiB)")
        if disk_size_gib and disk_path is None:
            raise ValueError("kv_offloading_disk_size needs kv_offloading_disk_path")
        return cls(backend=backend, cpu_bytes=int(size_gib * GIB), disk_path=disk_path,
                   disk_bytes=int((disk_size_gib or 0) * GIB))

    @property
    def cpu_gib(self) -> float:
        return self.cpu_bytes / GIB

    @property
    def disk_gib(self) -> float:
        return self.disk_bytes / GIB

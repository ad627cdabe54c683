"""What the builders take from a plan: the engine flags and the pod's memory sizes.

A small operator-side value object, so that the builders depend on these few numbers
and not on the planner's whole result type.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True, slots=True)
class EngineSizing:
    """One replica's planned size.

    Args:
        serve_args: ``kvpilot serve`` flags from the planner (``--max-model-len``,
            ``--max-num-seqs``, ``--kv-cache-dtype``, offload flags, ...); model, host, port
            and extra flags are added by the Deployment builder.
        replicas: replicas the planner wants when neither spec.replicas nor an autoscaler decides.
        cpu_offload_gib: host-memory KV tier per replica (0 = no CPU tier).
        disk_offload_gib: disk KV tier per replica (0 = no disk tier).
        offload_backend: ``native`` / ``lmcache`` when a tier exists, else None.
        disk_path: where the engine expects the disk tier (``--kv-offloading-disk-path``).
        shm_gib: size of the memory-backed ``/dev/shm``.
        memory_gib: container memory request and limit (None = leave unset).
        gpu: the catalogue GPU type the plan is exact for (pods are pinned to it).
        weight_bytes: the checkpoint's size as the planner estimates it (sizes the model cache).
        nodes: pods per replica, one a node (pipeline stages); above 1 a LeaderWorkerSet group.
        status: what goes into ``status.plan`` (camelCase keys).
        prefill: with ``spec.disaggregation``, the prefill pool's sizing (this one is then
            the decode pool's; each pool's ``replicas`` is the planner's ratio).
    """

    serve_args: tuple[str, ...]
    replicas: int = 1
    cpu_offload_gib: float = 0.0
    disk_offload_gib: float = 0.0
    offload_backend: str | None = None
    disk_path: str | None = None
    shm_gib: float = 1.0
    memory_gib: float | None = None
    gpu: str | None = None
    weight_bytes: int | None = None
    nodes: int = 1
    status: Mapping[str, Any] = field(default_factory=dict)
    prefill: EngineSizing | None = None

    @property
    def disaggregated(self) -> bool:
        return self.prefill is not None

    def __post_init__(self) -> None:
        if self.nodes < 1:
            raise ValueError(f"nodes must be >= 1, got {self.nodes}")
        if self.replicas < 0:
            raise ValueError(f"replicas must be >= 0, got {self.replicas}")
        for name in ("cpu_offload_gib", "disk_offload_gib", "shm_gib"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")

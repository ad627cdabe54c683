"""``TPGroup``: one engine's tensor-parallel ranks and the collectives between them.

Two process groups over the engine's own ``TCPStore`` (the driver hosts it on a free
port): ``device_pg`` carries activations (all-reduce of row-parallel outputs, the
embedding's sum, the logits gathered to the driver: NCCL on CUDA, gloo on CPU) and
``cpu_pg`` carries control (the step inputs, sizing figures: always gloo, CPU tensors).
They are built directly from the store rather than through
``torch.distributed.init_process_group``, so no process-wide default group exists and
each engine in a process has its own.

A ``TPGroup()`` with the defaults is the single-rank group: every collective is a no-op.
"""

from __future__ import annotations

import contextlib
import datetime
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

DEFAULT_TIMEOUT = datetime.timedelta(minutes=30)   # torch's default; weights can load slowly


class RanksOutOfStep(RuntimeError):
    """Raised (from the original error) when something fails while the ranks run a step
    together: some may be waiting in a collective the others will never join."""


@dataclass(frozen=True, slots=True)
class TPGroup:
    """This process's place among the engine's ranks (rank 0 is the driver)."""

    rank: int = 0
    world_size: int = 1
    device_pg: Any = None      # activations: ProcessGroupNCCL on CUDA, ProcessGroupGloo on CPU
    cpu_pg: Any = None         # control: ProcessGroupGloo

    @property
    def is_driver(self) -> bool:
        return self.rank == 0

    # ---- activations (device_pg) ------------------------------------------------
    def all_reduce(self, x: torch.Tensor, op: dist.ReduceOp = dist.ReduceOp.SUM) -> torch.Tensor:
        """Reduce ``x`` in place over the ranks and return it."""
        if self.world_size == 1:
            return x
        opts = dist.AllreduceOptions()
        opts.reduceOp = op
        self.device_pg.allreduce([x], opts).wait()
        return x

    def gather_to_driver(self, x: torch.Tensor) -> list[torch.Tensor] | None:
        """Every rank's ``x`` (same shape everywhere), in rank order, on the driver; None
        on the other ranks."""
        if self.world_size == 1:
            return [x]
        x = x.contiguous()
        opts = dist.GatherOptions()
        opts.rootRank = 0
        if not self.is_driver:
            self.device_pg.gather([], [x], opts).wait()
            return None
        out = [torch.empty_like(x) for _ in range(self.world_size)]
        self.device_pg.gather([out], [x], opts).wait()
        return out

    # ---- control (cpu_pg) ---------------------------------------------------------
    def broadcast_from_driver(self, x: torch.Tensor) -> torch.Tensor:
        """The driver's ``x`` (a contiguous CPU tensor) into every rank's ``x``."""
        if self.world_size > 1:
            opts = dist.BroadcastOptions()
            opts.rootRank = 0
            opts.rootTensor = 0
            self.cpu_pg.broadcast([x], opts).wait()
        return x

    def all_gather_cpu(self, x: torch.Tensor) -> torch.Tensor:
        """``[world_size, *x.shape]``: every rank's ``x`` (a CPU tensor), in rank order."""
        if self.world_size == 1:
            return x[None]
        out = [torch.empty_like(x) for _ in range(self.world_size)]
        self.cpu_pg.allgather([out], [x.contiguous()]).wait()
        return torch.stack(out)

    def abort(self) -> None:
        """Break pending collectives (a peer died): they raise instead of waiting forever."""
        for pg in {id(p): p for p in (self.device_pg, self.cpu_pg) if p is not None}.values():
            with contextlib.suppress(Exception):   # best effort while failing anyway
                pg.abort()


def gloo_group(store: dist.Store, prefix: str, rank: int, world_size: int, timeout: datetime.timedelta,
               hostname: str = "127.0.0.1") -> dist.ProcessGroupGloo:
    """A gloo process group over ``store`` under ``prefix``, talking on ``hostname``'s
    interface (the loopback one when every rank shares a host)."""
    options = dist.ProcessGroupGloo._Options()
    options._timeout = timeout
    options._devices = [dist.ProcessGroupGloo.create_device(hostname=hostname)]
    return dist.ProcessGroupGloo(dist.PrefixStore(prefix, store), rank, world_size, options)


def nccl_group(store: dist.Store, prefix: str, rank: int, world_size: int, device: torch.device,
               timeout: datetime.timedelta):
    from torch.distributed import ProcessGroupNCCL

    torch.cuda.set_device(device)
    options = ProcessGroupNCCL.Options()
    options._timeout = timeout
    return ProcessGroupNCCL(dist.PrefixStore(prefix, store), rank, world_size, options)


def create_tp_group(store: dist.Store, rank: int, world_size: int, device: torch.device,
                    timeout: datetime.timedelta = DEFAULT_TIMEOUT, prefix: str = "tp",
                    hostname: str = "127.0.0.1") -> TPGroup:
    """Join the engine's ranks (blocks until every rank has called this). The ranks share a
    host (one pod): gloo talks over the loopback interface, whatever the hostname says.
    ``prefix``: the groups' names in the store (one per pipeline stage's ranks)."""
    cpu_pg = gloo_group(store, f"{prefix}-cpu", rank, world_size, timeout, hostname)
    if device.type != "cuda":
        return TPGroup(rank, world_size, cpu_pg, cpu_pg)
    device_pg = nccl_group(store, f"{prefix}-nccl", rank, world_size, device, timeout)
    return TPGroup(rank, world_size, device_pg, cpu_pg)

"""``PipelineGroup``: this rank's pipeline stage and the point-to-point sends between stages.

Ranks are numbered ``rank = stage * TP + tp_rank`` (``contract.pipeline_stages``). Besides its
stage's tensor-parallel ``TPGroup``, every rank is in two world-wide groups (``world``):
``world.cpu_pg`` carries control (the driver's step broadcast, the sizing all-gather:
gloo) and ``world.device_pg`` the activations between stages (gloo on CPU, NCCL on CUDA):

- stage ``s`` (each of its TP ranks, whose hidden states are whole after the row-parallel
  all-reduce) sends ``[2, tokens, hidden]`` (hidden states and the residual stream not yet
  added) to the same TP rank of stage ``s + 1``;
- the last stage's first TP rank (where its TP ranks gathered the logits) sends the float32
  logits of the step's sampling rows to the driver (rank 0), which samples.

A step's batch goes through the stages as microbatches in flight (``microbatch``), each
send tagged with its microbatch's index; steps themselves run one after another. With one
stage ``world`` is the tensor-parallel group itself and nothing is sent.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass

import torch

from kvpilot.contract.pipeline_stages import StageLayers, stage_layers, stage_of_rank
from kvpilot.engine.model.parallel.group import (
    DEFAULT_TIMEOUT,
    TPGroup,
    create_tp_group,
    gloo_group,
    nccl_group,
)

TAG_ACTIVATIONS = 1 << 20      # + the microbatch's index
TAG_LOGITS = 2 << 20


@dataclass(frozen=True, slots=True)
class PipelineGroup:
    """This rank's stage among ``num_stages`` of ``tp_size`` ranks each (defaults: one stage)."""

    stage: int = 0
    num_stages: int = 1
    tp_size: int = 1
    world: TPGroup = TPGroup()

    @property
    def enabled(self) -> bool:
        return self.num_stages > 1

    @property
    def is_first(self) -> bool:
        return self.stage == 0

    @property
    def is_last(self) -> bool:
        return self.stage == self.num_stages - 1

    @property
    def is_driver(self) -> bool:
        return self.world.rank == 0

    @property
    def last_stage_leader(self) -> int:
        """The rank that sends the logits to the driver."""
        return (self.num_stages - 1) * self.tp_size

    def layers(self, num_layers: int) -> StageLayers:
        if not self.enabled:
            return StageLayers()
        return stage_layers(num_layers, self.num_stages, self.stage)

    # ---- point to point (world.device_pg) --------------------------------------
    def isend_next(self, hidden: torch.Tensor, residual: torch.Tensor, microbatch: int = 0):
        """Start sending the stage's output to the same TP rank of the next stage; returns
        ``(work, buffer)``: wait on ``work``, keeping ``buffer`` alive until then."""
        packed = torch.stack([hidden, residual]).contiguous()
        work = self.world.device_pg.send([packed], self.world.rank + self.tp_size, TAG_ACTIVATIONS + microbatch)
        return work, packed

    def send_next(self, hidden: torch.Tensor, residual: torch.Tensor) -> None:
        self.isend_next(hidden, residual)[0].wait()

    def recv_prev(self, num_tokens: int, hidden_size: int, dtype: torch.dtype,
                  device: torch.device, microbatch: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """The previous stage's ``(hidden, residual)`` for ``num_tokens`` tokens."""
        packed = torch.empty((2, num_tokens, hidden_size), dtype=dtype, device=device)
        self.world.device_pg.recv([packed], self.world.rank - self.tp_size, TAG_ACTIVATIONS + microbatch).wait()
        return packed[0], packed[1]

    def isend_logits(self, logits: torch.Tensor, microbatch: int = 0):
        logits = logits.contiguous()
        return self.world.device_pg.send([logits], 0, TAG_LOGITS + microbatch), logits

    def send_logits(self, logits: torch.Tensor) -> None:
        self.isend_logits(logits)[0].wait()

    def recv_logits(self, num_rows: int, vocab_size: int, device: torch.device,
                    microbatch: int = 0) -> torch.Tensor:
        logits = torch.empty((num_rows, vocab_size), dtype=torch.float32, device=device)
        self.world.device_pg.recv([logits], self.last_stage_leader, TAG_LOGITS + microbatch).wait()
        return logits


def create_parallel_groups(store, rank: int, tp: int, pp: int, device: torch.device,
                           timeout: datetime.timedelta = DEFAULT_TIMEOUT,
                           hostname: str = "127.0.0.1") -> tuple[TPGroup, PipelineGroup]:
    """Join the engine's ranks: ``(this stage's TPGroup, PipelineGroup)`` of global ``rank``
    (blocks until every rank has called this). ``hostname``: the interface the world-wide
    groups talk on (a stage's own ranks share a host and talk on the loopback)."""
    if pp == 1:
        group = create_tp_group(store, rank, tp, device, timeout)
        return group, PipelineGroup(0, 1, tp, group)
    stage, tp_rank = stage_of_rank(rank, tp)
    stage_tp = create_tp_group(store, tp_rank, tp, device, timeout, prefix=f"tp{stage}") if tp > 1 else TPGroup()
    world_size = tp * pp
    cpu_pg = gloo_group(store, "world-cpu", rank, world_size, timeout, hostname)
    if device.type == "cuda":
        device_pg = nccl_group(store, "world-nccl", rank, world_size, device, timeout)
    else:
        device_pg = gloo_group(store, "world-p2p", rank, world_size, timeout, hostname)
    return stage_tp, PipelineGroup(stage, pp, tp, TPGroup(rank, world_size, device_pg, cpu_pg))

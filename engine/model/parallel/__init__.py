"""Tensor and pipeline parallelism: one model replica split over ranks (processes, one
device each): ``TP`` ranks per pipeline stage, ``rank = stage * TP + tp_rank``.

- ``group``: ``TPGroup``, one engine's ranks and their collectives (its own process
  groups over its own store: no torch.distributed default group, so several engines can
  live in one process).
- ``sharding``: which rows / columns / heads a rank holds (pure arithmetic), and reading
  just those out of a checkpoint tensor, before any dtype conversion.
- ``linear``: Megatron-style layers: column-parallel (fused QKV, gate/up), row-parallel
  (o_proj, down, then an all-reduce), vocab-parallel embedding and LM head.
- ``step_channel``: the driver's per-step broadcast of flat int64 step inputs and the
  workers' unpacking of them into their own persistent buffers.
- ``pipeline``: ``PipelineGroup``, a rank's stage, the world-wide groups, the point-to-point
  sends of hidden states between stages and of the last stage's logits to the driver.
- ``microbatch``: a step's batch cut at request boundaries into microbatches that are in
  flight through the stages together.
- ``workers``: the driver's side: spawning ranks 1..N-1, watching them, shutting down.
- ``worker``: a rank's process: load its shard, then serve the driver's commands.

Rank 0 (the driver) is the engine's own process: it schedules, builds each step's
inputs, runs its shard (of stage 0) and samples once from the gathered logits (sent back
by the last stage under pipeline parallelism). Workers never see
requests, only tensors. A pipeline over the pods of a LeaderWorkerSet group (one stage per
pod) is ``kvpilot.engine.deploy``: ``workers`` watches those pods with its ``lws``.

May import: torch, ``kvpilot.contract``, ``kvpilot.kernels``, the rest of
``kvpilot.engine.model`` and ``kvpilot.engine.deploy.lws`` (the pods' environment and
heartbeats).
"""

"""A tensor- or pipeline-parallel worker process (ranks 1..N-1): load this rank's shard, then run what
the driver broadcasts until it says stop.

Started by ``workers.WorkerGroup`` as ``python -m kvpilot.engine.model.parallel.worker
RANK`` with its ``WorkerSpec`` pickled on stdin. The worker takes its
device's memory baseline, announces itself in the engine's store (``ready/<rank>``),
joins the ranks' process groups, loads its shard and serves commands
(``step_channel.Command``): a step (forward pass, logits to the driver), the memory
profiling step, sizing its own stage's KV cache (pipeline parallelism), allocating the KV
cache, shutting down. It never schedules or samples.

It exits when the driver says SHUTDOWN; when the driver goes away (a collective fails
as the connection closes, or a watcher thread sees its parent process change); or on
any error, which it first records in the store (``error/<rank>``) so that the driver
can say why.
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import os
import pickle
import sys
import threading
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from kvpilot.engine.config import CacheConfig, ModelConfig, ParallelConfig, SchedulerConfig
from kvpilot.engine.model.device_memory import DeviceMemory, MemorySnapshot, device_memory_for
from kvpilot.engine.model.memory_profiling import profile_memory, stage_num_blocks
from kvpilot.engine.model.parallel.group import TPGroup
from kvpilot.engine.model.parallel.pipeline import PipelineGroup, create_parallel_groups
from kvpilot.engine.model.parallel.step_channel import Command, StepReceiver
from kvpilot.engine.model.runner import ModelRunner

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class WorkerSpec:
    """What a worker process is started with (pickled once, at spawn)."""

    model_config: ModelConfig
    cache_config: CacheConfig
    scheduler_config: SchedulerConfig
    parallel_config: ParallelConfig
    attention_backend: str
    store_host: str
    store_port: int
    timeout_s: float
    log_level: int
    gloo_host: str = "127.0.0.1"     # the interface the world-wide groups talk on (lws.gloo_hostname)


def error_key(rank: int) -> str:
    return f"error/{rank}"


def ready_key(rank: int) -> str:
    return f"ready/{rank}"


def cpu_threads_per_rank(world_size: int) -> int:
    """Intra-op threads for a CPU rank: the cores shared out, so ranks do not oversubscribe."""
    return max(1, (os.cpu_count() or 1) // world_size)


class Worker:
    """One rank's runner, fed by the driver's broadcasts."""

    def __init__(self, spec: WorkerSpec, tp: TPGroup, device: torch.device,
                 device_memory: DeviceMemory | None, baseline: MemorySnapshot | None,
                 pp: PipelineGroup | None = None) -> None:
        self.spec = spec
        self.device_memory = device_memory
        self.baseline = baseline
        self.runner = ModelRunner(spec.model_config, spec.cache_config, spec.scheduler_config, device,
                                  spec.attention_backend, tp, pp=pp,
                                  num_microbatches=spec.parallel_config.num_microbatches)
        max_blocks = -(-spec.model_config.max_model_len // spec.cache_config.block_size)
        self.receiver = StepReceiver(self.runner.pp.world, spec.scheduler_config.max_num_batched_tokens,
                                     spec.scheduler_config.max_num_seqs, max_blocks, device,
                                     num_kv_groups=self.runner.num_kv_groups)

    def serve(self) -> None:
        """Run commands until SHUTDOWN."""
        runner = self.runner
        while True:
            command, args = self.receiver.recv()
            if command is Command.STEP:
                step, calibrate = self.receiver.recv_step(args)
                runner.forward_step(step, calibrate)
            elif command is Command.PROFILE:
                self._profile()
            elif command is Command.ALLOCATE:
                runner.allocate_kv_cache(args[0], args[1] or None)
            elif command is Command.SIZE:
                stage_num_blocks(runner, self.spec.cache_config, self.spec.scheduler_config,
                                 self.device_memory, self.baseline)
            elif command is Command.SHUTDOWN:
                return

    def _profile(self) -> None:
        if self.device_memory is None or self.baseline is None:
            raise RuntimeError("the driver profiles memory but this worker has no device memory reading")
        profile_memory(self.device_memory, self.baseline, self.runner, self.spec.cache_config,
                       self.spec.scheduler_config)


def _exit_with_parent() -> None:
    """Exit when the process that started this one is gone (it was killed, say)."""
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(0.5)
        os._exit(0)

    threading.Thread(target=watch, name="kvpilot-parent-watch", daemon=True).start()


def worker_main(rank: int, spec: WorkerSpec) -> None:
    """A worker process's whole life."""
    _exit_with_parent()
    logging.basicConfig(level=spec.log_level,
                        format=f"%(asctime)s %(levelname)s [rank {rank}] %(name)s: %(message)s")
    parallel = spec.parallel_config
    world_size = parallel.world_size
    device = torch.device(parallel.device_of(rank))
    timeout = datetime.timedelta(seconds=spec.timeout_s)
    store = dist.TCPStore(spec.store_host, spec.store_port, world_size, is_master=False, timeout=timeout)
    try:
        if device.type == "cpu":
            torch.set_num_threads(cpu_threads_per_rank(len(parallel.devices)))
        device_memory = device_memory_for(device, rank)
        baseline = device_memory.snapshot() if device_memory is not None else None
        store.set(ready_key(rank), "1")
        tp, pp = create_parallel_groups(store, rank, parallel.tensor_parallel_size,
                                        parallel.pipeline_parallel_size, device, timeout, spec.gloo_host)
        worker = Worker(spec, tp, device, device_memory, baseline, pp)
        logger.info("rank %d of %d (pipeline stage %d, tensor-parallel rank %d) ready on %s (pid %d)",
                    rank, world_size, pp.stage, tp.rank, device, os.getpid())
        worker.serve()
    except BaseException as exc:  # noqa: BLE001 - recorded for the driver, then exit
        logger.exception("tensor-parallel rank %d failed", rank)
        with contextlib.suppress(Exception):   # the driver may be gone already
            store.set(error_key(rank), f"{type(exc).__name__}: {exc}")
        os._exit(1)
    os._exit(0)   # skip interpreter teardown: the process groups' threads need no goodbye


if __name__ == "__main__":
    worker_main(int(sys.argv[1]), pickle.load(sys.stdin.buffer))

"""A LeaderWorkerSet worker pod's process: run this pod's pipeline stage for the leader.

``kvpilot serve`` in a pod whose ``LWS_WORKER_INDEX`` is above 0 (with the same flags as
the leader's, ``--pipeline-parallel-size`` included: what the operator renders for the
worker template) comes here instead of starting a server: it connects to the leader's
store (``LWS_LEADER_ADDRESS:KVPILOT_RENDEZVOUS_PORT``, waiting up to the rendezvous
timeout for the leader to listen), starts its stage's ``TP`` ranks as worker processes
(``worker``, as the leader starts its own), and then watches them:

- every ``lws.HEARTBEAT_PERIOD_S`` it adds to ``heartbeat/<index>`` in the store, which
  the leader's ``lws.PodWatch`` expects (its silence fails the leader's engine);
- a rank that fails: its error goes to ``pod-error/<index>``, the other ranks are
  stopped and the pod exits 1 (the LeaderWorkerSet recreates the group);
- the leader gone (the store unreachable): exit 0 if every rank finished cleanly (the
  leader's SHUTDOWN), else the ranks are stopped, exit 1;
- every rank done after the leader's SHUTDOWN: exit 0.
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import time

import torch.distributed as dist

from kvpilot.engine.deploy.lws import (
    HEARTBEAT_PERIOD_S,
    describe_pod,
    gloo_hostname,
    heartbeat_key,
    pod_error_key,
    stage_ranks,
)
from kvpilot.engine.exceptions import describe_exit
from kvpilot.engine.model.parallel.group import DEFAULT_TIMEOUT
from kvpilot.engine.model.parallel.worker import WorkerSpec, error_key
from kvpilot.engine.model.parallel.workers import start_worker, stop_processes

logger = logging.getLogger(__name__)
# How long the ranks may take to finish after the leader (its store) went away: a leader
# that stops cleanly sends SHUTDOWN first, and the ranks exit 0 at once.
LEADER_GONE_GRACE_S = 3.0


def serve_stage(args) -> int:
    """A worker pod's whole life (``args``: its ``EngineArgs``, with a rendezvous); returns
    the exit status."""
    model_config, cache_config, scheduler_config = args.create_configs()
    parallel = args.create_parallel_config(model_config.arch)
    rv = parallel.rendezvous
    index, tp = rv.worker_index, parallel.tensor_parallel_size
    pod = describe_pod(index, tp)
    logger.info("%s: joining the leader's store at %s:%d (timeout %g s)", pod, rv.leader_address,
                rv.port, rv.timeout_s)
    try:
        store = dist.TCPStore(rv.leader_address, rv.port, parallel.world_size, is_master=False,
                              timeout=datetime.timedelta(seconds=rv.timeout_s))
    except Exception as exc:  # noqa: BLE001 - torch raises several kinds for an absent leader
        logger.error("%s: the leader's store at %s:%d did not answer within %g s: %s", pod,
                     rv.leader_address, rv.port, rv.timeout_s, exc)
        return 1
    spec = WorkerSpec(model_config, cache_config, scheduler_config, parallel, args.attention_backend,
                      rv.leader_address, rv.port, DEFAULT_TIMEOUT.total_seconds(),
                      logging.getLogger("kvpilot").getEffectiveLevel(), gloo_hostname(rv))
    processes = {rank: start_worker(rank, spec) for rank in stage_ranks(index, tp)}
    logger.info("%s: started ranks %s (pids %s)", pod, list(processes),
                [p.pid for p in processes.values()])
    try:
        return _watch(store, index, processes)
    finally:
        stop_processes(list(processes.values()), timeout=5.0)


def _watch(store, index: int, processes: dict) -> int:
    while True:
        try:
            store.add(heartbeat_key(index), 1)
        except Exception as exc:  # noqa: BLE001 - the leader (and its store) went away
            if _all_stopped_cleanly(processes, LEADER_GONE_GRACE_S):   # after its SHUTDOWN
                logger.info("every rank of this pod stopped at the leader's request")
                return 0
            logger.error("the leader's store is unreachable (%s): stopping this pod's ranks", exc)
            return 1
        exited = {rank: p.returncode for rank, p in processes.items() if p.poll() is not None}
        failed = {rank: code for rank, code in exited.items() if code != 0}
        if failed:
            rank, code = min(failed.items())
            why = f"rank {rank} (pid {processes[rank].pid}) {describe_exit(code)}{_recorded(store, rank)}"
            logger.error("%s", why)
            with contextlib.suppress(Exception):   # the leader may be gone already
                store.set(pod_error_key(index), why)
            return 1
        if len(exited) == len(processes):
            logger.info("every rank of this pod stopped at the leader's request")
            return 0
        time.sleep(HEARTBEAT_PERIOD_S)


def _all_stopped_cleanly(processes: dict, timeout: float) -> bool:
    """Whether every rank exits with status 0 within ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while any(p.poll() is None for p in processes.values()) and time.monotonic() < deadline:
        time.sleep(0.05)
    return all(p.poll() == 0 for p in processes.values())


def _recorded(store, rank: int) -> str:
    with contextlib.suppress(Exception):
        if store.check([error_key(rank)]):
            return ": " + store.get(error_key(rank)).decode(errors="replace")
    return ""

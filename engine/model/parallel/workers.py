"""The driver's side of tensor and pipeline parallelism: start ranks 1..N-1, watch them, stop them.

``WorkerGroup`` hosts the engine's ``TCPStore`` on a free loopback port, starts one
process per worker rank (``python -m kvpilot.engine.model.parallel.worker RANK``, its
``WorkerSpec`` pickled once on stdin: unlike multiprocessing's spawn, this never re-runs
the caller's main script), waits until each has announced itself (failing fast, with
the worker's own error, if one dies while starting), then joins the ranks' process
groups as rank 0. The driver's ``ModelRunner`` sends its commands through ``channel``.

Failure: a monitor thread per worker waits for its process to end. When a worker dies
outside a shutdown, the group is marked failed with an ``EngineDeadError`` that names
the rank, its exit status and the error it recorded; the other workers are stopped (on
CUDA the process groups are aborted, so a driver blocked in a collective raises instead
of hanging) and the callbacks registered with ``on_failure`` run, on the monitor thread.
A collective that raises on the driver (gloo notices a closed connection at once) is
turned into the same error by ``dead_error``.
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import os
import pickle
import subprocess
import sys
import threading
import time
import weakref
from collections.abc import Callable

import torch
import torch.distributed as dist

from kvpilot.engine.deploy.lws import (
    HEARTBEAT_PERIOD_S,
    HEARTBEAT_TIMEOUT_S,
    PodWatch,
    describe_pod,
    gloo_hostname,
)
from kvpilot.engine.exceptions import EngineDeadError, describe_exit
from kvpilot.engine.model.parallel.group import DEFAULT_TIMEOUT
from kvpilot.engine.model.parallel.pipeline import create_parallel_groups
from kvpilot.engine.model.parallel.step_channel import Command, StepSender
from kvpilot.engine.model.parallel.worker import WorkerSpec, error_key, ready_key

logger = logging.getLogger(__name__)

STORE_HOST = "127.0.0.1"
# How long a failing collective waits for the monitor to name the worker that died.
FAILURE_ATTRIBUTION_S = 2.0


def _wait(process: subprocess.Popen, timeout: float) -> None:
    with contextlib.suppress(subprocess.TimeoutExpired):
        process.wait(max(0.0, timeout))


def stop_processes(processes: list[subprocess.Popen], timeout: float = 10.0) -> None:
    """Wait for the processes to exit, then terminate, then kill what is left."""
    deadline = time.monotonic() + timeout
    for p in processes:
        _wait(p, deadline - time.monotonic())
    for signal_them in ("terminate", "kill"):
        alive = [p for p in processes if p.poll() is None]
        for p in alive:
            getattr(p, signal_them)()
        for p in alive:
            _wait(p, 2.0)


def _watch(group_ref: weakref.ref, rank: int, process: subprocess.Popen) -> None:
    """A monitor thread: tell the group (if it still exists) when rank ``rank`` exits."""
    process.wait()
    group = group_ref()
    if group is not None:
        group._worker_exited(rank)


def _watch_pods(group_ref: weakref.ref, pods: PodWatch) -> None:
    """The pod monitor thread: fail the group (if it still exists) when a worker pod fails."""
    while True:
        time.sleep(HEARTBEAT_PERIOD_S)
        group = group_ref()
        if group is None or group._closing or group.failure is not None:
            return
        try:
            why = pods.failed()
        except Exception as exc:  # noqa: BLE001 - the store itself is gone
            why = f"the group's store failed ({type(exc).__name__}: {exc})"
        if why is not None:
            group._pod_failed(why)
            return
        del group


def start_worker(rank: int, spec: WorkerSpec) -> subprocess.Popen:
    # PYTHONSAFEPATH: the working directory must not shadow the standard library (the
    # repository's operator/ folder would hide ``operator``)
    env = {**os.environ, "PYTHONSAFEPATH": "1"}
    process = subprocess.Popen([sys.executable, "-m", "kvpilot.engine.model.parallel.worker", str(rank)],
                               stdin=subprocess.PIPE, env=env)
    with contextlib.suppress(BrokenPipeError):   # it died at once: _wait_ready says how
        process.stdin.write(pickle.dumps(spec))
        process.stdin.close()
    return process


class WorkerGroup:
    """Ranks 1..N-1 of one engine, as seen from rank 0 (this process).

    Ranks on this host are started here (all of them, or with a ``rendezvous`` only stage
    0's); a LeaderWorkerSet's worker pods start their own stage's ranks
    (``engine.deploy.stage_pod``), which join this process's store on the rendezvous port and
    are watched through their pods' heartbeats (``lws.PodWatch``).

    Args:
        model_config, cache_config, scheduler_config, parallel_config, attention_backend:
            what every rank builds its runner from (sent to the workers once, at start).
        start_timeout_s: how long the workers may take to announce themselves (with a
            rendezvous: its ``timeout_s``).
        timeout: how long a collective may wait for a rank (a dead rank is noticed sooner).
    """

    def __init__(self, *, model_config, cache_config, scheduler_config, parallel_config,
                 attention_backend: str, start_timeout_s: float = 300.0,
                 timeout: datetime.timedelta = DEFAULT_TIMEOUT) -> None:
        self.world_size = world_size = parallel_config.world_size
        self.tp_size = tp = parallel_config.tensor_parallel_size
        self.num_stages = parallel_config.pipeline_parallel_size
        self.kind = "tensor-parallel" if self.num_stages == 1 else "pipeline-parallel"
        self.rendezvous = rv = parallel_config.rendezvous
        self.device = torch.device(parallel_config.devices[0])
        if rv is None:
            self.store = dist.TCPStore(STORE_HOST, 0, world_size, is_master=True, wait_for_workers=False,
                                       timeout=timeout)
        else:
            self.store = dist.TCPStore(rv.leader_address, rv.port, world_size, is_master=True,
                                       wait_for_workers=False, timeout=timeout)
            start_timeout_s = rv.timeout_s
        hostname = gloo_hostname(rv)
        spec = WorkerSpec(model_config, cache_config, scheduler_config, parallel_config, attention_backend,
                          STORE_HOST, self.store.port, timeout.total_seconds(),
                          logging.getLogger("kvpilot").getEffectiveLevel(), hostname)
        local = range(1, world_size) if rv is None else range(1, tp)
        self.processes = {rank: start_worker(rank, spec) for rank in local}
        self.remote_ranks = [] if rv is None else list(range(tp, world_size))
        self.pods = None if rv is None else PodWatch(self.store, range(1, self.num_stages), tp)
        # workers never outlive this object (nor this process), even if close() is never called
        self._finalizer = weakref.finalize(self, stop_processes, list(self.processes.values()), 0.0)
        # set once every failure listener has been told (so whoever sees it, e.g. a step
        # raising it, can count on the listeners having run); _failing is claimed first
        self.failure: EngineDeadError | None = None
        self._failing: EngineDeadError | None = None
        self._failed = threading.Event()
        self._callbacks: list[Callable[[EngineDeadError], None]] = []
        self._lock = threading.Lock()
        self._closing = False
        try:
            self._wait_ready(start_timeout_s)
            self.group, self.pipeline = create_parallel_groups(self.store, 0, tp, self.num_stages, self.device,
                                                               timeout, hostname)
        except BaseException:
            self.close(graceful=False)
            raise
        self.channel = StepSender(self.pipeline.world)
        # monitors hold no strong reference: an unclosed group can still be collected
        for rank, process in self.processes.items():
            threading.Thread(target=_watch, args=(weakref.ref(self), rank, process),
                             name=f"kvpilot-tp-monitor-{rank}", daemon=True).start()
        if self.pods is not None:
            self.pods.restart()      # heartbeats are expected from now on
            threading.Thread(target=_watch_pods, args=(weakref.ref(self), self.pods),
                             name="kvpilot-pod-monitor", daemon=True).start()
        logger.info("%s: %d ranks (TP %d x PP %d) on %s; local worker pids %s%s", self.kind, world_size, tp,
                    self.num_stages, ", ".join(parallel_config.devices), self.pids,
                    f"; worker pods joined at {rv.leader_address}:{rv.port}" if rv is not None else "")

    @property
    def pids(self) -> list[int]:
        """Process ids of the workers started here (ranks 1..N-1 on this host), in rank order."""
        return [p.pid for _, p in sorted(self.processes.items())]

    # ---- start-up --------------------------------------------------------------
    def _wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        pending = set(range(1, self.world_size))
        while pending:
            for rank in sorted(pending):
                if self.store.check([ready_key(rank)]):
                    pending.discard(rank)
                    continue
                process = self.processes.get(rank)
                if process is not None and process.poll() is not None:
                    raise RuntimeError(f"{self.kind} worker rank {rank} "
                                       f"{describe_exit(process.returncode)} while starting"
                                       f"{self._recorded_error(rank)}")
            for index in range(1, self.num_stages) if self.pods is not None else ():
                if (error := self.pods.pod_error(index)) is not None:
                    raise RuntimeError(f"pipeline rendezvous: {describe_pod(index, self.tp_size)} failed "
                                       f"while starting: {error}")
            if pending and time.monotonic() > deadline:
                raise RuntimeError(self._missing(sorted(pending), timeout_s))
            if pending:
                time.sleep(0.05)

    def _missing(self, pending: list[int], timeout_s: float) -> str:
        local = [r for r in pending if r in self.processes]
        remote = sorted({r // self.tp_size for r in pending if r not in self.processes})
        parts = []
        if local:
            parts.append(f"{self.kind} worker rank(s) {local} did not start within {timeout_s:g} s")
        if remote:
            rv = self.rendezvous
            pods = "; ".join(describe_pod(i, self.tp_size) for i in remote)
            parts.append(f"pipeline rendezvous timed out after {timeout_s:g} s waiting for {pods} to join "
                         f"the leader's store at {rv.leader_address}:{rv.port} "
                         f"(LWS_GROUP_SIZE={rv.group_size}); missing ranks {pending}")
        return "; ".join(parts)

    def _recorded_error(self, rank: int) -> str:
        try:
            if self.store.check([error_key(rank)]):
                return ": " + self.store.get(error_key(rank)).decode(errors="replace")
        except Exception:  # noqa: BLE001 - the reason is a nicety
            pass
        return ""

    # ---- failure ---------------------------------------------------------------
    def on_failure(self, callback: Callable[[EngineDeadError], None]) -> None:
        """Call ``callback(error)`` (on the monitor thread) when a worker dies; at once if
        one already has."""
        with self._lock:
            failure = self.failure
            if failure is None:
                self._callbacks.append(callback)
        if failure is not None:
            callback(failure)

    def _worker_exited(self, rank: int) -> None:
        """The monitor saw rank ``rank``'s process end."""
        if self._closing:
            return
        process = self.processes[rank]
        self._fail(EngineDeadError(f"{self.kind} worker rank {rank} (pid {process.pid}) "
                                   f"{describe_exit(process.returncode)}{self._recorded_error(rank)}"))

    def _pod_failed(self, why: str) -> None:
        """The pod monitor saw a worker pod fail (its error, or no heartbeat)."""
        if not self._closing:
            self._fail(EngineDeadError(why))

    def _fail(self, error: EngineDeadError) -> None:
        """Fail the group with ``error`` (the first caller wins): stop the survivors, tell
        every listener, then publish ``failure``."""
        with self._lock:
            if self._failing is not None:
                return
            self._failing = error
        logger.error("the engine is dead: %s", error)
        if self.device.type == "cuda" and hasattr(self, "pipeline"):
            self.group.abort()    # NCCL would otherwise wait for the dead rank until its timeout
            self.pipeline.world.abort()
        for p in self.processes.values():
            if p.poll() is None:
                p.kill()          # the survivors are out of step with the driver now
        while True:               # listeners registered meanwhile are told too, each once
            with self._lock:
                if not self._callbacks:
                    self.failure = error
                    break
                callback = self._callbacks.pop(0)
            try:
                callback(error)
            except Exception:  # noqa: BLE001 - one listener must not stop the others
                logger.exception("a worker-failure callback raised")
        self._failed.set()

    def check(self) -> None:
        """Raise the ``EngineDeadError`` if a worker has died."""
        if self.failure is not None:
            raise self.failure

    def death(self, timeout: float = FAILURE_ATTRIBUTION_S) -> EngineDeadError | None:
        """The failure of a worker that died or is dying (its exit is noticed within
        ``timeout``); None when every worker lives on."""
        deadline = time.monotonic() + timeout
        while self.failure is None and time.monotonic() < deadline:
            if self.pods is None and all(p.poll() is None for p in self.processes.values()) and \
                    time.monotonic() > deadline - timeout + 0.2:
                return None
            time.sleep(0.02)
        return self.failure

    def dead_error(self, exc: BaseException) -> EngineDeadError:
        """The error to raise for ``exc``, raised by the driver in the middle of a step.

        The ranks may be out of step after any error in a step, so the group is failed
        either way; the monitor gets a moment to name the worker whose death caused it.
        """
        deadline = time.monotonic() + FAILURE_ATTRIBUTION_S + (HEARTBEAT_TIMEOUT_S if self.pods else 0.0)
        while self.failure is None and time.monotonic() < deadline:
            time.sleep(0.02)
        self._fail(EngineDeadError(
            f"a {self.kind} step failed ({type(exc).__name__}: {exc}); the ranks are out "
            f"of step, so the engine cannot continue"))   # no-op if the monitor named a worker
        self._failed.wait(FAILURE_ATTRIBUTION_S)          # the monitor may still be telling listeners
        return self._failing

    # ---- shutdown --------------------------------------------------------------
    def close(self, graceful: bool = True) -> None:
        """Stop the workers: a SHUTDOWN command when ``graceful`` and they are healthy (they
        must be between commands: the engine is between steps), then signals."""
        if self._closing:
            return
        self._closing = True
        if graceful and self.failure is None and hasattr(self, "channel"):
            with contextlib.suppress(Exception):   # stopping them anyway
                self.channel.send(Command.SHUTDOWN)
        stop_processes(list(self.processes.values()), timeout=10.0 if graceful else 0.0)
        self._finalizer.detach()

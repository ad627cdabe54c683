"""A pipeline over the pods of a LeaderWorkerSet group: the environment, the store keys, the
pods' heartbeats.

The LeaderWorkerSet controller gives every pod of a group ``LWS_LEADER_ADDRESS`` (the
leader pod's DNS name), ``LWS_GROUP_SIZE`` (pods in the group) and ``LWS_WORKER_INDEX``
(0: the leader); the operator's templates add ``KVPILOT_RENDEZVOUS_PORT`` (the port of the
leader's ``torch.distributed`` store), and ``KVPILOT_RENDEZVOUS_TIMEOUT`` (seconds, default
600) may shorten how long the leader waits for its workers. One pod runs one pipeline
stage: ``LWS_WORKER_INDEX`` is the stage, its TP ranks ``stage * TP .. stage * TP + TP - 1``.

The leader's engine (``workers.WorkerGroup``) hosts the store; each worker pod's process
(``stage_pod``) connects to it, starts its stage's ranks and adds to its heartbeat counter
(``heartbeat/<index>``) every ``HEARTBEAT_PERIOD_S``; when one of its ranks dies it writes
``pod-error/<index>`` and exits. ``PodWatch`` (on the leader) turns a pod's error, or a
heartbeat that stopped for ``HEARTBEAT_TIMEOUT_S``, into the pod's failure.
"""

from __future__ import annotations

import ipaddress
import socket
import time
from collections.abc import Mapping

from kvpilot.engine.config import Rendezvous

LWS_ENV = ("LWS_LEADER_ADDRESS", "LWS_GROUP_SIZE", "LWS_WORKER_INDEX")
PORT_ENV = "KVPILOT_RENDEZVOUS_PORT"
TIMEOUT_ENV = "KVPILOT_RENDEZVOUS_TIMEOUT"
DEFAULT_PORT = 29500
HEARTBEAT_PERIOD_S = 0.25
HEARTBEAT_TIMEOUT_S = 2.0


def rendezvous_from_env(environ: Mapping[str, str]) -> Rendezvous | None:
    """The group's rendezvous from a LeaderWorkerSet pod's environment; None outside one
    (no ``LWS_WORKER_INDEX``). ValueError for a partial or malformed environment."""
    if "LWS_WORKER_INDEX" not in environ:
        return None
    missing = [name for name in LWS_ENV if not environ.get(name)]
    if missing:
        raise ValueError(f"LeaderWorkerSet environment incomplete: {', '.join(missing)} unset")
    try:
        return Rendezvous(environ["LWS_LEADER_ADDRESS"], int(environ.get(PORT_ENV, DEFAULT_PORT)),
                          int(environ["LWS_GROUP_SIZE"]), int(environ["LWS_WORKER_INDEX"]),
                          float(environ.get(TIMEOUT_ENV, 600)))
    except ValueError as exc:
        raise ValueError(f"LeaderWorkerSet environment: {exc}") from None


def gloo_hostname(rendezvous: Rendezvous | None) -> str:
    """The interface the world-wide groups talk on: the loopback one when the leader is on
    this host (tests, one node), else this pod's own address."""
    if rendezvous is None:
        return "127.0.0.1"
    try:
        leader = ipaddress.ip_address(socket.gethostbyname(rendezvous.leader_address))
    except (OSError, ValueError):
        leader = None
    if leader is not None and leader.is_loopback:
        return "127.0.0.1"
    return socket.gethostbyname(socket.gethostname())


def stage_ranks(index: int, tp: int) -> range:
    return range(index * tp, (index + 1) * tp)


def heartbeat_key(index: int) -> str:
    return f"heartbeat/{index}"


def pod_error_key(index: int) -> str:
    return f"pod-error/{index}"


def describe_pod(index: int, tp: int) -> str:
    ranks = stage_ranks(index, tp)
    listed = str(ranks[0]) if len(ranks) == 1 else f"{ranks[0]}-{ranks[-1]}"
    return f"worker pod LWS_WORKER_INDEX={index} (pipeline stage {index}, rank{'s' if len(ranks) > 1 else ''} {listed})"


class PodWatch:
    """The leader's view of the worker pods' heartbeats (``store``: the group's store)."""

    def __init__(self, store, indices: range, tp: int) -> None:
        self.store = store
        self.tp = tp
        self.indices = indices
        self.restart()

    def restart(self) -> None:
        """Count each pod's silence from now."""
        now = time.monotonic()
        self._seen = {i: (-1, now) for i in self.indices}

    def pod_error(self, index: int) -> str | None:
        """What pod ``index`` recorded before it went down, else None."""
        key = pod_error_key(index)
        if self.store.check([key]):
            return self.store.get(key).decode(errors="replace")
        return None

    def failed(self) -> str | None:
        """Why a pod is gone (its recorded error, or its silence), else None."""
        now = time.monotonic()
        for index, (count, since) in self._seen.items():
            error = self.pod_error(index)
            if error is not None:
                return f"{describe_pod(index, self.tp)} failed: {error}"
            value = self.store.add(heartbeat_key(index), 0)
            if value != count:
                self._seen[index] = (value, now)
            elif now - since > HEARTBEAT_TIMEOUT_S:
                return (f"{describe_pod(index, self.tp)} stopped answering (no heartbeat for "
                        f"{now - since:.1f} s): the pod died or lost the network")
        return None

"""The children as the operator knows them: kopf's watch indexes plus its own recent writes.

kopf watches every child kind (one list + watch stream per kind, filtered by the
operator's ``managed-by`` label) and keeps each object in an index (``kopf.index``), so a
reconcile pass reads children from memory instead of GETting them. A watch event arrives
some time after the write that caused it, so the operator also remembers what its own
writes returned (``WriteLog``) and, for each object, uses whichever of the two is newer.

Newer is decided by ``resourceVersion`` read as an integer, as client-go's
``NewIntegerResourceVersionMutationCache`` does: Kubernetes documents resource versions as
opaque, but every API server in use (etcd's revision) and the test emulator issue
increasing integers. Where one is not an integer, a remembered write simply wins until it
is ``ttl`` seconds old.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from kvpilot.operator.constants import ENGINE_CONTAINER
from kvpilot.operator.kube import KubeApi, KubeError
from kvpilot.operator.resources import ChildKind

Key = tuple[ChildKind, str, str]  # kind, namespace, name


def resource_version(obj: Mapping[str, Any] | None) -> int | None:
    """``metadata.resourceVersion`` as an integer (None when absent or not an integer)."""
    rv = ((obj or {}).get("metadata") or {}).get("resourceVersion")
    return int(rv) if isinstance(rv, str) and rv.isdigit() else None


def newest(a: Mapping[str, Any] | None, b: Mapping[str, Any] | None) -> Mapping[str, Any] | None:
    """Of two versions of one object, the one with the higher resourceVersion (``a`` on a tie
    or when either is not comparable and ``a`` is not None)."""
    if a is None or b is None:
        return a if a is not None else b
    ra, rb = resource_version(a), resource_version(b)
    return b if ra is not None and rb is not None and rb > ra else a


def pod_summary(body: Mapping[str, Any]) -> dict:
    """What the operator keeps of an engine pod, not the whole object: its identity and
    scheduling state (phase and conditions), and for ``engine_observer`` where its engine
    serves (IP, ports), what it runs (args) and which process it is (restart counts)."""
    meta, status = body.get("metadata") or {}, body.get("status") or {}
    engines = [{k: copy.deepcopy(ct[k]) for k in ("name", "args", "ports") if k in ct}
               for ct in (body.get("spec") or {}).get("containers") or () if ct.get("name") == ENGINE_CONTAINER]
    kept = {k: copy.deepcopy(status[k]) for k in ("phase", "conditions", "podIP") if k in status}
    kept["containerStatuses"] = [{"name": cs.get("name"), "restartCount": cs.get("restartCount", 0)}
                                 for cs in status.get("containerStatuses") or ()]
    return {"metadata": {k: meta[k] for k in ("name", "namespace", "uid", "labels", "resourceVersion",
                                              "deletionTimestamp") if k in meta},
            "spec": {"containers": engines}, "status": kept}


def stored_copy(body: Mapping[str, Any]) -> dict:
    """A private copy of a watched object for an index (``managedFields`` dropped: large and
    never read)."""
    obj = copy.deepcopy(dict(body))
    (obj.get("metadata") or {}).pop("managedFields", None)
    return obj


@dataclass(frozen=True, slots=True)
class _Written:
    obj: dict | None          # None: deleted by the operator
    rv: int | None
    at: float                 # time.monotonic() of the write


class WriteLog:
    """What the operator's own writes returned, until the watch has caught up with them.

    Args:
        ttl: seconds after which a remembered write is dropped regardless (the watch has
            long caught up by then; this bounds memory and non-integer resource versions).
        clock: monotonic time source (tests pass a fake).
    """

    def __init__(self, ttl: float = 60.0, clock: Callable[[], float] = time.monotonic) -> None:
        self._ttl = ttl
        self._clock = clock
        self._items: dict[Key, _Written] = {}

    def __len__(self) -> int:
        return len(self._items)

    def record(self, key: Key, obj: Mapping[str, Any] | None, rv: int | None = None) -> None:
        """Remember that ``key`` is now ``obj`` (None: deleted at resourceVersion ``rv``)."""
        if obj is not None:
            rv = resource_version(obj)
            obj = dict(obj)
        self._items[key] = _Written(obj, rv, self._clock())
        self._expire()

    def observe(self, key: Key, event_type: str | None, obj: Mapping[str, Any]) -> bool:
        """Note a watch event for ``key``; returns whether it is the echo of the operator's
        own write (nothing new to react to).

        Once the watch has delivered the written version, or anything newer, the index is
        at least as fresh as the write and the write is forgotten.
        """
        written = self._items.get(key)
        rv = resource_version(obj)
        if written is None or rv is None or written.rv is None:
            return False
        deleted = event_type == "DELETED"
        echo = written.obj is not None and not deleted and rv == written.rv
        if rv > written.rv or (rv == written.rv and (deleted or written.obj is not None)):
            del self._items[key]
        return echo

    def overlay(self, key: Key, watched: Mapping[str, Any] | None) -> Mapping[str, Any] | None:
        """``watched`` (the index's copy, None if absent) or the operator's newer write."""
        written = self._items.get(key)
        if written is None:
            return watched
        if self._clock() - written.at > self._ttl:
            del self._items[key]
            return watched
        rv = resource_version(watched)
        if written.rv is not None and rv is not None:
            # a tombstone holds until a newer object shows up (a re-creation)
            caught_up = rv > written.rv if written.obj is None else rv >= written.rv
            if caught_up:
                del self._items[key]
                return watched
        elif written.obj is None and watched is None:
            del self._items[key]  # the watch has seen the deletion too
            return None
        return written.obj

    def _expire(self) -> None:
        now = self._clock()
        if len(self._items) > 64:
            for key in [k for k, w in self._items.items() if now - w.at > self._ttl]:
                del self._items[key]


class Children:
    """Read and write an InferenceService's children through the caches.

    Args:
        api: the API client (writes, and reads of objects the watch cannot see).
        indexes: per child kind, kopf's index keyed by ``(namespace, name)``; a kind that is
            absent (its API is not installed, so kopf does not watch it) reads as empty.
        writes: the operator's write log, shared by all services.
        pods: kopf's index of engine pods (``pod_summary``) keyed by ``(namespace, service)``.
    """

    def __init__(self, api: KubeApi, indexes: Mapping[ChildKind, Mapping[Any, Iterable[Mapping]]],
                 writes: WriteLog, pods: Mapping[Any, Iterable[Mapping]] | None = None) -> None:
        self._api = api
        self._indexes = indexes
        self._writes = writes
        self._pods = pods if pods is not None else {}

    def pods(self, namespace: str, service: str) -> list[Mapping[str, Any]]:
        """The service's engine pods as last watched."""
        return list(self._pods.get((namespace, service), ()))

    def get(self, kind: ChildKind, namespace: str, name: str) -> Mapping[str, Any] | None:
        """The object as last seen (watch or own write), or None if it is not known to exist."""
        watched = None
        index = self._indexes.get(kind)
        if index is not None:
            for obj in index.get((namespace, name), ()):  # several only while one is re-created
                watched = newest(watched, obj)
        return self._writes.overlay((kind, namespace, name), watched)

    async def fetch(self, kind: ChildKind, namespace: str, name: str) -> dict | None:
        """GET the object (for one the watch does not show: not labelled as ours)."""
        obj = await self._api.get(kind.path(namespace, name))
        if obj is not None:
            self._writes.record((kind, namespace, name), obj)
        return obj

    async def create(self, kind: ChildKind, namespace: str, body: dict) -> dict:
        created = await self._api.create(kind.path(namespace), body)
        self._writes.record((kind, namespace, created["metadata"]["name"]), created)
        return created

    async def patch(self, kind: ChildKind, namespace: str, name: str, patch: dict) -> dict:
        try:
            patched = await self._api.merge_patch(kind.path(namespace, name), patch)
        except KubeError as exc:
            if exc.status == 404:  # gone since the watch last said: known absent now
                self._writes.record((kind, namespace, name), None)
            raise
        self._writes.record((kind, namespace, name), patched)
        return patched

    async def delete(self, kind: ChildKind, namespace: str, name: str) -> bool:
        """Delete (background propagation); False when it was already gone."""
        current = self.get(kind, namespace, name)
        deleted = await self._api.delete(kind.path(namespace, name))
        self._writes.record((kind, namespace, name), None, resource_version(current))
        return deleted

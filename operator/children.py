"""The children as the operator knows them: kopf's watch indexes plus its own recent writes.

kopf watches every child kind (one list + watch stream per kind, filtered by the
operator's ``managed-by`` label) and keeps each object in an index (``kopf.index``, the
copies of ``index_copies``), so a reconcile pass reads children from memory instead of
GETting them. Its own writes are remembered (``write_log.WriteLog``) until the watch shows
them, and for each object the newer of the two is used (``resource_version.newest``).
Writes are server-side applies under the operator's field manager (``server_side_apply``).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from kvpilot.operator.kube_api import KubeApi, KubeError
from kvpilot.operator.resource_version import newest, resource_version
from kvpilot.operator.resources import ChildKind
from kvpilot.operator.write_log import WriteLog


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

    async def apply(self, kind: ChildKind, namespace: str, name: str, body: dict) -> dict:
        """Server-side apply ``body`` (created when absent); returns the object as stored."""
        try:
            applied = await self._api.apply(kind.path(namespace, name), body)
        except KubeError as exc:
            if exc.status == 404:  # the namespace is going away: known absent now
                self._writes.record((kind, namespace, name), None)
            raise
        self._writes.record((kind, namespace, name), applied)
        return applied

    async def delete(self, kind: ChildKind, namespace: str, name: str) -> bool:
        """Delete (background propagation); False when it was already gone."""
        current = self.get(kind, namespace, name)
        deleted = await self._api.delete(kind.path(namespace, name))
        self._writes.record((kind, namespace, name), None, resource_version(current))
        return deleted

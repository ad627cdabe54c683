"""kopf registrations of the InferenceService operator (handlers only; logic elsewhere).

``build_registry(settings)`` returns a fresh registry holding:

- login from the pod's service account or the kubeconfig; start-up: kopf settings
  (standalone unless peering is configured; with peering, this replica's priority and
  keep-alive lifetime, ``kvpilot.operator.peering``; server-side label selectors on the
  child watches), the metrics endpoint and the shared worker context; clean-up closes the
  API client;
- a daemon per InferenceService running its ``worker.ServiceWorker`` (passes on change,
  a rare jittered resync, backoff on API failures);
- InferenceService events: poke its worker (not for the echo of its own status write);
- per child kind (Deployment, Service, PVC, HPA, ScaledObject, PodMonitor, PDB): an index
  (kopf's in-memory cache of the operator's children, filled from one watch per kind
  and complete before any worker starts) and an event handler that pokes the owner's
  worker when a child changes or disappears (drift repair without polling);
- engine pods (label-selected): an index of their scheduling state, where they serve and
  what they run (``index_copies.pod_summary``), read when replicas are missing (``Degraded``
  NoMatchingNodes / Unschedulable) and to read what ready ones allocated
  (``engine_observer``: ``status.observed``, ``SizingDrift``), and an event handler that
  pokes the service's worker when one changes;
- CustomResourceDefinition events in a child kind's group: forget the cached discovery
  and poke every worker (PodMonitors / ScaledObjects can be made, or no longer).

InferenceServices carry no finalizer: the per-object daemon runs without the one kopf
would add (``_without_finalizer``), so an InferenceService deleted while no operator runs
(its namespace deleted with the operator in it) goes at once, and its children with it
(owner references). The worker ends itself on the object's DELETED event or when its
status write finds it gone. kopf removes the finalizer older operators left
(``serving.kvpilot.dev/finalizer``) from every object it sees.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Mapping
from typing import Any

import kopf

from kvpilot.operator import constants as c
from kvpilot.operator.adapter_loader import AdapterLoader
from kvpilot.operator.discovery import Discovery
from kvpilot.operator.engine_observer import EngineObserver
from kvpilot.operator.index_copies import pod_summary, stored_copy
from kvpilot.operator.kube_api import KubeApi
from kvpilot.operator.metrics import serve_metrics
from kvpilot.operator.peering import peering_priority
from kvpilot.operator.resources import KINDS, ChildKind
from kvpilot.operator.settings import OperatorSettings
from kvpilot.operator.worker import ServiceWorker, WorkerContext

RESOURCE = (c.GROUP, c.VERSION, c.PLURAL)
MANAGED = {c.LABEL_MANAGED_BY: c.MANAGER}
ENGINE_PODS = {c.LABEL_NAME: c.APP_NAME, c.LABEL_COMPONENT: "engine"}  # the pod template's labels
PODS_INDEX = "pods_index"
CHILD_GROUPS = frozenset(kind.group for kind in KINDS.values())  # CRDs in these: children come or go
_BY_RESOURCE: dict[tuple[str, str], ChildKind] = {(k.group, k.plural): k for k in KINDS.values()}


def index_id(kind: ChildKind) -> str:
    """The kwarg under which kopf passes ``kind``'s index to handlers."""
    return f"{kind.plural}_index"


def _controller(body: Mapping[str, Any]) -> str | None:
    """The name of the InferenceService controlling a child, if one does."""
    for ref in (body.get("metadata") or {}).get("ownerReferences") or ():
        if ref.get("controller") and ref.get("kind") == c.KIND and ref.get("apiVersion") == c.API_VERSION:
            return ref.get("name")
    return None


def _selector(labels: Mapping[str, str]) -> str:
    return ",".join(f"{k}={v}" for k, v in labels.items())


def _without_finalizer(registry: kopf.OperatorRegistry, fn: Callable[..., Any]) -> None:
    """Let ``fn``'s daemon run without the finalizer kopf puts on every object a daemon serves.

    kopf holds that finalizer until the daemon has stopped, so that no daemon outlives its
    object, and its decorator offers no switch (nolar/kopf#896 declined one). Here the
    finalizer costs more than it guards: an InferenceService deleted while no operator runs
    (its namespace deleted with the operator in it: issue 43) would stay Terminating for
    good, and its namespace with it, while its children go with their owner references
    anyway. The worker instead ends on the object's DELETED event (``service_changed``) or
    when its status write finds the object gone (404). With no handler requiring it, kopf
    also removes the finalizer ``settings.persistence.finalizer`` names, which operators
    before this one left on every InferenceService.
    """
    spawning = registry._spawning  # noqa: SLF001 - kopf's daemons and timers; no public setter
    handlers = spawning._handlers  # noqa: SLF001
    found = [i for i, h in enumerate(handlers) if h.fn is fn]
    if not found:
        raise RuntimeError(f"no kopf daemon of {fn.__name__} to run without a finalizer (kopf changed?)")
    for i in found:
        handlers[i] = dataclasses.replace(handlers[i], requires_finalizer=False)


def build_registry(settings: OperatorSettings) -> kopf.OperatorRegistry:
    """A registry with the operator's handlers."""
    registry = kopf.OperatorRegistry()

    @kopf.on.startup(registry=registry)
    async def startup(settings: kopf.OperatorSettings, memo: kopf.Memo, **_: Any) -> None:
        config: OperatorSettings = memo.config
        settings.peering.standalone = config.peering is None
        if config.peering is not None:
            settings.peering.name = config.peering
            settings.peering.priority = peering_priority(time.time())
            settings.peering.lifetime = config.peering_lifetime
        settings.posting.reporting_component = c.MANAGER
        # No handler requires a finalizer (_without_finalizer): kopf removes this one, which
        # operators before issue 43 put on every InferenceService, wherever it finds it.
        settings.persistence.finalizer = c.FINALIZER
        settings.background.instant_exit_timeout = 0.5  # how long kopf waits for an idle worker
        # Only our children travel over the child watches (server-side label selector).
        children = {(k.group, k.plural) for k in KINDS.values()}
        settings.watching.label_selectors[lambda r: (r.group, r.plural) in children] = _selector(MANAGED)
        settings.watching.label_selectors[lambda r: (r.group, r.plural) == ("", "pods")] = _selector(ENGINE_PODS)
        metrics = serve_metrics(config.metrics_port, config.metrics_bind_address) if config.metrics_port else None
        api = await KubeApi.connect(config.api_timeout_seconds)
        memo.api = api
        memo.ctx = WorkerContext(api=api, settings=config, discovery=Discovery(api.has_api), metrics=metrics,
                                 observer=EngineObserver.from_settings(config, api),
                                 adapter_loader=AdapterLoader.from_settings(config))

    @kopf.on.login(registry=registry)
    def login(**kwargs: Any) -> kopf.ConnectionInfo | None:
        # The pod's service account, else $KUBECONFIG / ~/.kube/config (kopf's own readers).
        return kopf.login_with_service_account(**kwargs) or kopf.login_with_kubeconfig(**kwargs)

    @kopf.on.cleanup(registry=registry)
    async def cleanup(memo: kopf.Memo, **_: Any) -> None:
        if memo.get("ctx") is not None and memo.ctx.observer is not None:
            await memo.ctx.observer.close()
        if memo.get("ctx") is not None and memo.ctx.adapter_loader is not None:
            await memo.ctx.adapter_loader.close()
        if memo.get("api") is not None:
            await memo.api.close()

    # A worker exits as soon as its object is deleted, or after its current pass; one whose
    # pass takes longer than a second (a slow API server) is cancelled.
    @kopf.daemon(*RESOURCE, cancellation_backoff=1.0, cancellation_timeout=5.0, registry=registry)
    async def serve(body: kopf.Body, memo: kopf.Memo, stopped: kopf.DaemonStopped, **kwargs: Any) -> None:
        indexes = {kind: kwargs[index_id(kind)] for kind in KINDS.values() if index_id(kind) in kwargs}
        await ServiceWorker(memo.ctx, body, indexes, kwargs.get(PODS_INDEX)).serve(stopped)

    _without_finalizer(registry, serve)

    @kopf.on.event(*RESOURCE, registry=registry)
    async def service_changed(type: str | None, body: kopf.Body, memo: kopf.Memo, **_: Any) -> None:
        worker = memo.ctx.workers.get(body.metadata.namespace, body.metadata.name)
        if worker is not None and type == "DELETED" and worker.serves(body):
            worker.stop()  # no finalizer held it: kopf does not stop the daemon of a deleted object
        elif worker is not None and not worker.is_echo(body):
            worker.poke()

    async def index_child(namespace: str, name: str, body: kopf.Body, **_: Any) -> dict:
        return {(namespace, name): stored_copy(body)}

    async def child_changed(type: str | None, body: kopf.Body, resource: kopf.Resource,
                            memo: kopf.Memo, **_: Any) -> None:
        owner = _controller(body)
        kind = _BY_RESOURCE.get((resource.group, resource.plural))
        if owner is None or kind is None:
            return
        key = (kind, body.metadata.namespace, body.metadata.name)
        if not memo.ctx.writes.observe(key, type, body):
            memo.ctx.workers.poke(body.metadata.namespace, owner)

    for kind in KINDS.values():
        where = {"group": kind.group, "version": kind.api_version.rpartition("/")[2],
                 "plural": kind.plural, "registry": registry}
        kopf.index(id=index_id(kind), labels=MANAGED, **where)(index_child)
        # No label filter here: an object whose label was removed leaves the watch with a
        # DELETED event that no longer carries the label, and its owner must still hear of it.
        kopf.on.event(id=f"{kind.plural}_changed", **where)(child_changed)

    @kopf.index("", "v1", "pods", id=PODS_INDEX, labels=ENGINE_PODS, registry=registry)
    async def index_pod(namespace: str, labels: kopf.Labels, body: kopf.Body, **_: Any) -> dict:
        return {(namespace, labels.get(c.LABEL_INSTANCE)): pod_summary(body)}

    @kopf.on.event("", "v1", "pods", labels=ENGINE_PODS, registry=registry)
    async def pod_changed(namespace: str, labels: kopf.Labels, memo: kopf.Memo, **_: Any) -> None:
        if c.LABEL_INSTANCE in labels:
            memo.ctx.workers.poke(namespace, labels[c.LABEL_INSTANCE])

    @kopf.on.event("apiextensions.k8s.io", "v1", "customresourcedefinitions", registry=registry,
                   when=lambda spec, **_: spec.get("group") in CHILD_GROUPS)
    async def child_api_changed(type: str | None, spec: kopf.Spec, memo: kopf.Memo,
                                logger: logging.Logger, **_: Any) -> None:
        if type is None:  # the initial listing: nothing was cached before it
            return
        memo.ctx.discovery.forget(spec["group"])
        logger.info("the %s API changed; reconciling every service", spec["group"])
        memo.ctx.workers.poke_all()

    return registry

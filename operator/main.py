"""kopf registrations of the InferenceService operator (handlers only; logic in reconcile).

``build_registry(settings)`` returns a fresh registry holding:

- login from the pod's service account or the kubeconfig; start-up: kopf settings
  (standalone unless peering is configured; with peering, this replica's priority and
  keep-alive lifetime, ``kvpilot.operator.peering``), the metrics endpoint and the API
  client; clean-up closes it;
- create / resume / update(spec): one reconcile pass;
- a timer every ``resync_seconds``: the same pass, which observes the Deployment into
  status and repairs drifted or deleted children (writing nothing when all is well);
- delete: log only (children go with their owner references). kopf keeps a finalizer
  (``serving.kvpilot.dev/finalizer``) on each object for its timer and removes it when
  the object is deleted, so deleting an InferenceService needs the operator running.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

import kopf

from kvpilot.operator import constants as c
from kvpilot.operator.kube import KubeApi, KubeError
from kvpilot.operator.metrics import serve_metrics
from kvpilot.operator.peering import peering_priority
from kvpilot.operator.reconcile import reconcile
from kvpilot.operator.settings import OperatorSettings

RESOURCE = (c.GROUP, c.VERSION, c.PLURAL)


async def _run(body: kopf.Body, patch: kopf.Patch, memo: kopf.Memo, logger: logging.Logger) -> None:
    """One reconcile pass, serialized per object (handlers and the timer may overlap).

    The pass works on a fresh read of the object: a timer that waited for the lock while a
    spec update was applied must not re-apply the older spec it was started with.
    """
    lock = memo.setdefault("lock", asyncio.Lock())
    api: KubeApi = memo.api
    async with lock:
        path = f"/apis/{c.API_VERSION}/namespaces/{body.metadata.namespace}/{c.PLURAL}/{body.metadata.name}"
        try:
            fresh = await api.get(path)
            if fresh is None or fresh.get("metadata", {}).get("deletionTimestamp"):
                return
            result = await reconcile(api, fresh, memo.config)
        except KubeError:
            if api.closing:  # a pass cut short by shutdown; the next start redoes it
                logger.debug("reconcile interrupted by shutdown")
                return
            if memo.get("metrics") is not None:
                memo.metrics.record_pass(False)
            raise
    if memo.get("metrics") is not None:
        memo.metrics.record_pass(True, result.writes)
    for write in result.writes:
        logger.info(write)
    for key, value in result.status_patch.items():
        patch.status[key] = value
    for event in result.events:
        if event.type == "Warning":
            logger.warning("%s: %s", event.reason, event.message)
        kopf.event(body, type=event.type, reason=event.reason, message=event.message[:1024])


def build_registry(settings: OperatorSettings) -> kopf.OperatorRegistry:
    """A registry with the operator's handlers; ``settings`` sets the resync interval."""
    registry = kopf.OperatorRegistry()

    @kopf.on.startup(registry=registry)
    async def startup(settings: kopf.OperatorSettings, memo: kopf.Memo, **_: Any) -> None:
        settings.peering.standalone = memo.config.peering is None
        if memo.config.peering is not None:
            settings.peering.name = memo.config.peering
            settings.peering.priority = peering_priority(time.time())
            settings.peering.lifetime = memo.config.peering_lifetime
        settings.posting.reporting_component = c.MANAGER
        # kopf puts a finalizer on each object while its timer runs, so that the timer is
        # stopped before the object goes; name it after us rather than kopf.
        settings.persistence.finalizer = c.FINALIZER
        # A deletion that lands while the timer's pass is running waits for the pass: give it
        # half a second to end on its own, then look again every 2 s (kopf's default is 60 s).
        settings.background.instant_exit_timeout = 0.5
        settings.background.cancellation_polling = 2.0
        memo.metrics = serve_metrics(memo.config.metrics_port) if memo.config.metrics_port else None
        memo.api = await KubeApi.connect()

    @kopf.on.login(registry=registry)
    def login(**kwargs: Any) -> kopf.ConnectionInfo | None:
        # The pod's service account, else $KUBECONFIG / ~/.kube/config (kopf's own readers).
        return kopf.login_with_service_account(**kwargs) or kopf.login_with_kubeconfig(**kwargs)

    @kopf.on.cleanup(registry=registry)
    async def cleanup(memo: kopf.Memo, **_: Any) -> None:
        if memo.get("api") is not None:
            await memo.api.close()

    @kopf.on.resume(*RESOURCE, registry=registry)
    @kopf.on.create(*RESOURCE, registry=registry)
    @kopf.on.update(*RESOURCE, field="spec", registry=registry)
    async def reconcile_spec(body: kopf.Body, patch: kopf.Patch, memo: kopf.Memo,
                             logger: logging.Logger, **_: Any) -> None:
        await _run(body, patch, memo, logger)

    @kopf.timer(*RESOURCE, interval=settings.resync_seconds, initial_delay=settings.resync_seconds,
                registry=registry)
    async def observe(body: kopf.Body, patch: kopf.Patch, memo: kopf.Memo,
                      logger: logging.Logger, **_: Any) -> None:
        await _run(body, patch, memo, logger)

    @kopf.on.delete(*RESOURCE, optional=True, registry=registry)
    def deleted(name: str, namespace: str, logger: logging.Logger, **_: Any) -> None:
        logger.info("InferenceService %s/%s deleted; its children go with their owner references",
                    namespace, name)

    return registry

"""One worker per InferenceService: reconcile passes one at a time, when something changed.

A worker (run by a kopf daemon for as long as the object exists) sleeps until it is
poked, or until its resync comes due, then runs one pass (``reconcile``), writes the
status patch through the status subresource and posts the Events of condition changes.

- **Pokes.** The watch handlers poke a worker when its InferenceService changes, when one
  of its children changes or disappears, and (all workers) when an optional API appears
  or goes (a CRD changed). Watch events that are echoes of the worker's own writes do not
  poke. Pokes during a pass run one more pass after it; pokes never run passes in parallel.
- **One writer.** Passes of one service never overlap, and each starts from the newest of
  the watched object and what its own last status write returned, so a pass never
  re-reads an older status than the one it just wrote: an Event is posted once per
  condition change, and only after the status carrying that change was stored.
- **Resync.** A safety net, every ``resync_seconds`` times a random factor in [0.75, 1.25]
  so that services drift apart instead of firing together; it reads only the caches, so
  it costs no API request when nothing changed.
- **Backoff.** A pass whose API calls failed in a way that may pass (409, 429, 5xx,
  timeouts) is retried after an exponential, jittered backoff, never sooner than the
  server's ``Retry-After``, whatever pokes arrive meanwhile. A failure that needs a change
  (a missing API, a forbidden or invalid object, a name held by someone else's object,
  which the operator's watch does not see) is tried again on a poke, or after
  ``BLOCKED_RETRY_SECONDS`` (or the resync, if sooner). A pass that raises (a bug) is
  logged and retried like a transient failure rather than ending the worker.
- **Bounded.** At most ``max_concurrent_reconciles`` passes run at once, operator-wide.
- **Ends with its object.** No finalizer holds an InferenceService for its worker
  (``main._without_finalizer``): the worker ends after its current pass when the object's
  DELETED event arrives (``stop``), or when its status write finds the object gone (404).
"""

from __future__ import annotations

import asyncio
import logging
import random
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import kopf

from kvpilot.operator import constants as c
from kvpilot.operator.adapter_loader import AdapterLoader
from kvpilot.operator.children import Children
from kvpilot.operator.discovery import Discovery
from kvpilot.operator.engine_observer import EngineObserver
from kvpilot.operator.kube_api import KubeApi, KubeError
from kvpilot.operator.metrics import OperatorMetrics
from kvpilot.operator.reconcile import Failure, ReconcileResult, reconcile
from kvpilot.operator.resource_version import newest, resource_version
from kvpilot.operator.resources import ChildKind
from kvpilot.operator.settings import OperatorSettings
from kvpilot.operator.write_log import WriteLog

ServiceKey = tuple[str, str]  # namespace, name
BLOCKED_RETRY_SECONDS = 60.0
UNREAD_ENGINES_RETRY_SECONDS = 5.0
logger = logging.getLogger(__name__)


class _ServiceLogger(logging.LoggerAdapter):
    """Prefixes a worker's messages with its ``namespace/name``."""

    def process(self, msg: Any, kwargs: Any) -> tuple[Any, Any]:
        return f"[{self.extra['service']}] {msg}", kwargs


@dataclass(frozen=True, slots=True)
class Backoff:
    """Exponential backoff with jitter: ``initial * 2**(failures-1)`` up to ``cap`` seconds,
    times a random factor in [0.8, 1.2]."""

    initial: float = 0.5
    cap: float = 30.0

    def delay(self, failures: int, rng: random.Random) -> float:
        base = min(self.cap, self.initial * 2 ** max(0, failures - 1))
        return base * rng.uniform(0.8, 1.2)


class Workers:
    """The running workers by (namespace, name), for the watch handlers to poke."""

    def __init__(self) -> None:
        self._workers: dict[ServiceKey, ServiceWorker] = {}

    def __len__(self) -> int:
        return len(self._workers)

    def add(self, worker: ServiceWorker) -> None:
        self._workers[worker.key] = worker

    def discard(self, worker: ServiceWorker) -> None:
        if self._workers.get(worker.key) is worker:
            del self._workers[worker.key]

    def get(self, namespace: str, name: str) -> ServiceWorker | None:
        return self._workers.get((namespace, name))

    def poke(self, namespace: str, name: str) -> bool:
        """Ask for a pass of one service; False when it has no worker (not yet, or gone)."""
        worker = self._workers.get((namespace, name))
        if worker is not None:
            worker.poke()
        return worker is not None

    def poke_all(self) -> None:
        for worker in self._workers.values():
            worker.poke()


@dataclass(slots=True)
class WorkerContext:
    """What all workers share: the API client, the caches, the registry and the limits.

    Args:
        api: the API client.
        settings: operator settings.
        discovery: cached discovery of optional APIs.
        writes: the operator's recent writes (see ``write_log.WriteLog``).
        workers: the registry of running workers.
        backoff: retry delays after failures that may pass.
        rng: randomness for jitter (seeded in tests).
        metrics: the operator's Prometheus metrics (None: not served).
    """

    api: KubeApi
    settings: OperatorSettings
    discovery: Discovery
    writes: WriteLog = field(default_factory=WriteLog)
    workers: Workers = field(default_factory=Workers)
    backoff: Backoff = field(default_factory=Backoff)
    rng: random.Random = field(default_factory=random.Random)
    metrics: OperatorMetrics | None = None
    observer: EngineObserver | None = None
    adapter_loader: AdapterLoader | None = None
    slots: asyncio.Semaphore | None = None

    def __post_init__(self) -> None:
        if self.slots is None:
            self.slots = asyncio.Semaphore(self.settings.max_concurrent_reconciles)

    def resync_delay(self) -> float:
        return self.settings.resync_seconds * self.rng.uniform(0.75, 1.25)


async def _first(*events: Any, timeout: float | None) -> None:
    """Wait until one of ``events`` (asyncio.Event, kopf's DaemonStopped: an awaitable ``wait()``)
    is set, or ``timeout`` seconds (None: no limit)."""
    waiters = [asyncio.ensure_future(event.wait()) for event in events]
    try:
        await asyncio.wait(waiters, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for waiter in waiters:
            waiter.cancel()


class ServiceWorker:
    """Reconciles one InferenceService.

    Args:
        ctx: the shared context.
        body: the InferenceService as kopf last saw it (kopf's live body of a daemon: it
            is updated in place as watch events arrive).
        indexes: kopf's child indexes by kind (see ``children.Children``).
        pods: kopf's engine pod index (see ``children.Children``).
    """

    def __init__(self, ctx: WorkerContext, body: Mapping[str, Any],
                 indexes: Mapping[ChildKind, Any], pods: Mapping[Any, Any] | None = None) -> None:
        meta = body["metadata"]
        self.key: ServiceKey = (meta["namespace"], meta["name"])
        self._ctx = ctx
        self._body = body
        self._indexes = indexes
        self._pods = pods
        self._logger = _ServiceLogger(logger, {"service": "/".join(self.key)})
        self._uid = meta.get("uid")
        self._poked = asyncio.Event()
        self._poked.set()  # the first pass runs at once (creation, operator start)
        self._gone = asyncio.Event()  # the object was deleted: end after the current pass
        self._written: Mapping[str, Any] | None = None  # what the last status write returned
        self.passes = 0

    def poke(self) -> None:
        self._poked.set()

    def stop(self) -> None:
        """The object is gone: end after the current pass (``serve`` returns)."""
        self._gone.set()

    def serves(self, body: Mapping[str, Any]) -> bool:
        """Whether ``body`` is this worker's object (not another of the same name)."""
        uid = (body.get("metadata") or {}).get("uid")
        return uid is None or self._uid is None or uid == self._uid

    def is_echo(self, body: Mapping[str, Any]) -> bool:
        """Whether a watch event carrying ``body`` is the echo of this worker's status write."""
        rv = resource_version(body)
        return rv is not None and rv == resource_version(self._written)

    def view(self) -> Mapping[str, Any]:
        """The InferenceService as this worker should see it: the newer of the watched
        object and what its own last status write returned."""
        return newest(dict(self._body), self._written)

    async def serve(self, stopped: Any) -> None:
        """Run passes until ``stopped`` (kopf's daemon flag: awaitable ``wait()``, truthy once
        set) is set, at the latest when the current pass ends."""
        ctx, loop = self._ctx, asyncio.get_running_loop()
        stopping = asyncio.Event()

        async def wait_for_stop() -> None:
            await _first(self._gone, stopped, timeout=None)  # kopf stops it, or its object went
            stopping.set()

        stop_watch = asyncio.create_task(wait_for_stop())
        ctx.workers.add(self)
        failures, delay, not_before = 0, None, 0.0
        try:
            while True:
                await _first(self._poked, stopping, timeout=delay)
                if (wait := not_before - loop.time()) > 0:  # honour the backoff, pokes or not
                    await _first(stopping, timeout=wait)
                if stopping.is_set():
                    return
                self._logger.debug("reconcile pass %d starting (%s)", self.passes + 1,
                                   "poked" if self._poked.is_set() else "resync")
                self._poked.clear()
                try:
                    async with ctx.slots:
                        result = await self.reconcile_once()
                except Exception:  # a bug: keep the worker and retry it like a failure that may pass
                    self._logger.exception("reconcile pass failed")
                    result = ReconcileResult(failures=[Failure("reconcile", KubeError(0, "crashed"))])
                if ctx.api.closing:  # the operator is stopping: the pass was cut short
                    return
                if ctx.metrics is not None and result is not None:
                    ctx.metrics.record_pass(not result.failures, result.writes)
                    if result.sizing is not None:
                        ctx.metrics.record_sizing(*self.key, result.sizing.planned_blocks,
                                                  result.sizing.observed_blocks)
                    if result.figures is not None:
                        ctx.metrics.record_service(*self.key, result.figures)
                if result is not None and result.retry:
                    failures += 1
                    delay = max(ctx.backoff.delay(failures, ctx.rng), result.retry_after or 0.0)
                    not_before = loop.time() + delay
                    self._logger.warning("reconcile failed, retrying in %.1fs: %s", delay,
                                         "; ".join(str(f) for f in result.failures))
                    continue
                failures, not_before = 0, 0.0
                delay = ctx.resync_delay()
                if result is not None and result.sizing is not None and result.sizing.unread:
                    # engine pods whose KV cache could not be read yet (busy, or more than a
                    # pass reads): look again soon rather than at the next resync
                    delay = min(delay, UNREAD_ENGINES_RETRY_SECONDS * ctx.rng.uniform(0.75, 1.25))
                if result is not None and result.adapters_settling:  # adapters loading: retries due soon
                    delay = min(delay, UNREAD_ENGINES_RETRY_SECONDS * ctx.rng.uniform(0.75, 1.25))
                if result is not None and result.failures:  # needs a change: look again now and then
                    delay = min(delay, BLOCKED_RETRY_SECONDS * ctx.rng.uniform(0.75, 1.25))
        finally:
            ctx.workers.discard(self)
            if ctx.observer is not None:  # the service is gone (or the operator stops)
                ctx.observer.forget(self.key)
            if ctx.adapter_loader is not None:
                ctx.adapter_loader.forget(self.key)
            if ctx.metrics is not None:
                ctx.metrics.forget(*self.key)
            stop_watch.cancel()

    async def reconcile_once(self) -> ReconcileResult | None:
        """One pass; None when the object is being deleted or is gone."""
        ctx = self._ctx
        body = self.view()
        meta = body.get("metadata") or {}
        if meta.get("deletionTimestamp"):
            return None
        children = Children(ctx.api, self._indexes, ctx.writes, self._pods)
        result = await reconcile(children, ctx.discovery, body, ctx.settings, ctx.observer, ctx.adapter_loader)
        for write in result.writes:
            self._logger.info(write)
        self.passes += 1
        if result.status_patch:
            path = f"/apis/{c.API_VERSION}/namespaces/{meta['namespace']}/{c.PLURAL}/{meta['name']}/status"
            try:
                self._written = await ctx.api.merge_patch(path, {"status": result.status_patch})
            except KubeError as exc:
                if exc.status == 404:  # deleted, its DELETED event not seen (yet): done
                    self.stop()
                    return None
                # Events wait for the status that carries their change: the next pass
                # computes the same transitions again and posts them then.
                result.failures.append(Failure("status", exc))
                return result
        for event in result.events:
            if event.type == "Warning":
                self._logger.warning("%s: %s", event.reason, event.message)
            kopf.event(dict(body), type=event.type, reason=event.reason, message=event.message[:1024])
        self._logger.debug("reconcile pass %d done: %d writes, %d failures, status %s", self.passes,
                           len(result.writes), len(result.failures),
                           "patched" if result.status_patch else "unchanged")
        return result

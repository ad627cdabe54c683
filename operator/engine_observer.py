"""What the engines really allocated: each ready engine pod's ``/metrics``, read torch-free.

The operator plans ``num_gpu_blocks`` per replica and pins it with ``--kv-cache-memory-bytes``;
``EngineObserver`` reads back what each engine reports:

- ``vllm:cache_config_info`` (its labels ``num_gpu_blocks``, ``block_size``, ``cache_dtype``);
- ``kvpilot:kv_cache_memory_bytes`` (the KV cache as allocated) and, when the engine
  profiled its GPU at start-up, ``kvpilot:kv_cache_profiled_available_bytes`` (what the GPU
  really had for the KV cache).

Those figures are fixed for the life of an engine process, so each pod is read once (per
container restart) and remembered; a pass reads at most ``max_scrapes_per_pass`` pods not
read yet, concurrently, each within ``timeout`` seconds. A failed read is only logged and
tried again on a later pass: observation never fails a reconcile pass.

The prefix cache is read again every ``prefix_window`` seconds (``observe_prefix_cache``):
its counters' increase over that window gives the service's hit rate and, when it drops,
the top miss reason (``prefix_cache_window``: ``status.prefixCache``).

Only pods that run the current plan are read: ready, not terminating, with an IP, and with
the plan's serve flags on the engine container's command line (pods of an older rollout
generation report an older plan). A page over ``MAX_METRICS_BYTES`` (an engine's is tens of
KiB) is refused as it arrives: whatever runs in an engine pod cannot make the operator
buffer or parse an endless answer. A reader fetches a pod's metrics page
(``KVPILOT_ENGINE_METRICS``): straight from the pod (``pod``:
``http://POD_IP:PORT/metrics``, as Prometheus does), or through the API server's pod proxy
(``apiserver``: for an operator outside the cluster, or network policies that keep it from
the pods), or not at all (``off``).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from kvpilot.operator import constants as c
from kvpilot.operator.prefix_cache_window import (
    PrefixCounters,
    parse_prefix_counters,
    prefix_cache_status,
    window,
)

if TYPE_CHECKING:
    from kvpilot.operator.kube_api import KubeApi
    from kvpilot.operator.settings import OperatorSettings

logger = logging.getLogger(__name__)

CACHE_CONFIG_INFO = "vllm:cache_config_info"
KV_CACHE_MEMORY_BYTES = "kvpilot:kv_cache_memory_bytes"
PROFILED_KV_BYTES = "kvpilot:kv_cache_profiled_available_bytes"
METRICS_PORT_NAME = "http"
MAX_METRICS_BYTES = 4 << 20


class MetricsTooLarge(ValueError):
    """A metrics page over ``MAX_METRICS_BYTES``."""

    def __init__(self, size: int | None = None) -> None:
        got = f" ({size:,} bytes)" if size else ""
        super().__init__(f"the metrics page is over {MAX_METRICS_BYTES:,} bytes{got}; not read")


@dataclass(frozen=True, slots=True)
class EngineCache:
    """One engine's KV cache as it reports it.

    Args:
        num_gpu_blocks / block_size / cache_dtype: ``vllm:cache_config_info``'s labels.
        kv_cache_memory_bytes: the KV cache as allocated (None: not exported).
        profiled_kv_bytes: what start-up profiling left for the KV cache (None: not profiled).
    """

    num_gpu_blocks: int
    block_size: int
    cache_dtype: str
    kv_cache_memory_bytes: int | None = None
    profiled_kv_bytes: int | None = None

    @property
    def token_capacity(self) -> int:
        return self.num_gpu_blocks * self.block_size


def parse_engine_cache(text: str) -> EngineCache:
    """The KV cache figures in a ``/metrics`` page (Prometheus text format).

    Raises:
        ValueError: the page does not parse, or lacks ``vllm:cache_config_info``.
    """
    info: Mapping[str, str] | None = None
    gauges: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == CACHE_CONFIG_INFO and info is None:
                info = sample.labels
            elif sample.name in (KV_CACHE_MEMORY_BYTES, PROFILED_KV_BYTES):
                gauges.setdefault(sample.name, sample.value)
    if info is None:
        raise ValueError(f"no {CACHE_CONFIG_INFO} in the metrics")
    try:
        blocks, block_size = int(info["num_gpu_blocks"]), int(info["block_size"])
    except (KeyError, ValueError):
        raise ValueError(f"{CACHE_CONFIG_INFO} lacks integer num_gpu_blocks / block_size: "
                         f"{dict(info)}") from None

    def integer(name: str) -> int | None:
        return int(gauges[name]) if name in gauges else None

    return EngineCache(blocks, block_size, info.get("cache_dtype", ""), integer(KV_CACHE_MEMORY_BYTES),
                       integer(PROFILED_KV_BYTES))


@dataclass(frozen=True, slots=True)
class EnginePod:
    """A ready engine pod to read: where its metrics are and which process it is."""

    namespace: str
    name: str
    uid: str
    ip: str
    port: int
    restarts: int

    @property
    def key(self) -> tuple[str, int]:
        """Same key, same engine process (a container restart starts a new one)."""
        return self.uid, self.restarts


def _contains_run(args: Sequence[str], run: Sequence[str]) -> bool:
    n = len(run)
    return any(list(args[i:i + n]) == list(run) for i in range(len(args) - n + 1))


def _ready(pod: Mapping[str, Any]) -> bool:
    status = pod.get("status") or {}
    return status.get("phase") == "Running" and any(
        cond.get("type") == "Ready" and cond.get("status") == "True" for cond in status.get("conditions") or ())


def engine_pods(pods: Iterable[Mapping[str, Any]], serve_args: Sequence[str]) -> list[EnginePod]:
    """The ready pods among ``pods`` whose engine container runs ``serve_args`` (the plan's flags)."""
    out = []
    for pod in pods:
        meta, status = pod.get("metadata") or {}, pod.get("status") or {}
        if meta.get("deletionTimestamp") or not status.get("podIP") or not _ready(pod):
            continue
        container = next((ct for ct in (pod.get("spec") or {}).get("containers") or ()
                          if ct.get("name") == c.ENGINE_CONTAINER), None)
        if container is None or not _contains_run(container.get("args") or (), serve_args):
            continue
        port = next((p.get("containerPort") for p in container.get("ports") or ()
                     if p.get("name") == METRICS_PORT_NAME), None)
        if not isinstance(port, int):
            continue
        restarts = next((int(cs.get("restartCount") or 0) for cs in status.get("containerStatuses") or ()
                         if cs.get("name") == c.ENGINE_CONTAINER), 0)
        out.append(EnginePod(meta.get("namespace", ""), meta.get("name", ""), meta.get("uid") or "",
                             status["podIP"], port, restarts))
    return sorted(out, key=lambda p: p.name)


class DirectReader:
    """``GET http://POD_IP:PORT/metrics`` (what Prometheus does); one shared HTTP session."""

    def __init__(self) -> None:
        self._session: aiohttp.ClientSession | None = None

    async def __call__(self, pod: EnginePod) -> str:
        if self._session is None:
            self._session = aiohttp.ClientSession()
        host = f"[{pod.ip}]" if ":" in pod.ip else pod.ip
        async with self._session.get(f"http://{host}:{pod.port}/metrics") as response:
            response.raise_for_status()
            if (response.content_length or 0) > MAX_METRICS_BYTES:
                raise MetricsTooLarge(response.content_length)
            body = bytearray()
            async for chunk in response.content.iter_chunked(64 << 10):   # decompressed, if gzip
                body += chunk
                if len(body) > MAX_METRICS_BYTES:
                    raise MetricsTooLarge()
            return body.decode(response.charset or "utf-8", errors="replace")

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None


class ApiServerReader:
    """``GET /api/v1/namespaces/NS/pods/NAME:PORT/proxy/metrics`` through the API server with
    the operator's own client (RBAC: ``get`` on ``pods/proxy``)."""

    def __init__(self, api: KubeApi) -> None:
        self._api = api

    async def __call__(self, pod: EnginePod) -> str:
        text = await self._api.get_text(f"/api/v1/namespaces/{pod.namespace}/pods/{pod.name}:{pod.port}"
                                        "/proxy/metrics")
        if len(text) > MAX_METRICS_BYTES:  # read whole by the API client: at least never parsed
            raise MetricsTooLarge(len(text))
        return text

    async def close(self) -> None:  # the API client is the operator's; it closes it
        return None


@dataclass(slots=True)
class _PrefixWindow:
    """A service's last prefix-cache reading and what it made of the window before it."""

    time: float
    readings: dict[tuple[str, int], PrefixCounters]
    hit_rate: float | None = None
    status: dict[str, Any] | None = None


@dataclass(frozen=True, slots=True)
class EngineSample:
    """What one pod reported."""

    pod: str
    cache: EngineCache


class EngineObserver:
    """Reads and remembers the KV cache figures of each service's engine pods.

    Args:
        read: fetches a pod's metrics page as text, raising on any failure: ``DirectReader``
            or ``ApiServerReader``.
        timeout: seconds one read may take.
        max_scrapes_per_pass: pods of a service read at most per pass (the rest later).
    """

    def __init__(self, read: DirectReader | ApiServerReader, timeout: float = 2.0,
                 max_scrapes_per_pass: int = 4, prefix_window: float = 60.0) -> None:
        if timeout <= 0 or max_scrapes_per_pass < 1 or prefix_window <= 0:
            raise ValueError("timeout and prefix_window must be > 0 and max_scrapes_per_pass >= 1")
        self._read, self._timeout, self._max = read, timeout, max_scrapes_per_pass
        self._prefix_window = prefix_window
        self._seen: dict[tuple[str, str], dict[tuple[str, int], EngineCache]] = {}
        self._prefix: dict[tuple[str, str], _PrefixWindow] = {}
        # prefix-cache counters of pods first read by ``observe`` since the last window read
        self._baselines: dict[tuple[str, str], dict[tuple[str, int], PrefixCounters]] = {}
        self.scrapes = 0  # reads attempted

    async def _scrape(self, pod: EnginePod) -> tuple[EngineCache, PrefixCounters] | None:
        """The KV cache figures, and the prefix-cache counters of the same page."""
        self.scrapes += 1
        try:
            text = await asyncio.wait_for(self._read(pod), self._timeout)
            return parse_engine_cache(text), parse_prefix_counters(text)
        except Exception as exc:  # noqa: BLE001 - any failure only delays the observation
            logger.info("reading the KV cache figures of engine pod %s/%s failed (tried again later): %s",
                        pod.namespace, pod.name, str(exc) or type(exc).__name__)
            return None

    async def observe(self, service: tuple[str, str], pods: Sequence[EnginePod]) -> list[EngineSample]:
        """The samples of ``service``'s (namespace, name) engine ``pods`` that run its plan.

        Pods not read yet are read (at most ``max_scrapes_per_pass``, concurrently); pods read
        before are answered from memory, and pods no longer listed are forgotten. Pods whose
        read failed or was left for a later pass are missing from the answer.
        """
        known = self._seen.get(service, {})
        todo = [p for p in pods if p.key not in known][: self._max]
        read = await asyncio.gather(*(self._scrape(p) for p in todo)) if todo else []
        fresh = {p.key: found[0] for p, found in zip(todo, read, strict=True) if found is not None}
        # the same pages start the pods' prefix-cache windows (no read of their own)
        self._baselines.setdefault(service, {}).update(
            (p.key, found[1]) for p, found in zip(todo, read, strict=True) if found is not None)
        self._seen[service] = {p.key: known.get(p.key) or fresh[p.key] for p in pods
                               if p.key in known or p.key in fresh}
        return [EngineSample(p.name, self._seen[service][p.key]) for p in pods if p.key in self._seen[service]]

    async def _read_counters(self, pod: EnginePod) -> PrefixCounters | None:
        self.scrapes += 1
        try:
            return parse_prefix_counters(await asyncio.wait_for(self._read(pod), self._timeout))
        except Exception as exc:  # noqa: BLE001 - a failed read only skips the pod this window
            logger.info("reading the prefix-cache counters of engine pod %s/%s failed: %s",
                        pod.namespace, pod.name, str(exc) or type(exc).__name__)
            return None

    async def observe_prefix_cache(self, service: tuple[str, str], pods: Sequence[EnginePod],
                                   now: float) -> dict[str, Any] | None:
        """``status.prefixCache`` of ``service`` (None: no window yet). A window starts with the
        pages ``observe`` read (no read of its own); the pods' counters are read again once
        ``prefix_window`` seconds (monotonic ``now``) passed (at most ``max_scrapes_per_pass``
        pods, the same ones each time); in between, the last window's status is answered."""
        last = self._prefix.get(service)
        baselines = self._baselines.pop(service, {})
        if last is None:
            if baselines:
                self._prefix[service] = _PrefixWindow(now, baselines)
            return None
        if now - last.time < self._prefix_window:
            for key, counters in baselines.items():   # pods that joined during the window
                last.readings.setdefault(key, counters)
            return last.status
        todo = list(pods)[: self._max]
        read = await asyncio.gather(*(self._read_counters(p) for p in todo)) if todo else []
        readings = {p.key: counters for p, counters in zip(todo, read, strict=True) if counters is not None}
        counters = window(readings, last.readings)
        status = prefix_cache_status(counters, last.hit_rate, now - last.time) or last.status
        rate = counters.hits / counters.queries if counters.queries > 0 else last.hit_rate
        self._prefix[service] = _PrefixWindow(now, readings, rate, status)
        return status

    def forget(self, service: tuple[str, str]) -> None:
        """Drop what is remembered of a deleted service's pods."""
        self._seen.pop(service, None)
        self._prefix.pop(service, None)
        self._baselines.pop(service, None)

    async def close(self) -> None:
        await self._read.close()

    @classmethod
    def from_settings(cls, settings: OperatorSettings, api: KubeApi) -> EngineObserver | None:
        """The observer ``KVPILOT_ENGINE_METRICS`` asks for (None: ``off``)."""
        if settings.engine_metrics == "off":
            return None
        read = ApiServerReader(api) if settings.engine_metrics == "apiserver" else DirectReader()
        return cls(read, settings.engine_scrape_timeout, settings.engine_scrapes_per_pass)

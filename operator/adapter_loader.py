"""Loading each service's LoRA adapters into its ready engine pods, and their status.

The engine stops start-up on a bad ``--lora-modules`` entry, so an adapter reaches the
command line (``resources.adapters``) only once it has been seen to load. Until then the
operator loads it into every ready engine pod itself, through vLLM's run-time route
(``POST /v1/load_lora_adapter``, served with ``--allow-runtime-lora-updating``), and reads
each pod's ``GET /v1/models`` (adapters are the entries with a ``parent``) to see where it
is loaded. Per adapter::

    Pending   no ready engine pod yet (the pods' init containers fetch the files)
    Loading   loaded on some ready pods, being loaded on the others
    Ready     every ready engine pod serves it
    Failed    the engine refused it ``max_attempts`` times (the reason is the engine's
              own message: a malformed checkpoint, a rank above --max-lora-rank, a base
              model mismatch); not tried again until its source changes

Attempts back off exponentially (``base_backoff_s`` doubling up to ``max_backoff_s``);
a connection failure is retried on the same schedule but never makes an adapter Failed
(the pod, not the adapter, is at fault). An adapter that a pod serves but the spec no
longer lists is unloaded (``POST /v1/unload_lora_adapter``) from every ready pod.
"""

from __future__ import annotations

import contextlib
import json
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

import aiohttp

from kvpilot.operator.engine_observer import EnginePod

if TYPE_CHECKING:
    from kvpilot.operator.settings import OperatorSettings

logger = logging.getLogger(__name__)

PENDING, LOADING, READY, FAILED = "Pending", "Loading", "Ready", "Failed"
MAX_MODELS_BYTES = 1 << 20
# the engine's answers about the adapter itself (a bad request or checkpoint, no such adapter);
# others (401 without the service's API key, 5xx) are the pod's and never make an adapter Failed
REFUSALS = (400, 404, 422)


class AdapterRefused(Exception):
    """The engine answered with an error about the adapter (``REFUSALS``)."""


@dataclass(frozen=True, slots=True)
class AdapterTarget:
    """An adapter to serve: its name and where the engine pod holds its files."""

    name: str
    path: str


@dataclass(frozen=True, slots=True)
class LoaderPolicy:
    max_attempts: int = 5
    base_backoff_s: float = 2.0
    max_backoff_s: float = 60.0

    def backoff(self, attempts: int) -> float:
        return min(self.max_backoff_s, self.base_backoff_s * 2 ** max(0, attempts - 1))


@dataclass(frozen=True, slots=True)
class AdapterStatus:
    """One ``status.adapters[]`` entry."""

    name: str
    phase: str
    reason: str = ""
    ready_pods: int = 0
    attempts: int = 0

    def to_dict(self) -> dict:
        out = {"name": self.name, "phase": self.phase, "readyPods": self.ready_pods, "attempts": self.attempts}
        if self.reason:
            out["reason"] = self.reason
        return out


class AdapterClient(Protocol):
    async def adapters(self, pod: EnginePod) -> set[str]: ...

    async def load(self, pod: EnginePod, name: str, path: str) -> None: ...

    async def unload(self, pod: EnginePod, name: str) -> None: ...

    async def close(self) -> None: ...


class HttpAdapterClient:
    """The engine pods' LoRA routes, straight to ``POD_IP:PORT`` (one shared session);
    ``api_key``: the service's key, when its engines require one."""

    def __init__(self, api_key: str | None = None, timeout: float = 30.0) -> None:
        self._session: aiohttp.ClientSession | None = None
        self._headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._timeout = aiohttp.ClientTimeout(total=timeout)

    def _url(self, pod: EnginePod, path: str) -> str:
        host = f"[{pod.ip}]" if ":" in pod.ip else pod.ip
        return f"http://{host}:{pod.port}{path}"

    def _http(self) -> aiohttp.ClientSession:
        if self._session is None:
            self._session = aiohttp.ClientSession(headers=self._headers, timeout=self._timeout)
        return self._session

    async def adapters(self, pod: EnginePod) -> set[str]:
        async with self._http().get(self._url(pod, "/v1/models")) as response:
            response.raise_for_status()
            body = await response.content.read(MAX_MODELS_BYTES + 1)
            if len(body) > MAX_MODELS_BYTES:
                raise ValueError(f"/v1/models is over {MAX_MODELS_BYTES:,} bytes")
            data = json.loads(body).get("data") or []
            return {m["id"] for m in data if isinstance(m, dict) and m.get("parent")}

    async def _post(self, pod: EnginePod, path: str, body: dict) -> None:
        async with self._http().post(self._url(pod, path), json=body) as response:
            if response.status in REFUSALS:
                text = await response.text()
                with contextlib.suppress(ValueError, KeyError, TypeError):
                    text = json.loads(text)["error"]["message"]
                raise AdapterRefused(f"HTTP {response.status}: {text}"[:500])
            response.raise_for_status()

    async def load(self, pod: EnginePod, name: str, path: str) -> None:
        await self._post(pod, "/v1/load_lora_adapter", {"lora_name": name, "lora_path": path})

    async def unload(self, pod: EnginePod, name: str) -> None:
        await self._post(pod, "/v1/unload_lora_adapter", {"lora_name": name})

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None


@dataclass(slots=True)
class _Tries:
    path: str
    refusals: int = 0
    attempts: int = 0
    next_at: float = 0.0
    reason: str = ""


@dataclass(slots=True)
class _Service:
    tries: dict[str, _Tries] = field(default_factory=dict)


class AdapterLoader:
    """Keeps every ready pod of each service serving exactly the service's adapters.

    Args:
        client: the engine pods' LoRA routes (``HttpAdapterClient``).
        policy: attempts and backoff.
        clock: monotonic seconds (tests may pass their own).
    """

    def __init__(self, client: AdapterClient, policy: LoaderPolicy = LoaderPolicy(),
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._client, self._policy, self._clock = client, policy, clock
        self._services: dict[tuple[str, str], _Service] = {}

    async def sync(self, service: tuple[str, str], targets: Sequence[AdapterTarget],
                   pods: Sequence[EnginePod]) -> list[AdapterStatus]:
        """One pass: read each ready pod's adapters, unload those the spec dropped, load the
        missing ones whose backoff has passed; the status of each target, in order."""
        state = self._services.setdefault(service, _Service())
        wanted = {t.name: t for t in targets}
        state.tries = {n: t for n, t in state.tries.items() if n in wanted and t.path == wanted[n].path}
        loaded: dict[str, set[str]] = {}
        for pod in pods:
            try:
                loaded[pod.name] = await self._client.adapters(pod)
            except Exception as exc:  # noqa: BLE001 - that pod is read again next pass
                logger.info("reading the adapters of %s/%s failed: %s", pod.namespace, pod.name, exc)
        reachable = [p for p in pods if p.name in loaded]
        for pod in reachable:
            for name in sorted(loaded[pod.name] - set(wanted)):
                try:
                    await self._client.unload(pod, name)
                    loaded[pod.name].discard(name)
                    logger.info("unloaded adapter %s from %s/%s (no longer in the spec)", name,
                                pod.namespace, pod.name)
                except Exception as exc:  # noqa: BLE001 - tried again next pass
                    logger.info("unloading adapter %s from %s failed: %s", name, pod.name, exc)
        now = self._clock()
        for target in targets:
            tries = state.tries.setdefault(target.name, _Tries(target.path))
            if tries.refusals >= self._policy.max_attempts:
                continue
            for pod in reachable:
                if target.name in loaded[pod.name] or now < tries.next_at:
                    continue
                tries.attempts += 1
                try:
                    await self._client.load(pod, target.name, target.path)
                    loaded[pod.name].add(target.name)
                    tries.reason = ""
                except AdapterRefused as exc:
                    tries.refusals += 1
                    tries.reason = str(exc)
                except Exception as exc:  # noqa: BLE001 - the pod's fault, not the adapter's
                    tries.reason = f"engine pod {pod.name} unreachable: {exc or type(exc).__name__}"
                if tries.reason:
                    tries.next_at = now + self._policy.backoff(tries.attempts)
                    if tries.refusals >= self._policy.max_attempts:
                        break
        return [self._status(t, state.tries[t.name], reachable, loaded) for t in targets]

    def _status(self, target: AdapterTarget, tries: _Tries, pods: Sequence[EnginePod],
                loaded: dict[str, set[str]]) -> AdapterStatus:
        serving = sum(target.name in loaded[p.name] for p in pods)
        if tries.refusals >= self._policy.max_attempts:
            return AdapterStatus(target.name, FAILED, f"refused {tries.refusals} times: {tries.reason}",
                                 serving, tries.attempts)
        if not pods:
            return AdapterStatus(target.name, PENDING, "no ready engine pod", 0, tries.attempts)
        if serving == len(pods):
            return AdapterStatus(target.name, READY, "", serving, tries.attempts)
        reason = f"loaded on {serving} of {len(pods)} ready pods" + (f"; last: {tries.reason}" if tries.reason else "")
        return AdapterStatus(target.name, LOADING, reason, serving, tries.attempts)

    @property
    def policy(self) -> LoaderPolicy:
        return self._policy

    def forget(self, service: tuple[str, str]) -> None:
        self._services.pop(service, None)

    @classmethod
    def from_settings(cls, settings: OperatorSettings) -> AdapterLoader | None:
        """A loader that reaches the pods directly (``KVPILOT_ENGINE_METRICS=pod``, the default),
        with the settings' attempts and first backoff; None otherwise (adapters then load at
        pod start only, once verified)."""
        if settings.engine_metrics != "pod":
            return None
        policy = LoaderPolicy(max_attempts=settings.adapter_load_attempts,
                              base_backoff_s=settings.adapter_load_backoff_seconds)
        return cls(HttpAdapterClient(), policy)

    async def close(self) -> None:
        await self._client.close()


def ready_total(statuses: Sequence[AdapterStatus]) -> str:
    """The printer column: ``ready/total``."""
    return f"{sum(s.phase == READY for s in statuses)}/{len(statuses)}"

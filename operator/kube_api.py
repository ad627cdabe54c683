"""Raw JSON access to the Kubernetes REST API through the ``kubernetes`` asyncio client.

The operator reads and writes plain dicts (its builders produce dicts), so it uses the
client's transport, authentication and TLS handling (``kubernetes.aio``) and not its
generated model classes. Credentials: in-cluster service account, else ``$KUBECONFIG``
(read when connecting, not at import), else ``~/.kube/config``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
from typing import Any

import aiohttp
from kubernetes.aio import client as aio_client
from kubernetes.aio import config as aio_config
from kubernetes.aio.client.exceptions import ApiException

from kvpilot.operator.constants import FIELD_MANAGER

MERGE_PATCH = "application/merge-patch+json"
# Server-side apply: the body is the manager's whole intent (JSON is YAML).
APPLY_PATCH = "application/apply-patch+yaml"
# Names the operator's own requests in audit logs (kopf's say "kopf/<version>").
USER_AGENT = "kvpilot-operator"

logger = logging.getLogger(__name__)


FOREIGN_CONTROLLER = "ForeignController"  # reason: the name is taken by another controller's object
# Answers worth retrying soon: conflicts, throttling, server errors and timeouts (0 = no
# answer at all: connection refused or reset, or the request timed out).
TRANSIENT_STATUSES = frozenset({0, 409, 429, 500, 502, 503, 504})


class KubeError(Exception):
    """A non-2xx answer from the API server (status 0: no answer).

    Args:
        status: the HTTP status.
        message: the ``Status`` object's message, or the body.
        retry_after: seconds from a ``Retry-After`` header (429, 503), else None.
        reason: the ``Status`` object's reason (``AlreadyExists``, ``Conflict``, ...).
    """

    def __init__(self, status: int, message: str, retry_after: float | None = None,
                 reason: str = "") -> None:
        super().__init__(f"HTTP {status}: {message}")
        self.status = status
        self.message = message
        self.retry_after = retry_after
        self.reason = reason

    @property
    def transient(self) -> bool:
        """Whether the same request may well succeed if retried after a while (not so for
        a name held by someone else's object: that needs a person)."""
        return self.status in TRANSIENT_STATUSES and self.reason != FOREIGN_CONTROLLER

    @property
    def already_exists(self) -> bool:
        return self.status == 409 and self.reason == "AlreadyExists"


def _retry_after(value: str | None) -> float | None:
    """Seconds from a ``Retry-After`` header (the delay form; HTTP dates are not used by
    Kubernetes)."""
    try:
        return max(0.0, float(value)) if value else None
    except ValueError:
        return None


class KubeApi:
    """Plain-dict GET/PATCH (merge, server-side apply)/DELETE on API paths.

    Args:
        api_client: a connected ``kubernetes.aio.client.ApiClient``.
        timeout: seconds one request may take (a slow API server fails the request, and the
            caller retries later, rather than hanging a reconcile pass).
    """

    def __init__(self, api_client: aio_client.ApiClient, timeout: float = 30.0) -> None:
        self._client = api_client
        self._client.user_agent = USER_AGENT
        self._timeout = timeout
        self._active = 0
        self._idle = asyncio.Event()
        self._idle.set()
        self.closing = False

    @classmethod
    async def connect(cls, timeout: float = 30.0) -> KubeApi:
        """Configure from the service account in a pod, else from the kubeconfig file."""
        configuration = aio_client.Configuration()
        try:
            aio_config.load_incluster_config(client_configuration=configuration)
        except aio_config.ConfigException:
            path = os.environ.get("KUBECONFIG") or os.path.expanduser("~/.kube/config")
            await aio_config.load_kube_config(config_file=path, client_configuration=configuration,
                                              persist_config=False)
        return cls(aio_client.ApiClient(configuration), timeout)

    async def close(self, timeout: float = 10.0) -> None:
        """Refuse new requests, let the ones in flight finish (up to ``timeout``), close."""
        self.closing = True
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._idle.wait(), timeout)
        await self._client.close()

    async def request(self, method: str, path: str, body: Any = None,
                      content_type: str = "application/json",
                      query: list[tuple[str, str]] | None = None, raw: bool = False) -> Any:
        """One API call; returns the decoded JSON answer (``raw``: the text), raises KubeError
        on non-2xx."""
        if self.closing:
            raise KubeError(0, "the API client is closing (operator shutdown)")
        headers = {"Accept": "application/json", "Content-Type": content_type}
        self._active += 1
        self._idle.clear()
        try:
            serialized = await self._client.param_serialize(method, path, header_params=headers,
                                                            query_params=query, body=body,
                                                            auth_settings=["BearerToken"])
            response = await self._client.call_api(*serialized, _request_timeout=self._timeout)
            data = await response.read()
        except ApiException as exc:  # raised by some transports instead of a response
            raise KubeError(exc.status or 0, str(exc.reason)) from exc
        except (TimeoutError, aiohttp.ClientError) as exc:
            raise KubeError(0, f"{method} {path}: {type(exc).__name__}: {exc}") from exc
        finally:
            self._active -= 1
            if not self._active:
                self._idle.set()
        if not 200 <= response.status <= 299:
            try:
                status = json.loads(data)
                message = status.get("message") or data.decode(errors="replace")
                reason = status.get("reason") or ""
            except (ValueError, AttributeError):
                message, reason = data.decode(errors="replace"), ""
            raise KubeError(response.status, message, _retry_after(response.headers.get("Retry-After")),
                            reason)
        if raw:
            return data.decode(errors="replace")
        return json.loads(data) if data else {}

    async def get_text(self, path: str) -> str:
        """A plain-text answer: a pod's ``/metrics`` through the API server's pod proxy."""
        return await self.request("GET", path, raw=True)

    async def get(self, path: str) -> dict | None:
        """The object at ``path``, or None when it does not exist."""
        try:
            return await self.request("GET", path)
        except KubeError as exc:
            if exc.status == 404:
                return None
            raise

    async def merge_patch(self, path: str, patch: dict) -> dict:
        return await self.request("PATCH", path, patch, content_type=MERGE_PATCH,
                                  query=[("fieldManager", FIELD_MANAGER)])

    async def apply(self, path: str, body: dict, force: bool = True) -> dict:
        """Server-side apply ``body`` as the operator's field manager; creates the object when
        absent. ``force``: take over the fields of ``body`` from any other manager that set
        them to something else (the body holds only fields the operator owns)."""
        return await self.request("PATCH", path, body, content_type=APPLY_PATCH,
                                  query=[("fieldManager", FIELD_MANAGER), ("force", str(force).lower())])

    async def delete(self, path: str) -> bool:
        """Delete (background propagation); False when it was already gone."""
        try:
            await self.request("DELETE", path, {"kind": "DeleteOptions", "apiVersion": "v1",
                                                "propagationPolicy": "Background"})
            return True
        except KubeError as exc:
            if exc.status == 404:
                return False
            raise

    async def has_api(self, group: str, version: str) -> bool:
        """Whether the server serves ``group/version`` (discovery)."""
        return await self.get(f"/apis/{group}/{version}") is not None

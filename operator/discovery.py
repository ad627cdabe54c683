"""Which optional APIs the cluster serves, asked once and remembered until CRDs change.

The optional children (PodMonitor from the Prometheus operator, ScaledObject from KEDA)
exist only where their CRDs are installed. Asking the API server on every reconcile pass
costs a request per service per pass for an answer that changes only when someone
installs or removes a CRD, so the answer is cached per group/version and forgotten when
the operator sees a CustomResourceDefinition of that group change (``forget``).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable


class Discovery:
    """Cached ``group/version`` discovery.

    Args:
        probe: asks the API server whether it serves a group/version
            (``KubeApi.has_api``); called once per group/version until ``forget``.
    """

    def __init__(self, probe: Callable[[str, str], Awaitable[bool]]) -> None:
        self._probe = probe
        # one probe per key, shared by the passes that ask while it is in flight
        self._served: dict[tuple[str, str], asyncio.Future[bool]] = {}

    async def has_api(self, group: str, version: str) -> bool:
        """Whether the server serves ``group/version`` (from the cache when known).

        A probe that fails (the API server erred) is not remembered: the error goes to the
        caller and the next call asks again.
        """
        key = (group, version)
        future = self._served.get(key)
        if future is None:
            future = self._served[key] = asyncio.ensure_future(self._probe(group, version))
        try:
            return await asyncio.shield(future)
        except Exception:
            if self._served.get(key) is future:
                del self._served[key]
            raise

    def forget(self, group: str) -> bool:
        """Drop what is known about ``group``; returns whether anything was known."""
        keys = [key for key in self._served if key[0] == group]
        for key in keys:
            del self._served[key]
        return bool(keys)

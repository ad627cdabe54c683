"""The KV-connector API's worker half, and a connector as the engine holds it.

The scheduler half is ``kvpilot.engine.core.kv_connector.KVConnectorScheduler`` (torch-free,
called while scheduling); the worker half owns the transfers, on the engine's step:

    output = worker.get_finished()          # step start: what ended since the last step
    scheduler.update_connector_output(output)
    sched = scheduler.schedule()            # its metadata: sched.kv_connector_metadata
    worker.start_load_kv(metadata)          # before the forward
    runner.execute(sched)
    worker.save_kv(metadata)                # after the forward

vLLM's model runner makes the same calls around its forward (its ``KVConnectorModelRunnerMixin``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

from kvpilot.engine.core.kv_connector import KVConnectorOutput, KVConnectorScheduler


class KVConnectorWorker(Protocol):
    """The worker half of a KV connector."""

    def register_kv_caches(self, kv_caches: Any) -> None:
        """The runner's allocated KV cache (one tensor, or per-layer views); called once."""

    def start_load_kv(self, metadata: Any) -> None:
        """Start (or do) the step's loads, and whatever must precede the forward."""

    def save_kv(self, metadata: Any) -> None:
        """What the step's forward produced that the connector saves."""

    def get_finished(self) -> KVConnectorOutput | None:
        """Async loads and held sends that ended since the last call, and failed blocks."""

    def wait(self, timeout: float) -> None:
        """Block up to ``timeout`` seconds for transfer progress (an engine with nothing
        to compute but transfers in flight waits here instead of spinning)."""

    def close(self) -> None:
        """Finish or abandon what is in flight; release the transfer resources."""


@dataclass(frozen=True, slots=True)
class KVConnector:
    """A connector's two halves, built together (``factory.create_kv_connector``)."""

    name: str
    scheduler: KVConnectorScheduler
    worker: KVConnectorWorker
    # What a failed async block load does: recompute the tokens here, or fail the request.
    load_failure_policy: str = "recompute"

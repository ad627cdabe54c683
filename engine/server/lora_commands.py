"""LoRA load / unload applied to an engine, wherever it runs (the in-process engine
thread, the engine core process): the outcome as ``(AdapterInfo or None, exception or
None)``, the exception one the client raises to the route."""

from __future__ import annotations

import logging

from kvpilot.engine.lora.registry import LoRANotFoundError
from kvpilot.engine.server.engine_client import AdapterNotFound, RequestFailed, RequestRejected

logger = logging.getLogger(__name__)


def run_lora_command(engine, op: str, name: str, path: str | None, base_model_name: str | None):
    """``op`` is ``load`` (returns the new adapter's ``AdapterInfo``) or ``unload``."""
    try:
        if op == "load":
            engine.add_lora(name, path, base_model_name)
            return next(a for a in engine.list_loras() if a.name == name), None
        if op == "unload":
            engine.remove_lora(name)
            return None, None
        raise ValueError(f"unknown LoRA command {op!r}")
    except LoRANotFoundError as exc:
        return None, AdapterNotFound(str(exc))
    except ValueError as exc:
        return None, RequestRejected(str(exc))
    except Exception as exc:  # noqa: BLE001 - a broken load fails only the command
        logger.exception("LoRA %s of %r failed", op, name)
        return None, RequestFailed(f"{type(exc).__name__}: {exc}")

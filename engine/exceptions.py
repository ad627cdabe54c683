"""The engine's errors (torch-free): why it can no longer serve, how a process it needed
ended, and what a client of the engine core (``kvpilot.engine.runtime``) raises to its
caller.

``EngineDeadError``: a part of the engine the step needs is gone for good (a
tensor-parallel worker process died, or a collective between the ranks failed, which
leaves them out of step). Unlike a step that fails on bad input, retrying cannot help:
servers fail every request and report unhealthy at once.
"""

from __future__ import annotations

import signal


class EngineDeadError(RuntimeError):
    """The engine cannot serve any more; the message says why."""


def describe_exit(code: int | None) -> str:
    """How a process ended, from its exit status (``subprocess``'s: negative = signal)."""
    if code is None:
        return "is not responding"
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with status {code}"


# ---- what a client of the engine core raises to its caller (the routes, ``LLM``) ----------

class EngineNotReady(RuntimeError):
    """The engine is still being built."""


class EngineDead(RuntimeError):
    """The engine failed to build, broke down or is shutting down."""


class QueueFull(RuntimeError):
    """The waiting queue is at ``max_waiting_requests``."""


class RequestRejected(ValueError):
    """The engine refused the request (its input can never be served)."""


class AdapterNotFound(RequestRejected):
    """The request names a LoRA adapter the engine does not serve (any more)."""


class RequestFailed(RuntimeError):
    """The engine raised while serving the request."""


class KVTransferFailed(RequestFailed):
    """The request's KV could not be loaded from another engine (a disaggregated prefill
    instance) and the load-failure policy is ``fail``; the message says why."""


class StepTimeout(RequestFailed):
    """The engine made no progress on the request for longer than ``hang_timeout``."""


class EngineStalled(RuntimeError):
    """The engine has made no progress for ``hang_timeout``; no request is accepted until it does."""

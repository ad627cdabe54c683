"""Errors the engine raises to say it can no longer serve, and how a process it needed
ended (torch-free).

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

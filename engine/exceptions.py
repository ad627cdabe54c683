"""Errors the engine raises to say it can no longer serve (torch-free).

``EngineDeadError``: a part of the engine the step needs is gone for good (a
tensor-parallel worker process died, or a collective between the ranks failed, which
leaves them out of step). Unlike a step that fails on bad input, retrying cannot help:
servers fail every request and report unhealthy at once.
"""

from __future__ import annotations


class EngineDeadError(RuntimeError):
    """The engine cannot serve any more; the message says why."""

"""Killing an engine's only local worker process and stepping until the engine says so.

Shared by the tensor- and pipeline-parallel engine tests.
"""

from __future__ import annotations

import os
import signal
import time

import pytest

from kvpilot.engine import EngineDeadError, SamplingParams


def kill_worker_mid_request(engine, kind: str, limit_s: float = 5.0) -> int:
    """Runs a request a few steps, SIGKILLs the engine's one worker, and checks the next
    steps raise ``EngineDeadError`` naming ``kind`` worker rank 1 within ``limit_s``, and
    keep raising. Returns the killed pid."""
    engine.add_request("r", list(range(3, 40)), SamplingParams(temperature=0, max_tokens=200))
    for _ in range(3):
        engine.step()
    (pid,) = engine.workers.pids
    os.kill(pid, signal.SIGKILL)
    start = time.monotonic()
    with pytest.raises(EngineDeadError, match=rf"{kind} worker rank 1 \(pid {pid}\) was killed by SIGKILL"):
        while True:
            engine.step()
    assert time.monotonic() - start < limit_s
    with pytest.raises(EngineDeadError):     # and stays dead
        engine.step()
    return pid

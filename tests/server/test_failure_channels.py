"""The failure policy over every channel of the engine core (issue 42, acceptance 2).

One engine core (``kvpilot.engine.runtime.core``) serves three channels: the core process
(the default of ``kvpilot serve``), the engine thread (``--engine-in-process``) and the
caller's own thread (``LLM.generate``, ``kvpilot generate``). Covered elsewhere:
raising steps and hangs through both server channels (``test_engine_faults.py``) and a dead
tensor-parallel worker behind the core process (``test_tensor_parallel_failure.py``).
Here: a dead worker behind the engine thread, and raising steps and a dead worker for
the caller's thread. A hang has no watchdog there: the caller's thread is the one that
would have to notice (as with vLLM's ``LLM``); it is the serving channels' concern.
"""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest

from kvpilot.engine import LLM, EngineDeadError, SamplingParams
from kvpilot.engine.exceptions import RequestFailed
from kvpilot.engine.runtime.messages import MAX_CONSECUTIVE_STEP_FAILURES

pytestmark = pytest.mark.slow

PARAMS = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
DETECTION_LIMIT_S = 5.0


def test_raising_steps_fail_the_call_then_the_engine_for_the_callers_thread(monkeypatch):
    llm = LLM("demo", kv_cache_memory_bytes=8 << 20, max_model_len=256, max_num_seqs=4)
    good = llm.generate([[1, 2, 3]], PARAMS)[0].outputs[0].token_ids

    def broken(*args, **kwargs):
        raise RuntimeError("injected: device error")

    monkeypatch.setattr(llm.llm_engine.runner, "execute", broken)
    for _ in range(MAX_CONSECUTIVE_STEP_FAILURES):
        with pytest.raises(RequestFailed, match="injected: device error"):
            llm.generate([[1, 2, 3], [4, 5]], PARAMS)
        assert not llm.llm_engine.has_unfinished_requests()      # the batch was aborted
    monkeypatch.undo()
    # the policy's limit of consecutive failed steps: the engine is dead for good
    with pytest.raises(EngineDeadError, match="injected: device error"):
        llm.generate([[1, 2, 3]], PARAMS)
    assert good and not llm.llm_engine.has_unfinished_requests()
    llm.llm_engine.close()


def test_one_failed_step_is_transient_for_the_callers_thread(monkeypatch):
    llm = LLM("demo", kv_cache_memory_bytes=8 << 20, max_model_len=256, max_num_seqs=4)
    good = llm.generate([[1, 2, 3]], PARAMS)[0].outputs[0].token_ids
    execute = llm.llm_engine.runner.execute
    calls = {"n": 0}

    def once(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("injected: transient")
        return execute(*args, **kwargs)

    monkeypatch.setattr(llm.llm_engine.runner, "execute", once)
    with pytest.raises(RequestFailed, match="transient"):
        llm.generate([[1, 2, 3]], PARAMS)
    assert llm.generate([[1, 2, 3]], PARAMS)[0].outputs[0].token_ids == good
    llm.llm_engine.close()


def test_a_dead_worker_fails_the_call_at_once_for_the_callers_thread():
    llm = LLM("demo", tensor_parallel_size=2, kv_cache_memory_bytes=16 << 20, max_model_len=1024,
              max_num_seqs=4)
    try:
        llm.generate([[3, 4, 5]], PARAMS)            # warm
        (pid,) = llm.llm_engine.workers.pids
        killed = {}

        def kill() -> None:
            killed["at"] = time.monotonic()
            os.kill(pid, signal.SIGKILL)

        timer = threading.Timer(0.5, kill)
        timer.start()
        with pytest.raises(EngineDeadError, match=rf"tensor-parallel worker rank 1 \(pid {pid}\) "
                                                  r"was killed by SIGKILL"):
            llm.generate([list(range(3, 40))], SamplingParams(temperature=0, max_tokens=900,
                                                              ignore_eos=True))
        assert time.monotonic() - killed["at"] < DETECTION_LIMIT_S
        with pytest.raises(EngineDeadError):           # and it stays dead
            llm.generate([[3, 4, 5]], PARAMS)
    finally:
        llm.llm_engine.close()


def test_a_dead_worker_fails_requests_and_health_at_once_for_the_engine_thread(kill_mid_generation):
    import httpx

    from kvpilot.engine.engine_args import EngineArgs
    from kvpilot.engine.llm_engine import LLMEngine
    from kvpilot.engine.server.config import ServerConfig

    from support.in_process_server import serving

    args = EngineArgs(model="demo", tensor_parallel_size=2, kv_cache_memory_bytes=16 << 20,
                      max_model_len=1024, max_num_seqs=4, served_model_name="tp")
    engines = []

    def build():
        engines.append(LLMEngine(args))
        return engines[0]

    with serving(build, ServerConfig()) as base_url, httpx.Client(base_url=base_url, timeout=60) as http:
        (pid,) = engines[0].workers.pids
        death = kill_mid_generation(http, "tp", lambda: os.kill(pid, signal.SIGKILL), DETECTION_LIMIT_S)
        assert "the engine failed while serving this request (request id" in death.stream_error
        assert death.health.status_code == 503 and "SIGKILL" in death.health.json()["error"]["message"]
        assert death.plain.status_code == 500 and "(request id" in death.plain.json()["error"]["message"]
        assert death.refused.status_code == 503 and "SIGKILL" in death.refused.json()["error"]["message"]
        print(f"\n[engine thread, tensor-parallel worker killed] stream error after "
              f"{death.stream_failed_s:.2f} s, /health 503 after {death.health_failed_s:.2f} s")
        assert death.stream_failed_s < DETECTION_LIMIT_S and death.health_failed_s < DETECTION_LIMIT_S

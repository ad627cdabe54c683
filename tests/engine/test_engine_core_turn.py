"""The engine core's turn (``engine/runtime/core.py``) on a real demo engine: what
every channel (engine thread, core process, the caller's thread) relies on, checked once
here; the end-to-end failure tests of the channels are in ``tests/server/test_engine_faults.py``
and ``tests/server/test_failure_channels.py``."""

from __future__ import annotations

import pytest

from kvpilot.engine import LLM, SamplingParams
from kvpilot.engine.runtime.core import EngineCore
from kvpilot.engine.runtime.messages import (
    ADAPTER_NOT_FOUND,
    INVALID,
    MAX_CONSECUTIVE_STEP_FAILURES,
    AbortRequest,
    AddRequest,
    Rejected,
)

PARAMS = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def llm():
    llm = LLM("demo", dtype="float32", kv_cache_memory_bytes=8 << 20, max_model_len=256, max_num_seqs=4)
    yield llm
    llm.llm_engine.close()


@pytest.fixture
def engine(llm):
    """The module's engine; what a test leaves unfinished is aborted after it."""
    yield llm.llm_engine
    llm.llm_engine.abort_request(llm.llm_engine.unfinished_request_ids())


def _add(request_id: str, **kwargs) -> AddRequest:
    return AddRequest(request_id, [1, 2, 3, 4, 5], kwargs.pop("params", PARAMS), **kwargs)


def test_a_turn_serves_requests_to_the_end_as_offline_generate_does(llm, engine):
    core = EngineCore(engine)
    turn = core.turn([_add("a"), _add("b")])
    assert turn.stepped and turn.num_adds == 2 and turn.rejected == [] and turn.dead is None
    final = {}
    while True:
        final.update({out.request_id: out.outputs[0].token_ids for out in turn.outputs if out.finished})
        if not engine.has_unfinished_requests():
            break
        turn = core.turn([])
    (offline,) = llm.generate([[1, 2, 3, 4, 5]], PARAMS)
    assert final == {"a": offline.outputs[0].token_ids, "b": offline.outputs[0].token_ids}
    assert len(final["a"]) == 8
    assert not core.turn([]).stepped                       # nothing left: no step


def test_refused_adds_fail_alone_and_aborts_apply_in_order(engine):
    core = EngineCore(engine)
    turn = core.turn([_add("bad", params=SamplingParams(max_tokens=8, logprobs=10 ** 9)),
                      _add("lora", lora_name="no-such-adapter"),
                      _add("kept"), _add("gone"), AbortRequest("gone")])
    kinds = {r.request_id: r.kind for r in turn.rejected}
    assert kinds["bad"] == INVALID and kinds["lora"] in (INVALID, ADAPTER_NOT_FOUND)
    assert "kept" not in kinds and "gone" not in kinds
    assert turn.num_aborts == 1 and turn.num_adds == 4
    assert engine.unfinished_request_ids() == ["kept"]
    assert [type(outcome) for _, outcome in turn.applied] == [Rejected, Rejected, type(None), type(None),
                                                              type(None)]


def test_raising_steps_fail_their_requests_then_the_engine(engine, monkeypatch):
    core = EngineCore(engine)
    assert core.turn([_add("warm")]).dead is None
    while engine.has_unfinished_requests():
        core.turn([])

    def broken(*args, **kwargs):
        raise RuntimeError("injected: device error")

    monkeypatch.setattr(engine.runner, "execute", broken)
    for failure in range(1, MAX_CONSECUTIVE_STEP_FAILURES + 1):
        turn = core.turn([_add(f"r{failure}")])
        assert turn.failed_step == ([f"r{failure}"], "RuntimeError: injected: device error")
        assert not engine.has_unfinished_requests()            # aborted by the core
        assert (turn.dead is None) == (failure < MAX_CONSECUTIVE_STEP_FAILURES)
    assert isinstance(turn.dead, RuntimeError) and not turn.died_in_step


def test_one_good_step_resets_the_failure_count(engine, monkeypatch):
    core = EngineCore(engine)
    execute = engine.runner.execute
    calls = {"n": 0}

    def flaky(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] % MAX_CONSECUTIVE_STEP_FAILURES:       # fail, fail, succeed, ...
            raise RuntimeError("injected")
        return execute(*args, **kwargs)

    monkeypatch.setattr(engine.runner, "execute", flaky)
    for i in range(3 * MAX_CONSECUTIVE_STEP_FAILURES):
        assert core.turn([_add(f"r{i}")]).dead is None

"""With token-granular reuse on, a subscriber still rebuilds every tier exactly from the KV
events (``test_replica_view``'s workload and follower, with offload on and copies made),
and the outputs are the tokens the engine gives without reuse."""

from __future__ import annotations

import importlib.util
import random
from pathlib import Path

import pytest
import zmq

from kvpilot.engine import LLM, SamplingParams

# the follower and the workload, read from their own test file (test modules are no package)
_spec = importlib.util.spec_from_file_location("replica_view_case",
                                               Path(__file__).with_name("test_replica_view.py"))
_case = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_case)
NUM_REQUESTS = 400


def _outputs(llm, requests) -> list[list[int]]:
    engine, outs = llm.llm_engine, {}
    for i, (prompt, salt, max_tokens) in enumerate(requests):
        engine.add_request(f"r{i}", prompt, SamplingParams(temperature=0.0, max_tokens=max_tokens,
                                                           ignore_eos=True), cache_salt=salt)
        if i % 30 == 29 or i == len(requests) - 1:   # a wave: enough to preempt
            while engine.has_unfinished_requests():
                for out in engine.step():
                    if out.finished:
                        outs[out.request_id] = out.outputs[0].token_ids
            if i % 150 == 149:
                assert engine.reset_prefix_cache()
            yield outs


@pytest.mark.slow
def test_events_rebuild_every_tier_with_token_reuse(micro_model, tmp_path, one_thread):
    requests = list(_case.workload(random.Random(1), NUM_REQUESTS))
    plain = LLM(micro_model, **_case.ENGINE_KW, kv_offloading_disk_path=str(tmp_path / "plain"))
    expected = list(_outputs(plain, requests))[-1]
    plain.llm_engine.close()
    llm = LLM(micro_model, **_case.ENGINE_KW, kv_offloading_disk_path=str(tmp_path / "disk"),
              kv_events_config=_case.events_config(), token_granular_reuse=True)
    engine = llm.llm_engine
    copies = []
    schedule = engine.scheduler.schedule

    def counting_schedule():
        out = schedule()
        copies.extend(out.kv_copies)
        return out

    engine.scheduler.schedule = counting_schedule
    ctx = zmq.Context()
    follower = _case.Follower(ctx, engine)
    try:
        got = None
        for got in _outputs(llm, requests):   # noqa: B007 - the last wave's outputs are all of them
            follower.sync()
            follower.assert_matches_engine()
        assert got == expected
        stats = engine.get_stats()
        # (preemption with reuse on: tests/engine/test_token_reuse_books.py)
        assert len(copies) > 20 and stats.external_prefix_cache_hits > 0
        print(f"\n{NUM_REQUESTS} requests, {len(copies)} token-granular copies "
              f"({sum(n for _, _, n in copies)} tokens), blocks: {dict(sorted(follower.view.counts.items()))}")
    finally:
        ctx.destroy(linger=0)
        engine.close()

"""The persistent batch builds exactly the inputs the straightforward list-based builder does.

Oracle: ``metadata_from_seqs``, which builds a step's inputs from Python lists of
(new token ids, cached tokens, block ids) per sequence, the way the runner did before
the persistent batch. A real scheduler drives random traffic (chunked prefill under a
small budget, prefix hits, preemption under a tiny pool, aborts); every step the
persistent batch's inputs must equal the oracle's, and the tokens it records for each
row must equal the request's.
"""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from kvpilot.engine.config import SchedulerConfig
from kvpilot.engine.core.block_hash import root_hash
from kvpilot.engine.core.kv_cache_manager import KVCacheManager
from kvpilot.engine.core.request import Request, RequestStatus
from kvpilot.engine.core.scheduler import Scheduler
from kvpilot.engine.model.input_batch import InputBatch
from kvpilot.engine.model.runner import metadata_from_seqs
from kvpilot.engine.model.step_inputs import StepInputBuilder
from kvpilot.engine.sampling_params import SamplingParams

BLOCK, MAX_LEN, VOCAB = 4, 64, 50
CPU = torch.device("cpu")


def _oracle(scheduled):
    seqs = [(s.request.token_ids_slice(s.num_computed_tokens, s.num_computed_tokens + s.num_new_tokens),
             s.num_computed_tokens, list(s.block_ids)) for s in scheduled]
    return metadata_from_seqs(seqs, BLOCK, CPU)


@pytest.mark.parametrize("seed", range(4))
def test_inputs_match_the_list_builder_under_random_traffic(seed):
    rng = random.Random(seed)
    kv = KVCacheManager(24, BLOCK, enable_caching=True, hash_root=root_hash("t"))
    sched = Scheduler(SchedulerConfig(max_num_seqs=5, max_num_batched_tokens=20, max_model_len=MAX_LEN), kv)
    batch = InputBatch(5, MAX_LEN, BLOCK, VOCAB, CPU)
    builder = StepInputBuilder(batch, 20, CPU)
    shared = [rng.randrange(VOCAB) for _ in range(12)]
    preempted = 0
    for step in range(120):
        if rng.random() < 0.3:
            prompt = shared[:rng.randrange(13)] + [rng.randrange(VOCAB) for _ in range(rng.randrange(1, 15))]
            max_tokens = rng.randrange(1, MAX_LEN - len(prompt))
            sched.add_request(Request(f"r{step}", prompt, SamplingParams(max_tokens=max_tokens),
                                      max_tokens=max_tokens))
        if sched.running and rng.random() < 0.05:
            victim = rng.choice(sched.running).request_id
            sched.finish_requests(victim, RequestStatus.FINISHED_ABORTED)
            batch.release(victim)
        out = sched.schedule()
        rows = batch.update(out)
        assert all(rid not in batch.rows for rid in out.preempted_request_ids)
        preempted += len(out.preempted_request_ids)
        if out.is_empty:
            continue
        got = builder.build(out.scheduled, rows)
        ids, positions, meta = _oracle(out.scheduled)
        assert torch.equal(got.input_ids, ids) and torch.equal(got.positions, positions)
        m = got.metadata
        assert torch.equal(m.slot_mapping, meta.slot_mapping)
        assert torch.equal(m.seq_lens, meta.seq_lens)
        assert torch.equal(m.query_start_loc, meta.query_start_loc)
        assert torch.equal(m.block_tables, meta.block_tables)
        assert (m.query_lens_cpu, m.seq_lens_cpu, m.max_query_len, m.num_actual_tokens) == \
            (meta.query_lens_cpu, meta.seq_lens_cpu, meta.max_query_len, meta.num_actual_tokens)
        # prompt tokens in the step (a prefill, or a preempted request's recompute)
        assert m.computes_prompt == any(s.num_computed_tokens < len(s.request.prompt_token_ids)
                                        for s in out.scheduled)
        sampling = [s for s in out.scheduled if s.samples]
        assert got.sample_req_ids == [s.request.request_id for s in sampling]
        ends = np.cumsum([s.num_new_tokens for s in out.scheduled]) - 1
        expected_rows = [int(ends[i]) for i, s in enumerate(out.scheduled) if s.samples]
        assert got.logits_indices.tolist() == expected_rows
        tokens = [rng.randrange(VOCAB) for _ in sampling]
        batch.append_sampled(got.sample_rows, tokens)
        advanced = sched.update_from_output(out, {r: [t] for r, t in zip(got.sample_req_ids, tokens, strict=True)})
        for r in advanced:
            row = batch.rows[r.request_id]
            assert batch.token_ids[row, :batch.num_tokens[row]].tolist() == r.prompt_token_ids + r.output_token_ids
            if r.num_output_tokens >= r.max_tokens:
                sched.finish_requests(r.request_id, RequestStatus.FINISHED_LENGTH)
                batch.release(r.request_id)
    assert preempted > 0, "the traffic should preempt at least once"


def test_padded_decode_batch_is_inert():
    """A decode batch padded to a captured size: padding rows store nothing, attend nothing."""
    batch = InputBatch(8, MAX_LEN, BLOCK, VOCAB, CPU)
    builder = StepInputBuilder(batch, 32, CPU)
    kv = KVCacheManager(40, BLOCK, enable_caching=False, hash_root=root_hash("t"))
    sched = Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=32, max_model_len=MAX_LEN), kv)
    for i in range(3):
        sched.add_request(Request(f"r{i}", [1 + i] * (3 + i), SamplingParams(max_tokens=5), max_tokens=5))
    out = sched.schedule()                       # prefill: never padded
    got = builder.build(out.scheduled, batch.update(out), pad_for=lambda n: 8)
    assert got.padded_size is None
    batch.append_sampled(got.sample_rows, [7, 8, 9])
    sched.update_from_output(out, {r: [t] for r, t in zip(got.sample_req_ids, [7, 8, 9], strict=True)})
    out = sched.schedule()                       # decode of 3, padded to 8
    rows = batch.update(out)
    padded = builder.build(out.scheduled, rows, pad_for=lambda n: 8)
    assert padded.padded_size == 8
    m = padded.metadata
    assert padded.input_ids.shape == (8,) and padded.input_ids[:3].tolist() == [7, 8, 9]
    assert m.slot_mapping[3:].tolist() == [-1] * 5 and m.seq_lens[3:].tolist() == [0] * 5
    assert m.query_start_loc.tolist() == [0, 1, 2, 3, 3, 3, 3, 3, 3]
    assert m.block_tables.shape == (8, batch.max_blocks_per_seq)
    with pytest.raises(ValueError, match="cannot pad"):
        builder.build(out.scheduled, rows, pad_for=lambda n: 2)


def test_padded_decode_path_gives_the_eager_tokens(tiny_checkpoint):
    """The CUDA-graph path's inputs (decode batches padded to a captured size, static
    buffers, hidden states sliced back) give the eager path's greedy tokens. On CPU the
    "graph" runs the padded forward eagerly; the capture itself needs CUDA."""
    from kvpilot.engine import LLM, SamplingParams
    from kvpilot.engine.model.cuda_graphs import DecodeGraphs, capture_sizes

    path = str(tiny_checkpoint("qwen3"))
    prompts = [[5, 6, 7], [8] * 20, [9, 10], [11] * 5, [12] * 33]
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (9, 3, 6, 12, 2)]
    eager = [o.outputs[0].token_ids for o in
             LLM(path, dtype="float32", num_gpu_blocks=64, max_model_len=128).generate(prompts, params)]
    llm = LLM(path, dtype="float32", num_gpu_blocks=64, max_model_len=128, max_num_seqs=8)
    runner = llm.llm_engine.runner
    assert capture_sizes(8) == [1, 2, 4, 8] and capture_sizes(20) == [1, 2, 4, 8, 16, 20]
    runner.graphs = DecodeGraphs(runner.model, runner.inputs, runner.kv_caches, runner.backend,
                                 capture_sizes(8), 128)
    padded = []
    real_run = runner.graphs.run
    runner.graphs.run = lambda step, size: padded.append((len(step.sample_req_ids), size)) or \
        real_run(step, size)
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, params)] == eager
    assert {size for _, size in padded} == {8, 4, 2, 1}     # 5, 4, 3, 2, 1 running
    assert all(size == min(s for s in (1, 2, 4, 8) if s >= n) for n, size in padded)

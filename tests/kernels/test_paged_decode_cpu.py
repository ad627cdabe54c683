"""The compiled CPU decode kernel against the dense reference and the pure-torch path.

Decode rows (one query per sequence) of lengths 1 to 700, none a block multiple, over
shuffled block tables with NaN in every unused cache slot (the kernel must never read
one); head sizes 16/40/64/80/96/128/256, MHA, GQA 2/3/4 and MQA; fp32/fp16/bf16 against
``unified_attention_ref`` (fp32 on the same cache) within the shared tolerances, and
fp64 against the torch path; sliding windows shorter and longer than a sequence; the
engine's torch backend routing its decode rows and its short multi-token rows (a
speculative step's verification) to the kernel, beside a chunked prefill. Bad arguments are refused before any memory is read.
"""

from __future__ import annotations

import pytest
import torch

from kvpilot.engine.model.attention import select_attention_backend
from kvpilot.engine.model.attention.torch_backend import KERNEL_MAX_QUERY, paged_attention
from kvpilot.kernels import paged_decode_cpu
from kvpilot.kernels.paged_batch import make_paged_batch
from kvpilot.kernels.unified_attention import unified_attention_ref

from support.attention_helpers import TOL, assert_attention_close, attend, stored

pytestmark = pytest.mark.skipif(paged_decode_cpu.load() is None,
                                reason="the CPU decode kernel cannot be built here (no C++ compiler)")

DECODE = ((700, 1), (4, 1), (300, 1), (15, 1), (31, 1), (64, 1), (0, 1), (150, 1), (33, 1))


def _kernel(batch, sliding_window=None):
    m = batch.metadata
    n = len(m.query_lens_cpu)
    return paged_decode_cpu.paged_decode(batch.query[:n], batch.kv_cache, m.block_tables, m.seq_lens,
                                         batch.scale, sliding_window)


def _windowed_ref(batch, window):
    """Dense attention of each sequence's last token over its last ``window`` keys."""
    m = batch.metadata
    kv = batch.kv_cache.float()
    block_size = kv.shape[2]
    out = []
    for i, seq_len in enumerate(m.seq_lens_cpu):
        first = max(0, seq_len - window)
        pos = torch.arange(first, seq_len)
        slots = m.block_tables[i, pos // block_size].long() * block_size + pos % block_size
        k = kv[0].flatten(0, 1)[slots].transpose(0, 1)            # [kv_heads, L, dim]
        v = kv[1].flatten(0, 1)[slots].transpose(0, 1)
        q = batch.query[i].float()[:, None, :]                     # [heads, 1, dim]
        group = q.shape[0] // k.shape[0]
        k, v = k.repeat_interleave(group, 0), v.repeat_interleave(group, 0)
        weights = torch.softmax((q @ k.transpose(1, 2)) * batch.scale, dim=-1)
        out.append((weights @ v)[:, 0, :])
    return torch.stack(out)


@pytest.mark.parametrize(("dtype", "num_heads", "num_kv_heads", "head_dim", "block_size"), [
    (torch.float32, 4, 4, 64, 16),     # MHA
    (torch.float32, 4, 2, 16, 16),     # the micro model's heads
    (torch.float16, 4, 2, 128, 32),    # GQA 2
    (torch.bfloat16, 8, 4, 128, 16),   # head 128: the vector path's unrolled rows (64: the MHA case)
    (torch.bfloat16, 8, 2, 80, 16),    # GQA 4, head 80
    (torch.float32, 6, 2, 96, 32),     # GQA 3
    (torch.bfloat16, 4, 1, 96, 16),    # MQA
    (torch.bfloat16, 4, 2, 40, 16),    # a head that is not a whole number of 16-lane vectors
    (torch.float32, 4, 1, 256, 16),    # Gemma 3's heads: 32 vectors of 8 lanes, 64-key chunks
    (torch.bfloat16, 8, 2, 256, 16),
])
def test_decode_rows_match_the_dense_reference(dtype, num_heads, num_kv_heads, head_dim, block_size):
    batch = stored(make_paged_batch(DECODE, num_heads=num_heads, num_kv_heads=num_kv_heads,
                                     head_dim=head_dim, block_size=block_size, dtype=dtype,
                                     num_padding_tokens=0))
    assert_attention_close(_kernel(batch), attend(batch, unified_attention_ref), dtype)


@pytest.mark.parametrize(("dtype", "head_dim"), [(torch.bfloat16, 64), (torch.float32, 64), (torch.float32, 256)])
def test_a_rows_result_depends_on_neither_its_batch_nor_the_threads(dtype, head_dim):
    """Long rows are split into chunks that run in parallel and are merged: the chunks
    follow the row's length and the head width only, so a row alone, in a batch, on one or
    two threads, gives the same bits (speculative verification relies on it: its rows equal
    decode rows). A batch of nine takes every KV head of a sequence per work item, a row
    alone one KV head."""
    batch = stored(make_paged_batch(DECODE, num_heads=6, num_kv_heads=2, head_dim=head_dim, block_size=16,
                                     dtype=dtype, num_padding_tokens=0))
    m = batch.metadata
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        together = _kernel(batch)
        torch.set_num_threads(1)
        alone = [paged_decode_cpu.paged_decode(batch.query[i:i + 1], batch.kv_cache, m.block_tables[i:i + 1],
                                               m.seq_lens[i:i + 1], batch.scale)[0]
                 for i in range(len(m.query_lens_cpu))]
    finally:
        torch.set_num_threads(threads)
    assert max(m.seq_lens_cpu) > 512    # several chunks
    assert torch.equal(together, torch.stack(alone))


def test_float64_matches_the_torch_path():
    batch = stored(make_paged_batch(DECODE, num_heads=6, num_kv_heads=2, head_dim=64,
                                     dtype=torch.float64, fill="zero", num_padding_tokens=0))
    torch_path = paged_attention(batch.query, batch.kv_cache, batch.metadata, batch.scale,
                                 batch.k_scale, batch.v_scale)
    torch.testing.assert_close(_kernel(batch), torch_path, atol=1e-12, rtol=1e-12)


@pytest.mark.parametrize("window", [1, 7, 48, 1000])
def test_sliding_window_reads_only_the_last_keys(window):
    batch = stored(make_paged_batch(DECODE, num_heads=4, num_kv_heads=2, head_dim=64,
                                     fill="zero", num_padding_tokens=0))
    # blocks wholly before each window may have been released: poison them (neither
    # path may read them; the torch path also reads zeroed slots past a row's end)
    m, block_size = batch.metadata, batch.kv_cache.shape[2]
    for i, seq_len in enumerate(m.seq_lens_cpu):
        for b in range(max(0, seq_len - window) // block_size):
            batch.kv_cache[:, m.block_tables[i, b]] = float("nan")
    out = _kernel(batch, window)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, _windowed_ref(batch, window), atol=TOL[torch.float32],
                               rtol=TOL[torch.float32])
    torch_path = paged_attention(batch.query, batch.kv_cache, batch.metadata, batch.scale,
                                 batch.k_scale, batch.v_scale, sliding_window=window)
    torch.testing.assert_close(out, torch_path, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("window", [None, 40])
def test_the_cpu_backend_sends_decode_and_short_rows_to_the_kernel(window):
    """Decode rows, a 13-token chunk on a cached prefix (a speculative step's verification
    has this shape) and a fresh 9-token prefill go to the kernel, one row per token; a
    24-token chunk (over ``KERNEL_MAX_QUERY``) and a fresh 40-token prefill keep the masked
    path. With padding rows: the same output as the pure-torch path, padding rows zero."""
    specs = ((37, 1), (20, 13), (300, 1), (0, 9), (5, 1), (60, KERNEL_MAX_QUERY + 8), (0, 40))
    batch = stored(make_paged_batch(specs, num_heads=4, num_kv_heads=2, head_dim=64, fill="zero"))
    args = (batch.query, batch.kv_cache, batch.metadata, batch.scale, batch.k_scale, batch.v_scale)
    calls = []

    class Recorded:   # the real kernel, noting which rows it was given
        supports = staticmethod(paged_decode_cpu.supports)

        @staticmethod
        def paged_decode(query, kv_cache, tables, seq_lens, *rest):
            calls.append(seq_lens.tolist())
            return paged_decode_cpu.paged_decode(query, kv_cache, tables, seq_lens, *rest)

    with_kernel = paged_attention(*args, window, Recorded)
    # one call: each short sequence's tokens as rows ending at that token, in step order
    assert calls == [[38, *range(21, 34), 301, *range(1, 10), 6]]
    torch.testing.assert_close(with_kernel, paged_attention(*args, window), atol=1e-5, rtol=1e-5)
    n = batch.metadata.num_actual_tokens
    assert bool((with_kernel[n:] == 0).all())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_one_verification_row_matches_the_masked_path(dtype):
    """A step of one sequence's 7 new tokens (1 + 6 drafts) on a 130-token context: the
    kernel's rows are the step's tokens in order, and its output equals the masked path's."""
    batch = stored(make_paged_batch(((130, 7),), num_heads=4, num_kv_heads=2, head_dim=64, fill="zero",
                                    dtype=dtype))
    args = (batch.query, batch.kv_cache, batch.metadata, batch.scale, batch.k_scale, batch.v_scale)
    tol = {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 2e-2, "rtol": 2e-2}
    torch.testing.assert_close(paged_attention(*args, None, paged_decode_cpu), paged_attention(*args, None), **tol)


def test_the_backend_is_chosen_by_name():
    cpu = torch.device("cpu")
    assert select_attention_backend("auto", cpu).name == "cpu"
    assert select_attention_backend("cpu", cpu).decode_kernel is paged_decode_cpu
    assert select_attention_backend("torch", cpu).decode_kernel is None
    with pytest.raises(ValueError, match="runs on CPU only"):
        select_attention_backend("cpu", torch.device("cuda"))


def _good():
    batch = stored(make_paged_batch(((30, 1), (3, 1)), num_heads=4, num_kv_heads=2, head_dim=16,
                                     num_padding_tokens=0))
    m = batch.metadata
    return dict(query=batch.query, kv_cache=batch.kv_cache, block_tables=m.block_tables.clone(),
                seq_lens=m.seq_lens.clone(), scale=batch.scale)


def _table_entry(value):
    def mutate(a):
        a["block_tables"][0, 1] = value
    return mutate


@pytest.mark.parametrize(("mutate", "error", "match"), [
    (lambda a: a.update(query=a["query"][:, :3]), ValueError, "cannot attend over"),
    (lambda a: a.update(query=a["query"][0]), ValueError, "query must be"),
    (lambda a: a.update(kv_cache=a["kv_cache"].to(torch.float8_e4m3fn)), ValueError, "one dtype"),
    (lambda a: a.update(query=a["query"].half()), ValueError, "one dtype"),
    (lambda a: a.update(block_tables=a["block_tables"].long()), ValueError, "int32"),
    (lambda a: a.update(seq_lens=a["seq_lens"][:1]), ValueError, "seq_lens"),
    (lambda a: a.update(kv_cache=a["kv_cache"].transpose(1, 2)), ValueError, "must be"),
    (lambda a: a.update(sliding_window=0), ValueError, "sliding_window"),
    (_table_entry(10_000), RuntimeError, "outside the cache"),
    (_table_entry(-1), RuntimeError, "outside the cache"),
    (lambda a: a["seq_lens"].fill_(10_000), RuntimeError, "block table holds"),
    (lambda a: a["seq_lens"].fill_(0), RuntimeError, "has 0 tokens"),
])
def test_rejects_bad_arguments(mutate, error, match):
    args = _good()
    mutate(args)
    with pytest.raises(error, match=match):
        paged_decode_cpu.paged_decode(**args)

"""Compiled-kernel checks of split-KV attention, RMSNorm (+ residual) and rotary.

Each check runs its kernel on odd shapes (head sizes 64/80/96/128, non-power-of-two
hidden sizes and lengths, GQA/MQA) and compares with the kernel's pure-torch reference;
it returns one record per case (``name``, ``ok``, ``max_err``). ``smoke`` picks tiny
shapes so the same code runs on CPU through the Triton interpreter (the tests).
Used by ``kvpilot.engine.bench.kernels_gpu`` and ``scripts/gpu-check.sh``.
"""

from __future__ import annotations

import torch

TOL = {torch.float32: 5e-5, torch.float16: 4e-3, torch.bfloat16: 3e-2}


def _record(name: str, got: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> dict:
    err = (got.float() - ref.float()).abs().max().item() if got.numel() else 0.0
    ok = bool(torch.isfinite(got.float()).all()) and torch.allclose(
        got.float(), ref.float(), atol=TOL[dtype], rtol=TOL[dtype])
    print(f"  {name:<78} max|err| {err:.2e}  {'ok' if ok else 'FAIL'}")
    return {"name": name, "ok": ok, "max_err": err}


def check_split_kv(device, *, smoke: bool) -> list[dict]:
    """Split-KV decode against the dense reference (forced split counts)."""
    from kvpilot.kernels.kv_store import store_kv_cache_ref
    from kvpilot.kernels.paged_batch import make_paged_batch
    from kvpilot.kernels.unified_attention import unified_attention, unified_attention_ref

    cases = [  # dtype, cache, heads, kv_heads, head_dim, splits, specs
        (torch.bfloat16, None, 32, 8, 128, 8, ((8191, 1), (3000, 1), (77, 1))),
        (torch.float16, None, 12, 4, 80, 5, ((4097, 1), (1, 1))),
        (torch.bfloat16, None, 8, 1, 96, 16, ((16000, 1),)),
        (torch.bfloat16, torch.float8_e4m3fn, 16, 8, 64, 3, ((2049, 1), (999, 1))),
    ]
    if smoke:
        cases = [(d, c, max(2, h // 8), max(1, kv // 8), hd, sp, tuple((min(ctx, 90), q) for ctx, q in specs))
                 for d, c, h, kv, hd, sp, specs in cases[:2]]
    records = []
    for dtype, cache_dtype, heads, kv_heads, head_dim, splits, specs in cases:
        b = make_paged_batch(specs, num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim,
                             dtype=dtype, cache_dtype=cache_dtype, device=device)
        m = b.metadata
        store_kv_cache_ref(b.key, b.value, b.kv_cache[0], b.kv_cache[1], m.slot_mapping,
                           b.k_scale, b.v_scale)
        args = (b.query, b.kv_cache[0], b.kv_cache[1], m.block_tables, m.seq_lens, m.query_start_loc)
        out = unified_attention(*args, m.max_query_len, b.scale, b.k_scale, b.v_scale,
                                num_kv_splits=splits)
        ref = unified_attention_ref(*args, b.scale, b.k_scale, b.v_scale)
        n = m.num_actual_tokens
        name = (f"split-kv {str(dtype)[6:]} cache={str(cache_dtype or dtype)[6:]} heads={heads}/"
                f"{kv_heads} d={head_dim} splits={splits} L<={max(c for c, _ in specs) + 1}")
        records.append(_record(name, out[:n], ref[:n], dtype))
    return records


def check_rms_norm(device, *, smoke: bool) -> list[dict]:
    from kvpilot.kernels.rms_norm import rms_norm, rms_norm_ref

    cases = [(1, 4096, torch.bfloat16), (333, 1000, torch.float16), (64, 2560, torch.float32),
             (257, 5120, torch.bfloat16)]
    if smoke:
        cases = [(3, 80, torch.float32), (5, 96, torch.float16)]
    gen = torch.Generator(device=device).manual_seed(0)
    records = []
    for num_tokens, hidden, dtype in cases:
        x = torch.randn(num_tokens, hidden, generator=gen, device=device).to(dtype)
        res = torch.randn(num_tokens, hidden, generator=gen, device=device).to(dtype)
        w = (1 + 0.1 * torch.randn(hidden, generator=gen, device=device)).to(dtype)
        records.append(_record(f"rms_norm {str(dtype)[6:]} T={num_tokens} hidden={hidden}",
                               rms_norm(x, w, 1e-6), rms_norm_ref(x, w, 1e-6), dtype))
        got, got_res = rms_norm(x, w, 1e-6, res)
        ref, ref_res = rms_norm_ref(x, w, 1e-6, res)
        records.append(_record(f"rms_norm+residual {str(dtype)[6:]} T={num_tokens} hidden={hidden}",
                               torch.cat([got, got_res]), torch.cat([ref, ref_res]), dtype))
    return records


def check_rotary(device, *, smoke: bool) -> list[dict]:
    from kvpilot.contract.rope import RopeConfig
    from kvpilot.engine.model.layers.rotary import RotaryEmbedding
    from kvpilot.kernels.rotary import rotary_embedding, rotary_embedding_ref

    cases = [(128, 32, 8, 1000, torch.bfloat16, 1.0), (64, 14, 2, 7, torch.float16, 1.0),
             (96, 8, 1, 129, torch.bfloat16, 0.5), (80, 16, 16, 33, torch.float32, 1.0)]
    if smoke:
        cases = [(64, 6, 2, 5, torch.float32, 1.0), (96, 4, 1, 3, torch.float16, 0.5)]
    gen = torch.Generator(device=device).manual_seed(0)
    records = []
    for head_dim, heads, kv_heads, num_tokens, dtype, partial in cases:
        table = RotaryEmbedding(RopeConfig(theta=1e6, partial_rotary_factor=partial), head_dim,
                                8192, 8192).to(device)
        pos = torch.randint(0, 8192, (num_tokens,), generator=gen, device=device)
        q = torch.randn(num_tokens, heads, head_dim, generator=gen, device=device).to(dtype)
        k = torch.randn(num_tokens, kv_heads, head_dim, generator=gen, device=device).to(dtype)
        ref = rotary_embedding_ref(pos, q, k, table.cos_table, table.sin_table, table.rotary_dim)
        got = rotary_embedding(pos, q.clone(), k.clone(), table.cos_table, table.sin_table,
                               table.rotary_dim)
        name = (f"rotary {str(dtype)[6:]} d={head_dim} rot={table.rotary_dim} heads={heads}/"
                f"{kv_heads} T={num_tokens}")
        records.append(_record(name, torch.cat([got[0].flatten(), got[1].flatten()]),
                               torch.cat([ref[0].flatten(), ref[1].flatten()]), dtype))
    return records

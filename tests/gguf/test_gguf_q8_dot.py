"""The q8-activation path of the CPU GGUF kernel (``gguf_matmul_cpu.matmul_q8``).

Oracles:

- a pure-torch model of the path: each token's activations quantized per 32-value block
  exactly as the kernel does (``d = amax * (1/127)`` in float32, codes
  ``round_half_even(x * (127 / amax))``), then multiplied, in float64, by the ``gguf`` package's
  dequantization of the weight. The kernel's integer dot products and float32 scaling
  must match it to float32 rounding (and to the output dtype's rounding), for each type,
  both instruction sets (AVX512-VNNI, and the AVX2 fallback forced by its argument), batch
  sizes on both sides of the token tile, bfloat16/float16/float32 inputs;
- float64 ``F.linear`` over the dequantized weight: the activation rounding keeps the
  result within 2 % of its largest value (a kernel that drops a block's min, a scale or a
  block fails it);
- transformers' GGUF loader in float32 for a tiny GGUF Llama served in bfloat16 with
  the q8 path (the engine's default for 16-bit models): first
  step log-probabilities within 0.15 nats over the top 5 tokens, the first 3 greedy
  tokens equal.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T
from gguf.quants import dequantize as reference_dequantize

from kvpilot.engine.model.layers.gguf_linear import build_layout, gguf_linear, uses_q8
from kvpilot.kernels import gguf_matmul_cpu

from support.gguf_blocks import random_blocks
from support.q8_reference import assert_matches_q8_reference

Q8_TYPES = (T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0)
BATCHES = (1, 3, 16, 17, 33, 64)
# Rows wider than the kernel's 4,096-column tile, which it multiplies a tile's width at a
# time: Qwen2.5-0.5B's down_proj (a whole and a partial chunk), and 8,192 + 32 (two whole
# chunks, then one half-empty block pair)
WIDE_COLUMNS = (4864, 8224)
ISAS = [isa for isa in ("vnni", "avx2")
        if gguf_matmul_cpu.load() is not None and gguf_matmul_cpu.load().q8_isa() in
        ({1} if isa == "vnni" else {1, 2})]

pytestmark = pytest.mark.skipif(not ISAS, reason="no q8 path here (no compiler, or neither AVX2 nor VNNI)")


def _weight(qtype: T, rows: int, columns: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    raw = random_blocks(qtype, rows, columns, np.random.default_rng(seed))
    return torch.from_numpy(raw), torch.from_numpy(reference_dequantize(raw, qtype)).double()


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("qtype", Q8_TYPES, ids=lambda t: t.name)
def test_kernel_matches_the_q8_reference_to_float_rounding(qtype, isa):
    torch.manual_seed(int(qtype))
    rows, columns = 13, 96      # a partial row tile; 3 blocks: a half-empty block pair
    raw, weight = _weight(qtype, rows, columns, int(qtype))
    bias = torch.randn(rows)
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        for batch in BATCHES:
            x = (torch.randn(batch, columns) * torch.rand(batch, 1) * 4).to(dtype)
            x[0, :32] = 0                                # an all-zero block: scale 0
            y = gguf_matmul_cpu.matmul_q8(x, raw, int(qtype), bias if batch % 2 else None, isa=isa)
            assert y.dtype == dtype and y.shape == (batch, rows)
            assert_matches_q8_reference(y, x, weight, bias if batch % 2 else None)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("qtype", Q8_TYPES, ids=lambda t: t.name)
def test_rows_wider_than_the_kernels_tile_match_the_q8_reference(qtype, isa):
    """Each row's sums carried from one 4,096-column chunk to the next, the mins added once."""
    torch.manual_seed(200 + int(qtype))
    rows = 13                   # a partial row tile
    for columns in WIDE_COLUMNS:
        raw, weight = _weight(qtype, rows, columns, 200 + int(qtype))
        bias = torch.randn(rows)
        for dtype, batch in ((torch.bfloat16, 1), (torch.float16, 7), (torch.float32, 6)):  # token tiles + rest
            x = (torch.randn(batch, columns) * torch.rand(batch, 1) * 4).to(dtype)
            x[0, 4096:4128] = 0                          # an all-zero block in the second chunk
            y = gguf_matmul_cpu.matmul_q8(x, raw, int(qtype), bias if batch % 2 else None, isa=isa)
            assert y.dtype == dtype and y.shape == (batch, rows)
            assert_matches_q8_reference(y, x, weight, bias if batch % 2 else None)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("qtype", Q8_TYPES, ids=lambda t: t.name)
def test_kernel_is_close_to_f_linear_over_the_dequantized_weight(qtype, isa):
    torch.manual_seed(100 + int(qtype))
    rows, columns = 70, 576
    raw, weight = _weight(qtype, rows, columns, 100 + int(qtype))
    for batch in (1, 8, 33):
        x = torch.randn(batch, columns).to(torch.bfloat16)
        truth = x.double() @ weight.T
        y = gguf_matmul_cpu.matmul_q8(x, raw, int(qtype), isa=isa).double()
        float_path = gguf_matmul_cpu.matmul(x.float(), raw, int(qtype)).double()
        scale = truth.abs().max()
        assert (y - truth).abs().max() <= 2e-2 * scale
        assert (y - truth).norm() <= 1e-2 * truth.norm()
        assert (float_path - truth).abs().max() <= 1e-5 * scale     # the exact path stays exact


def test_the_layer_takes_the_q8_path_for_16_bit_activations_only(monkeypatch):
    monkeypatch.setenv(gguf_matmul_cpu.Q8_ENV, "0")
    assert not uses_q8(torch.bfloat16, int(T.Q4_1), 1)               # the switch
    monkeypatch.delenv(gguf_matmul_cpu.Q8_ENV)                        # on by default
    raw, weight = _weight(T.Q4_1, 40, 256, 3)
    layout = build_layout(256, [40], [int(T.Q4_1)])
    calls = []
    real = gguf_matmul_cpu.matmul_q8
    monkeypatch.setattr(gguf_matmul_cpu, "matmul_q8", lambda *a, **k: calls.append(a[0].shape) or real(*a, **k))
    flat = raw.reshape(-1)
    for dtype, batch, q8 in [(torch.bfloat16, 1, True), (torch.float16, gguf_matmul_cpu.Q8_MAX_BATCH, True),
                             (torch.float32, 1, False), (torch.bfloat16, gguf_matmul_cpu.Q8_MAX_BATCH + 1, False)]:
        calls.clear()
        x = torch.randn(batch, 256).to(dtype)
        y = gguf_linear(x, flat, None, layout)
        assert y.dtype == dtype and bool(calls) == q8 == uses_q8(dtype, int(T.Q4_1), batch)
        truth = x.double() @ weight.T
        assert (y.double() - truth).abs().max() <= 2e-2 * truth.abs().max()
    assert not uses_q8(torch.bfloat16, int(T.Q4_K), 1)              # k-quants: the float path


def test_the_isa_can_be_forced_and_refused(monkeypatch):
    monkeypatch.setenv(gguf_matmul_cpu.Q8_ENV, "1")
    monkeypatch.setenv(gguf_matmul_cpu.Q8_ISA_ENV, "avx2")
    assert gguf_matmul_cpu.q8_isa() == "avx2"
    monkeypatch.setenv(gguf_matmul_cpu.Q8_ISA_ENV, "off")
    assert gguf_matmul_cpu.q8_isa() is None
    assert not uses_q8(torch.bfloat16, int(T.Q4_1), 1)
    monkeypatch.setenv(gguf_matmul_cpu.Q8_ISA_ENV, "sse")
    with pytest.raises(ValueError, match="expected one of"):
        gguf_matmul_cpu.q8_isa()
    monkeypatch.delenv(gguf_matmul_cpu.Q8_ISA_ENV)
    assert gguf_matmul_cpu.q8_isa() == ISAS[0]
    raw, _ = _weight(T.Q4_K, 4, 256, 0)
    with pytest.raises(ValueError, match="no q8 path"):
        gguf_matmul_cpu.matmul_q8(torch.randn(1, 256), raw, int(T.Q4_K))


@pytest.mark.parametrize("qtype", ["Q4_1", "Q8_0"])
def test_a_bfloat16_engine_follows_transformers_gguf(tmp_path, qtype, monkeypatch):
    """A tiny GGUF Llama served in bfloat16 (its decode linears on the q8 path) against
    transformers' float32 GGUF model: log-probabilities of the first generated token's
    top 5 within 0.15 nats, and the same first 3 greedy tokens."""
    from transformers import AutoModelForCausalLM

    from kvpilot.engine import LLM, SamplingParams

    from support.gguf_files import VOCAB, write_gguf

    write_gguf(tmp_path / "model.gguf", "llama", qtype, seed=5)
    prompt = list(np.random.default_rng(5).integers(3, VOCAB, 12))
    prompt = [int(t) for t in prompt]
    hf = AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file="model.gguf", dtype=torch.float32).eval()
    with torch.no_grad():
        ids, hf_logprobs = list(prompt), None
        for _ in range(3):
            logits = hf(torch.tensor([ids])).logits[0, -1]
            hf_logprobs = torch.log_softmax(logits.double(), -1) if hf_logprobs is None else hf_logprobs
            ids.append(int(logits.argmax()))
    from kvpilot.engine.model.fused_decode import FusedDecode

    calls = []
    for name in ("matmul_q8", "matmul_q8_interleaved"):     # the layout the layer chose
        real = getattr(gguf_matmul_cpu, name)
        monkeypatch.setattr(gguf_matmul_cpu, name, lambda *a, real=real, **k: calls.append(1) or real(*a, **k))
    real_fused = FusedDecode.run     # or the fused decode step, which calls the same kernels natively
    monkeypatch.setattr(FusedDecode, "run", lambda *a: (out := real_fused(*a)) is not None and calls.append(1) or out)
    monkeypatch.delenv(gguf_matmul_cpu.Q8_ENV, raising=False)
    llm = LLM(str(tmp_path / "model.gguf"), dtype="bfloat16", num_gpu_blocks=16, max_model_len=64)
    out = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True,
                                                logprobs=5))[0].outputs[0]
    assert calls, "the decode steps did not take the q8 path"
    assert list(out.token_ids) == ids[len(prompt):]
    first = out.logprobs[0]
    assert len(first) >= 5
    for token, lp in first.items():
        assert abs(lp.logprob - hf_logprobs[token].item()) <= 0.15, (token, lp.logprob, hf_logprobs[token].item())

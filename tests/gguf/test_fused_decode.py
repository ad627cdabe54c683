"""The fused decode step (``engine/model/fused_decode.py``, ``kernels/fused_decode_cpu``):
all decoder layers of a decode step in one native call, bit for bit the layer path.

The oracle is the engine's own layer-by-layer path, which the GGUF parity tests check
against transformers and ``test_gguf_interleaved``/``test_gguf_q8_dot`` against the q8
reference. Every step the fused call takes here is run again through the layers on the
same inputs (writing the same K/V again) and the hidden states and residuals must be
equal to the bit: decode steps of several sequences of different lengths (prefix hits, a
pool small enough to share blocks) and n-gram verification steps of several tokens, on
Llama (Q4_1), Qwen2 (q/k/v bias, Q8_0), Qwen3 (per-head q/k norms, Q4_0) and Gemma 3 (Q8_0)
files, a Qwen2 file whose down_proj is wider than the q8 kernel's 4,096-column tile (Q5_1:
GGUF rows, its sums carried across chunks of the row), and Qwen2, Qwen3 and Gemma 3 bfloat16
checkpoints (oneDNN-packed projections). The Gemma 3 models have 5 local layers to 1 global
(windows of 16 and 32 tokens, their own rope) and contexts past the window: a hybrid KV
cache, each layer reading its group's tables, as for a Qwen2 checkpoint whose second layer
has a window of 8.
"""

from __future__ import annotations

import logging

import pytest
import torch

from kvpilot.engine import LLM, SamplingParams
from kvpilot.engine.model import auto_dtype, fused_decode
from kvpilot.engine.model.cpu_info import CPUInfo
from kvpilot.engine.model.layers import packed_linear
from kvpilot.kernels import fused_decode_cpu, gguf_matmul_cpu
from kvpilot.kernels.attention_metadata import AttentionMetadata

from support.gemma3_checkpoints import build_gemma3
from support.gguf_files import write_gguf
from support.tiny_checkpoints import build_checkpoint, save_tokenizer

pytestmark = pytest.mark.skipif(
    gguf_matmul_cpu.load() is None or gguf_matmul_cpu.q8_isa() is None or fused_decode_cpu.load() is None,
    reason="the fused decode step needs the q8 GGUF path (AVX2 or AVX512-VNNI) and a C++ compiler")

NO_BF16_CPU = CPUInfo("AMD EPYC 7B13", 2, frozenset({"avx2", "fma", "f16c"}))
# a down_proj of 4,160 inputs: past the 4,096 that the q8 path once stopped at
WIDE = {"intermediate_size": 4160}
SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 4}


def _prompts() -> list[list[int]]:
    """Repeating patterns (n-gram drafts), of different lengths; two share a prefix."""
    shared = [7, 8, 9, 10] * 8
    return [[11, 12, 13] * 5, shared + [20, 21], shared + [30, 31, 32, 33] * 3, [40, 41]]


def _model(tmp_path, kind: str, weights: str, tied: bool = False) -> str:
    """A GGUF file of ``weights`` (a ggml type), or a bfloat16 checkpoint (its projections
    prepacked for oneDNN as they load); ``KIND-wide``: ``kind`` with the ``WIDE`` MLP;
    ``tied``: the GGUF's token embedding is its LM head."""
    if weights == "bf16-checkpoint" and kind == "gemma3":
        path = build_gemma3(tmp_path / "ckpt", seed=3)   # float32, loaded in bfloat16
        save_tokenizer(path, 512)
        return str(path)
    if kind == "qwen2-window":   # a window of 8 on its second layer: a hybrid KV cache
        return str(build_checkpoint(tmp_path / "ckpt", "qwen2", seed=3, dtype=torch.bfloat16,
                                    use_sliding_window=True, sliding_window=8, max_window_layers=1))
    if weights == "bf16-checkpoint":
        return str(build_checkpoint(tmp_path / "ckpt", kind, seed=3, dtype=torch.bfloat16))
    kind, wide = kind.removesuffix("-wide"), kind.endswith("-wide")
    overrides = {**(WIDE if wide else {}), **({"tie_word_embeddings": True} if tied else {})}
    return str(write_gguf(tmp_path / "model.gguf", kind, weights, seed=3, overrides=overrides or None))


@pytest.mark.parametrize(("kind", "weights"), [("llama", "Q4_1"), ("qwen2", "Q8_0"), ("qwen3", "Q4_0"),
                                               ("qwen2-wide", "Q5_1"), ("gemma3", "Q8_0"),
                                               ("llama", "Q4_1-float32"), ("qwen2", "Q8_0-float32"),
                                               ("qwen2", "bf16-checkpoint"), ("qwen3", "bf16-checkpoint"),
                                               ("gemma3", "bf16-checkpoint"), ("qwen2-window", "bf16-checkpoint")])
def test_every_fused_step_equals_the_layers_bit_for_bit(tmp_path, monkeypatch, kind, weights):
    """``TYPE-float32``: a float32 engine that ``--dtype auto`` chose on a CPU without native
    bfloat16, its decode tokens on the q8 path in float32 (``ModelConfig.gguf_float32_q8``);
    its LM head is the tied GGUF embedding, whose kernel gives a row the same bits in a
    verification step as alone (a float32 head's ``F.linear`` need not: MKL's product of one
    row and of several round differently, which 16-bit logits hide)."""
    if weights == "bf16-checkpoint" and not packed_linear.available():
        pytest.skip("no oneDNN packing in this torch build")
    dtype = "bfloat16"
    if weights.endswith("-float32"):
        monkeypatch.setattr(auto_dtype, "cpu_info", lambda: NO_BF16_CPU)
        weights, dtype = weights.removesuffix("-float32"), "auto"
    path = _model(tmp_path, kind, weights, tied=dtype == "auto")
    llm = LLM(path, dtype=dtype, num_gpu_blocks=64, max_model_len=256, max_num_seqs=4, speculative_config=SPEC)
    try:
        model = llm.llm_engine.runner.model
        assert model.fused_decode is not None
        assert model.fused_decode.dtype == (torch.float32 if dtype == "auto" else torch.bfloat16)
        if kind.endswith("-wide"):   # the wide projection in GGUF rows, multiplied by matmul_q8 in the step
            down = model.layers[0].mlp.down_proj.gguf
            assert down.columns == WIDE["intermediate_size"] and not down.interleaved
        seen = {"steps": 0, "rows": set(), "verify": 0, "hybrid": 0}
        real_run = fused_decode.FusedDecode.run

        def checked_run(self, positions, hidden, residual, kv_caches, metadata):
            out = real_run(self, positions, hidden, residual, kv_caches, metadata)
            if out is not None:
                layers = model._run_layers(positions, hidden, residual, kv_caches, metadata, llm.llm_engine.runner.backend)
                assert torch.equal(out[0], layers[0]) and torch.equal(out[1], layers[1])
                seen["steps"] += 1
                seen["rows"].add(hidden.shape[0])
                hybrid = not isinstance(metadata, AttentionMetadata)
                seen["verify"] += (metadata[0] if hybrid else metadata).max_query_len > 1
                seen["hybrid"] += hybrid
            return out

        monkeypatch.setattr(fused_decode.FusedDecode, "run", checked_run)
        # the tiny Gemma 3 and tied models repeat their drafts more (fewer steps): longer runs
        params = SamplingParams(temperature=0.0, max_tokens=64 if dtype == "auto" else 40 if kind == "gemma3" else 24,
                                ignore_eos=True, logprobs=1)
        fused = llm.generate(_prompts(), params)
    finally:
        llm.llm_engine.close()
    assert seen["steps"] > 10 and max(seen["rows"]) > 1 and seen["verify"] > 0, seen
    assert (seen["hybrid"] == seen["steps"]) == (kind in ("gemma3", "qwen2-window")), seen

    monkeypatch.setenv(fused_decode.FUSED_DECODE_ENV, "0")
    plain = LLM(path, dtype=dtype, num_gpu_blocks=64, max_model_len=256, max_num_seqs=4)
    try:
        assert plain.llm_engine.runner.model.fused_decode is None
        layered = plain.generate(_prompts(), params)
    finally:
        plain.llm_engine.close()
    for a, b in zip(fused, layered, strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert [sorted((t, p.logprob) for t, p in d.items()) for d in a.outputs[0].logprobs] == \
            [sorted((t, p.logprob) for t, p in d.items()) for d in b.outputs[0].logprobs]


def test_models_the_kernel_does_not_run_exactly_keep_the_layers(tmp_path, caplog):
    write_gguf(tmp_path / "llama.gguf", "llama", "Q4_1", seed=4)
    write_gguf(tmp_path / "k-quants.gguf", "llama", "Q4_K", seed=4)
    write_gguf(tmp_path / "gemma.gguf", "gemma3", "Q8_0", seed=4)
    cases = [("llama.gguf", "float32", "no q8 path"),            # float32 keeps the exact float path
             ("llama.gguf", "bfloat16", None),
             ("k-quants.gguf", "bfloat16", "no q8 path for ggml type 12"),   # 256-value blocks
             ("gemma.gguf", "float32", "no q8 path"),
             ("gemma.gguf", "bfloat16", None)]
    for name, dtype, reason in cases:
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="kvpilot.engine.model.fused_decode"):
            llm = LLM(str(tmp_path / name), dtype=dtype, num_gpu_blocks=32, max_model_len=128)
        try:
            built = llm.llm_engine.runner.model.fused_decode
        finally:
            llm.llm_engine.close()
        assert (built is None) == (reason is not None), (name, dtype)
        if reason is not None:
            assert reason in caplog.text


def test_the_kernel_refuses_swapped_entry_points_and_bad_steps():
    ops = fused_decode_cpu.entry_points()
    swapped = {**ops, "silu_mul": ops["store_kv"]}
    with pytest.raises(TypeError, match="kvpilot.silu_mul"):
        fused_decode_cpu.load().DecodeLayers(swapped, 4, 2, 64, 0.125)
    with pytest.raises(ValueError, match="share"):
        fused_decode_cpu.new_decoder(4, 3, 64, 0.125)
    layers = fused_decode_cpu.new_decoder(4, 2, 64, 0.125)
    hidden = torch.zeros(2, 256, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="one KV cache per layer"):
        layers.forward(hidden, None, torch.zeros(2, dtype=torch.long), [torch.zeros(1)],
                       [torch.zeros(2, dtype=torch.long)], 2, [torch.zeros(2, 1, dtype=torch.int32)],
                       [torch.ones(2, dtype=torch.int32)])
    with pytest.raises(RuntimeError, match="four linears"):
        layers.add_layer(torch.ones(256), torch.ones(256), None, None, 1e-6, torch.ones(8, 64), torch.ones(8, 64), 64,
                         [], [], [], [])
    q8 = [torch.zeros(rows, 34, dtype=torch.uint8) for rows in (512, 256, 1024, 256)]   # Q8_0 [rows, 32 values]
    linears = (q8, [8] * 4, [None] * 4, [-1] * 4)
    for options, message in ((dict(norm_form="rms"), "a norm form"), (dict(activation="relu"), "an activation"),
                             (dict(post_attn_norm=torch.ones(256)), "come together"),
                             (dict(sliding_window=-1), "sliding window")):
        with pytest.raises(RuntimeError, match=message):
            layers.add_layer(torch.ones(256), torch.ones(256), None, None, 1e-6, torch.ones(8, 64), torch.ones(8, 64),
                             64, *linears, **options)
    assert layers.num_layers() == 0

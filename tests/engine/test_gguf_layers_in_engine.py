"""GGUF block weights inside a running engine: every decoder linear layer, the token
embedding and the LM head of a tiny Llama given GGUF storage (``layers.gguf_linear``) generates the same greedy tokens as the same
engine holding the ``gguf`` package's dequantization of those blocks as float32 weights,
through prefill (the tiled path), decode (the kernel) and prefix hits."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T
from gguf.quants import dequantize

from kvpilot.engine import LLM, SamplingParams
from kvpilot.engine.model.layers.gguf_linear import (
    load_gguf_weight,
    resident_bytes,
    use_gguf_embedding,
    use_gguf_weight,
)
from kvpilot.kernels import gguf_matmul_cpu

from support.gguf_blocks import random_blocks

LINEARS = ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj")
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)

pytestmark = pytest.mark.skipif(gguf_matmul_cpu.load() is None, reason="no C++ compiler here")


def _blocks(qtype: T, weight: torch.Tensor, rng: np.random.Generator) -> np.ndarray:
    if qtype in (T.Q8_0, T.Q4_0, T.Q4_1):     # the checkpoint's own weights, quantized
        from gguf.quants import quantize

        return quantize(weight.numpy(), qtype)
    return random_blocks(qtype, *weight.shape, rng)


def _swap_in_gguf(quantized: LLM, dense: LLM, qtypes: tuple[T, ...], rng: np.random.Generator) -> int:
    """Each layer of ``quantized`` gets GGUF blocks (one type per part, cycling through
    ``qtypes``); ``dense`` gets their dequantized values. Returns the blocks' bytes and
    checks that the layers hold exactly those."""
    total = 0
    for q_layer, d_layer in zip(quantized.llm_engine.runner.model.layers,
                                dense.llm_engine.runner.model.layers, strict=True):
        for name in LINEARS:
            q, d = q_layer.get_submodule(name), d_layer.get_submodule(name)
            sizes = getattr(d, "output_sizes", [d.weight.shape[0]])
            types = [qtypes[i % len(qtypes)] for i in range(len(sizes))]
            parts = torch.split(d.weight.detach(), sizes)
            raws = [_blocks(t, p, rng) for t, p in zip(types, parts, strict=True)]
            assert use_gguf_weight(q, [int(t) for t in types]) is None
            for i, (t, raw) in enumerate(zip(types, raws, strict=True)):
                load_gguf_weight(q, raw, int(t), shard_id=i if len(sizes) > 1 else None)
            assert resident_bytes(q) == sum(r.nbytes for r in raws)
            total += sum(r.nbytes for r in raws)
            with torch.no_grad():
                d.weight.copy_(torch.cat([torch.from_numpy(dequantize(r, t)) for t, r in zip(types, raws, strict=True)]))
    for name in ("embed_tokens", "lm_head"):      # the embedding, and the untied LM head
        q, d = (llm.llm_engine.runner.model.get_submodule(name) for llm in (quantized, dense))
        raw = _blocks(qtypes[0], d.weight.detach(), rng)
        assert use_gguf_embedding(q, int(qtypes[0])) is None
        load_gguf_weight(q, raw, int(qtypes[0]))
        assert resident_bytes(q) == raw.nbytes
        total += raw.nbytes
        with torch.no_grad():
            d.weight.copy_(torch.from_numpy(dequantize(raw, qtypes[0])))
    dense.llm_engine.runner.model.use_transposed_output_weight()    # the CPU head's copy, renewed
    return total


@pytest.mark.parametrize("qtypes", [(T.Q8_0,), (T.Q4_1, T.Q4_0), (T.Q4_K, T.Q6_K, T.Q5_K)],
                         ids=["Q8_0", "Q4_1+Q4_0", "Q4_K+Q6_K+Q5_K"])
def test_gguf_layers_generate_like_their_dequantized_weights(tiny_checkpoint, qtypes):
    path = str(tiny_checkpoint("llama", hidden_size=256, intermediate_size=512))
    kw = dict(dtype="float32", num_gpu_blocks=64, max_model_len=256, max_num_batched_tokens=48)
    quantized, dense = LLM(path, **kw), LLM(path, **kw)
    before = resident_bytes(quantized.llm_engine.runner.model)
    model = quantized.llm_engine.runner.model
    assert model.lm_head is not None
    linears = sum(resident_bytes(layer.get_submodule(name)) for layer in model.layers for name in LINEARS)
    linears += resident_bytes(model.embed_tokens) + resident_bytes(model.lm_head)
    blocks = _swap_in_gguf(quantized, dense, qtypes, np.random.default_rng(0))
    assert blocks < linears * 0.3       # at most 8.5 bits a weight against float32's 32
    assert resident_bytes(model) == before - linears + blocks
    rng = np.random.default_rng(1)
    shared = rng.integers(3, 512, 40).tolist()
    prompts = [rng.integers(3, 512, n).tolist() for n in (1, 7, 90)] + [shared + [5], shared + [6, 7]]
    expected = [o.outputs[0].token_ids for o in dense.generate(prompts, GREEDY)]
    got = [o.outputs[0].token_ids for o in quantized.generate(prompts, GREEDY)]
    assert got == expected
    assert quantized.get_stats().prefix_cache_hits > 0

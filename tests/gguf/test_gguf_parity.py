"""GGUF files run token-identical to transformers' GGUF loader, for every supported
architecture layout x GGML type.

Each case writes a tiny seeded model as a GGUF file (``support.gguf_files``: llama.cpp's
names, its Llama q/k permutation, Gemma's ``1 + weight`` norms; weights in F32, F16,
Q8_0, Q4_0, Q4_1, or random Q4_K / Q5_K / Q6_K blocks); the oracle is
``AutoModelForCausalLM.from_pretrained(dir, gguf_file=...)`` in float32, greedy. The
engine runs the same token prompts with prefix caching on (two prompts share two blocks)
and chunked prefill under a small token budget, float32 activations. The quantized types'
linear layers and token embedding stay in their GGUF blocks (``layers.gguf_linear``):
prefill multiplies decoded tiles, decode runs the CPU kernel on the blocks. Gemma 3's prompts outrun its sliding
window (16 tokens).
"""

from __future__ import annotations

import random

import pytest

from kvpilot.contract.gguf import KEPT_QUANTIZED
from kvpilot.engine import LLM, SamplingParams
from kvpilot.kernels import gguf_matmul_cpu

from support.gguf_files import KINDS, VOCAB, write_gguf
from support.hf_oracle import hf_greedy

QTYPES = ["F32", "F16", "Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q5_K", "Q6_K"]
MAX_NEW = 6
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)


def prompts(seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    rand = lambda n: [rng.randrange(3, VOCAB) for _ in range(n)]  # noqa: E731
    shared = rand(32)
    return [rand(1), rand(9), shared + rand(5), shared + rand(20)]


@pytest.mark.parametrize("qtype", QTYPES)
@pytest.mark.parametrize("kind", list(KINDS))
def test_greedy_matches_transformers_gguf(tmp_path, kind, qtype):
    seed = list(KINDS).index(kind) * 10 + QTYPES.index(qtype)
    write_gguf(tmp_path / "model.gguf", kind, qtype, seed=seed)
    cases = prompts(seed)
    expected = hf_greedy(tmp_path, cases, MAX_NEW, gguf_file="model.gguf")
    assert len({t for out in expected for t in out}) > 3     # not one repeated token
    llm = LLM(str(tmp_path / "model.gguf"), dtype="float32", num_gpu_blocks=64, max_model_len=256,
              max_num_batched_tokens=32)
    model = llm.llm_engine.runner.model
    kept = qtype in KEPT_QUANTIZED and gguf_matmul_cpu.load() is not None
    assert (model.layers[0].mlp.down_proj.gguf is not None) == kept       # the blocks, multiplied as stored
    assert (model.embed_tokens.gguf is not None) == kept
    assert llm.llm_engine.model_config.arch.num_hidden_layers == KINDS[kind][1]["num_hidden_layers"]
    got = [o.outputs[0].token_ids for o in llm.generate(cases, GREEDY)]
    assert got == expected
    assert llm.get_stats().prefix_cache_hits >= 32

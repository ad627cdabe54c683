"""Shared set-up of the KV offload tests.

A small Qwen3 checkpoint (4 layers, hidden 128, vocabulary 4,096, output projection
sharpened so that greedy decoding does not tie) with the demo model's tokenizer files:
prefilling 1,500 tokens takes a fraction of a second, and outputs depend on every
token, so KV that was restored wrongly changes them.

The device pool (100 blocks of 16 tokens) is too small to keep a 1,500-token prefix
while another 1,500-token request runs, so the prefix is evicted between the first
request and the one that shares it. The no-offload engine's outputs are the oracle
(that engine is itself checked token-for-token against HF transformers in tests/engine).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from kvpilot.engine import LLM

from support.offload_helpers import ENGINE_KW, GREEDY, build_offload_model, make_prompts


@pytest.fixture(scope="session")
def offload_model(demo_model_dir, tmp_path_factory) -> str:
    return str(build_offload_model(tmp_path_factory.mktemp("offload-model"), Path(demo_model_dir)))


@pytest.fixture(scope="session")
def prompts():
    return make_prompts()


@pytest.fixture(scope="session")
def reference(offload_model, prompts):
    """No-offload outputs of ``second`` and ``third``: {prompt tuple: CompletionOutput}."""
    llm = LLM(offload_model, **ENGINE_KW)
    outs = llm.generate([prompts.second, prompts.third], GREEDY)
    return {tuple(p): o.outputs[0] for p, o in zip([prompts.second, prompts.third], outs, strict=True)}

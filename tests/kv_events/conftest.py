"""KV-event tests: a micro model (2 layers, hidden 64, vocabulary 1,024) with the demo
model's tokenizer files, so that thousands of requests run in seconds."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from support.kv_event_subscriber import MICRO_VOCAB


@pytest.fixture(scope="session")
def micro_model(demo_model_dir, tmp_path_factory) -> str:
    import torch
    import transformers

    path = tmp_path_factory.mktemp("kv-events-model")
    config = transformers.Qwen3Config(
        vocab_size=MICRO_VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, head_dim=32, max_position_embeddings=1024,
        rms_norm_eps=1e-6, tie_word_embeddings=False, bos_token_id=151643, eos_token_id=151645)
    torch.manual_seed(0)
    transformers.Qwen3ForCausalLM(config).save_pretrained(path, safe_serialization=True)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(Path(demo_model_dir) / name, path / name)
    return str(path)


@pytest.fixture
def one_thread():
    """One intra-op thread: the micro model's matmuls are too small to split, and on a
    loaded 2-core machine a second thread only makes each step wait for it."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)

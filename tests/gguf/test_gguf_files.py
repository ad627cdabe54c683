"""Which GGUF file ``--model`` names, and ``--hf-config-path`` (EngineArgs resolution,
no model loaded)."""

from __future__ import annotations

import json

import pytest

from kvpilot.contract.gguf import find_gguf
from kvpilot.engine.engine_args import EngineArgs

from support.gguf_files import hf_model, write_gguf


@pytest.fixture(scope="module")
def gguf_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("gguf")
    write_gguf(path / "tiny-qwen3.Q8_0.gguf", "qwen3", "Q8_0")
    return path


def test_model_is_the_file_or_the_directory_holding_it(gguf_dir, tmp_path):
    file = gguf_dir / "tiny-qwen3.Q8_0.gguf"
    assert find_gguf(file) == file and find_gguf(gguf_dir) == file
    for model in (file, gguf_dir):
        config = EngineArgs(str(model), max_model_len=128).create_configs()[0]
        assert config.model == str(file)
        assert config.served_model_name == "tiny-qwen3.Q8_0"
        assert config.arch.architecture == "Qwen3ForCausalLM" and config.arch.head_dim == 128
    (tmp_path / "a.gguf").write_bytes(file.read_bytes())
    (tmp_path / "b.gguf").write_bytes(file.read_bytes())
    with pytest.raises(ValueError, match="several GGUF files"):
        EngineArgs(str(tmp_path)).create_configs()
    (tmp_path / "a.gguf").unlink()
    (tmp_path / "b.gguf").write_bytes(b"not a gguf file")
    with pytest.raises(ValueError, match="not a readable GGUF file"):
        EngineArgs(str(tmp_path)).create_configs()


def test_hf_config_path_replaces_the_metadata(gguf_dir, tmp_path):
    cfg = hf_model("qwen3").config.to_dict()
    cfg.update(architectures=["Qwen3ForCausalLM"], max_position_embeddings=384)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    from_meta = EngineArgs(str(gguf_dir)).create_configs()[0]
    overridden = EngineArgs(str(gguf_dir), hf_config_path=str(tmp_path)).create_configs()[0]
    assert from_meta.max_model_len == 1024 and overridden.max_model_len == 384
    assert overridden.arch.head_dim == from_meta.arch.head_dim
    with pytest.raises(ValueError, match="applies to a GGUF model"):
        EngineArgs(str(tmp_path), hf_config_path=str(tmp_path)).create_configs()
    with pytest.raises(FileNotFoundError, match="has no config.json"):
        EngineArgs(str(gguf_dir), hf_config_path=str(gguf_dir)).create_configs()


def test_linear_types_name_each_fused_layers_ggml_types(gguf_dir):
    from kvpilot.engine.model.gguf.arch import load_gguf_arch_config
    from kvpilot.engine.model.gguf.weights import GGUFCheckpoint

    file = gguf_dir / "tiny-qwen3.Q8_0.gguf"
    types = GGUFCheckpoint(file, load_gguf_arch_config(file)).linear_types()
    assert types == {f"layers.{i}.{name}": {"Q8_0"} for i in range(2)
                     for name in ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj")}

"""A hostile or broken checkpoint is refused before the engine builds or allocates for it.

Oracle: the real engine (``LLM``) on a tiny checkpoint built with transformers, whose
config.json / index is edited as a malicious mirror could; the time and memory a refusal
takes are measured around the call.
"""

from __future__ import annotations

import json
import resource
import shutil
import time

import pytest

from kvpilot.engine import LLM
from kvpilot.engine.model.checkpoint_checks import CheckpointError


def _copy(tiny_checkpoint, tmp_path, **config):
    path = tmp_path / "ckpt"
    shutil.copytree(tiny_checkpoint("llama"), path)
    cfg = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**cfg, **config}))
    return path


def _refused(path, match: str) -> float:
    """Seconds the engine took to refuse ``path``; its peak RSS grows by less than 200 MiB."""
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    start = time.perf_counter()
    with pytest.raises(CheckpointError, match=match):
        LLM(str(path), dtype="float32", num_gpu_blocks=64, max_model_len=256)
    elapsed = time.perf_counter() - start
    grown_mib = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024
    assert grown_mib < 200, f"the refusal cost {grown_mib:.0f} MiB"
    return elapsed


def test_a_million_layer_config_is_refused_at_once(tiny_checkpoint, tmp_path):
    path = _copy(tiny_checkpoint, tmp_path, num_hidden_layers=1_000_000)
    elapsed = _refused(path, r"num_hidden_layers = 1,000,000 is outside 1..1,024")
    assert elapsed < 5
    print(f"\nmillion-layer config refused in {elapsed:.2f} s")


@pytest.mark.parametrize("config, match", [
    ({"num_hidden_layers": 512}, r"num_hidden_layers = 512, but the weights hold layers: 2 \(indices 0..1\)"),
    ({"hidden_size": 60000, "num_attention_heads": 4, "head_dim": 16},
     r"model.embed_tokens.weight has shape \(512, 64\), the config implies \(512, 60000\)"),
    ({"intermediate_size": 1 << 19}, r"mlp.gate_proj.weight has shape \(128, 64\)"),
])
def test_a_config_the_weights_do_not_match_is_refused_before_allocating(tiny_checkpoint, tmp_path, config, match):
    # within the bounds, but e.g. 60000 x 60000 float32 projections would take 14 GB each
    elapsed = _refused(_copy(tiny_checkpoint, tmp_path, **config), match)
    assert elapsed < 5


@pytest.mark.parametrize("config", [{"vocab_size": 0}, {"head_dim": 4096}, {"max_position_embeddings": 1 << 30}])
def test_sizes_outside_the_bounds_are_named(tiny_checkpoint, tmp_path, config):
    (field, value), = config.items()
    _refused(_copy(tiny_checkpoint, tmp_path, **config), rf"{field} = {value:,} is outside")


def test_an_oversized_config_file_is_refused(tiny_checkpoint, tmp_path):
    path = _copy(tiny_checkpoint, tmp_path, padding="x" * (5 << 20))
    _refused(path, r"config.json is [\d,]+ bytes; a config.json is at most")


@pytest.mark.parametrize("shard", ["../outside/model.safetensors", "ABSOLUTE", "link/model.safetensors"])
def test_index_shards_outside_the_model_directory_are_refused(tiny_checkpoint, tmp_path, shard):
    path = _copy(tiny_checkpoint, tmp_path)
    outside = tmp_path / "outside"
    outside.mkdir()
    (path / "model.safetensors").rename(outside / "model.safetensors")  # loadable, but not ours
    if shard == "ABSOLUTE":
        shard = str(outside / "model.safetensors")
    if shard.startswith("link/"):
        (path / "link").symlink_to(outside, target_is_directory=True)
    from safetensors import safe_open

    with safe_open(str(outside / "model.safetensors"), framework="numpy") as f:
        names = list(f.keys())  # noqa: SIM118
    (path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {n: shard for n in names}}))
    _refused(path, "outside the model directory")

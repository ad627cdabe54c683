"""The decode roofline of ``bench peer`` / ``bench offline`` (``engine.bench.roofline``):
bytes per decode token counted against the files' own headers (``gguf.GGUFReader``,
safetensors), the embedding rule both ways (untied: one row gathered; tied: read whole by
the LM head), KV bytes against transformers' own layer types, the bandwidth probe, and the
share arithmetic; ``bench offline`` at one stream prints the line."""

from __future__ import annotations

import math
import subprocess
import sys

import pytest
import torch
from gguf import GGUFReader
from safetensors import safe_open

from kvpilot.engine.bench.roofline import (
    Roofline,
    kv_bytes_per_token,
    mean_decode_context,
    read_bandwidth,
    weight_bytes_per_token,
)
from kvpilot.engine.model.gguf.arch import load_model_arch

from support.gguf_files import COMMON, VOCAB, hf_model, write_gguf

HIDDEN = COMMON["hidden_size"]


@pytest.fixture(scope="module")
def gguf_files(tmp_path_factory):
    """An untied Llama with F16 weights and a tied Gemma 3 with Q8_0 weights."""
    path = tmp_path_factory.mktemp("roofline-gguf")
    return {"untied": write_gguf(path / "llama-f16.gguf", "llama", "F16"),
            "tied": write_gguf(path / "gemma3-q8.gguf", "gemma3", "Q8_0")}


def test_a_gguf_token_reads_every_tensor_as_stored_and_one_embedding_row(gguf_files):
    tensors = {t.name: t for t in GGUFReader(str(gguf_files["untied"])).tensors}
    assert "output.weight" in tensors                       # untied: the LM head is its own tensor
    embedding = int(tensors["token_embd.weight"].n_bytes)
    stored = sum(int(t.n_bytes) for t in tensors.values())
    assert weight_bytes_per_token(gguf_files["untied"], None) == stored - embedding + embedding // VOCAB
    # the engine dequantizes F16 (no block kernel for it): served in float32, 4 bytes a weight
    elements = sum(int(t.n_elements) for t in tensors.values())
    assert weight_bytes_per_token(gguf_files["untied"], "float32") == 4 * (elements - VOCAB * HIDDEN + HIDDEN)


def test_a_tied_gguf_embedding_is_read_whole_by_the_lm_head(gguf_files):
    tensors = GGUFReader(str(gguf_files["tied"])).tensors
    assert "output.weight" not in {t.name for t in tensors}
    assert weight_bytes_per_token(gguf_files["tied"], None) == sum(int(t.n_bytes) for t in tensors)


def _header_elements(model_dir) -> dict[str, int]:
    with safe_open(str(model_dir / "model.safetensors"), framework="numpy") as f:
        return {name: math.prod(f.get_slice(name).get_shape()) for name in f.keys()}  # noqa: SIM118


def test_a_checkpoint_token_counts_its_weights_in_the_served_dtype(tiny_checkpoint):
    untied = tiny_checkpoint("llama")
    elements = _header_elements(untied)
    assert "lm_head.weight" in elements
    embedding = elements["model.embed_tokens.weight"]
    hidden = embedding // load_model_arch(untied).vocab_size
    per_token = sum(elements.values()) - embedding + hidden
    assert weight_bytes_per_token(untied, "float32") == 4 * per_token
    assert weight_bytes_per_token(untied, "bfloat16") == 2 * per_token
    with pytest.raises(ValueError, match="dtype it is served in"):
        weight_bytes_per_token(untied, None)


def test_a_tied_checkpoint_embedding_counts_whole_and_once(tiny_checkpoint):
    tied = tiny_checkpoint("qwen3", tie_word_embeddings=True)
    elements = _header_elements(tied)
    assert "lm_head.weight" not in elements and load_model_arch(tied).tie_word_embeddings
    assert weight_bytes_per_token(tied, "bfloat16") == 2 * sum(elements.values())


def test_kv_bytes_count_each_layer_up_to_its_window(gguf_files, tiny_checkpoint):
    arch = load_model_arch(tiny_checkpoint("llama"))
    per_slot = 2 * arch.num_key_value_heads * arch.head_dim
    assert kv_bytes_per_token(arch, 100, 2) == arch.num_hidden_layers * per_slot * 2 * 100
    gemma = load_model_arch(gguf_files["tied"])
    layer_types = hf_model("gemma3").config.layer_types          # transformers' own reading
    window = hf_model("gemma3").config.sliding_window
    slots = sum(min(100, window) if t == "sliding_attention" else 100 for t in layer_types)
    assert "full_attention" in layer_types and window < 100
    assert kv_bytes_per_token(gemma, 100, 4) == 2 * gemma.num_key_value_heads * gemma.head_dim * 4 * slots


def test_mean_decode_context_averages_over_output_tokens():
    # outputs computed at contexts 10, 11, 12 and 30
    assert mean_decode_context([10, 30], [3, 1]) == 16
    with pytest.raises(ValueError):
        mean_decode_context([10], [0])


def test_the_bandwidth_probe_is_positive_and_restores_the_threads():
    threads = torch.get_num_threads()
    bandwidth = read_bandwidth(num_bytes=8 << 20, repeats=2, threads=1)
    assert bandwidth > 0 and math.isfinite(bandwidth)
    assert torch.get_num_threads() == threads


def test_the_ceiling_is_bandwidth_over_bytes_and_the_share_a_fraction_of_it():
    roof = Roofline(46e9, 96_500_000, kv_bytes=3_500_000, context=176)
    assert roof.bytes_per_token == 100_000_000
    assert roof.ceiling == pytest.approx(460.0)
    assert roof.share(115.0) == pytest.approx(0.25)
    assert roof.share(None) is None
    assert roof.describe(115.0) == "100.0 MB/token -> 460 tok/s, 25% reached"
    assert roof.as_dict(115.0)["share"] == pytest.approx(0.25)
    for bad in (dict(bandwidth=0.0, weight_bytes=1), dict(bandwidth=math.inf, weight_bytes=1),
                dict(bandwidth=1e9, weight_bytes=0)):
        with pytest.raises(ValueError):
            Roofline(**bad)


def test_bench_offline_at_one_stream_prints_the_roofline(tiny_checkpoint):
    proc = subprocess.run(
        [sys.executable, "-m", "kvpilot.engine.cli.main", "bench", "offline",
         "--model", str(tiny_checkpoint("llama")), "--num-prompts", "2", "--workload", "uniform",
         "--min-prompt", "8", "--max-prompt", "16", "--min-output", "4", "--max-output", "8",
         "--max-num-seqs", "1", "--max-model-len", "64", "--hf-batch-sizes", ""],
        capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    line = next(x for x in proc.stdout.splitlines() if x.startswith("roofline"))
    assert "GB/s" in line and "float32" in line and "% reached" in line

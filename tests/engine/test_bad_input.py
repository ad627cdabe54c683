"""Bad input gets a clear error, and the engine keeps serving the other requests."""

from __future__ import annotations

import json
import shutil

import pytest

from kvpilot.engine import LLM, SamplingParams
from kvpilot.engine.core.request_queue import make_request_queue

GREEDY = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(tiny_checkpoint):
    return LLM(str(tiny_checkpoint("llama")), num_gpu_blocks=64, max_model_len=256)


def test_bad_requests_are_rejected_and_others_still_finish(llm):
    engine = llm.llm_engine
    engine.add_request("good-1", [5, 6, 7, 8], GREEDY)
    with pytest.raises(ValueError, match="prompt must not be empty"):
        engine.add_request("empty-text", "", GREEDY)
    with pytest.raises(ValueError, match="prompt must not be empty"):
        engine.add_request("empty-ids", [], GREEDY)
    with pytest.raises(ValueError, match=r"300 tokens long.*max_model_len\) is 256"):
        engine.add_request("too-long", [5] * 300, GREEDY)
    with pytest.raises(ValueError, match=r"token ids must be integers in \[0, 512\)"):
        engine.add_request("bad-ids", [5, 9999], GREEDY)
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request("good-1", [1, 2], GREEDY)
    engine.step()                                   # good-1 is mid-flight
    engine.add_request("good-2", "The quick brown fox", GREEDY)
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    assert set(done) == {"good-1", "good-2"}
    assert all(len(o.outputs[0].token_ids) == 5 for o in done.values())
    assert llm.get_stats().kv_cache_usage == 0.0


@pytest.mark.parametrize("kwargs, message", [
    ({"max_tokens": 0}, "max_tokens must be at least 1, got 0"),
    ({"max_tokens": -3}, "max_tokens must be at least 1, got -3"),
    ({"temperature": -1.0}, "temperature must be non-negative"),
    ({"top_p": 0.0}, r"top_p must be in \(0, 1\]"),
    ({"n": 0}, "n must be at least 1"),
    ({"stop": [""]}, "stop strings must not be empty"),
])
def test_bad_sampling_params(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


def test_unknown_architecture(tiny_checkpoint, tmp_path):
    path = tmp_path / "ckpt"
    shutil.copytree(tiny_checkpoint("llama"), path)
    cfg = json.loads((path / "config.json").read_text())
    cfg["architectures"] = ["MambaForCausalLM"]
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=r"unsupported model architecture 'MambaForCausalLM'.*LlamaForCausalLM"):
        LLM(str(path), num_gpu_blocks=64, max_model_len=256)


def test_missing_weights(tiny_checkpoint, tmp_path):
    path = tmp_path / "ckpt"
    shutil.copytree(tiny_checkpoint("llama"), path)
    (path / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match=r"no \*\.safetensors weights in"):
        LLM(str(path), num_gpu_blocks=64, max_model_len=256)


def test_missing_tensor_is_named(tiny_checkpoint, tmp_path):
    from safetensors.torch import load_file, save_file

    path = tmp_path / "ckpt"
    shutil.copytree(tiny_checkpoint("llama"), path)
    tensors = load_file(path / "model.safetensors")
    del tensors["model.layers.1.mlp.down_proj.weight"]
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"missing weights \['layers.1.mlp.down_proj.weight'\]"):
        LLM(str(path), num_gpu_blocks=64, max_model_len=256)


def test_pickle_only_checkpoint_is_refused(tiny_checkpoint, tmp_path):
    path = tmp_path / "ckpt"
    shutil.copytree(tiny_checkpoint("llama"), path)
    (path / "model.safetensors").rename(path / "pytorch_model.bin")
    with pytest.raises(FileNotFoundError, match="pickle checkpoints are not loaded"):
        LLM(str(path), num_gpu_blocks=64, max_model_len=256)


def test_missing_model_dir():
    with pytest.raises(FileNotFoundError, match="does not exist"):
        LLM("/nonexistent/model", num_gpu_blocks=64)


def test_cache_smaller_than_max_model_len(tiny_checkpoint):
    with pytest.raises(ValueError, match=r"holds 128 tokens.*largest max_model_len that fits is 128"):
        LLM(str(tiny_checkpoint("llama")), num_gpu_blocks=8, max_model_len=256)


def test_unknown_scheduling_policy():
    with pytest.raises(ValueError, match="unknown scheduling policy"):
        make_request_queue("random")

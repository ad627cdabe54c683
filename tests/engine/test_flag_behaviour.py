"""Engine-side effects of vLLM flags ``kvpilot serve`` honours: ``--tokenizer``,
``--generation-config`` / ``--override-generation-config``, ``--max-logprobs``,
``--no-enable-chunked-prefill`` and ``--num-gpu-blocks-override``."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from kvpilot.engine import LLM, SamplingParams
from kvpilot.engine.engine_args import EngineArgs
from kvpilot.engine.generation_defaults import load_generation_defaults
from kvpilot.engine.llm_engine import LLMEngine

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def split_checkpoint(tiny_checkpoint, tmp_path_factory) -> tuple[Path, Path]:
    """(model dir with weights and config only, the tokenizer's dir)."""
    source = tiny_checkpoint("qwen3")
    model = tmp_path_factory.mktemp("weights-only")
    for name in ("config.json", "model.safetensors"):
        os.symlink(source / name, model / name)
    (model / "generation_config.json").write_text(json.dumps(
        {"eos_token_id": 2, "do_sample": True, "temperature": 0.0, "top_k": 7,
         "max_new_tokens": 5}))
    return model, source


def test_tokenizer_from_another_directory(split_checkpoint):
    model, tokenizer = split_checkpoint
    with pytest.raises(FileNotFoundError, match="tokenizer.json"):
        LLM(str(model), dtype="float32", num_gpu_blocks=32, max_model_len=128)
    llm = LLM(str(model), dtype="float32", tokenizer=str(tokenizer), num_gpu_blocks=32, max_model_len=128)
    reference = LLM(str(tokenizer), dtype="float32", num_gpu_blocks=32, max_model_len=128)
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    assert (llm.generate("The quick brown fox", params)[0].outputs[0].text
            == reference.generate("The quick brown fox", params)[0].outputs[0].text)


def test_generation_config_defaults_apply_to_requests(split_checkpoint):
    model, tokenizer = split_checkpoint
    auto = LLM(str(model), dtype="float32", tokenizer=str(tokenizer), num_gpu_blocks=32, max_model_len=128)
    assert auto.llm_engine.model_config.default_sampling == {
        "temperature": 0.0, "top_k": 7, "max_tokens": 5}
    # temperature 0 from the file: unseeded default requests are greedy, 5 tokens long
    outs = auto.generate(["Paged attention"] * 3)
    texts = {o.outputs[0].text for o in outs}
    assert len(texts) == 1 and all(len(o.outputs[0].token_ids) <= 5 for o in outs)
    greedy = auto.generate("Paged attention", SamplingParams(temperature=0, max_tokens=5))
    assert texts == {greedy[0].outputs[0].text}
    # vllm: the file is ignored; the override still applies
    plain = LLM(str(model), dtype="float32", tokenizer=str(tokenizer), num_gpu_blocks=32, max_model_len=128,
                generation_config="vllm", override_generation_config={"top_p": 0.5})
    assert plain.llm_engine.model_config.default_sampling == {"top_p": 0.5}
    assert plain.get_default_sampling_params().temperature == 1.0


def test_generation_config_directory_and_errors(split_checkpoint, tmp_path):
    model, _ = split_checkpoint
    (tmp_path / "generation_config.json").write_text('{"top_p": 0.8, "repetition_penalty": 1.1}')
    assert load_generation_defaults(str(tmp_path), str(model)) == {
        "top_p": 0.8, "repetition_penalty": 1.1}
    assert load_generation_defaults("auto", str(tmp_path), {"temperature": 0.3}) == {
        "temperature": 0.3, "top_p": 0.8, "repetition_penalty": 1.1}
    with pytest.raises(FileNotFoundError):
        load_generation_defaults(str(tmp_path / "missing"), str(model))
    with pytest.raises(ValueError, match="unknown key"):
        load_generation_defaults("vllm", str(model), {"do_sample": False})


def test_max_logprobs_limits_requests(tiny_checkpoint):
    llm = LLM(str(tiny_checkpoint("qwen3")), dtype="float32", num_gpu_blocks=32, max_model_len=128, max_logprobs=2)
    ok = llm.generate([[3, 4]], SamplingParams(max_tokens=1, logprobs=2))
    assert len(ok[0].outputs[0].logprobs[0]) >= 2
    with pytest.raises(ValueError, match=r"max_logprobs \(2\)"):
        llm.generate([[3, 4]], SamplingParams(max_tokens=1, logprobs=3))


def test_without_chunked_prefill_a_prompt_waits_to_fit_whole(tiny_checkpoint):
    path = str(tiny_checkpoint("qwen3"))
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)

    def first_step_tokens(chunked: bool) -> list[int]:
        engine = LLMEngine(EngineArgs(path, dtype="float32", num_gpu_blocks=64, max_model_len=128,
                                      max_num_batched_tokens=128, enable_chunked_prefill=chunked))
        engine.add_request("a", [7] * 100, params)
        engine.add_request("b", [8] * 100, params)
        scheduled = engine.scheduler.schedule()
        return [s.num_new_tokens for s in scheduled.scheduled]

    assert first_step_tokens(True) == [100, 28]    # b's prompt is split across steps
    assert first_step_tokens(False) == [100]       # b waits for a step it fits whole


def test_num_gpu_blocks_override_sizes_the_cache(tiny_checkpoint):
    llm = LLM(str(tiny_checkpoint("qwen3")), dtype="float32", num_gpu_blocks=40, max_model_len=128)
    assert llm.llm_engine.cache_info.num_gpu_blocks == 40

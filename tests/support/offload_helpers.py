"""Constants and helpers of the KV offload tests (their test modules and the subprocess
worker ``tests/offload/lmcache_worker.py`` import it)."""

from __future__ import annotations

import random
import shutil
from dataclasses import dataclass
from pathlib import Path

import pytest

from kvpilot.engine import LLM, SamplingParams

BLOCK = 16
PREFIX_LEN = 1500
# Full blocks of the shared prefix: the most any cache can serve of it.
PREFIX_BLOCK_TOKENS = PREFIX_LEN // BLOCK * BLOCK
ENGINE_KW = dict(dtype="float32", num_gpu_blocks=100, max_model_len=1600, max_num_batched_tokens=2048, block_size=BLOCK)
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=3)
VOCAB = 4096


def build_offload_model(path: Path, tokenizer_dir: Path) -> Path:
    import torch
    import transformers

    config = transformers.Qwen3Config(
        vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=4096,
        rms_norm_eps=1e-6, tie_word_embeddings=False, bos_token_id=151643, eos_token_id=151645)
    torch.manual_seed(0)
    model = transformers.Qwen3ForCausalLM(config)
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(8.0)
    model.save_pretrained(path, safe_serialization=True)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokenizer_dir / name, path / name)
    return path


@dataclass(frozen=True)
class Prompts:
    first: list[int]       # shared prefix + suffix A
    second: list[int]      # shared prefix + suffix B (the request that should hit)
    third: list[int]       # shared prefix + suffix C
    filler: list[int]      # unrelated, long enough to evict the prefix from the device pool


def make_prompts(seed: int = 0) -> Prompts:
    rng = random.Random(seed)

    def tokens(n: int) -> list[int]:
        return [rng.randrange(3, VOCAB) for _ in range(n)]

    prefix = tokens(PREFIX_LEN)
    return Prompts(prefix + tokens(37), prefix + tokens(61), prefix + tokens(45), tokens(1500))


def assert_same_output(out, ref) -> None:
    """Token-identical, and the sampled tokens' logprobs agree (KV restored exactly)."""
    assert out.token_ids == ref.token_ids
    for got, want, token in zip(out.logprobs, ref.logprobs, out.token_ids, strict=True):
        assert got[token].logprob == pytest.approx(want[token].logprob, abs=1e-4)


def run_measured(llm: LLM, prompt: list[int]):
    """Generate one prompt; returns (output, stats before, stats after)."""
    before = llm.get_stats()
    out = llm.generate([prompt], GREEDY)[0]
    return out.outputs[0], before, llm.get_stats()


def delta(after, before, field: str) -> int:
    return (getattr(after, field) or 0) - (getattr(before, field) or 0)


def exported(stats) -> dict[str, float]:
    """The samples the server's /metrics shows for ``stats`` (prometheus_client's own exposition)."""
    from prometheus_client import CollectorRegistry, generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    from kvpilot.engine.server.metrics_engine_stats import EngineStatsCollector

    registry = CollectorRegistry()
    registry.register(EngineStatsCollector(lambda: stats, "m"))
    return {s.name: s.value for family in text_string_to_metric_families(generate_latest(registry).decode())
            for s in family.samples}

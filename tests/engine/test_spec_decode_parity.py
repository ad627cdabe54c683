"""Greedy outputs under speculative decoding are token-identical to decoding without it,
and so to HF transformers (and PEFT for LoRA adapters).

Each proposer (n-gram lookup, a draft model, an EAGLE-style head) runs on one architecture
of the HF-parity set, the three rotating (Qwen3, Llama, Qwen2), so every proposer and every
architecture is covered once. One batch mixes prompts under the base model, the same
prompts under a random LoRA adapter, and a request constrained by a JSON schema; the engine runs it with chunked prefill under a small token budget and a KV
pool so small that requests are preempted and recomputed, twice (the second pass hits the
prefix cache). Prompts repeat segments of themselves, so n-gram drafts are often right;
random models fall into loops, so drafts are accepted and rejected alike. Oracles: HF
greedy for the base rows, transformers + PEFT for the adapter rows, the engine without
speculation for the constrained row (HF has no grammar).
"""

from __future__ import annotations

import random

import pytest

from kvpilot.engine import LLM, SamplingParams
from kvpilot.engine.lora.config import LoRAModule
from kvpilot.engine.sampling_params import StructuredOutputsParams

from support.eagle_heads import build_eagle_head
from support.hf_oracle import hf_greedy
from support.lora_adapters import build_adapter, peft_greedy

CASES = [("ngram", "qwen3"), ("draft_model", "llama"), ("eagle", "qwen2")]
MAX_NEW = 12
# min_tokens: EOS is banned as the oracles' generate(min_new_tokens=...) bans it (and the
# ban applies at every scored position of a speculative step)
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, min_tokens=MAX_NEW)
SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "n": {"type": "integer"}},
          "required": ["name", "n"]}
JSON = SamplingParams(temperature=0.0, max_tokens=24, structured_outputs=StructuredOutputsParams(json=SCHEMA))
# 16-token blocks: the batch needs about 37 at once (prompts, outputs, drafts), the longest
# request 5; 14 force preemptions while every request still fits
NUM_BLOCKS = 14
ENGINE = dict(dtype="float32", max_model_len=128, num_gpu_blocks=NUM_BLOCKS, max_num_batched_tokens=32,
              max_num_seqs=16, enable_lora=True, max_loras=1, max_lora_rank=8)


def prompts_for(seed: int) -> list[list[int]]:
    """Prompts that copy from themselves: a segment and its repeat, some sharing a prefix."""
    rng = random.Random(seed)
    rand = lambda n: [rng.randrange(3, 512) for _ in range(n)]  # noqa: E731
    shared = rand(32)
    out = []
    for n in (6, 24):
        seg = rand(n)
        out.append(seg + rand(5) + seg[: n // 2])
    out += [shared + rand(5), shared + rand(12) + shared[:8]]
    return out


def oracles(kind, tiny_checkpoint, tmp_path_factory):
    """(checkpoint, adapter, prompts, expected outputs per adapter name and for the schema row)."""
    # one decoder layer: the architecture's layer all the same, at half the engine's and the
    # oracles' cost (the stop and drafter tests run two-layer targets under speculation)
    base = tiny_checkpoint(kind, num_hidden_layers=1)
    adapter = build_adapter(base, tmp_path_factory.mktemp(f"spec-lora-{kind}"), 8, seed=7)
    prompts = prompts_for(len(kind))
    expected = {None: hf_greedy(base, prompts, MAX_NEW), "ad": peft_greedy(base, adapter, prompts, MAX_NEW)}
    reference = LLM(str(base), **ENGINE, lora_modules=(LoRAModule("ad", str(adapter)),))
    expected["json"] = reference.generate([prompts[1]], JSON)[0].outputs[0].token_ids
    return base, adapter, prompts, expected


def run_batch(llm: LLM, prompts: list[list[int]]) -> dict:
    """Every prompt under the base model and the adapter, and one constrained request."""
    batch = [(None, p, GREEDY) for p in prompts] + [("ad", p, GREEDY) for p in prompts]
    batch.insert(3, ("json", prompts[1], JSON))
    outs = llm.generate([p for _, p, _ in batch], [s for _, _, s in batch],
                        lora_name=[None if n == "json" else n for n, _, _ in batch])
    got: dict = {None: [], "ad": []}
    for (name, _, _), out in zip(batch, outs, strict=True):
        if name == "json":
            got["json"] = out.outputs[0].token_ids
        else:
            got[name].append(out.outputs[0].token_ids)
    return got


def spec_config(proposer: str, base, tmp_path_factory) -> dict:
    """n-gram lookup; a draft model (the target itself: the base rows' drafts are right, the
    adapter and schema rows' drafts are often wrong); an EAGLE head."""
    if proposer == "ngram":
        return {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
                "prompt_lookup_max": 3}
    if proposer == "draft_model":
        return {"method": "draft_model", "model": str(base), "num_speculative_tokens": 3}
    head = build_eagle_head(base, tmp_path_factory.mktemp("eagle"))
    return {"method": "eagle", "model": str(head), "num_speculative_tokens": 3}


@pytest.mark.slow
@pytest.mark.parametrize(("proposer", "kind"), CASES)
def test_greedy_is_token_identical_with_everything_in_one_batch(proposer, kind, tiny_checkpoint,
                                                                tmp_path_factory):
    base, adapter, prompts, expected = oracles(kind, tiny_checkpoint, tmp_path_factory)
    llm = LLM(str(base), **ENGINE, lora_modules=(LoRAModule("ad", str(adapter)),),
              speculative_config=spec_config(proposer, base, tmp_path_factory))
    assert run_batch(llm, prompts) == expected
    first = llm.get_stats()
    assert run_batch(llm, prompts) == expected          # again: prefix hits this time
    stats = llm.get_stats()
    spec = stats.spec_decoding
    print(f"{proposer}: {spec}, preemptions {stats.num_preemptions}, prefix hits "
          f"{stats.prefix_cache_hits}, steps {stats.num_steps}")
    assert stats.num_preemptions > 0 and stats.prefix_cache_hits > first.prefix_cache_hits
    assert stats.num_steps > sum(map(len, prompts)) * 2 // 32     # prefills were chunked
    # runs of accepted drafts were verified too, and rejected ones
    assert 0 < spec.num_accepted_tokens < spec.num_draft_tokens
    assert stats.kv_cache_usage == 0.0

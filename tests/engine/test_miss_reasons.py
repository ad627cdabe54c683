"""Prefix-cache miss reasons against a workload with eight planted causes
(``bench.miss_workload``): the counter attributes each probe's uncached tokens to the
planted cause's reason, and the explanation (offline comparison, an engine's explanation,
two replicas' explanations) names the cause."""

from __future__ import annotations

import pytest

from kvpilot.engine import LLM, SamplingParams
from kvpilot.engine.bench.miss_workload import CAUSES, planted_workload, prompt_ids, run, table
from kvpilot.engine.lora.config import LoRAModule
from kvpilot.engine.prefix_verdict import PromptSpec, compare, from_replicas

from support.lora_adapters import build_adapter
from support.tiny_checkpoints import build_checkpoint

GREEDY = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
KWARGS = dict(dtype="float32", max_model_len=1024)
BLOCK = 16
# what explain-prefix names, by planted cause
EXPLAINED = {"evicted": "evicted", "different_cache_salt": "different_cache_salt",
             "different_lora_adapter": "different_lora_adapter",
             "edited_system_prompt": "edited_prompt", "template_whitespace": "whitespace_change",
             "date_in_system_prompt": "date_in_prompt", "wrong_replica": "wrong_replica",
             "last_partial_block": "last_partial_block"}


@pytest.fixture(scope="module")
def replicas(tmp_path_factory):
    """Two engines of one tiny model (the first with a LoRA adapter and a small KV cache,
    so that fillers evict)."""
    base = build_checkpoint(tmp_path_factory.mktemp("miss-base"), "qwen3")
    adapter = build_adapter(base, tmp_path_factory.mktemp("miss-adapter"), 8, seed=7)
    first = LLM(str(base), enable_lora=True, max_loras=1, max_lora_rank=8,
                lora_modules=(LoRAModule("adapter", str(adapter)),), num_gpu_blocks=160, **KWARGS)
    second = LLM(str(base), num_gpu_blocks=160, **KWARGS)
    return [first, second]


def _planted(seed: int):
    """A planted workload of its own for each test (prompts no other test sent)."""
    return planted_workload(seed, sentences=6, num_fillers=6, filler_sentences=12)


def test_every_planted_cause_is_counted_under_its_reason(replicas):
    llms, planted = replicas, _planted(3)
    results = run(llms, planted, GREEDY)
    print("\n" + table(results))
    assert [r.cause for r in results] == list(CAUSES)
    for r in results:
        assert r.uncached > 0, r.cause
        assert r.share >= 0.95, (r.cause, r.by_reason, r.uncached)


def test_explain_prefix_names_every_planted_cause(replicas):
    llms, planted = replicas, _planted(4)
    tokenizer = llms[0].get_tokenizer()

    def decode(ids):
        return tokenizer.decode(list(ids), skip_special_tokens=False)

    def spec(chat):
        return PromptSpec(prompt_ids(tokenizer, chat), chat.cache_salt, chat.lora_name)

    named = {}
    for miss in planted:
        if miss.cause in ("evicted", "wrong_replica"):
            # what only replicas know: warm them as the workload does, then ask the
            # probe's replica first and the other one second
            for chat in (miss.seed, *miss.fillers):
                llms[chat.replica].generate([spec(chat).token_ids], GREEDY)
            order = [miss.probe.replica, 1 - miss.probe.replica]
            explanations = [(f"replica-{i}", llms[i].llm_engine.explain_prefix(spec(miss.probe).token_ids))
                            for i in order]
            verdict = from_replicas(explanations)
        else:
            verdict = compare(spec(miss.seed), spec(miss.probe), BLOCK, decode)
        named[miss.cause] = verdict.cause
        print(miss.cause, "->", verdict.as_dict())
    assert named == {cause: EXPLAINED[cause] for cause in CAUSES}

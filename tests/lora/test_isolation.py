"""Adapters never share KV, bad adapters are refused with a clear error while the engine
keeps serving, an adapter removed mid-request finishes that request, and the KV budget
shrinks by the adapter slots' memory."""

from __future__ import annotations

import json
import shutil

import pytest
from safetensors.torch import load_file, save_file

from kvpilot.engine import LLM, SamplingParams
from kvpilot.engine.lora.checkpoint import LoRACheckpointError
from kvpilot.engine.lora.config import LoRAConfig, LoRAModule
from kvpilot.engine.lora.memory import lora_device_bytes
from kvpilot.engine.lora.registry import LoRAExistsError, LoRANotFoundError

from support.lora_adapters import build_adapter, edit_config, peft_greedy
from support.tiny_checkpoints import build_checkpoint

GREEDY = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
PROMPT = list(range(10, 74))      # 4 full blocks of 16


def _llm(base, adapters, **kwargs):
    return LLM(str(base), dtype="float32", enable_lora=True, max_loras=2, max_lora_rank=16,
               lora_modules=tuple(LoRAModule(n, str(p)) for n, p in adapters.items()),
               num_gpu_blocks=128, max_model_len=256, **kwargs)


def _hits(llm) -> int:
    return llm.get_stats().prefix_cache_hits


def test_same_prompt_under_two_adapters_shares_no_blocks(lora_case):
    base, adapters = lora_case("qwen3")
    llm = _llm(base, adapters)
    llm.generate([PROMPT], GREEDY, lora_name="sql")
    before = _hits(llm)
    llm.generate([PROMPT], GREEDY, lora_name="chat")     # another adapter: no hit
    llm.generate([PROMPT], GREEDY)                       # the base model: no hit
    assert _hits(llm) == before
    llm.generate([PROMPT], GREEDY, lora_name="chat")     # the same adapter again: hits
    after_chat = _hits(llm)
    assert after_chat - before >= 48
    llm.generate([PROMPT], GREEDY)                       # and the base model's own blocks
    assert _hits(llm) - after_chat >= 48


def test_block_hashes_carry_the_adapter_key(lora_case):
    base, adapters = lora_case("qwen3")
    engine = _llm(base, adapters).llm_engine
    hashes = {}
    for name in (None, "sql", "chat"):
        engine.add_request(f"r-{name}", PROMPT, GREEDY, lora_name=name)
        request = engine.scheduler.requests[f"r-{name}"]
        engine.kv_cache_manager.update_block_hashes(request)
        hashes[name] = request.block_hashes
        engine.abort_request([f"r-{name}"])
    assert all(len(h) == 4 for h in hashes.values())
    for i in range(4):   # every block differs, not only the chain's first
        assert len({h[i] for h in hashes.values()}) == 3


def _copy(src, tmp_path, name):
    dst = tmp_path / name
    shutil.copytree(src, dst)
    return dst


def _bad_adapters(base, adapters, tmp_path):
    good = adapters["sql"]
    cases = {}
    cases["missing directory"] = (tmp_path / "nowhere", "does not exist")
    no_config = _copy(good, tmp_path, "no-config")
    (no_config / "adapter_config.json").unlink()
    cases["no adapter_config.json"] = (no_config, "adapter_config.json")
    bad_json = _copy(good, tmp_path, "bad-json")
    (bad_json / "adapter_config.json").write_text("{not json")
    cases["malformed config"] = (bad_json, "not valid JSON")
    dora = _copy(good, tmp_path, "dora")
    edit_config(dora, use_dora=True)
    cases["DoRA"] = (dora, "use_dora")
    truncated = _copy(good, tmp_path, "truncated")
    data = (truncated / "adapter_model.safetensors").read_bytes()
    (truncated / "adapter_model.safetensors").write_bytes(data[: len(data) // 2])
    cases["truncated weights"] = (truncated, "not a readable safetensors file")
    embed = _copy(good, tmp_path, "embed")
    tensors = load_file(embed / "adapter_model.safetensors")
    tensors["base_model.model.model.embed_tokens.lora_embedding_A"] = next(iter(tensors.values())).clone()
    save_file(tensors, embed / "adapter_model.safetensors")
    cases["embedding adapter"] = (embed, "embed_tokens")
    over = build_adapter(base, tmp_path / "rank32", 32, seed=7)
    cases["rank above --max-lora-rank"] = (over, "rank 32 exceeds --max-lora-rank 16")
    other_base = build_checkpoint(tmp_path / "other-base", "qwen3", hidden_size=96)
    wrong = build_adapter(other_base, tmp_path / "wrong-base", 8, seed=8)
    cases["another base model's adapter"] = (wrong, "another base model")
    return cases


@pytest.mark.slow
def test_bad_adapters_are_refused_and_the_engine_keeps_serving(lora_case, tmp_path):
    base, adapters = lora_case("qwen3")
    llm = _llm(base, {"sql": adapters["sql"]})
    engine = llm.llm_engine
    expected = peft_greedy(base, adapters["sql"], [PROMPT], 4)
    for what, (path, message) in _bad_adapters(base, adapters, tmp_path).items():
        with pytest.raises(LoRACheckpointError, match=message):
            engine.add_lora("bad", str(path))
        assert "bad" not in engine.lora, what
        got = [o.outputs[0].token_ids for o in llm.generate([PROMPT], GREEDY, lora_name="sql")]
        assert got == expected, what
    with pytest.raises(LoRAExistsError):
        engine.add_lora("sql", str(adapters["chat"]))
    with pytest.raises(LoRANotFoundError, match="does not exist"):
        engine.add_request("x", PROMPT, GREEDY, lora_name="bad")


def test_a_bad_start_up_adapter_stops_start_up(lora_case, tmp_path):
    base, adapters = lora_case("qwen3")
    over = build_adapter(base, tmp_path / "rank32", 32, seed=7)
    with pytest.raises(LoRACheckpointError, match="exceeds --max-lora-rank"):
        _llm(base, {"big": over})


def test_removed_adapter_finishes_its_requests_then_refuses_new_ones(lora_case):
    base, adapters = lora_case("qwen3")
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    expected = peft_greedy(base, adapters["chat"], [PROMPT], 8)[0]
    engine = _llm(base, adapters).llm_engine
    engine.add_request("r", PROMPT, params, lora_name="chat")
    outputs = engine.step() + engine.step()
    engine.remove_lora("chat")
    with pytest.raises(LoRANotFoundError):
        engine.add_request("late", PROMPT, params, lora_name="chat")
    assert "chat" not in [a.name for a in engine.list_loras()]
    while engine.has_unfinished_requests():
        outputs += engine.step()
    assert outputs[-1].finished and outputs[-1].outputs[0].token_ids == expected
    assert engine.lora.num_device_resident == 0   # sql never ran; chat freed after its request
    # loaded again under the same name: a new adapter, its own KV
    engine.add_lora("chat", str(adapters["sql"]))
    engine.add_request("again", PROMPT, params, lora_name="chat")
    while engine.has_unfinished_requests():
        last = engine.step()
    assert last[-1].outputs[0].token_ids == peft_greedy(base, adapters["sql"], [PROMPT], 8)[0]


def test_kv_budget_shrinks_by_the_adapter_slots(lora_case, monkeypatch):
    base, adapters = lora_case("qwen3")
    monkeypatch.setenv("KVPILOT_FAKE_DEVICE_MEMORY", json.dumps({"total_gib": 1, "free_gib": 1}))
    plain = LLM(str(base), dtype="float32", max_model_len=256, gpu_memory_utilization=0.05).llm_engine
    lora = LLM(str(base), dtype="float32", max_model_len=256, gpu_memory_utilization=0.05, enable_lora=True,
               max_loras=4, max_lora_rank=16).llm_engine
    arch = plain.model_config.arch
    formula = lora_device_bytes(arch, LoRAConfig(max_loras=4, max_lora_rank=16), plain.model_config.dtype)
    # 4 slots x rank 16 x sum(in + out) of the 7 projections x 2 layers x 4 bytes
    q, kv = arch.num_attention_heads * arch.head_dim, arch.num_key_value_heads * arch.head_dim
    h, inter = arch.hidden_size, arch.intermediate_size
    per_layer = (h + q) * 2 + (h + kv) * 2 + 2 * (h + inter) + (inter + h)
    assert formula == 4 * 16 * per_layer * arch.num_hidden_layers * 4
    assert lora.runner.lora.slots.num_bytes == formula
    assert (plain.cache_info.profiled_available_bytes - lora.cache_info.profiled_available_bytes
            == formula)
    assert lora.cache_info.num_gpu_blocks < plain.cache_info.num_gpu_blocks


def test_kv_events_carry_the_adapter_name_in_extra_keys_and_lora_name(lora_case):
    """As vLLM's extra keys: the adapter name on each stored block, the salt after it on
    a chain's first block; the events' ``lora_name`` names the adapter."""
    from kvpilot.engine.core.kv_event_log import STORED, KVEventLog
    from kvpilot.engine.kv_events.translate import EventTranslator

    base, adapters = lora_case("qwen3")
    engine = _llm(base, adapters).llm_engine
    log = KVEventLog({0: ("full_attention", None)})
    engine.kv_cache_manager.pool.attach_events(log, 0)
    engine.add_request("a", PROMPT, GREEDY, lora_name="sql", cache_salt="t")
    engine.add_request("b", [t + 1 for t in PROMPT], GREEDY)
    while engine.has_unfinished_requests():
        engine.step()
    records = [r for r in log.take() if r[0] == STORED]
    keys = [k for r in records for k in r[7]]
    assert keys.count(("sql", "t")) == 1 and keys.count(("sql",)) == 3   # 4 blocks, salt on the first
    assert keys.count(None) == 4                                         # the base request's blocks
    # and lora_name as vLLM sets it (vLLM's router salts its block keys with it)
    events = EventTranslator(engine.kv_cache_manager.block_size, {0: ("full_attention", None)}
                             ).translate(records)
    blocks = {}
    for event in events:
        blocks[event.lora_name] = blocks.get(event.lora_name, 0) + len(event.block_hashes)
    assert blocks == {"sql": 4, None: 4}

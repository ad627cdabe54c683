"""Structured outputs in the engine: a random-weight model produces only text its
grammar allows (checked by independent validators: ``jsonschema``, ``re``, the choice
list), constrained and free rows share batches, the compile cache works, and the
matcher stays in step with the request through preemption and dropped tokens."""

from __future__ import annotations

import json
import re
import time

import jsonschema
import pytest

from kvpilot.engine import LLM, SamplingParams
from kvpilot.engine.config import StructuredOutputsConfig
from kvpilot.engine.core.scheduler import ScheduledRequest, SchedulerOutput
from kvpilot.engine.sampling_params import StructuredOutputsParams as SO

pytestmark = pytest.mark.slow

SCHEMA = {
    "type": "object",
    "properties": {
        "id": {"type": "integer", "minimum": 0, "maximum": 999},
        "kind": {"enum": ["cat", "dog", "fish"]},
        "name": {"type": "string", "maxLength": 5},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 3}, "maxItems": 2},
        "owner": {"type": "object", "properties": {"vip": {"type": "boolean"},
                                                   "age": {"type": "integer", "minimum": 18,
                                                           "maximum": 99}},
                  "required": ["vip", "age"]},
    },
    "required": ["id", "kind", "name", "tags", "owner"],
}


@pytest.fixture(scope="module")
def llm(tiny_checkpoint):
    return LLM(str(tiny_checkpoint("qwen3")), dtype="float32", num_gpu_blocks=256, max_model_len=512,
               max_num_seqs=16)


def _texts(llm, params: list[SamplingParams], prompt="Paged attention") -> list[str]:
    outs = llm.generate([prompt] * len(params), params)
    return [o.outputs[0].text for o in outs]


def test_json_schema_outputs_validate(llm):
    params = [SamplingParams(temperature=1.0, seed=i, max_tokens=200, structured_outputs=SO(json=SCHEMA))
              for i in range(8)]
    outs = llm.generate(["Paged attention"] * len(params), params)
    for out in outs:
        jsonschema.validate(json.loads(out.outputs[0].text), SCHEMA)
        assert out.outputs[0].finish_reason == "stop"
    assert len({o.outputs[0].text for o in outs}) > 4      # sampled, not one fixed string
    # without the grammar the same model writes no JSON at all
    free = _texts(llm, [SamplingParams(temperature=1.0, seed=0, max_tokens=40)])[0]
    with pytest.raises(ValueError):
        json.loads(free)


def test_regex_choice_grammar_and_json_object(llm):
    regex = r"[a-f]{3}-\d{2,4}"
    choices = ["yes", "no", "ask \"later\""]
    grammar = 'root ::= "(" item ("," item)* ")"\nitem ::= [0-9] | "x"'
    cases = [(SO(regex=regex), lambda t: re.fullmatch(regex, t)),
             (SO(choice=choices), lambda t: t in choices),
             (SO(grammar=grammar), lambda t: re.fullmatch(r"\((?:[0-9x])(?:,[0-9x])*\)", t)),
             (SO(json_object=True), lambda t: isinstance(json.loads(t), dict))]
    for so, check in cases:
        params = [SamplingParams(temperature=1.0, seed=i, max_tokens=60, structured_outputs=so)
                  for i in range(4)]
        for text in _texts(llm, params):
            assert check(text), (so, text)


def test_constrained_and_free_rows_share_a_batch(llm):
    free = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    alone = _texts(llm, [free])[0]
    mixed = _texts(llm, [free, SamplingParams(temperature=0, max_tokens=12, structured_outputs=SO(regex="[0-9]{12}")),
                         free])
    assert mixed[0] == mixed[2] == alone
    assert re.fullmatch("[0-9]{12}", mixed[1])


def test_n_children_have_their_own_matchers(llm):
    params = SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=40,
                            structured_outputs=SO(choice=["alpha", "beta", "gamma", "delta"]))
    [out] = llm.generate(["Paged attention"], params)
    assert all(c.text in {"alpha", "beta", "gamma", "delta"} for c in out.outputs)
    assert len(llm.llm_engine.structured_output) == 0     # finished requests drop theirs


def test_compile_cache_and_bad_constraints(llm):
    backend = llm.llm_engine.structured_output.backend
    so = SO(json={"type": "object", "properties": {"a": {"type": "boolean"}}, "required": ["a"]})
    _texts(llm, [SamplingParams(max_tokens=10, structured_outputs=so)])
    compiles = backend.num_compiles
    _texts(llm, [SamplingParams(max_tokens=10, seed=i, structured_outputs=so) for i in range(3)])
    assert backend.num_compiles == compiles
    for bad in (SO(json='{"type": "object", "properties": 5}'), SO(regex="(unclosed"),
                SO(grammar="root ::= missing_rule")):
        with pytest.raises(ValueError, match="invalid"):
            llm.generate(["x"], SamplingParams(max_tokens=2, structured_outputs=bad))
    assert not llm.llm_engine.has_unfinished_requests()
    with pytest.raises(ValueError, match="exactly one"):
        SO(regex="a", choice=["a"])


def test_preempted_constrained_requests_resume_their_grammar(tiny_checkpoint, llm):
    params = [SamplingParams(temperature=0, max_tokens=120, structured_outputs=SO(json=SCHEMA)),
              SamplingParams(temperature=0.9, seed=3, max_tokens=120,
                             structured_outputs=SO(json=SCHEMA))]
    prompts = [list(range(3, 3 + 40)), list(range(200, 240))]
    expected = [o.outputs[0].text for o in llm.generate(prompts, params)]
    # 12 blocks of 16 tokens cannot hold both requests (40 + ~80 tokens each) at once
    tight = LLM(str(tiny_checkpoint("qwen3")), dtype="float32", num_gpu_blocks=12, block_size=16,
                max_model_len=190, max_num_seqs=2)
    got = [o.outputs[0].text for o in tight.generate(prompts, params)]
    assert tight.get_stats().num_preemptions > 0
    assert got == expected
    for text in got:
        jsonschema.validate(json.loads(text), SCHEMA)


def test_matcher_rolls_back_tokens_the_request_lost(llm):
    """If a request's generated tokens shrink (a discarded step), the next bitmask is the
    one for the shorter output: the matcher never runs ahead of the request."""
    engine = llm.llm_engine
    so = SO(regex="[a-z]{2}[0-9]{2}[a-z]{2}")
    engine.add_request("rollback", "Paged attention", SamplingParams(temperature=0, max_tokens=6,
                                                                     structured_outputs=so))
    request = engine.scheduler.requests["rollback"]
    while len(request.output_token_ids) < 3:
        engine.step()
    manager = engine.structured_output

    def mask_now():
        step = SchedulerOutput([ScheduledRequest(request, request.num_tokens - 1, 1, [])])
        return manager.grammar_bitmask(step).bitmask[0].clone()

    at_three = mask_now()
    kept = list(request.output_token_ids)
    del request.output_token_ids[1:]                       # drop two tokens
    at_one = mask_now()
    assert not (at_one == at_three).all()
    request.output_token_ids[:] = kept                      # and gain them back
    assert (mask_now() == at_three).all()
    engine.abort_request(["rollback"])
    assert len(manager) == 0


def test_with_a_reasoning_parser_only_the_text_after_think_is_constrained(demo_model_dir):
    """The qwen3 gate: no bitmask while the request reasons; after ``</think>`` the grammar
    starts (its first mask: digits only); a prompt whose reasoning already ended is
    constrained at once."""
    from kvpilot.engine.core.request import Request
    from kvpilot.engine.structured_output import StructuredOutputManager
    from kvpilot.engine.text.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_pretrained(demo_model_dir)
    manager = StructuredOutputManager(tokenizer, 151936, reasoning_parser="qwen3")
    params = SamplingParams(structured_outputs=SO(regex="[0-9]{5}")).with_stop_ids(
        tokenizer.eos_token_ids)
    end, digit, letter = (tokenizer.token_to_id(t) for t in ("</think>", "7", "x"))

    def allowed(request: Request) -> set[int] | None:
        step = SchedulerOutput([ScheduledRequest(request, request.num_tokens - 1, 1, [])])
        mask = manager.grammar_bitmask(step)
        if mask is None:
            return None
        bits = mask.bitmask[0]
        return {t for t in (digit, letter, end) if bits[t // 32] >> (t % 32) & 1}

    def add(request: Request) -> None:   # the grammar compiles on the manager's thread
        manager.add_request(request)
        while manager.num_waiting:
            manager.wait(1.0)
            assert manager.poll()[1] == []   # (ready, failed): no failure

    thinking = Request("thinking", tokenizer.encode("Think first."), params)
    add(thinking)
    assert allowed(thinking) is None                  # reasoning: free text
    thinking.output_token_ids += [letter, letter]
    manager.accept(thinking)
    assert allowed(thinking) is None
    thinking.output_token_ids.append(end)             # the reasoning ends
    manager.accept(thinking)
    assert allowed(thinking) == {digit}
    done = Request("done", tokenizer.encode("<think>\n\n</think>\n\nAnswer:"), params)
    add(done)
    assert allowed(done) == {digit}


def test_a_grammar_late_past_the_timeout_fails_alone_then_serves_from_the_cache(tiny_checkpoint):
    """The engine alone: a grammar not ready within the compile timeout fails its request
    with a ValueError (a 400 through the server) while a free request beside it finishes;
    the compile goes on and lands in the cache, so the same constraint then runs at once."""
    llm = LLM(str(tiny_checkpoint("qwen3")), dtype="float32", num_gpu_blocks=64, max_model_len=256,
              structured_outputs_config=StructuredOutputsConfig(compile_timeout=0.001))
    engine = llm.llm_engine
    so = SO(choice=[f"option {i}" for i in range(20_000)])
    engine.add_request("late", "pick", SamplingParams(max_tokens=8, structured_outputs=so))
    engine.add_request("free", "talk", SamplingParams(max_tokens=8, ignore_eos=True))
    assert engine.scheduler.requests["late"].status.value == "waiting_for_grammar"
    failed, finished = [], set()
    while engine.has_unfinished_requests():
        finished |= {out.request_id for out in engine.step() if out.finished}
        failed += engine.take_failed_requests()
    assert finished == {"free"}
    assert [f.request_id for f in failed] == ["late"] and failed[0].invalid
    assert "--structured-output-compile-timeout" in failed[0].message
    backend = engine.structured_output.backend
    deadline = time.monotonic() + 120
    while backend.cached(so) is None:
        assert time.monotonic() < deadline, "the compile never finished"
        time.sleep(0.05)
    [out] = llm.generate(["pick"], SamplingParams(max_tokens=8, structured_outputs=so))
    assert out.outputs[0].text in so.choice
    assert backend.num_compiles == 1

"""One source per contract: the CRD file is what the tables render, drift on either side
fails the check, and each CEL rule means in Python what it means in CEL.

Oracles: cel-python (the rules as CEL, as the API server evaluates them) and jsonschema
(the rendered openAPIV3Schema, as ``crd_schema.admit`` applies it).
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import random
import shutil
from pathlib import Path

import celpy
import pytest
import yaml

from kvpilot.operator.contract import inference_service as table
from kvpilot.operator.contract.crd import FILE_NAME, crd, render
from kvpilot.operator.contract.schema import Arr, Bool, Field, Int, Map, Num, Obj, SpecError, Str

from support import crd_schema

ROOT = Path(__file__).resolve().parents[2]
GOOD = {"model": {"uri": "hf://Qwen/Qwen3-0.6B"}, "gpu": {"type": "l4"},
        "slo": {"maxContext": 8192, "p95PromptTokens": 2048, "p95OutputTokens": 512, "concurrency": 16}}


def _script():
    spec = importlib.util.spec_from_file_location("sync_chart_crds", ROOT / "scripts" / "sync_chart_crds.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _with_slo_bound(maximum: int) -> Obj:
    """The spec table with one bound changed: slo.maxContext's maximum."""
    slo = dataclasses.replace(table.SLO, properties={
        **table.SLO.properties, "maxContext": dataclasses.replace(table.SLO.properties["maxContext"], maximum=maximum)})
    return dataclasses.replace(table.SPEC, properties={**table.SPEC.properties, "slo": slo})


def _admit(spec_schema: Obj, spec: dict) -> list[str]:
    """What an API server holding the CRD rendered from ``spec_schema`` says of ``spec``."""
    schema = crd(spec_schema)["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    return crd_schema.admit(schema, {"apiVersion": "serving.kvpilot.dev/v1alpha1", "kind": "InferenceService",
                                     "metadata": {"name": "x"}, "spec": spec})[1]


def test_the_crd_files_are_what_the_tables_render():
    sync = _script()
    assert sync.contract_differences() == [], "run: python scripts/sync_chart_crds.py"
    assert sync.differences() == []
    assert crd_schema.load_crd() == yaml.safe_load(render())


def test_a_bound_or_a_rule_changed_on_one_side_only_fails_the_check(tmp_path):
    sync = _script()
    # the table side: one bound changed, the CRD file not regenerated
    drifted = sync.contract_differences(files=lambda: {FILE_NAME: render(_with_slo_bound(4096))})
    assert drifted == [f"{ROOT / 'crds' / FILE_NAME} differs from the contract tables (kvpilot/operator/contract/)"]
    # the CRD side: one CEL rule, then one bound, edited in the file by hand
    source = tmp_path / "crds"
    shutil.copytree(ROOT / "crds", source, ignore=shutil.ignore_patterns("examples"))
    text = (source / FILE_NAME).read_text()
    rule = "self.p50PromptTokens <= self.p95PromptTokens"
    assert text.count(rule) == 1 and text.count("maximum: 2097152") == 1
    for edited in (text.replace(rule, "self.p50PromptTokens < self.p95PromptTokens"),
                   text.replace("maximum: 2097152", "maximum: 1048576")):
        (source / FILE_NAME).write_text(edited)
        assert len(sync.contract_differences(source)) == 1
    (source / FILE_NAME).write_text(text)
    assert sync.contract_differences(source) == []
    assert sync.main(["--check"]) == 0


def test_one_change_in_the_table_moves_the_crd_and_the_operator_together():
    spec = {**GOOD, "slo": {**GOOD["slo"], "maxContext": 8192}}
    assert _admit(table.SPEC, spec) == [] and table.SPEC.check(spec, "spec")
    narrower = _with_slo_bound(4096)
    errors = _admit(narrower, spec)
    assert errors and "maxContext" in errors[0]
    with pytest.raises(SpecError, match=r"spec.slo.maxContext must be <= 4096, got 8192"):
        narrower.check(spec, "spec")


def _rules(node: Field, path: str = "spec"):
    """(path, rule) of every rule in the table."""
    for rule in getattr(node, "rules", ()):
        yield path, node, rule
    if isinstance(node, Obj):
        for name, sub in node.properties.items():
            yield from _rules(sub, f"{path}.{name}")
    elif isinstance(node, Arr):
        yield from _rules(node.items, f"{path}[]")


STRINGS = ("hf://org/model", "s3://bucket/x", "pvc://claim/p", "/models/x", "--api-key=abc", "--port",
           "--api-key", "lmcache", "native", "none", "hpa", "keda", "")


def _sample(node: Field, rng: random.Random, depth: int = 0):
    """A value of ``node``'s type (not of its bounds: the rules are about relations)."""
    if isinstance(node, Obj):
        return {name: _sample(sub, rng, depth + 1) for name, sub in node.properties.items()
                if rng.random() < 0.55 and depth < 3}
    if isinstance(node, Arr):
        return [_sample(node.items, rng, depth + 1) for _ in range(rng.randrange(4))]
    if isinstance(node, Bool):
        return rng.random() < 0.5
    if isinstance(node, Int):
        return rng.choice(node.enum or (0, 1, 2, 3, 16, 512, 2048, 8192))
    if isinstance(node, Num):
        return rng.choice((0.5, 1.0, 4.0, 16.0))
    if isinstance(node, Str):
        return rng.choice(node.enum or STRINGS)
    if isinstance(node, Map):
        return {}
    return {}


@functools.lru_cache(maxsize=64)
def _program(rule: str) -> celpy.Runner:
    env = celpy.Environment()
    return env.program(env.compile(rule))


def _cel(rule: str, value) -> bool:
    try:
        return bool(_program(rule).evaluate({"self": celpy.json_to_cel(value)}))
    except celpy.CELEvalError:   # the API server rejects an object whose rule cannot evaluate
        return False


def test_every_rule_means_in_python_what_it_means_in_cel():
    rng = random.Random(25)
    rules = list(_rules(table.SPEC))
    assert len(rules) == 41   # spec 10, model 2, slo 5, engine.extraArgs 1, engine.speculative 2, offload 2,
    #                           autoscaling 3, lora 1, routing.vllmRouter 1, disaggregation's pools 2 x 7 (the
    #                           pool, its engine and its extraArgs, its speculative 2, its autoscaling 2)
    for path, node, rule in rules:
        verdicts = set()
        for _ in range(150):
            value = _sample(node, rng)
            python, cel = rule.holds(value), _cel(rule.cel, value)
            assert python == cel, (path, rule.cel, value)
            verdicts.add(python)
        assert verdicts == {True, False}, (path, rule.cel)   # both outcomes were exercised

"""An InferenceService that names a GGUF file: admitted, fetched alone, served, sized.

Oracles: the CRD's own schema (``support.crd_schema``, as the API server applies it), the
real ``huggingface_hub`` client and ``python -m kvpilot.operator.model_fetch`` against a
fake Hub on loopback that counts the bytes it sends, the real ``kvpilot serve`` parser for
the engine's args, and the planner's own weight table for the plan.
"""

from __future__ import annotations

import copy
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from kvpilot.engine.server.args import make_serve_parser
from kvpilot.operator import constants as c
from kvpilot.operator.model_fetch import TOKENIZER_PATTERNS, HubSource, fetch, parse_hf_uri
from kvpilot.operator.planner.catalog import preset_model
from kvpilot.operator.planner.plan import make_plan
from kvpilot.operator.resources import desired_children
from kvpilot.operator.resources.common import Owner
from kvpilot.operator.settings import OperatorSettings
from kvpilot.operator.spec import parse_spec
from kvpilot.operator.spec_to_plan import plan_request, plan_service

from support import crd_schema
from support.fake_hub import HubServer

SETTINGS = OperatorSettings(engine_image="registry.example/kvpilot:1.2.3")
SCHEMA = crd_schema.version_schema(crd_schema.load_crd())
REPO = "kvpilot-test/tiny-GGUF"
EXAMPLE = next(p for p in crd_schema.EXAMPLES if p.stem == "gguf-file")


def _cr(model: dict) -> dict:
    spec = {"model": model, "gpu": {"type": "l4"},
            "slo": {"maxContext": 8192, "p95PromptTokens": 2048, "p95OutputTokens": 512, "concurrency": 8}}
    return {"apiVersion": c.API_VERSION, "kind": c.KIND,
            "metadata": {"name": "gguf", "namespace": "serving", "uid": "uid-gguf"}, "spec": spec}


@pytest.mark.parametrize("uri", [
    "hf://Qwen/Qwen3-8B-GGUF/Qwen3-8B-Q4_K_M.gguf",
    "hf://Qwen/Qwen3-8B-GGUF/sub/dir/Qwen3-8B-Q8_0.gguf@main",
    "pvc://models/gguf/Qwen3-8B-Q4_K_M.gguf",
])
def test_gguf_uris_are_admitted(uri):
    cr = _cr({"uri": uri, "architecture": "qwen3-8b", "tokenizer": "hf://Qwen/Qwen3-8B@main"})
    assert crd_schema.admit(SCHEMA, cr)[1] == []
    parse_spec(cr["spec"], "gguf")


@pytest.mark.parametrize("model", [
    {"uri": "hf://Qwen/Qwen3-8B-GGUF/../evil.gguf"},           # a dot segment leaves the cache
    {"uri": "hf://Qwen/Qwen3-8B-GGUF/.hidden.gguf"},
    {"uri": "hf://Qwen/Qwen3-8B-GGUF/model.bin"},               # one file: GGUF only
    {"uri": "hf://Qwen/Qwen3-8B-GGUF/x.gguf", "tokenizer": "hf://Qwen/Qwen3-8B/tokenizer.json"},
    {"uri": "hf://Qwen/Qwen3-8B-GGUF/x.gguf", "tokenizer": "pvc://claim/tok"},
])
def test_bad_gguf_uris_are_rejected_by_the_schema(model):
    errors = crd_schema.admit(SCHEMA, _cr(model))[1]
    assert errors and any("model" in e for e in errors), errors


def _children(cr: dict):
    spec = parse_spec(cr["spec"], cr["metadata"]["name"])
    outcome = plan_service(spec)
    assert outcome.feasible, outcome.message
    owner = Owner(cr["metadata"]["name"], cr["metadata"]["namespace"], cr["metadata"]["uid"])
    children = desired_children(owner, spec, outcome.sizing, SETTINGS, podmonitor_api=True)
    return next(ch.body for ch in children if ch.kind.kind == "Deployment")["spec"]["template"]["spec"]


def _flag(args: list[str], name: str) -> str:
    return args[args.index(name) + 1]


def test_the_example_fetches_one_file_and_the_base_models_tokenizer():
    cr = yaml.safe_load(EXAMPLE.read_text())
    cr["metadata"].update(namespace="serving", uid="uid-gguf")
    pod = _children(cr)
    model_init, tokenizer_init = pod["initContainers"]
    engine = pod["containers"][0]
    assert _flag(model_init["command"], "--uri") == cr["spec"]["model"]["uri"]
    assert "--tokenizer-only" in tokenizer_init["command"]
    assert _flag(tokenizer_init["command"], "--uri") == cr["spec"]["model"]["tokenizer"]
    args = make_serve_parser().parse_args(engine["args"])   # the engine's own parser
    file = parse_hf_uri(cr["spec"]["model"]["uri"]).file
    assert args.model == f"{_flag(model_init['command'], '--dest')}/{file}"
    assert args.tokenizer == _flag(tokenizer_init["command"], "--dest")
    mounts = {m["name"]: m for m in engine["volumeMounts"]}
    assert mounts["tokenizer"]["readOnly"] is True and mounts["model"]["readOnly"] is True
    assert {v["name"] for v in pod["volumes"]} >= {"model", "tokenizer"}


def test_a_pvc_gguf_file_is_served_as_that_file():
    pod = _children(_cr({"uri": "pvc://models/gguf/Qwen3-8B-Q8_0.gguf", "architecture": "qwen3-8b"}))
    assert "initContainers" not in pod
    assert _flag(pod["containers"][0]["args"], "--model") == "/models/gguf/Qwen3-8B-Q8_0.gguf"


def test_the_plan_counts_the_weights_the_gpu_holds():
    """On a GPU the engine dequantizes a GGUF file at load: the plan counts the unquantized
    preset's bytes (never the file's smaller size, which would over-plan KV), and the
    derivation says why."""
    spec = parse_spec(_cr({"uri": "hf://Qwen/Qwen3-8B-GGUF/Qwen3-8B-Q4_K_M.gguf"})["spec"], "gguf")
    plan = make_plan(plan_request(spec))
    preset = preset_model("qwen3-8b")
    assert _weights(spec) == preset.total_weight_bytes
    assert any("Qwen3-8B-Q4_K_M.gguf is dequantized" in line for line in plan.derivation)


def _weights(spec) -> int:
    return make_plan(plan_request(spec)).memory["weight_bytes_total"]


def _repo(directory: Path) -> Path:
    directory.mkdir(parents=True)
    (directory / "model-Q4_0.gguf").write_bytes(os.urandom(300_000))
    (directory / "model-Q8_0.gguf").write_bytes(os.urandom(500_000))
    (directory / "config.json").write_text('{"model_type": "qwen3"}')
    (directory / "tokenizer.json").write_text('{"model": {}}')
    (directory / "tokenizer_config.json").write_text('{"chat_template": "{{ x }}"}')
    (directory / "README.md").write_text("# many quantizations\n")
    return directory


@pytest.fixture
def hub(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))
    monkeypatch.setenv("HF_HUB_DISABLE_TELEMETRY", "1")
    monkeypatch.delenv("HF_TOKEN", raising=False)
    with HubServer() as server:
        yield server


def _files(dest: Path) -> set[str]:
    return {p.relative_to(dest).as_posix() for p in dest.rglob("*")
            if p.is_file() and not p.relative_to(dest).parts[0].startswith(".")}


def test_the_init_container_fetches_only_the_named_file(hub, tmp_path):
    source = _repo(tmp_path / "src")
    hub.hub.publish(REPO, source)
    dest = tmp_path / "cache" / "model"
    env = {**os.environ, "HF_ENDPOINT": hub.url, "HF_HOME": str(tmp_path / "hf-home"), "PYTHONSAFEPATH": "1",
           "HF_HUB_DISABLE_PROGRESS_BARS": "1"}
    done = subprocess.run([sys.executable, "-m", "kvpilot.operator.model_fetch", "--uri",
                           f"hf://{REPO}/model-Q4_0.gguf", "--dest", str(dest)],
                          env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    assert _files(dest) == {"model-Q4_0.gguf"}
    assert (dest / "model-Q4_0.gguf").read_bytes() == (source / "model-Q4_0.gguf").read_bytes()
    assert hub.hub.file_bytes == 300_000   # the other quantization was never sent
    hub.hub.reset()
    # the next pod start finds it complete; switching files swaps them (one copy on the claim)
    uri = parse_hf_uri(f"hf://{REPO}/model-Q4_0.gguf")
    assert not fetch(HubSource(hub.url, patterns=uri.patterns()), REPO, None, dest).downloaded
    other = parse_hf_uri(f"hf://{REPO}/model-Q8_0.gguf")
    assert fetch(HubSource(hub.url, patterns=other.patterns()), REPO, None, dest).downloaded
    assert _files(dest) == {"model-Q8_0.gguf"} and hub.hub.file_bytes == 500_000


def test_a_tokenizer_fetch_takes_tokenizer_files_only(hub, tmp_path):
    hub.hub.publish(REPO, _repo(tmp_path / "src"))
    dest = tmp_path / "tokenizer"
    uri = parse_hf_uri(f"hf://{REPO}")
    fetch(HubSource(hub.url, patterns=uri.patterns(tokenizer_only=True)), REPO, None, dest)
    assert _files(dest) == {"tokenizer.json", "tokenizer_config.json"}
    assert "tokenizer*" in TOKENIZER_PATTERNS


def test_a_file_uri_is_not_a_tokenizer_source(tmp_path):
    done = subprocess.run([sys.executable, "-m", "kvpilot.operator.model_fetch", "--uri",
                           f"hf://{REPO}/model-Q4_0.gguf", "--dest", str(tmp_path), "--tokenizer-only"],
                          env={**os.environ, "PYTHONSAFEPATH": "1"}, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "takes a repository" in done.stderr


def test_operator_and_crd_agree_on_the_forms():
    """The operator's own parse of each admitted form (the contract's one regex)."""
    parsed = parse_spec(copy.deepcopy(_cr({"uri": "hf://a/b-GGUF/d/e-Q4_1.gguf@v1"}))["spec"], "x").model
    assert (parsed.repo_id, parsed.file) == ("a/b-GGUF", "d/e-Q4_1.gguf")
    assert parse_hf_uri("hf://a/b-GGUF/d/e-Q4_1.gguf@v1").revision == "v1"
    assert parse_hf_uri("hf://a/b").file is None

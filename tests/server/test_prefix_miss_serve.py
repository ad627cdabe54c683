"""Prefix-cache miss reasons through real ``kvpilot serve`` processes (the demo model): the
opt-in ``usage.prompt_tokens_details`` field (the ``openai`` SDK sees OpenAI's shape
otherwise), the request log line, the counter on /metrics, and ``kvpilot explain-prefix``
naming each planted cause, against two replicas where only replicas can tell (evicted,
wrong replica behind a round robin) and offline for the rest."""

from __future__ import annotations

import json
import subprocess
import sys

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvpilot.engine.bench.miss_workload import planted_workload
from kvpilot.engine.bench.server_process import launch_server

pytestmark = pytest.mark.slow
MODEL = "demo"
FLAGS = ["--model", "demo", "--served-model-name", MODEL, "--max-model-len", "1024",
         "--num-gpu-blocks-override", "64", "--enable-log-requests", "--uvicorn-log-level", "warning"]
OFFLINE = {"different_cache_salt": "different_cache_salt", "different_lora_adapter": "different_lora_adapter",
           "edited_system_prompt": "edited_prompt", "template_whitespace": "whitespace_change",
           "date_in_system_prompt": "date_in_prompt", "last_partial_block": "last_partial_block"}


@pytest.fixture(scope="module")
def replicas(tmp_path_factory):
    logs = tmp_path_factory.mktemp("replicas")
    with launch_server(FLAGS, log_path=logs / "a.log") as a, launch_server(FLAGS, log_path=logs / "b.log") as b:
        yield a, b


def _planted(seed: int) -> dict:
    return {m.cause: m for m in planted_workload(seed, adapter="adapter", sentences=8, num_fillers=6,
                                                 filler_sentences=30)}


def _chat(server, body: dict, **extra) -> dict:
    response = httpx.post(f"{server.base_url}/v1/chat/completions", timeout=120,
                          json={**body, "max_tokens": 2, "temperature": 0, **extra})
    assert response.status_code == 200, response.text
    return response.json()


def _explain(*args: str) -> dict:
    done = subprocess.run([sys.executable, "-m", "kvpilot.engine.cli.main", "explain-prefix", *args, "--json"],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout)


def test_usage_details_only_when_asked(replicas):
    a, _ = replicas
    miss = _planted(11)["edited_system_prompt"]
    client = openai.OpenAI(base_url=f"{a.base_url}/v1", api_key="none", max_retries=0)
    messages = [{"role": r, "content": c} for r, c in miss.seed.messages]
    client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2, temperature=0)
    probe = [{"role": r, "content": c} for r, c in miss.probe.messages]
    plain = client.chat.completions.create(model=MODEL, messages=probe, max_tokens=2, temperature=0)
    details = plain.usage.prompt_tokens_details
    assert details.model_dump(exclude_none=True) == {"cached_tokens": details.cached_tokens}
    assert not details.model_extra
    asked = client.chat.completions.create(model=MODEL, messages=probe, max_tokens=2, temperature=0,
                                           extra_body={"prefix_cache_details": True, "cache_salt": "x"})
    (entry,) = asked.usage.prompt_tokens_details.model_extra["prefix_cache_misses"]
    assert entry["reason"] == "never_seen"   # another salt's tokens are not this client's business
    stream = client.chat.completions.create(
        model=MODEL, messages=probe[:1] + [{"role": "user", "content": "Another question."}], max_tokens=2,
        temperature=0, stream=True, stream_options={"include_usage": True},
        extra_body={"prefix_cache_details": True})
    usage = [chunk.usage for chunk in stream if chunk.usage is not None][-1]
    (entry,) = usage.prompt_tokens_details.model_extra["prefix_cache_misses"]
    assert entry["reason"] == "divergence" and entry["divergence"]["kind"] in ("edit", "tokenization")
    assert "cached_text_after" not in entry["divergence"]    # what the cache held stays private
    assert entry["tokens"] == usage.prompt_tokens - usage.prompt_tokens_details.cached_tokens


def test_log_line_and_counter(replicas):
    a, _ = replicas
    _chat(a, _planted(12)["wrong_replica"].seed.body(MODEL))
    assert "Prefix cache of request" in a.log_path.read_text()
    assert "never_seen" in a.log_path.read_text()
    text = httpx.get(f"{a.base_url}/metrics").text
    counted = {s.labels["reason"]: s.value for f in text_string_to_metric_families(text) for s in f.samples
               if s.name == "kvpilot:prefix_cache_miss_tokens_total"}
    assert counted["never_seen"] > 0 and set(counted) >= {"divergence", "evicted_capacity", "too_short"}


def test_explain_prefix_names_what_only_replicas_know(replicas, tmp_path):
    a, b = replicas
    planted = _planted(13)
    wrong = planted["wrong_replica"]
    _chat(a, wrong.seed.body(MODEL))                  # round robin: the seed went to a ...
    probe = tmp_path / "probe.json"
    probe.write_text(json.dumps(wrong.probe.body(MODEL)))
    verdict = _explain(f"@{probe}", "--replica", b.base_url, "--replica", a.base_url)   # ... the probe to b
    assert verdict["cause"] == "wrong_replica" and verdict["holder"] == a.base_url
    assert isinstance(verdict["replica_miss_tokens_by_reason"], dict)   # b may have counted nothing yet
    evicted = planted["evicted"]
    _chat(a, evicted.seed.body(MODEL))
    for filler in evicted.fillers:
        _chat(a, filler.body(MODEL))
    probe.write_text(json.dumps(evicted.probe.body(MODEL)))
    verdict = _explain(f"@{probe}", "--replica", a.base_url)
    assert verdict["cause"] == "evicted" and verdict["reason"] == "evicted_capacity"
    assert verdict["evicted_age_s"] >= 0


def test_explain_prefix_offline_names_the_rest(tmp_path, capsys):
    """The first cause through the command as a user runs it (its own process), the others
    through the same entry point in this process (a process each would cost ~6 s)."""
    from kvpilot.engine.cli.main import main

    planted = _planted(14)
    named = {}
    for n, cause in enumerate(OFFLINE):
        miss = planted[cause]
        files = []
        for i, chat in enumerate((miss.seed, miss.probe)):
            body = {**chat.body(MODEL), "chat_template": chat.chat_template}   # as the workload renders
            files.append(tmp_path / f"{cause}-{i}.json")
            files[-1].write_text(json.dumps(body))
        args = ["explain-prefix", *(f"@{f}" for f in files), "--model", "demo", "--json"]
        if n == 0:
            named[cause] = _explain(*args[1:-1])["cause"]
        else:
            capsys.readouterr()
            assert main(args) == 0
            named[cause] = json.loads(capsys.readouterr().out)["cause"]
    assert named == OFFLINE

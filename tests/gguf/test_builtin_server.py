"""``kvpilot serve`` without ``--model`` serves the built-in SmolLM2-135M-Instruct, which
answers (the README's first screen): a real server, asked through the ``openai`` SDK."""

from __future__ import annotations

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvpilot.engine.bench.server_process import launch_server

QUESTION = "What is the capital of France?"


@pytest.mark.slow
def test_default_model_answers_the_readme_question(tmp_path):
    flags = ["--max-model-len", "1024", "--kv-cache-memory-bytes", "64Mi"]
    with launch_server(flags, log_path=tmp_path / "serve.log", timeout=300) as server:
        client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="none", max_retries=0, timeout=120)
        models = client.models.list().data
        assert [m.id for m in models] == ["SmolLM2-135M-Instruct"]
        reply = client.chat.completions.create(model=models[0].id, temperature=0, max_tokens=32,
                                               messages=[{"role": "user", "content": QUESTION}])
        answer = reply.choices[0].message.content
        print(f"\n{QUESTION} -> {answer!r}")
        assert "Paris" in answer
        assert reply.choices[0].finish_reason == "stop"
        # Asked again, the prompt's first blocks come from the prefix cache and only its
        # last tokens are computed: the same answer (it once derailed: test_prompt_activations)
        again = client.chat.completions.create(model=models[0].id, temperature=0, max_tokens=32,
                                               messages=[{"role": "user", "content": QUESTION}])
        assert again.choices[0].message.content == answer
        assert _counter(server.base_url, "vllm:prefix_cache_hits") >= 32
        log = (tmp_path / "serve.log").read_text()
        assert "GGUF SmolLM2-135M-Instruct.Q4_1.gguf: resident weights" in log


def _counter(base_url: str, name: str) -> float:
    """A counter's value from the server's ``/metrics`` (Prometheus' own text parser)."""
    text = httpx.get(f"{base_url}/metrics", timeout=30).text
    for family in text_string_to_metric_families(text):
        if family.name == name:
            return sum(sample.value for sample in family.samples if sample.name == f"{name}_total")
    raise AssertionError(f"{name} is not in /metrics")

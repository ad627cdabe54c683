"""``kvpilot serve`` without ``--model`` serves the built-in SmolLM2-135M-Instruct, which
answers (the README's first screen): a real server, asked through the ``openai`` SDK."""

from __future__ import annotations

import openai
import pytest

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
        log = (tmp_path / "serve.log").read_text()
        assert "GGUF SmolLM2-135M-Instruct.Q4_1.gguf: resident weights" in log

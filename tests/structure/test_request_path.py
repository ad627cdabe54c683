"""How much of the project one streamed chat request runs through (issue 42).

A real ``kvpilot serve`` (demo model, engine core in its own process) is started with a
tracing hook (``support.file_trace``); after warm-up requests, the project files whose
Python functions run while ONE streamed chat request is served are recorded in both
processes. A newcomer follows that path by reading those files: it must stay short.
docs/engine.md, "The path of one request", draws it.
"""

from __future__ import annotations

from pathlib import Path

import openai
import pytest

from kvpilot.engine.bench.server_process import launch_server

from support.file_trace import traced_env

ROOT = Path(__file__).resolve().parents[2]
MAX_FILES = 40   # 55 on fea2f16, before issue 42


def _chat(client: openai.OpenAI, content: str) -> str:
    stream = client.chat.completions.create(
        model="demo", stream=True, max_tokens=8, temperature=0,
        messages=[{"role": "user", "content": content}])
    return "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)


@pytest.mark.slow
def test_one_streamed_chat_request_runs_in_few_project_files(tmp_path):
    env, window = traced_env(tmp_path, ROOT)
    with launch_server(["--model", "demo", "--served-model-name", "demo",
                        "--kv-cache-memory-bytes", str(16 << 20), "--max-model-len", "512",
                        "--uvicorn-log-level", "warning", "--log-stats-interval", "0"],
                       log_path=tmp_path / "serve.log", env=env, timeout=300) as server:
        client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="none", max_retries=0)
        for i in range(3):   # warm-up: imports, first-use caches, the first step's set-up
            _chat(client, f"warm up {i}")
        window.start()
        text = _chat(client, "Tell me about paged attention.")
        window.stop(num_processes=2)
    processes = window.per_process()
    files = sorted(str(Path(f).relative_to(ROOT)) for f in window.files())
    assert text, "the traced request streamed nothing"
    assert len(processes) == 2, [p["argv"] for p in processes]
    per_process = {p["argv"][0]: len(p["files"]) for p in processes}
    for proc in processes:
        print(proc["argv"][:3])
        for f, fns in sorted(proc["functions"].items()):
            print("   ", Path(f).relative_to(ROOT), " ".join(fns))
    print(f"{len(files)} project files over {len(processes)} processes {per_process}:\n  "
          + "\n  ".join(files))
    assert len(files) <= MAX_FILES, (
        f"one streamed chat request runs code in {len(files)} project files (at most "
        f"{MAX_FILES}): " + ", ".join(files))

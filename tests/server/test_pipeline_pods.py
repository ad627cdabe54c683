"""A pipeline over two "pods" (separate process trees on this host) with only the
LeaderWorkerSet environment between them.

Each pod runs the command line the operator renders for its LeaderWorkerSet template
(``kvpilot serve`` with the same flags, ``--pipeline-parallel-size 2``) with
``LWS_LEADER_ADDRESS=127.0.0.1``, ``LWS_GROUP_SIZE=2``, ``LWS_WORKER_INDEX`` 0 or 1 and the
rendezvous port in ``KVPILOT_RENDEZVOUS_PORT``. The leader serves /v1/completions
(checked token for token against HF's greedy continuation through the ``openai`` SDK);
killing the worker pod's whole process group mid-generation fails the in-flight requests
and turns the leader's /health to 503 within 5 s; a leader whose worker never comes fails
its start-up with the rendezvous error naming the missing pod, within the configured
timeout.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator

import httpx
import openai
import pytest

from kvpilot.engine.bench.server_process import free_port, launch_server

from support.hf_oracle import hf_greedy
from support.tiny_checkpoints import build_checkpoint

DETECTION_LIMIT_S = 5.0


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return build_checkpoint(tmp_path_factory.mktemp("ckpt-pp"), "qwen3", num_hidden_layers=3)


def _flags(path, tp: int = 1) -> list[str]:
    return ["--model", str(path), "--dtype", "float32", "--pipeline-parallel-size", "2",
            "--tensor-parallel-size", str(tp),
            "--kv-cache-memory-bytes", "4Mi", "--max-model-len", "1024", "--max-num-seqs", "4",
            "--served-model-name", "pp", "--uvicorn-log-level", "warning"]


def _lws_env(index: int, port: int, **extra: str) -> dict[str, str]:
    return {"LWS_LEADER_ADDRESS": "127.0.0.1", "LWS_GROUP_SIZE": "2", "LWS_WORKER_INDEX": str(index),
            "KVPILOT_RENDEZVOUS_PORT": str(port), **extra}


@contextlib.contextmanager
def _worker_pod(path, port: int, log_path, tp: int = 1) -> Iterator[subprocess.Popen]:
    """The worker pod: its own session (a process group, killed whole like a pod), killed
    on the way out if it is still there."""
    cmd = [sys.executable, "-m", "kvpilot.engine.cli.main", "serve", "--host", "127.0.0.1",
           "--port", str(free_port()), *_flags(path, tp)]
    with log_path.open("wb") as log:
        worker = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                  env={**os.environ, "PYTHONSAFEPATH": "1", **_lws_env(1, port)})
    try:
        yield worker
    finally:
        if worker.poll() is None:
            os.killpg(worker.pid, signal.SIGKILL)
        worker.wait(10)


@pytest.mark.slow
def test_leader_and_worker_pods_serve_and_a_killed_worker_fails_the_leader(tmp_path, checkpoint,
                                                                           kill_mid_generation):
    port = free_port()
    with (
        _worker_pod(checkpoint, port, tmp_path / "worker.log") as worker,
        launch_server(_flags(checkpoint), log_path=tmp_path / "leader.log", timeout=240,
                      env=_lws_env(0, port)) as leader,
        httpx.Client(base_url=leader.base_url, timeout=60) as http,
    ):
        assert worker.poll() is None
        client = openai.OpenAI(base_url=f"{leader.base_url}/v1", api_key="none")
        prompt = list(range(5, 45))
        reply = client.completions.create(model="pp", prompt=prompt, max_tokens=8, temperature=0,
                                          extra_body={"ignore_eos": True})
        expected = hf_greedy(checkpoint, [prompt], 8)[0]
        from transformers import AutoTokenizer

        assert reply.choices[0].finish_reason == "length" and reply.usage.completion_tokens == 8
        assert reply.choices[0].text == AutoTokenizer.from_pretrained(checkpoint).decode(expected)
        print(f"\n[pipeline pods] completion {reply.choices[0].text!r} == HF's tokens {expected} decoded")
        death = kill_mid_generation(http, "pp", lambda: os.killpg(worker.pid, signal.SIGKILL),
                                    DETECTION_LIMIT_S)
        assert "the engine failed while serving this request (request id" in death.stream_error
        assert death.health.status_code == 503
        message = death.health.json()["error"]["message"]
        assert "worker pod LWS_WORKER_INDEX=1 (pipeline stage 1, rank 1)" in message
        assert death.plain.status_code == 500 and death.refused.status_code == 503
        print(f"[pipeline pods] worker pod killed: stream error after {death.stream_failed_s:.2f} s, "
              f"/health 503 after {death.health_failed_s:.2f} s: {message}")
        assert death.stream_failed_s < DETECTION_LIMIT_S and death.health_failed_s < DETECTION_LIMIT_S


@pytest.mark.slow
def test_tensor_parallel_ranks_inside_each_pod_and_a_clean_stop(tmp_path, checkpoint):
    """TP=2 x PP=2 over two pods: each pod starts its own stage's two ranks (the leader's
    engine rank 1, the worker pod ranks 2 and 3); stopping the leader stops the worker pod."""
    port = free_port()
    with _worker_pod(checkpoint, port, tmp_path / "worker.log", tp=2) as worker:
        with launch_server(_flags(checkpoint, tp=2), log_path=tmp_path / "leader.log", timeout=240,
                           env=_lws_env(0, port)) as leader:
            client = openai.OpenAI(base_url=f"{leader.base_url}/v1", api_key="none")
            prompts = [list(range(5, 45)), list(range(100, 103))]
            expected = hf_greedy(checkpoint, prompts, 8)
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(checkpoint)
            for prompt, tokens in zip(prompts, expected, strict=True):
                reply = client.completions.create(model="pp", prompt=prompt, max_tokens=8, temperature=0,
                                                  extra_body={"ignore_eos": True})
                assert reply.choices[0].text == tokenizer.decode(tokens)
            assert "ranks [2, 3]" in (tmp_path / "worker.log").read_text()
        code = worker.wait(30)
        print(f"\n[pipeline pods, TP=2 each] {len(prompts)} completions equal HF's; the worker pod "
              f"exited {code} after the leader stopped")
        assert code == 0, (tmp_path / "worker.log").read_text()[-3000:]


@pytest.mark.slow
def test_a_rank_dying_inside_the_worker_pod_fails_the_leader_with_its_exit(tmp_path, checkpoint):
    """Not the whole pod: one of its ranks. The pod records why and exits; the leader names it."""
    import re

    port = free_port()
    worker_log = tmp_path / "worker.log"
    with (
        _worker_pod(checkpoint, port, worker_log) as worker,
        launch_server(_flags(checkpoint), log_path=tmp_path / "leader.log", timeout=240,
                      env=_lws_env(0, port)) as leader,
        httpx.Client(base_url=leader.base_url, timeout=60) as http,
    ):
        (pid,) = map(int, re.search(r"started ranks \[1\] \(pids \[(\d+)\]\)", worker_log.read_text()).groups())
        os.kill(pid, signal.SIGKILL)
        killed = time.monotonic()
        while (health := http.get("/health")).status_code == 200 and time.monotonic() < killed + 10:
            time.sleep(0.05)
        unready_s = time.monotonic() - killed
        message = health.json()["error"]["message"]
        assert health.status_code == 503
        assert (f"worker pod LWS_WORKER_INDEX=1 (pipeline stage 1, rank 1) failed: rank 1 (pid {pid}) "
                f"was killed by SIGKILL") in message
        print(f"\n[pipeline pods] a worker pod's rank killed: /health 503 after {unready_s:.2f} s: {message}")
        assert unready_s < DETECTION_LIMIT_S
        assert worker.wait(10) == 1


def test_a_missing_worker_pod_fails_the_rendezvous_naming_it(tmp_path, checkpoint):
    port = free_port()
    start = time.monotonic()
    with pytest.raises(RuntimeError) as failed:
        launch_server(_flags(checkpoint), log_path=tmp_path / "leader.log", timeout=120,
                      env=_lws_env(0, port, KVPILOT_RENDEZVOUS_TIMEOUT="3"))
    elapsed = time.monotonic() - start
    log = str(failed.value)
    expected = (f"pipeline rendezvous timed out after 3 s waiting for worker pod LWS_WORKER_INDEX=1 "
                f"(pipeline stage 1, rank 1) to join the leader's store at 127.0.0.1:{port} "
                f"(LWS_GROUP_SIZE=2); missing ranks [1]")
    assert expected in log, log
    print(f"\n[pipeline pods] leader without its worker exited after {elapsed:.1f} s: {expected}")


def test_the_lws_environment_is_read_strictly():
    from kvpilot.engine.config import ParallelConfig
    from kvpilot.engine.deploy.lws import rendezvous_from_env

    assert rendezvous_from_env({}) is None
    rv = rendezvous_from_env(_lws_env(1, 1234, KVPILOT_RENDEZVOUS_TIMEOUT="7.5"))
    assert (rv.leader_address, rv.port, rv.group_size, rv.worker_index, rv.timeout_s) == (
        "127.0.0.1", 1234, 2, 1, 7.5)
    with pytest.raises(ValueError, match="LeaderWorkerSet environment incomplete: LWS_LEADER_ADDRESS unset"):
        rendezvous_from_env({"LWS_WORKER_INDEX": "1", "LWS_GROUP_SIZE": "2"})
    with pytest.raises(ValueError, match=r"LWS_WORKER_INDEX 2 must be in \[0, 2\)"):
        rendezvous_from_env(_lws_env(2, 1234))
    with pytest.raises(ValueError, match="LWS_GROUP_SIZE 2 must equal --pipeline-parallel-size 3"):
        ParallelConfig(1, ("cpu",), 3, rv)

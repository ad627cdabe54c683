"""``vllm:spec_decode_*`` from a real ``kvpilot serve --speculative-config``: present, self-
consistent, and equal to what the engine's own independent counters imply.

Requests run to ``max_tokens`` (no stops, no preemption), so every token a request gets is
either one sampled per scoring event (the prefill's last chunk, then each decode step) or
an accepted draft, and every token a step computes is a prompt token, a request's last
token in a decode step, or a draft:

    generation tokens = sampling events + accepted draft tokens
    iteration tokens  = computed prompt tokens + (sampling events - requests) + draft tokens

so ``accepted = generation - (iteration - computed prompt - draft tokens + requests)``,
with ``vllm:generation_tokens``, ``vllm:iteration_tokens_total`` (its sum),
``kvpilot:prompt_tokens_computed`` and ``vllm:request_success`` on one side and the
speculative counters on the other.
"""

from __future__ import annotations

import time

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvpilot.engine.bench.server_process import launch_server

K = 3
PROMPTS = ["The quick brown fox jumps over the lazy dog. " * 4,
           "def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)\n" * 2,
           "Paged attention stores keys and values in blocks. Paged attention",
           "Kubernetes operators reconcile desired state. Kubernetes"]


def _samples(text: str) -> dict[tuple[str, tuple], float]:
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = tuple(sorted((k, v) for k, v in s.labels.items() if k != "model_name"))
            out[(s.name, labels)] = s.value
    return out


@pytest.mark.slow
def test_spec_decode_metrics_agree_with_the_engines_own_counts(tiny_checkpoint, tmp_path):
    spec = f'{{"method": "ngram", "num_speculative_tokens": {K}, "prompt_lookup_min": 1, "prompt_lookup_max": 3}}'
    flags = ["--model", str(tiny_checkpoint("qwen3")), "--dtype", "float32", "--max-model-len", "256",
             "--num-gpu-blocks-override", "64", "--speculative-config", spec, "--log-stats-interval", "0.2"]
    log = tmp_path / "serve.log"
    with launch_server(flags, log_path=log, timeout=300) as server:
        client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="none", max_retries=0)
        for i, prompt in enumerate(PROMPTS):
            client.completions.create(model=client.models.list().data[0].id, prompt=prompt,
                                      max_tokens=12 + i, temperature=0,
                                      extra_body={"ignore_eos": True})
        metrics = _samples(httpx.get(f"{server.base_url}/metrics").text)
        deadline = time.monotonic() + 10     # the periodic stats line: the next tick after the requests
        while "Draft acceptance rate:" not in log.read_text() and time.monotonic() < deadline:
            time.sleep(0.1)
    drafts = metrics[("vllm:spec_decode_num_drafts_total", ())]
    draft_tokens = metrics[("vllm:spec_decode_num_draft_tokens_total", ())]
    accepted = metrics[("vllm:spec_decode_num_accepted_tokens_total", ())]
    per_pos = [metrics[("vllm:spec_decode_num_accepted_tokens_per_pos_total", (("position", str(i)),))]
               for i in range(K)]
    print(f"drafts {drafts}, draft tokens {draft_tokens}, accepted {accepted}, per position {per_pos}")
    assert 0 < accepted <= draft_tokens <= K * drafts
    assert per_pos == sorted(per_pos, reverse=True) and per_pos[0] <= drafts
    assert sum(per_pos) == accepted
    generation = metrics[("vllm:generation_tokens_total", ())]
    iteration = metrics[("vllm:iteration_tokens_total_sum", ())]
    computed_prompt = metrics[("kvpilot:prompt_tokens_computed_total", ())]
    requests = sum(v for (name, _), v in metrics.items() if name == "vllm:request_success_total")
    assert requests == len(PROMPTS)
    assert generation == sum(12 + i for i in range(len(PROMPTS)))
    sampling_events = iteration - computed_prompt - draft_tokens + requests
    assert accepted == generation - sampling_events
    assert "Draft acceptance rate:" in log.read_text()      # the periodic stats line

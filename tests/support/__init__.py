"""Helpers shared by the test folders, ``e2e/`` and ``scripts/bench_operator.py``.

Imported as ``support.<module>``: pytest puts ``tests/`` on ``sys.path`` (``pythonpath``
in pyproject.toml), so no test file edits ``sys.path``. A child Python that imports them
(a worker script a test starts) gets ``tests/`` through ``with_support_path``. Only this
package is meant to be imported from there: the test folders beside it hold no
``__init__.py`` and are never imported by name (the repository root, whose ``operator/``
would shadow the standard library, stays off ``sys.path``).

By the tests that use them first:

- engine: ``hf_oracle`` (HF transformers' greedy outputs, the parity oracle),
  ``fp8_checkpoints`` (FP8 copies of a checkpoint), ``one_request`` (one request's steps).
- kernels: ``attention_helpers`` (paged caches and the reference attention).
- offload: ``offload_helpers`` (the offload model, prompts and counters), ``shared_disk``
  (one engine's disk tier in a process of its own).
- server: ``vllm_metric_names`` (vLLM's metric names, also read by the observability tests).
- operator: ``kube_emulator`` / ``kube_emulator_api`` / ``kube_faults`` (the Kubernetes API
  emulator), ``api_calls`` and ``traffic`` (what the operator asked of it), ``crd_schema``,
  ``harness`` (the emulator thread, operator process, kubectl), ``operator_env``,
  ``built`` (children built from a spec), ``fake_hub`` (a Hugging Face Hub stand-in), ``deputy_specs``
  (the confused-deputy specs the policy must refuse, shared with the chart's tests).
- chart: ``chart`` (helm), ``manifests`` (schema checks), ``rbac`` (the chart's grants).
- autoscaling: ``adapter_rules``, ``hpa_algorithm``, ``kubelet``, ``platforms``,
  ``prometheus_sd``.
- observability: ``dashboards``, ``promtool``.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

TESTS_DIR = Path(__file__).resolve().parent.parent


def with_support_path(env: Mapping[str, str]) -> dict[str, str]:
    """A copy of ``env`` with ``tests/`` first on PYTHONPATH, for a child Python that
    imports ``support``."""
    path = [str(TESTS_DIR), *filter(None, env.get("PYTHONPATH", "").split(os.pathsep))]
    return {**env, "PYTHONPATH": os.pathsep.join(path)}

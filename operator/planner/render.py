"""Output formats of ``kvpilot plan``: a text sizing report, JSON, YAML, and serve flags."""

from __future__ import annotations

import json
import shlex
import textwrap

import yaml

from kvpilot.operator.planner.memory import gib
from kvpilot.operator.planner.result import Plan

FORMATS = ("text", "json", "yaml", "args")
_WIDTH = 100


def to_json(plan: Plan) -> str:
    return json.dumps(plan.to_dict(), indent=2, allow_nan=False)


def to_yaml(plan: Plan) -> str:
    return yaml.safe_dump(plan.to_dict(), sort_keys=False, width=_WIDTH, allow_unicode=True)


def to_args(plan: Plan) -> str:
    return shlex.join(plan.serve_args())


def _rows(rows: list[tuple[str, str]]) -> list[str]:
    return [f"  {name:<26} {value}" for name, value in rows]


def _wrap(text: str, first: str, rest: str) -> list[str]:
    return textwrap.wrap(text, _WIDTH, initial_indent=first, subsequent_indent=rest,
                         break_on_hyphens=False) or [first]


def to_text(plan: Plan) -> str:
    """A sizing report: verdict, settings, estimates, derivation, warnings, suggestions, flags."""
    est = plan.estimates
    verdict = ("FEASIBLE" if plan.feasible else "INFEASIBLE") + f" (binding constraint: {plan.binding_constraint})"
    kv_label = f"{plan.kv_cache_dtype} ({plan.kv_dtype_name}, {plan.kv_dtype_bytes} B)"
    nodes = f"{plan.pipeline_parallel_size} nodes x " if plan.pipeline_parallel_size > 1 else ""
    out = [f"kvpilot plan: {plan.model} on {nodes}{plan.tensor_parallel_size} x {plan.gpu} per replica, "
           f"{plan.replicas} replica(s)",
           f"Result: {verdict}"]
    out += _wrap(plan.binding_detail, "  ", "  ")
    failed = [c for c in plan.checks if not c.ok]
    for check in failed[1:]:
        out += _wrap(check.detail, f"  also failing ({check.name}): ", "    ")
    out += ["", "Engine settings (per replica; memory figures per GPU)"]
    out += _rows([
        ("tensor_parallel_size", str(plan.tensor_parallel_size)),
        *([("pipeline_parallel_size", f"{plan.pipeline_parallel_size} (one node each)")]
          if plan.pipeline_parallel_size > 1 else []),
        ("max_model_len", f"{plan.max_model_len:,}"),
        ("max_num_seqs", f"{plan.max_num_seqs:,}"),
        ("max_num_batched_tokens", f"{plan.max_num_batched_tokens:,}"),
        ("block_size", str(plan.block_size)),
        ("kv_cache_dtype", kv_label),
        ("gpu_memory_utilization", f"{plan.gpu_memory_utilization:.2f}"),
        ("kv_cache_memory_bytes", f"{plan.kv_cache_memory_bytes:,} ({gib(plan.kv_cache_memory_bytes):.2f} GiB)"),
        ("num_gpu_blocks", f"{plan.num_gpu_blocks:,}"),
        ("kv_token_capacity", f"{plan.kv_token_capacity:,} tokens"),
        ("kv_bytes_per_token", f"{plan.kv_bytes_per_token:,} B ({plan.kv_bytes_per_token / 1024:.1f} KiB)"),
        ("enable_prefix_caching", str(plan.enable_prefix_caching).lower()),
    ])
    out += ["", "Deployment"]
    out += _rows([
        ("replicas", str(plan.replicas)),
        ("GPUs in total", str(plan.replicas * plan.tensor_parallel_size * plan.pipeline_parallel_size)),
        ("cpu_offload_gib", f"{plan.cpu_offload_gib:g}"
         + (f" ({plan.offload_backend})" if plan.offload_backend else "")),
        ("disk_offload_gib", f"{plan.disk_offload_gib:g}"
         + (f" at {plan.offload_disk_path}" if plan.offload_disk_path else "")),
        ("pod memory / /dev/shm", f"{plan.pod_memory_gib:g} GiB / {plan.shm_gib:g} GiB"),
    ])
    if est.get("itl_p95_ms") is not None:
        out += ["", "Estimates (roofline)"]
        rows = [("ITL p95", f"~{est['itl_p95_ms']:,.1f} ms"), ("TTFT p95", f"~{est['ttft_p95_ms']:,.1f} ms")]
        if est.get("requests_per_second_per_replica") is not None:
            rows.append(("throughput per replica", f"~{est['requests_per_second_per_replica']:,.2f} req/s"))
        out += _rows(rows)
    out += ["", "Derivation"]
    for line in plan.derivation:
        number, _, text = line.partition(" ")
        out += _wrap(text, f"  {number:>3} ", " " * 6)
    if plan.warnings:
        out += ["", "Warnings"]
        for warning in plan.warnings:
            out += _wrap(warning, "  - ", "    ")
    if plan.suggestions:
        out += ["", "Suggestions (each verified to give a feasible plan)"]
        for s in plan.suggestions:
            out += _wrap(s.description, f"  - [{s.kind}] ", "    ")
            out.append(f"    apply: {json.dumps(s.apply)}")
    if plan.feasible:
        out += ["", "kvpilot serve flags"]
        out += _wrap(to_args(plan), "  kvpilot serve ", "      ")
    return "\n".join(out) + "\n"


def render(plan: Plan, fmt: str) -> str:
    """``plan`` in one of FORMATS."""
    if fmt == "text":
        return to_text(plan)
    if fmt == "json":
        return to_json(plan) + "\n"
    if fmt == "yaml":
        return to_yaml(plan)
    if fmt == "args":
        return to_args(plan) + "\n"
    raise ValueError(f"unknown output format {fmt!r}; expected one of {', '.join(FORMATS)}")

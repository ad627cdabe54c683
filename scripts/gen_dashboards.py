#!/usr/bin/env python3
"""Generate kvpilot's Grafana dashboards (charts/kvpilot/files/dashboards/*.json) with
Grafana's dashboards-as-code SDK (PyPI ``grafana-foundation-sdk``).

    .venv/bin/python scripts/gen_dashboards.py          # rewrite the JSON files
    .venv/bin/python scripts/gen_dashboards.py --check  # exit 1 when they are stale

Two dashboards: ``kvpilot-engines`` (KV cache, prefix cache, preemption, queues, latency
percentiles, throughput, batch size, speculative decoding's acceptance length, KV offload,
planned vs observed capacity, replicas)
and ``kvpilot-operator`` (reconciles, errors, plan outcomes, drift repairs). Both take the
Prometheus data source from the ``DS_PROMETHEUS`` variable (Grafana's import convention),
filter on ``namespace`` / ``model_name`` variables, and rate over ``$__rate_interval``.
The chart turns each file into a ConfigMap labelled ``grafana_dashboard: "1"``.
tests/observability checks that the committed files are this script's output and runs
every target's PromQL against a real Prometheus scraping real engines and the operator.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from grafana_foundation_sdk.builders import dashboard as gdash
from grafana_foundation_sdk.builders import heatmap, prometheus, timeseries
from grafana_foundation_sdk.cog.encoder import JSONEncoder
from grafana_foundation_sdk.models import dashboard as mdash
from grafana_foundation_sdk.models import prometheus as mprom

OUT_DIR = Path(__file__).resolve().parents[1] / "charts" / "kvpilot" / "files" / "dashboards"
DATASOURCE = mdash.DataSourceRef(type_val="prometheus", uid="${DS_PROMETHEUS}")
RATE = "$__rate_interval"
ENGINE = 'namespace=~"$namespace",model_name=~"$model_name"'   # the engines' series
SERVICE = 'namespace=~"$namespace"'                               # the operator's per-service series
QUANTILES = (0.5, 0.95, 0.99)


@dataclass(frozen=True)
class Target:
    expr: str
    legend: str
    heatmap: bool = False


@dataclass(frozen=True)
class PanelSpec:
    """One panel: a title, what it shows (the description), a unit and its targets."""

    title: str
    description: str
    unit: str
    targets: tuple[Target, ...]
    kind: str = "timeseries"     # or "heatmap"


def rate(series: str, selector: str = ENGINE) -> str:
    return f"rate({series}{{{selector}}}[{RATE}])"


def quantile_targets(histogram: str, selector: str = ENGINE) -> tuple[Target, ...]:
    return tuple(Target(f"histogram_quantile({q}, sum by (le) ({rate(histogram + '_bucket', selector)}))",
                        f"p{round(q * 100)}") for q in QUANTILES)


def ratio(numerator: str, denominator: str, by: str = "model_name") -> str:
    """rate(numerator) / rate(denominator), summed ``by``: a rate of rates, never a ratio of
    raw counters."""
    return f"sum by ({by}) ({rate(numerator)}) / sum by ({by}) ({rate(denominator)})"


def engine_rows() -> list[tuple[str, list[PanelSpec]]]:
    latency = [
        ("Time to first token", "vllm:time_to_first_token_seconds", "Arrival to first token."),
        ("Inter-token latency", "vllm:inter_token_latency_seconds", "Between steps giving a request tokens."),
        ("End-to-end latency", "vllm:e2e_request_latency_seconds", "Arrival to last token (finished)."),
        ("Queue time", "vllm:request_queue_time_seconds", "Arrival to first scheduling (finished)."),
        ("Prefill time", "vllm:request_prefill_time_seconds", "First scheduling to first token (finished)."),
        ("Decode time", "vllm:request_decode_time_seconds", "First to last token (finished)."),
    ]
    return [
        ("KV cache", [
            PanelSpec("KV cache usage per pod", "Share of each engine's KV blocks held by running "
                      "requests (0-1).", "percentunit",
                      (Target(f"max by (pod) (vllm:kv_cache_usage_perc{{{ENGINE}}})", "{{pod}}"),)),
            PanelSpec("KV cache usage, fleet", "Mean KV usage over the model's engines, and the fullest.",
                      "percentunit",
                      (Target(f"avg by (model_name) (vllm:kv_cache_usage_perc{{{ENGINE}}})", "mean {{model_name}}"),
                       Target(f"max by (model_name) (vllm:kv_cache_usage_perc{{{ENGINE}}})", "max {{model_name}}"))),
            PanelSpec("Prefix cache hit rate", "rate(hits) / rate(queries), in prompt tokens.",
                      "percentunit",
                      (Target(ratio("vllm:prefix_cache_hits_total", "vllm:prefix_cache_queries_total"),
                              "{{model_name}}"),)),
            PanelSpec("Why prefix-cache misses", "Uncached prompt tokens per second by why they "
                      "missed (kvpilot:prefix_cache_miss_tokens_total, decided at admission): never "
                      "seen here (or another replica holds it), evicted (capacity, preemption, full "
                      "offload tier), another cache salt or LoRA adapter, divergence from the cached "
                      "text, the last partial block or last token, too short. `kvpilot explain-prefix` "
                      "explains one request.", "short",
                      (Target(f"sum by (reason) ({rate('kvpilot:prefix_cache_miss_tokens_total')})", "{{reason}}"),)),
            PanelSpec("KV block residency (sampled)", "Median lifetime and idle-before-eviction of "
                      "sampled KV blocks (--kv-cache-metrics).", "s",
                      (Target(f"histogram_quantile(0.5, sum by (le) ({rate('vllm:kv_block_lifetime_seconds_bucket')}))",
                              "lifetime p50"),
                       Target("histogram_quantile(0.5, sum by (le) "
                              f"({rate('vllm:kv_block_idle_before_evict_seconds_bucket')}))", "idle before evict p50"),
                       Target(f"histogram_quantile(0.5, sum by (le) ({rate('vllm:kv_block_reuse_gap_seconds_bucket')}))",
                              "reuse gap p50"))),
        ]),
        ("Preemption and queues", [
            PanelSpec("Preemptions per second", "Sequences preempted for lack of KV blocks.", "ops",
                      (Target(f"sum by (pod) ({rate('vllm:num_preemptions_total')})", "{{pod}}"),)),
            PanelSpec("Preemptions per finished request", "rate(preemptions) / rate(finished requests).",
                      "short",
                      (Target(ratio("vllm:request_num_preemptions_sum", "vllm:request_num_preemptions_count"),
                              "{{model_name}}"),)),
            PanelSpec("Running and waiting requests", "Sequences in the batch; requests queued.", "short",
                      (Target(f"sum by (pod) (vllm:num_requests_running{{{ENGINE}}})", "running {{pod}}"),
                       Target(f"sum by (pod) (vllm:num_requests_waiting{{{ENGINE}}})", "waiting {{pod}}"))),
            PanelSpec("Waiting by reason", "capacity: no batch slot or KV blocks; deferred: other.", "short",
                      (Target(f"sum by (reason) (vllm:num_requests_waiting_by_reason{{{ENGINE}}})", "{{reason}}"),)),
        ]),
        ("Latency (p50 / p95 / p99)", [
            PanelSpec(title, description, "s", quantile_targets(histogram))
            for title, histogram, description in latency
        ]),
        ("Throughput and batch", [
            PanelSpec("Prompt and generation tokens per second", "Token throughput of the model.", "short",
                      (Target(f"sum by (model_name) ({rate('vllm:prompt_tokens_total')})", "prompt"),
                       Target(f"sum by (model_name) ({rate('vllm:generation_tokens_total')})", "generation"))),
            PanelSpec("Prompt tokens by source", "Computed, prefix-cache hits, offload-tier loads.", "short",
                      (Target(f"sum by (source) ({rate('vllm:prompt_tokens_by_source_total')})", "{{source}}"),)),
            PanelSpec("Batch size (tokens per step)", "Tokens each engine step computed "
                      "(vllm:iteration_tokens_total).", "short",
                      (Target(f"sum by (le) (increase(vllm:iteration_tokens_total_bucket{{{ENGINE}}}[{RATE}]))",
                              "{{le}}", heatmap=True),), kind="heatmap"),
            PanelSpec("Estimated FLOP/s and memory traffic per GPU", "From the model's shape "
                      "(--enable-mfu-metrics).", "short",
                      (Target(f"sum by (pod) ({rate('vllm:estimated_flops_per_gpu_total')})", "FLOP/s {{pod}}"),
                       Target(f"sum by (pod) ({rate('vllm:estimated_read_bytes_per_gpu_total')}) + "
                              f"sum by (pod) ({rate('vllm:estimated_write_bytes_per_gpu_total')})",
                              "bytes/s {{pod}}"))),
            PanelSpec("Speculative decoding: mean acceptance length", "Tokens a verification step "
                      "yields per draft, the bonus token included: 1 + rate(accepted draft tokens) / "
                      "rate(drafts) (--speculative-config; vLLM's definition).", "short",
                      (Target("1 + " + ratio("vllm:spec_decode_num_accepted_tokens_total",
                                             "vllm:spec_decode_num_drafts_total"), "{{model_name}}"),)),
        ]),
        ("KV offload", [
            PanelSpec("Offload tier hit rate", "rate(external hits) / rate(external queries).", "percentunit",
                      (Target(ratio("vllm:external_prefix_cache_hits_total",
                                    "vllm:external_prefix_cache_queries_total"), "{{model_name}}"),)),
            PanelSpec("KV bytes moved", "Between the device cache, host memory and disk.", "Bps",
                      (Target(f"sum by (transfer_type) ({rate('vllm:kv_offload_total_bytes_total')})",
                              "{{transfer_type}}"),)),
            PanelSpec("Offload tier usage", "Bytes held / capacity of the CPU and disk tiers.", "percentunit",
                      (Target(f"sum by (pod) (kvpilot:kv_offload_cpu_usage_bytes{{{ENGINE}}}) / "
                              f"sum by (pod) (kvpilot:kv_offload_cpu_capacity_bytes{{{ENGINE}}})", "CPU {{pod}}"),
                       Target(f"sum by (pod) (kvpilot:kv_offload_disk_usage_bytes{{{ENGINE}}}) / "
                              f"sum by (pod) (kvpilot:kv_offload_disk_capacity_bytes{{{ENGINE}}})", "disk {{pod}}"))),
        ]),
        ("Capacity and scaling (operator)", [
            PanelSpec("Planned vs observed KV blocks", "Blocks per replica in the plan, and what the "
                      "engine furthest from it allocated.", "short",
                      (Target(f"max by (name) (kvpilot:planned_kv_blocks{{{SERVICE}}})", "planned {{name}}"),
                       Target(f"max by (name) (kvpilot:observed_kv_blocks{{{SERVICE}}})", "observed {{name}}"))),
            PanelSpec("SizingDrift", "1 while observed KV capacity is off the plan.", "short",
                      (Target(f"max by (name) (kvpilot:inferenceservice_sizing_drift{{{ENGINE}}})", "{{name}}"),)),
            PanelSpec("Replicas vs desired", "The Deployment's replicas, what the autoscaler asks for, "
                      "and the ceiling.", "short",
                      (Target(f"max by (name) (kvpilot:inferenceservice_replicas{{{ENGINE}}})", "replicas {{name}}"),
                       Target(f"max by (name) (kvpilot:inferenceservice_desired_replicas{{{ENGINE}}})",
                              "desired {{name}}"),
                       Target(f"max by (name) (kvpilot:inferenceservice_max_replicas{{{ENGINE}}})", "max {{name}}"))),
        ]),
    ]


def operator_rows() -> list[tuple[str, list[PanelSpec]]]:
    passes = "kvpilot:operator_reconcile_passes_total"
    return [
        ("Operator", [
            PanelSpec("Reconcile passes per second", "By result: error when an API call of the pass failed.",
                      "ops", (Target(f"sum by (result) (rate({passes}[{RATE}]))", "{{result}}"),)),
            PanelSpec("Reconcile errors", "Share of passes that failed.", "percentunit",
                      (Target(f'sum(rate({passes}{{result="error"}}[{RATE}])) / sum(rate({passes}[{RATE}]))',
                              "errors"),)),
            PanelSpec("Plan outcomes", "Passes by plan outcome and reason (an infeasible plan's binding "
                      "constraint).", "short",
                      (Target(f"sum by (outcome, reason) (increase(kvpilot:operator_plan_outcomes_total[{RATE}]))",
                              "{{outcome}} {{reason}}"),)),
            PanelSpec("Drift repairs and child writes", "Child objects created, patched back (drift "
                      "repaired) or deleted per second.", "ops",
                      (Target(f"sum by (action) (rate(kvpilot:operator_child_writes_total[{RATE}]))", "{{action}}"),)),
            PanelSpec("Services with SizingDrift", "InferenceServices whose engines allocated KV "
                      "capacity off the plan.", "short",
                      (Target(f"count(kvpilot:inferenceservice_sizing_drift{{{SERVICE}}} == 1) or vector(0)",
                              "services"),)),
            PanelSpec("Operator CPU and memory", "The operator process.", "short",
                      (Target(f'rate(process_cpu_seconds_total{{job=~"$job"}}[{RATE}])', "CPU {{instance}}"),
                       Target('process_resident_memory_bytes{job=~"$job"} / 2^20', "RSS MiB {{instance}}"))),
        ]),
    ]


def _panel(spec: PanelSpec, panel_id: int) -> object:
    builder = (heatmap.Panel() if spec.kind == "heatmap" else timeseries.Panel().unit(spec.unit))
    builder = (builder.id(panel_id).title(spec.title).description(spec.description)
               .datasource(DATASOURCE).span(12).height(8))
    for i, target in enumerate(spec.targets):
        query = (prometheus.Dataquery().expr(target.expr).legend_format(target.legend)
                 .ref_id("ABCDEFGH"[i]).datasource(DATASOURCE).range())
        if target.heatmap:
            query = query.format(mprom.PromQueryFormat.HEATMAP)
        builder = builder.with_target(query)
    return builder


def _query_variable(name: str, label: str, query: str, include_all: bool = True) -> object:
    return (gdash.QueryVariable(name).label(label).datasource(DATASOURCE).query(query)
            .refresh(mdash.VariableRefresh.ON_TIME_RANGE_CHANGED).multi(True).include_all(include_all)
            .current(mdash.VariableOption(selected=True, text="All", value="$__all")))


def build_dashboard(uid: str, title: str, rows: list[tuple[str, list[PanelSpec]]],
                    variables: list[object]) -> dict:
    """The dashboard as Grafana's JSON model (a plain dict)."""
    builder = (gdash.Dashboard(title).uid(uid).tags(["kvpilot", "vllm"]).refresh("30s")
               .time("now-1h", "now").timezone("browser").editable()
               .with_variable(gdash.DatasourceVariable("DS_PROMETHEUS").label("Data source").type("prometheus")))
    for variable in variables:
        builder = builder.with_variable(variable)
    panel_id = 0
    for row_title, panels in rows:
        panel_id += 1
        builder = builder.with_row(gdash.Row(row_title).id(panel_id))
        for spec in panels:
            panel_id += 1
            builder = builder.with_panel(_panel(spec, panel_id))
    return json.loads(JSONEncoder(sort_keys=True, indent=2).encode(builder.build()))


def engine_dashboard() -> dict:
    return build_dashboard("kvpilot-engines", "kvpilot / engines", engine_rows(), [
        _query_variable("namespace", "Namespace", "label_values(vllm:num_requests_running, namespace)"),
        _query_variable("model_name", "Model", 'label_values(vllm:num_requests_running{namespace=~"$namespace"}, '
                                               "model_name)"),
    ])


def operator_dashboard() -> dict:
    return build_dashboard("kvpilot-operator", "kvpilot / operator", operator_rows(), [
        _query_variable("namespace", "Namespace", "label_values(kvpilot:planned_kv_blocks, namespace)"),
        _query_variable("job", "Operator job", "label_values(kvpilot:operator_reconcile_passes_total, job)"),
    ])


DASHBOARDS: dict[str, Callable[[], dict]] = {
    "kvpilot-engines.json": engine_dashboard,
    "kvpilot-operator.json": operator_dashboard,
}


def render(build: Callable[[], dict]) -> str:
    return json.dumps(build(), indent=2, sort_keys=True) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="exit 1 when a committed file is stale")
    parser.add_argument("--out", type=Path, default=OUT_DIR)
    args = parser.parse_args(argv)
    stale = []
    for name, build in DASHBOARDS.items():
        path, text = args.out / name, render(build)
        if args.check:
            if not path.exists() or path.read_text() != text:
                stale.append(name)
            continue
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    if stale:
        print(f"stale: {', '.join(stale)}: run scripts/gen_dashboards.py", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

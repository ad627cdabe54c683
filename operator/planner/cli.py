"""``kvpilot plan``: size the engine from SLOs and print the plan.

Only ``--model`` and ``--gpu`` are required. Without ``--max-context`` the plan serves
the model's own context, as vLLM's default ``max_model_len`` does; without the p95
lengths a request may fill that context (half prompt, half output). The derivation's
first line says which figures were assumed and the flags that pin them.

Exit status: 0 feasible, 2 infeasible (the plan and its suggestions are still
printed; ``-o args`` prints nothing on stdout then), 1 bad input (message on
stderr; unknown GPUs and models list the known ones). Argument errors exit 1
too, because 2 means "infeasible" here.

Torch-free: imported by the console script in the operator image.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from dataclasses import fields
from typing import Any

from kvpilot.contract.constants import KV_CACHE_DTYPES, OFFLOAD_BACKENDS
from kvpilot.contract.json_object import parse_json
from kvpilot.operator.planner.catalog import model_presets
from kvpilot.operator.planner.gpu import GPU_CATALOG
from kvpilot.operator.planner.plan import make_plan
from kvpilot.operator.planner.plan_request import PlanRequest, gpu_from_dict, model_from_dict
from kvpilot.operator.planner.render import FORMATS, render
from kvpilot.operator.planner.reserve import DEFAULT_KV_SAFETY_MARGIN
from kvpilot.operator.planner.result import Plan
from kvpilot.operator.planner.slo import Overrides, ServiceLevel, build
from kvpilot.operator.planner.weights import WEIGHT_QUANT_BYTES

EXIT_FEASIBLE, EXIT_BAD_INPUT, EXIT_INFEASIBLE = 0, 1, 2

def _fail(parser: argparse.ArgumentParser, message: str) -> None:
    parser.print_usage(sys.stderr)
    print(f"kvpilot plan: error: {message}", file=sys.stderr)
    sys.exit(EXIT_BAD_INPUT)


def register(subparsers: Any) -> argparse.ArgumentParser:
    """Add the ``plan`` subcommand to the ``kvpilot`` dispatcher."""
    p = subparsers.add_parser("plan", help="size the engine from SLOs (torch-free)",
                              description=__doc__.split("\n\n")[0])
    # Exit 1 on any argument error, not argparse's 2 (which means "infeasible" here). The
    # dispatcher's top-level parser reports leftover arguments itself, so they are caught here.
    p.error = lambda message: _fail(p, message)
    parse_known = p.parse_known_args

    def parse_known_args(args=None, namespace=None):
        parsed, extras = parse_known(args, namespace)
        if extras:
            _fail(p, f"unrecognized arguments: {' '.join(extras)}")
        return parsed, extras

    p.parse_known_args = parse_known_args
    m = p.add_argument_group("model and hardware")
    m.add_argument("--model", help="preset name, hub id, config.json or checkpoint directory")
    m.add_argument("--gpu", help=f"GPU name ({', '.join(GPU_CATALOG)}) or 'custom'")
    m.add_argument("--gpus", metavar="N", type=int, dest="tensor_parallel_size",
                   help="GPUs per replica (tensor parallel); default: smallest of 1, 2, 4, 8 that works")
    m.add_argument("--gpus-per-node", metavar="N", type=int, dest="gpus_per_node",
                   help="GPUs in one node (default: the GPU catalogue's); tensor parallelism stays within a node")
    m.add_argument("--nodes", metavar="N", type=int, dest="pipeline_parallel_size",
                   help="nodes (pipeline stages) per replica; default: one, more only when one node cannot "
                        "hold the weights and the SLO's KV")
    m.add_argument("--max-loras", metavar="N", type=int, dest="max_loras",
                   help="LoRA adapter slots on the GPU (the engine's --max-loras); their memory comes out "
                        "of the KV cache; default: LoRA off")
    m.add_argument("--max-lora-rank", metavar="R", type=int, dest="max_lora_rank",
                   help="the adapter slots' rank (the engine's --max-lora-rank; default 16)")
    m.add_argument("--speculative-config", metavar="JSON", type=_json_object, dest="speculative",
                   help="speculative decoding as the engine's --speculative-config (vLLM's fields): one "
                        "GPU, and a draft model's or EAGLE head's weights and KV counted; default: off")
    m.add_argument("--gpu-memory-gib", metavar="GIB", type=float, help="GPU memory, GiB (overrides the catalogue)")
    m.add_argument("--gpu-bandwidth-gbps", metavar="GB_S", type=float, help="GPU memory bandwidth, GB/s")
    m.add_argument("--gpu-tflops", metavar="TFLOPS", type=float, help="GPU dense BF16 TFLOP/s")
    s = p.add_argument_group("service level")
    s.add_argument("--max-context", metavar="TOKENS", type=int,
                   help="longest prompt + output accepted (max_model_len); default: the model's own context")
    s.add_argument("--p95-prompt-tokens", metavar="TOKENS", type=int,
                   help="default: half the context (a request may fill it)")
    s.add_argument("--p95-output-tokens", metavar="TOKENS", type=int, help="default: the rest of the context")
    s.add_argument("--p50-prompt-tokens", metavar="TOKENS", type=int, help="default: the p95 value")
    s.add_argument("--p50-output-tokens", metavar="TOKENS", type=int, help="default: the p95 value")
    s.add_argument("--concurrency", metavar="N", type=int, help="concurrent sequences across all replicas")
    s.add_argument("--requests-per-second", metavar="RPS", type=float, help="arrival rate across all replicas")
    s.add_argument("--ttft-p95-ms", metavar="MS", type=float)
    s.add_argument("--itl-p95-ms", metavar="MS", type=float)
    s.add_argument("--shared-prefix-tokens", metavar="TOKENS", type=int, default=0, help="system prompt / few-shot tokens")
    s.add_argument("--distinct-prefixes", metavar="K", type=int, default=1)
    s.add_argument("--allow-fp8-kv", action="store_true", help="let the planner pick an FP8 KV cache")
    o = p.add_argument_group("pinned engine settings (used as given, then checked)")
    o.add_argument("--replicas", metavar="N", type=int)
    o.add_argument("--kv-cache-dtype", choices=KV_CACHE_DTYPES)
    o.add_argument("--gpu-memory-utilization", metavar="FRACTION", type=float)
    o.add_argument("--block-size", metavar="TOKENS", type=int)
    o.add_argument("--max-num-seqs", metavar="N", type=int)
    o.add_argument("--max-num-batched-tokens", metavar="TOKENS", type=int)
    o.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=None)
    o.add_argument("--cpu-offload-gib", metavar="GIB", type=float)
    o.add_argument("--disk-offload-gib", metavar="GIB", type=float)
    o.add_argument("--offload-backend", choices=OFFLOAD_BACKENDS)
    o.add_argument("--weight-quantization", choices=tuple(WEIGHT_QUANT_BYTES))
    o.add_argument("--kv-safety-margin", metavar="FRACTION", type=float,
                   help=f"plan the KV cache this fraction below the calibrated estimate "
                        f"(default {DEFAULT_KV_SAFETY_MARGIN:g})")
    o.add_argument("--kv-cache-memory-bytes", metavar="BYTES", type=int,
                   help="pin the KV cache per GPU instead of what the GPU leaves for it (must fit)")
    o.add_argument("--cuda-graphs", action=argparse.BooleanOptionalAction, default=None,
                   help="reserve memory for CUDA graphs (default: off, kvpilot serve captures none)")
    p.add_argument("-o", "--output", choices=FORMATS, default="text")
    p.add_argument("--list", action="store_true", help="list model presets and GPUs, then exit")
    p.set_defaults(func=run)
    return p


def request_from_args(args: argparse.Namespace) -> tuple[PlanRequest, list[str]]:
    """The PlanRequest the flags describe, and what it assumed for the service-level
    figures not given; ValueError for missing or bad values."""
    missing = [f"--{name}" for name in ("model", "gpu") if getattr(args, name) is None]
    if missing:
        raise ValueError(f"missing required flag(s): {', '.join(missing)}")
    gpu: dict[str, Any] = {"name": args.gpu}
    for flag, key in (("gpu_memory_gib", "memory_gib"), ("gpu_bandwidth_gbps", "memory_bandwidth_gbps"),
                      ("gpu_tflops", "bf16_tflops")):
        if getattr(args, flag) is not None:
            gpu[key] = getattr(args, flag)
    model = model_from_dict(args.model)
    slo, assumed = _given(args, ServiceLevel), []
    if args.max_context is None:
        slo["max_context"] = model.max_position_embeddings
        assumed.append(f"--max-context {slo['max_context']} (the model's own context, vLLM's default max_model_len)")
    context = slo["max_context"]
    if args.p95_prompt_tokens is None and args.p95_output_tokens is None:
        slo["p95_prompt_tokens"], slo["p95_output_tokens"] = context // 2, context - context // 2
        assumed.append(f"--p95-prompt-tokens {context // 2} and --p95-output-tokens {context - context // 2} "
                       "(a request filling the context, as vLLM admits one)")
    elif args.p95_output_tokens is None:
        slo["p95_output_tokens"] = max(1, context - args.p95_prompt_tokens)
        assumed.append(f"--p95-output-tokens {slo['p95_output_tokens']} (the rest of the context)")
    elif args.p95_prompt_tokens is None:
        slo["p95_prompt_tokens"] = max(1, context - args.p95_output_tokens)
        assumed.append(f"--p95-prompt-tokens {slo['p95_prompt_tokens']} (the rest of the context)")
    request = PlanRequest(model=model, gpu=gpu_from_dict(gpu), slo=build(ServiceLevel, slo, "slo"),
                          overrides=build(Overrides, _given(args, Overrides), "overrides"))
    return request, assumed


def _noting(plan: Plan, assumed: list[str]) -> Plan:
    """``plan`` with a first derivation line naming the assumed figures and their flags."""
    if not assumed:
        return plan
    note = (f"Assumed (not given): {'; '.join(assumed)}. Pin them with the flags named to plan "
            "for your own workload.")
    return dataclasses.replace(plan, derivation=(note, *plan.derivation))


def _json_object(text: str) -> dict[str, Any]:
    """A JSON object flag's value (argparse reports the ValueError as a usage error)."""
    value = parse_json(text)
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("expected a JSON object")
    return value


def _given(args: argparse.Namespace, cls: type) -> dict[str, Any]:
    """The flags given for ``cls``'s fields: each field has a flag whose ``dest`` is its name."""
    return {f.name: getattr(args, f.name) for f in fields(cls) if getattr(args, f.name) is not None}


def _listing() -> str:
    gpus = [f"  {name:<12} {g.description}: {g.memory_bytes / 2**30:.2f} GiB to CUDA, "
            f"{g.memory_bandwidth_bytes_per_s / 1e9:,.0f} GB/s, {g.bf16_flops / 1e12:,.0f} TFLOP/s"
            for name, g in GPU_CATALOG.items()]
    return "\n".join(["Model presets:", *(f"  {name}" for name in model_presets()), "GPUs:", *gpus]) + "\n"


def run(args: argparse.Namespace) -> int:
    """Entry point set as the subparser's ``func``; returns the exit status."""
    if args.list:
        sys.stdout.write(_listing())
        return EXIT_FEASIBLE
    try:
        request, assumed = request_from_args(args)
        plan = _noting(make_plan(request), assumed)
    except ValueError as exc:
        print(f"kvpilot plan: error: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    if plan.feasible or args.output != "args":
        sys.stdout.write(render(plan, args.output))
    else:
        print(f"kvpilot plan: infeasible ({plan.binding_constraint}): {plan.binding_detail}", file=sys.stderr)
    return EXIT_FEASIBLE if plan.feasible else EXIT_INFEASIBLE

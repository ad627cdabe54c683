"""The ``kvpilot serve`` argument parser, built from the flag table (``vllm_flags``), and
the mapping of parsed flags onto ``EngineArgs``.

Torch-free on purpose: the operator parses the arguments it puts into a Deployment
with this very parser, and its image has no torch. Flag names follow vLLM's wherever
the concept is the same, so a vLLM command line carries over.
"""

from __future__ import annotations

import argparse
import dataclasses
import os

from kvpilot.engine.cli.parser import ArgumentParser
from kvpilot.engine.config import StructuredOutputsConfig
from kvpilot.engine.core.constants import MAX_TENSOR_PARALLEL_SIZE
from kvpilot.engine.engine_args import EngineArgs
from kvpilot.engine.lora.config import RUNTIME_LORA_UPDATING_ENV
from kvpilot.engine.model.parallel.lws import rendezvous_from_env
from kvpilot.engine.server.arg_types import parse_size
from kvpilot.engine.server.flag_table import Flag, add_flags
from kvpilot.engine.server.vllm_flags import SERVE_FLAGS

__all__ = ["add_serve_arguments", "engine_args_from_namespace", "make_serve_parser", "parse_size"]

# EngineArgs fields that no row sets one to one: built below from several flags or an
# environment variable, or not set from the command line at all (the architecture
# override and the sliding-window fp8 exemption serve tests and the planner).
DERIVED_ENGINE_FIELDS = ("model", "served_model_name", "structured_outputs_config",
                         "compute_nans_in_logits", "rendezvous")
ENGINE_FIELDS_WITHOUT_FLAG = ("architecture", "kv_cache_dtype_skip_sliding_window", "pipeline_microbatches")


def engine_flags() -> list[Flag]:
    """The honoured rows that set an ``EngineArgs`` field one to one."""
    return [f for f in SERVE_FLAGS if f.engine is not None]


def add_serve_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Adds every ``kvpilot serve`` flag of the table to ``parser`` and returns it (the
    refused vLLM flags hidden from --help: each stops start-up with a one-line reason)."""
    add_flags(parser, SERVE_FLAGS)
    return parser


def make_serve_parser(prog: str = "kvpilot serve") -> argparse.ArgumentParser:
    """A standalone parser for the ``kvpilot serve`` flags (also used by the operator)."""
    parser = ArgumentParser(
        prog=prog,
        description="Serve a model through an OpenAI-compatible HTTP API with Prometheus metrics.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    return add_serve_arguments(parser)


def resolve_model(ns: argparse.Namespace) -> str | None:
    """The model directory from ``--model`` or the positional ``MODEL``; ValueError if they differ."""
    if ns.model_tag is not None and ns.model is not None and ns.model_tag != ns.model:
        raise ValueError(f"the positional model {ns.model_tag!r} and --model {ns.model!r} differ; "
                         "give one of them")
    return ns.model_tag if ns.model_tag is not None else ns.model


def structured_outputs_config(ns: argparse.Namespace) -> StructuredOutputsConfig:
    """``--structured-outputs-config`` with ``--reasoning-parser``,
    ``--structured-output-compile-timeout`` and the older ``--guided-decoding-backend``
    folded in."""
    config = ns.structured_outputs_config or StructuredOutputsConfig()
    if ns.guided_decoding_backend is not None:
        config = dataclasses.replace(config, backend=ns.guided_decoding_backend)
    if ns.reasoning_parser is not None:
        if config.reasoning_parser not in (None, ns.reasoning_parser):
            raise ValueError(f"--reasoning-parser {ns.reasoning_parser} and "
                             f"--structured-outputs-config's {config.reasoning_parser} differ")
        config = dataclasses.replace(config, reasoning_parser=ns.reasoning_parser)
    if ns.structured_output_compile_timeout is not None:
        config = dataclasses.replace(config, compile_timeout=ns.structured_output_compile_timeout)
    return config


def engine_args_from_namespace(ns: argparse.Namespace) -> EngineArgs:
    """Builds the engine's ``EngineArgs`` from parsed ``kvpilot serve`` flags: every row
    with an ``engine`` field, plus the fields built from several flags.

    Raises ValueError for a combination this build cannot serve (tensor parallelism past
    one node) and whatever ``EngineArgs`` rejects.
    """
    if ns.tensor_parallel_size > MAX_TENSOR_PARALLEL_SIZE:
        raise ValueError(
            f"--tensor-parallel-size {ns.tensor_parallel_size} is not supported: one replica "
            f"spans at most {MAX_TENSOR_PARALLEL_SIZE} GPUs of one node per pipeline stage; span nodes "
            "with --pipeline-parallel-size, or scale further with replicas"
        )
    kwargs = {f.engine: getattr(ns, f.dest_name) for f in engine_flags()}
    kwargs.update(
        model=resolve_model(ns),
        served_model_name=ns.served_model_name[0] if ns.served_model_name else None,
        structured_outputs_config=structured_outputs_config(ns),
        # vLLM's switch for the NaN check (an environment variable there too)
        compute_nans_in_logits=os.environ.get("VLLM_COMPUTE_NANS_IN_LOGITS", "0").lower()
        not in ("", "0", "false"),
        # vLLM's switch for the runtime adapter routes (an environment variable there)
        allow_runtime_lora_updating=ns.allow_runtime_lora_updating
        or os.environ.get(RUNTIME_LORA_UPDATING_ENV, "").lower() in ("1", "true"),
        lora_modules=tuple(ns.lora_modules) if ns.lora_modules else None,
        # a pipeline over a LeaderWorkerSet group's pods: where they meet (None on one host)
        rendezvous=rendezvous_from_env(os.environ) if ns.pipeline_parallel_size > 1 else None,
    )
    return EngineArgs(**kwargs)

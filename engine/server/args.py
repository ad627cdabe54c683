"""The ``kvpilot serve`` argument parser, built from the flag table (``vllm_flags``), and
the mapping of parsed flags onto ``EngineArgs`` and the ``ServerConfig``.

Torch-free on purpose: the operator parses the arguments it puts into a Deployment
with this very parser, and its image has no torch. Flag names follow vLLM's wherever
the concept is the same, so a vLLM command line carries over.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
from types import MappingProxyType

from kvpilot.contract.constants import MAX_TENSOR_PARALLEL_SIZE
from kvpilot.engine.cli.parser import ArgumentParser
from kvpilot.engine.config import StructuredOutputsConfig
from kvpilot.engine.deploy.lws import rendezvous_from_env
from kvpilot.engine.engine_args import EngineArgs
from kvpilot.engine.lora.config import RUNTIME_LORA_UPDATING_ENV
from kvpilot.engine.server.arg_types import parse_size
from kvpilot.engine.server.config import (
    API_KEY_ENV,
    ChatConfig,
    CORSConfig,
    RequestLimits,
    ServerConfig,
    load_chat_template,
)
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


def server_config_from_namespace(ns: argparse.Namespace) -> ServerConfig:
    """Builds a ServerConfig from parsed ``kvpilot serve`` flags.

    Without ``--api-key`` the key comes from ``$KVPILOT_API_KEY`` (how a Kubernetes
    Secret reaches the server without showing on the command line).
    """
    chat = ChatConfig(
        chat_template=load_chat_template(ns.chat_template),
        default_template_kwargs=MappingProxyType(dict(ns.default_chat_template_kwargs or {})),
        enable_auto_tool_choice=ns.enable_auto_tool_choice,
        tool_call_parser=ns.tool_call_parser,
        exclude_tools_when_tool_choice_none=ns.exclude_tools_when_tool_choice_none,
        reasoning_parser=structured_outputs_config(ns).reasoning_parser,
    )
    return ServerConfig(
        served_model_names=tuple(ns.served_model_name or ()),
        api_key=ns.api_key or os.environ.get(API_KEY_ENV) or None,
        max_waiting_requests=ns.max_waiting_requests,
        log_stats_interval=0.0 if ns.disable_log_stats else ns.log_stats_interval,
        enable_log_requests=ns.enable_log_requests,
        max_log_len=ns.max_log_len,
        disable_fastapi_docs=ns.disable_fastapi_docs,
        enable_request_id_headers=ns.enable_request_id_headers,
        cors=CORSConfig(tuple(ns.allowed_origins), tuple(ns.allowed_methods),
                        tuple(ns.allowed_headers), ns.allow_credentials),
        chat=chat,
        max_request_body_bytes=ns.max_request_body_bytes or None,
        tokenizer_threads=ns.tokenizer_threads,
        engine_hang_timeout=ns.engine_hang_timeout or None,
        shutdown_timeout=ns.shutdown_timeout,
        metrics_require_api_key=ns.metrics_require_api_key,
        body_read_timeout=ns.body_read_timeout or None,
        limits=RequestLimits(
            max_stop_strings=ns.max_stop_strings, max_stop_string_chars=ns.max_stop_string_chars,
            max_choices=ns.max_structured_choices,
            max_constraint_bytes=ns.max_structured_output_bytes, max_tools=ns.max_tools,
            max_tools_bytes=ns.max_tools_bytes,
            max_sequences_per_request=ns.max_sequences_per_request),
    )

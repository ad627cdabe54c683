"""One source per shared constant: every side that names a dtype, a backend or a limit
agrees with ``kvpilot.contract.constants`` (the engine's CLI and configs, the planner
and its CLI, the operator's spec parsing and the CRD schema, which cannot import each
other's modules)."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest
import yaml

from kvpilot.contract import constants as c

ROOT = Path(__file__).resolve().parents[2]


def _choices(parser: argparse.ArgumentParser, flag: str) -> tuple:
    for action in parser._actions:
        if flag in action.option_strings:
            return tuple(action.choices)
    raise AssertionError(f"{flag} not found")


def test_serve_flags_take_their_choices_from_the_constants():
    from kvpilot.engine.server.args import make_serve_parser

    parser = make_serve_parser()
    assert _choices(parser, "--dtype") == c.MODEL_DTYPES
    assert _choices(parser, "--kv-cache-dtype") == c.KV_CACHE_DTYPES
    assert _choices(parser, "--attention-backend") == c.ATTENTION_BACKENDS
    assert _choices(parser, "--kv-offloading-backend") == c.OFFLOAD_BACKENDS


def test_planner_cli_takes_its_choices_from_the_constants():
    from kvpilot.operator.planner.cli import register

    sub = argparse.ArgumentParser().add_subparsers()
    parser = register(sub)
    assert _choices(parser, "--kv-cache-dtype") == c.KV_CACHE_DTYPES
    assert _choices(parser, "--offload-backend") == c.OFFLOAD_BACKENDS


def test_crd_enums_equal_the_constants():
    crd = yaml.safe_load((ROOT / "crds" / "serving.kvpilot.dev_inferenceservices.yaml").read_text())
    spec = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"]
    assert tuple(spec["engine"]["properties"]["kvCacheDtype"]["enum"]) == c.KV_CACHE_DTYPES
    assert tuple(spec["offload"]["properties"]["backend"]["enum"]) == c.OFFLOAD_BACKENDS


def test_engine_configs_accept_exactly_the_constants():
    from kvpilot.engine.config import CacheConfig
    from kvpilot.engine.offload.config import OffloadConfig

    for name in c.KV_CACHE_DTYPES:
        CacheConfig(kv_cache_dtype=name)
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of"):
        CacheConfig(kv_cache_dtype="int8")
    for name in c.OFFLOAD_BACKENDS:
        OffloadConfig(backend=name, cpu_bytes=1 << 30)
    with pytest.raises(ValueError, match="must be one of"):
        OffloadConfig(backend="redis", cpu_bytes=1 << 30)


def test_attention_backend_selection_knows_exactly_the_constants():
    import torch

    from kvpilot.engine.model.attention.backend import select_attention_backend

    assert select_attention_backend("torch", torch.device("cpu")).name == "torch"
    with pytest.raises(ValueError, match="unknown attention_backend"):
        select_attention_backend("flash", torch.device("cpu"))


def test_operator_and_planner_share_the_engine_disk_path_and_limits():
    from kvpilot.operator import constants as operator_constants
    from kvpilot.operator.planner.result import DEFAULT_DISK_PATH
    from kvpilot.operator.planner.slo import ServiceLevel  # noqa: F401 - imports the planner side
    from kvpilot.operator.planner.weights import DTYPE_BYTES

    assert operator_constants.KV_DISK_MOUNT == DEFAULT_DISK_PATH == c.DEFAULT_OFFLOAD_DISK_PATH
    assert set(DTYPE_BYTES) == set(c.MODEL_DTYPES) - {"auto"}


def test_tensor_parallel_limit_is_enforced_by_the_serve_flags():
    from kvpilot.engine.server.args import engine_args_from_namespace, make_serve_parser

    ns = make_serve_parser().parse_args(["--tensor-parallel-size", str(c.MAX_TENSOR_PARALLEL_SIZE + 1)])
    with pytest.raises(ValueError, match="tensor-parallel-size"):
        engine_args_from_namespace(ns)

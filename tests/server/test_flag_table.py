"""The ``kvpilot serve`` flag table is the one source of the parser, ``--help``, docs/serving.md's
flag tables and the defaults: each is checked against the table here, and the table's
defaults against the dataclasses that state them (``EngineArgs`` and the engine configs it
reads, ``ServerConfig``). Flags are matched whole: an abbreviation is an error.
"""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

import pytest

from kvpilot.engine.cli.main import build_parser
from kvpilot.engine.config import CacheConfig, ModelConfig, SchedulerConfig
from kvpilot.engine.engine_args import EngineArgs
from kvpilot.engine.server.args import (
    DERIVED_ENGINE_FIELDS,
    ENGINE_FIELDS_WITHOUT_FLAG,
    engine_args_from_namespace,
    engine_flags,
    make_serve_parser,
    server_config_from_namespace,
)
from kvpilot.engine.server.config import ServerConfig
from kvpilot.engine.server.flag_table import HONOURED
from kvpilot.engine.server.vllm_flags import SERVE_FLAGS, render_serve_flags, update_flag_tables

SERVING_PAGE = Path(__file__).resolve().parents[2] / "docs" / "serving.md"


def _long_options(parser: argparse.ArgumentParser) -> list[str]:
    return [o for o in parser._option_string_actions if o.startswith("--")]


def test_an_abbreviated_flag_is_an_error_not_the_flag_it_starts(capsys):
    # `--api-ke X` used to set the API key, past the CRD's and the operator's guard
    # against `--api-key` in extraArgs
    with pytest.raises(SystemExit) as info:     # the parser of `kvpilot serve`, not a server
        build_parser("serve").parse_args(["serve", "--api-ke", "secret"])
    assert info.value.code == 2
    assert "unrecognized arguments: --api-ke" in capsys.readouterr().err
    parser = make_serve_parser()
    options = set(_long_options(parser))
    for option in sorted(options):
        prefix = option[:-1]
        if prefix in options or len(prefix) < 3:
            continue
        with pytest.raises(SystemExit):
            parser.parse_args([prefix, "1"] if parser._option_string_actions[option].nargs != 0
                              else [prefix])
        assert "unrecognized arguments" in capsys.readouterr().err, prefix
    assert parser.parse_args(["--api-key=k"]).api_key == "k"     # whole names, as ever


def test_every_parser_of_the_kvpilot_command_matches_whole_flags():
    seen, todo = 0, [build_parser()]
    while todo:
        parser = todo.pop()
        seen += 1
        assert parser.allow_abbrev is False, parser.prog
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                todo.extend(action.choices.values())
    assert seen >= 10          # kvpilot, its five subcommands and the benchmarks


def test_help_is_the_table_text_with_its_default():
    parser = make_serve_parser()
    for flag in SERVE_FLAGS:
        if flag.status != HONOURED or not flag.option_strings:
            continue
        action = parser._option_string_actions[flag.name]
        assert action.help.replace("%%", "%") == flag.help_text, flag.name
        assert flag.help_text.startswith(flag.help)
        assert action.default == flag.resolved_default, flag.name


def test_the_serving_page_shows_every_rendered_flag_table():
    text = SERVING_PAGE.read_text()
    assert render_serve_flags() in text
    assert update_flag_tables(text) == text, (
        "docs/serving.md's flag tables are stale: run `python -m kvpilot.engine.server.vllm_flags docs/serving.md`")


def test_update_flag_tables_rewrites_a_stale_table_and_needs_the_markers():
    stale = "x\n<!-- serve-flags:begin -->\nSTALE-ROW\n<!-- serve-flags:end -->\n" \
            "<!-- vllm-flags:begin -->\nSTALE-ROW\n<!-- vllm-flags:end -->\ny\n"
    fresh = update_flag_tables(stale)
    assert "STALE-ROW" not in fresh and render_serve_flags() in fresh and fresh.endswith("y\n")
    with pytest.raises(ValueError, match="serve-flags"):
        update_flag_tables("no markers")


def test_every_engine_args_field_is_set_by_a_row_or_named_as_not():
    by_rows = [f.engine for f in engine_flags()]
    assert len(by_rows) == len(set(by_rows)), "two rows set one EngineArgs field"
    fields = {f.name for f in dataclasses.fields(EngineArgs)}
    assert set(by_rows) | set(DERIVED_ENGINE_FIELDS) | set(ENGINE_FIELDS_WITHOUT_FLAG) == fields
    assert not set(by_rows) & (set(DERIVED_ENGINE_FIELDS) | set(ENGINE_FIELDS_WITHOUT_FLAG))


@pytest.mark.parametrize(("config", "field", "flag", "engine_field"), [
    (SchedulerConfig, "max_num_seqs", "--max-num-seqs", "max_num_seqs"),
    (SchedulerConfig, "policy", "--scheduling-policy", "scheduling_policy"),
    (SchedulerConfig, "enable_chunked_prefill", "--enable-chunked-prefill", "enable_chunked_prefill"),
    (CacheConfig, "block_size", "--block-size", "block_size"),
    (CacheConfig, "gpu_memory_utilization", "--gpu-memory-utilization", "gpu_memory_utilization"),
    (CacheConfig, "kv_cache_dtype", "--kv-cache-dtype", "kv_cache_dtype"),
    (CacheConfig, "enable_prefix_caching", "--enable-prefix-caching", "enable_prefix_caching"),
    (ModelConfig, "seed", "--seed", "seed"),
    (ModelConfig, "max_logprobs", "--max-logprobs", "max_logprobs"),
])
def test_a_config_default_reaches_engine_args_the_parser_and_the_help(config, field, flag,
                                                                      engine_field):
    default = config.__dataclass_fields__[field].default
    assert getattr(EngineArgs(), engine_field) == default
    parser = make_serve_parser()
    assert parser.get_default(engine_field) == default
    row = next(f for f in SERVE_FLAGS if f.name == flag)
    if not isinstance(default, bool):
        assert f"(default: {default:g})" in row.help_text if isinstance(default, float) \
            else f"(default: {default})" in row.help_text
    assert engine_args_from_namespace(parser.parse_args([])) == EngineArgs()


def test_parser_defaults_are_the_server_config_defaults(monkeypatch):
    monkeypatch.delenv("KVPILOT_API_KEY", raising=False)
    assert server_config_from_namespace(make_serve_parser().parse_args([])) == ServerConfig()

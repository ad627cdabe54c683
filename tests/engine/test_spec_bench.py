"""``kvpilot bench spec`` at toy sizes: kvpilot with and without n-gram speculation runs
through both workloads, a peer that is not installed is skipped, llama.cpp's mode names
become its flags. Timings here mean nothing."""

from __future__ import annotations

import json
import subprocess
import sys

from kvpilot.engine.bench.spec import llama_spec_args, targets
from kvpilot.engine.bench.spec_workloads import copy_heavy, open_ended

from support.gguf_files import write_gguf


def test_llama_cpp_modes_become_its_flags():
    assert llama_spec_args("ngram-simple") == ["--spec-type", "ngram-simple"]
    assert llama_spec_args("ngram-map-k:size-n=3:size-m=16") == [
        "--spec-type", "ngram-map-k", "--spec-ngram-map-k-size-n", "3", "--spec-ngram-map-k-size-m", "16"]


def test_workloads_are_distinct_requests():
    copies = [copy_heavy(i)[0]["content"] for i in range(12)]
    chats = [open_ended(i)[0]["content"] for i in range(12)]
    assert len(set(copies)) == 12 and len(set(chats)) == 12
    assert "Rewrite" in copies[0] and "JSON" in copies[2]


def test_targets_compare_against_the_best_llama_cpp_mode():
    median = {"kvpilot": {"copy:tok/s@1": 10.0, "copy:tok/s@16": 50.0},
              "kvpilot+ngram": {"copy:tok/s@1": 25.0, "copy:tok/s@16": 49.0},
              "llama.cpp+ngram-simple": {"copy:tok/s@1": 15.0},
              "llama.cpp+ngram-mod": {"copy:tok/s@1": 22.0}}
    checks = {c["check"]: c for c in targets(median, ["copy"], [1, 16])}
    assert checks["copy tok/s@1 vs kvpilot"]["ratio"] == 2.5
    assert checks["copy tok/s@1 vs llama.cpp+ngram-mod"]["met"] is False      # 25 / 22 < 1.2
    assert checks["copy tok/s@16 vs kvpilot"]["met"] is True                  # 0.98 >= 0.95


def test_bench_spec_runs_kvpilot_with_and_without_speculation(tmp_path):
    gguf = write_gguf(tmp_path / "tiny.gguf", "llama", "Q8_0")
    out = tmp_path / "spec.json"
    proc = subprocess.run(
        [sys.executable, "-m", "kvpilot.engine.cli.main", "bench", "spec", "--gguf", str(gguf),
         "--servers", "kvpilot,kvpilot+ngram,llama.cpp+ngram-simple", "--peers-dir", str(tmp_path / "none"),
         "--threads", "1", "--streams", "1,2", "--requests-per-stream", "1", "--output-len", "6",
         "--kvpilot-spec", '{"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 1}',
         "--json-out", str(out)], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert "llama.cpp+ngram-simple" in result["skipped"]
    for name in ("kvpilot", "kvpilot+ngram"):
        (figures,) = result["runs"][name]
        for workload in ("copy", "chat"):
            assert figures[f"{workload}:tok/s@1"] > 0 and figures[f"{workload}:tok/s@2"] > 0
    assert "CPU:" in proc.stdout

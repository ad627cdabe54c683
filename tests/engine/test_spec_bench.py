"""``kvpilot bench spec``'s pure parts: llama.cpp's mode names become its flags, the
workloads are distinct requests, the targets compare against the best llama.cpp mode.
The benchmark itself stays out of the suite (it starts servers; run it by hand)."""

from __future__ import annotations

from kvpilot.engine.bench.spec import llama_spec_args, targets
from kvpilot.engine.bench.spec_workloads import copy_heavy, open_ended


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

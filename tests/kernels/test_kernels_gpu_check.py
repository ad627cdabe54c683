"""The GPU script's own test on CPU: its no-GPU exit and its code path through the interpreter.

This does not check the compiled kernels (that is what the script is for, on a GPU).
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from kvpilot.engine.bench import kernels_gpu as bench_gpu


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message printed without CUDA")
def test_exits_cleanly_without_cuda():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-m", "kvpilot.engine.bench.kernels_gpu"], env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "no CUDA device found" in proc.stdout
    assert "triton" not in proc.stderr.lower()   # the message comes before triton is imported


@pytest.mark.slow
def test_checks_and_bench_run_under_the_interpreter(capsys):
    # conftest set TRITON_INTERPRET=1 before triton was imported, as --interpret-smoke requires.
    assert bench_gpu.main(["--interpret-smoke"]) == 0
    out = capsys.readouterr().out
    assert "0 failure(s)" in out
    assert out.count(" ok") >= 20     # 8 store, 4 attention, 2 split-KV, 4 RMSNorm, 2 rotary
    assert "decode" in out and "prefill" in out


def test_fp8_probe_values_cover_ties_and_saturation():
    x = bench_gpu._fp8_probe_values(torch.float8_e4m3fn, "cpu")
    grid = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    grid = grid[torch.isfinite(grid)].unique().sort().values
    assert bool(torch.isin(grid, x).all())
    assert bool(torch.isin((grid[1:] + grid[:-1]) / 2, x).all())
    assert float(x.max()) > 448 and float(x.min()) < -448

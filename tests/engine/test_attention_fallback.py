"""Where the CPU decode kernel cannot be built (no C++ compiler), ``auto`` falls back to
the pure-torch path with a warning and an explicit ``cpu`` is refused with the reason.

Run in a fresh interpreter whose compiler is ``/bin/false`` and whose extension cache is
empty, so neither this machine's compiler nor its cached build can help.
"""

from __future__ import annotations

import os
import subprocess
import sys

SCRIPT = """
import torch
from kvpilot.engine.model.attention import select_attention_backend
print("auto ->", select_attention_backend("auto", torch.device("cpu")).name)
try:
    select_attention_backend("cpu", torch.device("cpu"))
except ValueError as exc:
    print("cpu ->", exc)
"""


def test_no_compiler_means_the_torch_path_and_a_warning(tmp_path):
    env = {**os.environ, "CXX": "/bin/false", "TORCH_EXTENSIONS_DIR": str(tmp_path),
           "PYTHONSAFEPATH": "1"}
    result = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True,
                            timeout=120, check=True)
    assert "auto -> torch" in result.stdout
    assert "cpu -> attention_backend 'cpu' needs the CPU paged-decode kernel" in result.stdout
    assert "the CPU paged-decode kernel could not be built" in result.stderr
    assert "decode attention runs on the pure-torch path" in result.stderr

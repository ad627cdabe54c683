"""The chart tests render charts/kvpilot with the real ``helm`` and reuse the operator
tests' API emulator and process helpers (tests/operator is put on ``sys.path``)."""

from __future__ import annotations

import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
OPERATOR_TESTS = HERE.parent / "operator"
for folder in (HERE, OPERATOR_TESTS):
    if str(folder) not in sys.path:
        sys.path.insert(0, str(folder))

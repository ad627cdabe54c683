"""The autoscaling tests: the prometheus-adapter rules the chart ships, the HPA algorithm,
and the closed loop end to end. They reuse the operator tests' emulator and process
helpers and the chart tests' helm helpers (both folders are put on ``sys.path``)."""

from __future__ import annotations

import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
for folder in (HERE, HERE.parent / "operator", HERE.parent / "chart"):
    if str(folder) not in sys.path:
        sys.path.insert(0, str(folder))

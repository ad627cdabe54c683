"""Shared fixtures of the operator tests: the Kubernetes API emulator and kubeconfig.

The helper modules here (``kube_emulator``, ``crd_schema``, ...) are plain modules, not a
package: this directory is put on ``sys.path`` so that tests and ``e2e/`` import them.
"""

from __future__ import annotations

import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
for folder in (HERE, HERE.parent / "chart"):  # tests/chart: the chart's RBAC check
    if str(folder) not in sys.path:
        sys.path.insert(0, str(folder))

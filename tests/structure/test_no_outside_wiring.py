"""Nothing sets attributes on the model runner or the model from outside them (issue 42).

The runner gets every collaborator when it is built; the model is configured by its own
methods and its loader. Checked on the source: every assignment to an attribute (``a.b =``,
``a.b += ``) in the engine is classified by what it assigns to.

- outside ``engine/model/runner.py``: nothing assigns to ``<...>.runner.<attr>`` or
  ``runner.<attr>``;
- in ``runner.py``: only ``self.<attr>`` is assigned (not the model's or a layer's);
- outside the model's own modules (``models/``, ``layers/``, ``gguf/``, ``loader.py``):
  nothing assigns to ``<...>.model.<attr>``, ``model.<attr>`` or an attention layer's
  attribute (``<...>.self_attn.<attr>``).

``engine/bench/`` is left out: a benchmark's probe wraps methods to time them.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
MODEL_OWN = ("engine/model/models/", "engine/model/layers/", "engine/model/gguf/",
             "engine/model/loader.py")


def _assigned_attributes(path: Path):
    """``(line, the assigned expression as source)`` of every attribute assignment."""
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign):
            targets = node.targets
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
            targets = [node.target]
        else:
            continue
        for target in targets:
            for t in ast.walk(target):
                if isinstance(t, ast.Attribute) and isinstance(t.ctx, ast.Store):
                    yield node.lineno, ast.unparse(t), ast.unparse(t.value)


def _owner(base: str) -> str | None:
    """Whose attribute an assignment to ``<base>.<attr>`` sets."""
    last = base.rsplit(".", 1)[-1].split("[", 1)[0]
    if last == "runner":
        return "runner"
    if last in ("model", "self_attn"):
        return "model"
    return None


def test_no_attribute_is_set_on_the_runner_or_the_model_from_outside():
    offences = []
    for path in sorted((ROOT / "engine").rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        if rel.startswith("engine/bench/"):
            continue
        for line, target, base in _assigned_attributes(path):
            owner = _owner(base)
            if rel == "engine/model/runner.py" and base != "self":
                offences.append(f"{rel}:{line}: the runner sets {target}")
            elif owner == "runner" and rel != "engine/model/runner.py":
                offences.append(f"{rel}:{line}: sets the runner's {target}")
            elif owner == "model" and not rel.startswith(MODEL_OWN):
                offences.append(f"{rel}:{line}: sets the model's {target}")
    assert not offences, "\n".join(offences)


def test_the_check_sees_an_outside_assignment(tmp_path):
    """The classifier is not blind: the shapes it must catch are caught."""
    source = tmp_path / "wiring.py"
    source.write_text("engine.runner.kv_transfer = x\nself.model.layers[0].self_attn.flag = True\n"
                      "runner.count = 1\nself.ok = 2\n")
    owners = [(target, _owner(base)) for _, target, base in _assigned_attributes(source)]
    assert owners == [("engine.runner.kv_transfer", "runner"),
                      ("self.model.layers[0].self_attn.flag", "model"),
                      ("runner.count", "runner"), ("self.ok", None)]

"""The "Where things live" table (docs/code-map.md): every file exists and defines the named symbol."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
ROW = re.compile(r"^\| (?P<concept>[^|]+?) \| `(?P<path>[^`]+)` \| `(?P<name>[^`]+)` \|$")


def _rows() -> list[tuple[str, str, str]]:
    text = (ROOT / "docs" / "code-map.md").read_text()
    section = text.split("# Where things live", 1)[1].split("\n## ", 1)[0]
    return [(m["concept"], m["path"], m["name"]) for line in section.splitlines()
            if (m := ROW.match(line))]


def _defined_names(path: Path) -> set[str]:
    names = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names.update(t.id for t in targets if isinstance(t, ast.Name))
    return names


def test_every_concept_maps_to_one_file_that_defines_it():
    rows = _rows()
    concepts = [concept for concept, _, _ in rows]
    required = ("Block pool", "Scheduler", "Prefix hashing", "Sampler", "Attention backend",
                "offload", "Planner", "Reconcile", "Builders")
    for word in required:
        assert any(word.lower() in c.lower() for c in concepts), f"the code map lacks {word!r}"
    assert len(set(concepts)) == len(concepts), "a concept is listed twice"
    for concept, rel, name in rows:
        path = ROOT / rel
        assert path.is_file(), f"{concept}: {rel} does not exist"
        assert name in _defined_names(path), f"{concept}: {rel} does not define {name}"

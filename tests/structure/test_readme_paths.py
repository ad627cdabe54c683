"""Every repository path the README names (in backticks) exists: a file that moves takes
its mentions with it."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
FOLDERS = ("tests", "e2e", "scripts", "engine", "operator", "kernels", "contract", "crds", "charts", ".ci")
PATH = re.compile(rf"`((?:{'|'.join(re.escape(f) for f in FOLDERS)})/[^`\s]*)`")


def test_every_path_in_the_readme_exists():
    named = set(PATH.findall((ROOT / "README.md").read_text()))
    literal = {p for p in named if not any(c in p for c in "*{<")}   # not a pattern
    assert len(literal) >= 50
    missing = sorted(p for p in literal if not (ROOT / p.rstrip("/")).exists())
    assert missing == [], f"the README names paths that do not exist: {missing}"

"""Every repository path the README and the docs pages name (in backticks) exists: a file
that moves takes its mentions with it."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
FOLDERS = ("tests", "e2e", "scripts", "engine", "operator", "kernels", "contract", "crds", "charts", ".ci",
           "docs")
PATH = re.compile(rf"`((?:{'|'.join(re.escape(f) for f in FOLDERS)})/[^`\s]*)`")
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def test_every_path_in_the_readme_and_the_docs_exists():
    assert len(PAGES) >= 10
    named = {p for page in PAGES for p in PATH.findall(page.read_text())}
    literal = {p for p in named if not any(c in p for c in "*{<")}   # not a pattern
    assert len(literal) >= 50
    missing = sorted(p for p in literal if not (ROOT / p.rstrip("/")).exists())
    assert missing == [], f"the README or the docs name paths that do not exist: {missing}"

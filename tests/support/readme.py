"""The README, read back by the tests that check it against the code."""

from __future__ import annotations

import re
from pathlib import Path

README = Path(__file__).resolve().parents[2] / "README.md"


def readme_metrics() -> dict[str, str]:
    """Exposed name -> type of every row of the README's Metrics table."""
    text = README.read_text()
    assert "## Metrics" in text, "README lacks its Metrics section"
    section = text.split("## Metrics", 1)[1].split("\n## ", 1)[0]
    documented = {}
    for row in re.finditer(r"^\|\s*(`(?:vllm|kvpilot):[^|]+)\|\s*(\w+)\s*\|", section, re.MULTILINE):
        for name in re.findall(r"`((?:vllm|kvpilot):[a-z0-9_:]+)`", row.group(1)):
            documented[name] = row.group(2)
    return documented

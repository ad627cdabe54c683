"""Every relative link in the README and the docs pages resolves: the file exists, and an
``#anchor`` names a heading of the target page as GitHub renders it (lower case,
punctuation dropped, spaces to hyphens, ``-1``, ``-2`` ... for repeats). Links inside code
are not links; web addresses are not checked (no network in the suite)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^(```|~~~).*?^\1", re.MULTILINE | re.DOTALL)
INLINE_CODE = re.compile(r"`[^`\n]*`")


def _prose(text: str) -> str:
    return INLINE_CODE.sub("", FENCE.sub("", text))


def slug(heading: str) -> str:
    """GitHub's anchor of a heading's text."""
    text = heading.strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)          # \w: letters, digits, underscore (Unicode)
    return text.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    found, seen = set(), {}
    for line in FENCE.sub("", page.read_text()).splitlines():
        m = re.match(r"^#{1,6} (.+?)\s*#*\s*$", line)
        if not m:
            continue
        base = slug(m.group(1))
        count = seen.get(base, 0)
        seen[base] = count + 1
        found.add(base if count == 0 else f"{base}-{count}")
    return found


def test_slugs_follow_github():
    assert slug("The path of one request") == "the-path-of-one-request"
    assert slug("Prefix-aware routing (`spec.routing.router`)") == "prefix-aware-routing-specroutingrouter"
    assert slug("Spec → plan → pods") == "spec--plan--pods"
    assert slug("KV offloading and KV-cache events") == "kv-offloading-and-kv-cache-events"


def test_every_relative_link_resolves():
    links, broken = 0, []
    for page in PAGES:
        for target in LINK.findall(_prose(page.read_text())):
            if re.match(r"^[a-z][a-z0-9+.-]*:", target):     # http:, https:, mailto:
                continue
            links += 1
            path, _, anchor = target.partition("#")
            file = (page.parent / path).resolve() if path else page
            if not file.exists():
                broken.append(f"{page.relative_to(ROOT)}: {target} (no such file)")
            elif anchor and (file.suffix != ".md" or anchor not in anchors(file)):
                broken.append(f"{page.relative_to(ROOT)}: {target} (no such heading)")
    assert links >= 20, links
    assert broken == [], "broken links:\n" + "\n".join(broken)


def test_the_readme_links_every_docs_page():
    readme = _prose((ROOT / "README.md").read_text())
    linked = {(ROOT / t.partition("#")[0]).resolve() for t in LINK.findall(readme)}
    assert set(PAGES[1:]) <= linked, sorted(p.name for p in set(PAGES[1:]) - linked)

"""The committed dashboards and their targets, with Grafana's variables substituted."""

from __future__ import annotations

import importlib.util
import json
import re
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD_DIR = ROOT / "charts" / "kvpilot" / "files" / "dashboards"


def generator():
    """scripts/gen_dashboards.py as a module."""
    spec = importlib.util.spec_from_file_location("gen_dashboards", ROOT / "scripts" / "gen_dashboards.py")
    module = sys.modules.get(spec.name)
    if module is None:
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module   # dataclasses look their module up there
        spec.loader.exec_module(module)
    return module


@dataclass(frozen=True)
class PanelTarget:
    dashboard: str
    panel: str
    ref_id: str
    expr: str


def load(name: str) -> dict:
    return json.loads((DASHBOARD_DIR / name).read_text())


def panels(dashboard: dict) -> list[dict]:
    """Every panel but rows (and the panels rows hold when collapsed)."""
    out = []
    for panel in dashboard["panels"]:
        if panel["type"] == "row":
            out += panel.get("panels") or []
        else:
            out.append(panel)
    return out


def targets(name: str) -> list[PanelTarget]:
    dashboard = load(name)
    return [PanelTarget(name, p["title"], t["refId"], t["expr"])
            for p in panels(dashboard) for t in p["targets"]]


def substitute(expr: str, variables: dict[str, str], rate_interval: str) -> str:
    """Grafana's substitution for a Prometheus query: ``$__rate_interval`` and each
    ``$var`` (multi-value "All" becomes the regex ``.*`` inside ``=~``)."""
    expr = expr.replace("$__rate_interval", rate_interval)
    for name in sorted(variables, key=len, reverse=True):
        expr = expr.replace(f"${{{name}}}", variables[name]).replace(f"${name}", variables[name])
    leftover = re.findall(r"\$\w+", expr)
    assert not leftover, f"unsubstituted variables {leftover} in {expr}"
    return expr

"""Counting the operator's API requests at the emulator, by verb and resource.

The emulator keeps every request it received (kmock records them); the operator's are
those sent by kopf (``kopf/<version>``) or by its own client (``kvpilot-operator``), as
opposed to kubectl's and the tests' own. Used by the scale and fault tests and by
``scripts/bench_operator.py``.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable

import kmock
import kube_emulator_api as api

OPERATOR_AGENTS = ("kopf/", "kvpilot-operator")


def requests(emulator: kmock.RawHandler, since: int = 0) -> list[kmock.Request]:
    """Every request the emulator received, from the ``since``-th on."""
    return list(emulator)[since:]


def by_operator(reqs: Iterable[kmock.Request]) -> list[kmock.Request]:
    return [r for r in reqs if r.headers.get("User-Agent", "").startswith(OPERATOR_AGENTS)]


def verb(req: kmock.Request) -> str:
    """The request's verb in Kubernetes terms (``discovery`` for group/version listings)."""
    p = api.parse_path(req.url.path)
    if p is None or p.plural is None:
        return "discovery"
    if req.method == "GET":
        return "watch" if req.params.get("watch") in ("true", "1") else ("get" if p.name else "list")
    return {"POST": "create", "PUT": "update", "PATCH": "patch", "DELETE": "delete"}.get(req.method,
                                                                                         req.method)


def resource(req: kmock.Request) -> str:
    """``group/plural[/subresource]`` (``core/...`` for the core group), or the discovery path."""
    p = api.parse_path(req.url.path)
    if p is None or p.plural is None:
        return req.url.path
    name = f"{p.group or 'core'}/{p.plural}"
    return f"{name}/{p.subresource}" if p.subresource else name


def counts(reqs: Iterable[kmock.Request]) -> Counter[tuple[str, str]]:
    """How many requests of each (verb, resource)."""
    return Counter((verb(r), resource(r)) for r in reqs)


def table(calls: Counter[tuple[str, str]], scale: float = 1.0, unit: str = "") -> str:
    """``calls`` as aligned lines, largest first, each multiplied by ``scale``."""
    lines = [f"  {v:<9} {res:<48} {n * scale:>9.1f}{unit}" for (v, res), n in calls.most_common()]
    return "\n".join(lines) or "  (none)"

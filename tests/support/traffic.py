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

from support import api_calls

OPERATOR_AGENTS = ("kopf/", "kvpilot-operator")


def requests(emulator: kmock.RawHandler, since: int = 0) -> list[kmock.Request]:
    """Every request the emulator received, from the ``since``-th on."""
    return list(emulator)[since:]


def by_operator(reqs: Iterable[kmock.Request]) -> list[kmock.Request]:
    return [r for r in reqs if r.headers.get("User-Agent", "").startswith(OPERATOR_AGENTS)]


def key(req: kmock.Request) -> tuple[str, str]:
    """(verb, ``group/plural[/subresource]``) of a request (``core`` for the core group), or
    ("discovery", path) for a discovery request (``/apis/GROUP/VERSION``)."""
    call = api_calls.api_call(req.method, req.url.path, req.params, req.headers.get("User-Agent", ""))
    if call is None:
        return "discovery", req.url.path
    name = f"{call.group or 'core'}/{call.resource}"
    return call.verb, f"{name}/{call.subresource}" if call.subresource else name


def counts(reqs: Iterable[kmock.Request]) -> Counter[tuple[str, str]]:
    """How many requests of each (verb, resource)."""
    return Counter(key(r) for r in reqs)


def table(calls: Counter[tuple[str, str]], scale: float = 1.0, unit: str = "") -> str:
    """``calls`` as aligned lines, largest first, each multiplied by ``scale``."""
    lines = [f"  {v:<9} {res:<48} {n * scale:>9.1f}{unit}" for (v, res), n in calls.most_common()]
    return "\n".join(lines) or "  (none)"

"""What kopf's watch indexes keep of each watched object (``main.py`` registers them).

An index holds a private copy per object, made when its watch event arrives: for an engine
pod only what the operator reads (``pod_summary``), for a child the object itself with
only the operator's own ``managedFields`` entry (``stored_copy``: the others are large and
never read; server-side apply reads its own to tell what it owns).
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any

from kvpilot.operator.constants import ENGINE_CONTAINER, FIELD_MANAGER


def pod_summary(body: Mapping[str, Any]) -> dict:
    """What the operator keeps of an engine pod, not the whole object: its identity and
    scheduling state (phase and conditions), and for ``engine_observer`` where its engine
    serves (IP, ports), what it runs (args) and which process it is (restart counts)."""
    meta, status = body.get("metadata") or {}, body.get("status") or {}
    engines = [{k: copy.deepcopy(ct[k]) for k in ("name", "args", "ports") if k in ct}
               for ct in (body.get("spec") or {}).get("containers") or () if ct.get("name") == ENGINE_CONTAINER]
    kept = {k: copy.deepcopy(status[k]) for k in ("phase", "conditions", "podIP") if k in status}
    kept["containerStatuses"] = [{"name": cs.get("name"), "restartCount": cs.get("restartCount", 0)}
                                 for cs in status.get("containerStatuses") or ()]
    return {"metadata": {k: meta[k] for k in ("name", "namespace", "uid", "labels", "resourceVersion",
                                              "deletionTimestamp") if k in meta},
            "spec": {"containers": engines}, "status": kept}


def stored_copy(body: Mapping[str, Any]) -> dict:
    """A private copy of a watched child for an index, keeping of ``managedFields`` only
    the entries of the operator's own field manager."""
    obj = copy.deepcopy(dict(body))
    meta = obj.get("metadata") or {}
    if "managedFields" in meta:
        meta["managedFields"] = [e for e in meta["managedFields"] or ()
                                 if isinstance(e, Mapping) and e.get("manager") == FIELD_MANAGER]
    return obj

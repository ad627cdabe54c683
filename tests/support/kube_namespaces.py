"""Namespace deletion for the emulator, in the order a real control plane goes through it.

``DELETE /api/v1/namespaces/NAME`` marks the namespace (``deletionTimestamp``,
``status.phase: Terminating``, the ``kubernetes`` finalizer in ``spec.finalizers``) and
answers 200 with it; from then on the API server refuses to create anything in it (403,
"unable to create new content in namespace NAME because it is being terminated"). The
namespace controller then empties it, one sweep every ``NamespaceLifecycle.step_seconds``,
as issue 43 saw on kube-controller-manager v1.36:

1. the pods (the operator's own pod among them);
2. ServiceAccounts, Roles and RoleBindings (from here on the tokens of a deleted
   ServiceAccount are refused with 401: ``KubeEmulator.service_account_token``);
3. everything else, custom resources included; the garbage collector deletes what their
   owners owned.

An object with finalizers is only marked (``deletionTimestamp``) and stays until they are
removed; the controller looks again every step and removes the namespace once nothing is
left in it.

Not modelled: graceful pod termination (pods go at once: no kubelet runs them), the
controller's discovery order within a sweep, its exponential requeue, the
``NamespaceDeletionContentFailure`` / ``NamespaceFinalizersRemaining`` status conditions,
and namespaces that must exist before objects are created in them (any namespace is
accepted, as before).
"""

from __future__ import annotations

import asyncio
import copy
import datetime
from dataclasses import dataclass, field
from typing import Any

# the sweeps, in order; None: every other kind
SWEEPS: tuple[frozenset[tuple[str, str]] | None, ...] = (
    frozenset({("", "pods")}),
    frozenset({("", "serviceaccounts"), ("rbac.authorization.k8s.io", "roles"),
               ("rbac.authorization.k8s.io", "rolebindings")}),
    None,
)


def terminating_message(namespace: str) -> str:
    return f"unable to create new content in namespace {namespace} because it is being terminated"


@dataclass
class NamespaceLifecycle:
    """The emulator's namespace controller.

    Args:
        step_seconds: the time between its sweeps (and between looks at a namespace that
            still holds objects with finalizers).
    """

    step_seconds: float = 0.3
    _tasks: set[asyncio.Task] = field(default_factory=set)

    @staticmethod
    def terminating(emulator: Any, namespace: str | None) -> bool:
        ns = emulator.objects.get(("", "namespaces", None, namespace)) if namespace else None
        return bool(ns and ns["metadata"].get("deletionTimestamp"))

    def delete(self, emulator: Any, name: str) -> dict:
        """Mark namespace ``name`` Terminating and start emptying it; returns it as stored."""
        rtype = emulator.types[("", "v1", "namespaces")]
        key = ("", "namespaces", None, name)
        old = emulator._get(rtype, None, name)
        if old["metadata"].get("deletionTimestamp"):
            return old
        new = copy.deepcopy(old)
        new["metadata"]["deletionTimestamp"] = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
        new.setdefault("spec", {})["finalizers"] = ["kubernetes"]
        new["status"] = {"phase": "Terminating"}
        emulator._bump(new)
        emulator.objects[key] = new
        emulator._emit(rtype, "MODIFIED", new, old)
        task = asyncio.get_running_loop().create_task(self._empty(emulator, name))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return copy.deepcopy(new)

    async def _empty(self, emulator: Any, name: str) -> None:
        for sweep in SWEEPS:
            await asyncio.sleep(self.step_seconds)
            async with emulator._lock:
                self._sweep(emulator, name, sweep)
        while True:
            async with emulator._lock:
                self._sweep(emulator, name, None)   # what came in meanwhile, GC leftovers
                if not any(key[2] == name for key in emulator.objects if key[1] != "namespaces"):
                    rtype = emulator.types[("", "v1", "namespaces")]
                    emulator._remove(rtype, ("", "namespaces", None, name))
                    return
            await asyncio.sleep(self.step_seconds)

    @staticmethod
    def _sweep(emulator: Any, name: str, kinds: frozenset[tuple[str, str]] | None) -> None:
        """Delete the objects of ``kinds`` (None: of every kind) in namespace ``name``."""
        for key in [k for k in emulator.objects if k[2] == name and k[1] != "namespaces"]:
            obj = emulator.objects.get(key)   # the garbage collector may have taken it meanwhile
            if obj is None or obj["metadata"].get("deletionTimestamp") or (kinds is not None and key[:2] not in kinds):
                continue
            rtype = emulator._type_for(key[0], key[1])
            if rtype is not None:
                emulator._delete(rtype, key[2], key[3])

    async def close(self) -> None:
        for task in list(self._tasks):
            task.cancel()

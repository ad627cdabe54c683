"""The PersistentVolumeClaim that holds the disk KV tier of a single-replica service."""

from __future__ import annotations

from kvpilot.operator.resources.common import Owner, gib_quantity
from kvpilot.operator.resources.deployment import disk_claim_gib
from kvpilot.operator.sizing import EngineSizing
from kvpilot.operator.spec import InferenceServiceSpec


def build_kv_disk_claim(owner: Owner, spec: InferenceServiceSpec, sizing: EngineSizing) -> dict:
    """A ReadWriteOnce claim of the disk tier's size plus filesystem headroom."""
    claim: dict = {
        "accessModes": ["ReadWriteOnce"],
        "resources": {"requests": {"storage": gib_quantity(disk_claim_gib(sizing))}},
    }
    if spec.offload.storage_class:
        claim["storageClassName"] = spec.offload.storage_class
    return {
        "apiVersion": "v1",
        "kind": "PersistentVolumeClaim",
        "metadata": owner.metadata("kv-disk", name=owner.kv_disk_claim),
        "spec": claim,
    }

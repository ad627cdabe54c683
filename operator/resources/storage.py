"""The disk KV tier's claim: the PersistentVolumeClaim child of a single-replica service, or
the template of per-pod ephemeral claims (``resources.deployment``) when there are more."""

from __future__ import annotations

from kvpilot.operator.resources.common import Owner, gib_quantity
from kvpilot.operator.resources.sizing import EngineSizing
from kvpilot.operator.spec import InferenceServiceSpec


def disk_claim_gib(sizing: EngineSizing) -> float:
    """Claim size for a disk tier: the tier plus 5% + 1 GiB for the filesystem and temp files."""
    return sizing.disk_offload_gib * 1.05 + 1.0


def disk_claim_spec(spec: InferenceServiceSpec, sizing: EngineSizing) -> dict:
    """A ReadWriteOnce claim's ``spec`` of the disk tier's size plus filesystem headroom."""
    claim: dict = {
        "accessModes": ["ReadWriteOnce"],
        "resources": {"requests": {"storage": gib_quantity(disk_claim_gib(sizing))}},
    }
    if spec.offload.storage_class:
        claim["storageClassName"] = spec.offload.storage_class
    return claim


def build_kv_disk_claim(owner: Owner, spec: InferenceServiceSpec, sizing: EngineSizing) -> dict:
    """The PersistentVolumeClaim child holding the disk tier (see ``disk_claim_spec``)."""
    return {
        "apiVersion": "v1",
        "kind": "PersistentVolumeClaim",
        "metadata": owner.metadata("kv-disk", name=owner.kv_disk_claim),
        "spec": disk_claim_spec(spec, sizing),
    }

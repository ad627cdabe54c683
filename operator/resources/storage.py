"""The service's claims: the disk KV tier and the model cache.

Each is a PersistentVolumeClaim child when all replicas can mount it (the disk tier: at
most one replica; the model cache: ReadWriteMany, or at most one replica), else the
template of per-pod ephemeral claims (``resources.deployment``), since a ReadWriteOnce
claim cannot follow pods onto several nodes.

The model cache (hf:// models, unless ``KVPILOT_MODEL_CACHE=off`` or
``spec.model.cache.enabled: false``) is ReadWriteMany when ``spec.model.cache.accessMode``
says so or its storage class is one of ``KVPILOT_RWX_STORAGE_CLASSES``; its size is the
planner's checkpoint size + 10% + 2 GiB (configs, tokenizer, the downloader's metadata,
files in flight) unless ``sizeGiB`` is given.
"""

from __future__ import annotations

import math

from kvpilot.operator.resources.common import Owner, gib_quantity
from kvpilot.operator.resources.sizing import EngineSizing
from kvpilot.operator.settings import OperatorSettings
from kvpilot.operator.spec import InferenceServiceSpec

GIB = 1 << 30
MODEL_CACHE_HEADROOM = 1.10
MODEL_CACHE_EXTRA_GIB = 2.0
RWX, RWO = "ReadWriteMany", "ReadWriteOnce"


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


def uses_model_cache(spec: InferenceServiceSpec, settings: OperatorSettings) -> bool:
    """Whether downloaded weights go to a cache claim (hf:// models) instead of an emptyDir."""
    return settings.model_cache and spec.model.scheme == "hf" and spec.model.cache.enabled


def model_cache_access_mode(spec: InferenceServiceSpec, settings: OperatorSettings) -> str:
    """``spec.model.cache.accessMode``, else ReadWriteMany where the storage class offers it."""
    cache = spec.model.cache
    if cache.access_mode:
        return cache.access_mode
    storage_class = cache.storage_class or settings.model_cache_storage_class
    return RWX if storage_class in settings.rwx_storage_classes else RWO


def model_cache_gib(spec: InferenceServiceSpec, sizing: EngineSizing) -> float:
    """``spec.model.cache.sizeGiB``, else the checkpoint + 10% + 2 GiB in whole GiB."""
    if spec.model.cache.size_gib is not None:
        return spec.model.cache.size_gib
    weights_gib = (sizing.weight_bytes or 0) / GIB
    return float(math.ceil(weights_gib * MODEL_CACHE_HEADROOM + MODEL_CACHE_EXTRA_GIB))


def model_cache_claim_child(spec: InferenceServiceSpec, settings: OperatorSettings, max_replicas: int) -> bool:
    """True when the cache is the PVC child every replica mounts (else per-pod claims)."""
    return uses_model_cache(spec, settings) and (
        model_cache_access_mode(spec, settings) == RWX or max_replicas <= 1)


def model_cache_claim_spec(spec: InferenceServiceSpec, sizing: EngineSizing, settings: OperatorSettings) -> dict:
    claim: dict = {
        "accessModes": [model_cache_access_mode(spec, settings)],
        "resources": {"requests": {"storage": gib_quantity(model_cache_gib(spec, sizing))}},
    }
    storage_class = spec.model.cache.storage_class or settings.model_cache_storage_class
    if storage_class:
        claim["storageClassName"] = storage_class
    return claim


def build_model_cache_claim(owner: Owner, spec: InferenceServiceSpec, sizing: EngineSizing,
                            settings: OperatorSettings) -> dict:
    """The PersistentVolumeClaim child holding the model cache (see the module docstring)."""
    return {
        "apiVersion": "v1",
        "kind": "PersistentVolumeClaim",
        "metadata": owner.metadata("model-cache", name=owner.model_cache_claim),
        "spec": model_cache_claim_spec(spec, sizing, settings),
    }


def model_cache_volume(owner: Owner, spec: InferenceServiceSpec, sizing: EngineSizing,
                       settings: OperatorSettings, max_replicas: int) -> dict | None:
    """The pod volume source of the model cache (None: no cache, an emptyDir instead)."""
    if not uses_model_cache(spec, settings):
        return None
    if model_cache_claim_child(spec, settings, max_replicas):
        return {"persistentVolumeClaim": {"claimName": owner.model_cache_claim}}
    return {"ephemeral": {"volumeClaimTemplate": {
        "metadata": {"labels": owner.labels("model-cache")},
        "spec": model_cache_claim_spec(spec, sizing, settings)}}}

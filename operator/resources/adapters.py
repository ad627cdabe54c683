"""LoRA adapters in the engine pod: where each adapter's files come from, and the flags.

Each ``spec.adapters[]`` entry gets a directory the engine reads:

- ``hf://org/name[@rev]``: an init container (``kvpilot.operator.model_fetch``, the same
  fetch as the weights: integrity-checked against the Hub's sizes, a marker per revision)
  puts it into the model cache at ``/models/adapters/NAME`` when the weights are fetched
  into one (hf:// or s3:// weights: a cache claim that outlives the pod fetches each
  revision once), else into an ``adapters`` emptyDir at ``/adapters/NAME``;
- ``s3://bucket/prefix``: the same with ``aws s3 sync``;
- ``pvc://claim/path``: the claim mounted read-only.

Loading (the reload-on-restart design): the engine stops start-up on a bad
``--lora-modules`` entry, so only the adapters the operator has seen load (``verified``,
from ``status.adapters``: POST /v1/load_lora_adapter on a ready pod, then /v1/models) are
passed as ``--lora-modules``; a restarted or added pod loads them before its readiness
probe passes, so it never takes traffic without them. Adapters not yet verified are loaded
at run time (``--allow-runtime-lora-updating``) by the operator's adapter loader.
"""

from __future__ import annotations

import hashlib
import posixpath
from dataclasses import dataclass, field

from kvpilot.operator import constants as c
from kvpilot.operator.resources.model import FETCH_ENV, MODEL_VOLUME
from kvpilot.operator.spec import AdapterSpec, InferenceServiceSpec

ADAPTERS_VOLUME = "adapters"
ADAPTERS_MOUNT = "/adapters"
CACHE_ADAPTERS_DIR = f"{c.MODEL_MOUNT}/adapters"
CLAIMS_MOUNT = "/adapter-claims"


@dataclass(frozen=True, slots=True)
class AdapterDelivery:
    """What the pod needs so that the engine finds each adapter at ``paths[name]``."""

    paths: dict[str, str] = field(default_factory=dict)
    volumes: list[dict] = field(default_factory=list)
    engine_mounts: list[dict] = field(default_factory=list)
    init_containers: list[dict] = field(default_factory=list)


def _label(prefix: str, name: str) -> str:
    """``prefix-name`` as a DNS-1123 label (63 characters; a long name ends in a hash)."""
    text = f"{prefix}-{name}"
    if len(text) <= 63:
        return text
    return f"{text[:54]}-{hashlib.sha256(name.encode()).hexdigest()[:8]}"


def in_model_cache(spec: InferenceServiceSpec) -> bool:
    """Whether fetched adapters go into the weights' volume (written by an init container)."""
    return spec.model.scheme in ("hf", "s3")


def _fetch_command(adapter: AdapterSpec, dest: str) -> list[str]:
    if adapter.scheme == "hf":
        return ["python", "-m", "kvpilot.operator.model_fetch", "--uri", adapter.source, "--dest", dest]
    source = f"s3://{adapter.bucket}/{adapter.sub_path}".rstrip("/")
    return ["aws", "s3", "sync", source, dest, "--only-show-errors"]


def adapter_paths(spec: InferenceServiceSpec) -> dict[str, str]:
    """Where the engine pod holds each adapter's files (what ``adapter_delivery`` puts there)."""
    root = CACHE_ADAPTERS_DIR if in_model_cache(spec) else ADAPTERS_MOUNT
    return {a.name: (posixpath.normpath(posixpath.join(CLAIMS_MOUNT, a.name, a.sub_path)) if a.scheme == "pvc"
                     else posixpath.join(root, a.name)) for a in spec.adapters}


def adapter_delivery(spec: InferenceServiceSpec, engine_image: str, s3_image: str, security_context: dict,
                     tmp_mount: dict) -> AdapterDelivery:
    """Volumes, mounts and init containers of ``spec.adapters`` (after the weights' own)."""
    if not spec.adapters:
        return AdapterDelivery()
    shared = in_model_cache(spec)
    volume, root = (MODEL_VOLUME, CACHE_ADAPTERS_DIR) if shared else (ADAPTERS_VOLUME, ADAPTERS_MOUNT)
    mount_path = c.MODEL_MOUNT if shared else ADAPTERS_MOUNT
    out = AdapterDelivery(paths=adapter_paths(spec))
    fetched = False
    for a in spec.adapters:
        if a.scheme == "pvc":
            vol = _label("adapter", a.name)
            where = posixpath.join(CLAIMS_MOUNT, a.name)
            out.volumes.append({"name": vol, "persistentVolumeClaim": {"claimName": a.claim, "readOnly": True}})
            out.engine_mounts.append({"name": vol, "mountPath": where, "readOnly": True})
            continue
        fetched = True
        dest = out.paths[a.name]
        container = {
            "name": _label("adapter", a.name),
            "image": engine_image if a.scheme == "hf" else s3_image,
            "command": _fetch_command(a, dest),
            "env": [dict(e) for e in FETCH_ENV],
            "volumeMounts": [{"name": volume, "mountPath": mount_path}, tmp_mount],
            "securityContext": security_context,
        }
        if spec.model.credentials_secret:   # the adapters come with the base model's credentials
            container["envFrom"] = [{"secretRef": {"name": spec.model.credentials_secret}}]
        out.init_containers.append(container)
    if fetched and not shared:
        out.volumes.append({"name": ADAPTERS_VOLUME, "emptyDir": {}})
        out.engine_mounts.append({"name": ADAPTERS_VOLUME, "mountPath": ADAPTERS_MOUNT, "readOnly": True})
    return out


def lora_args(spec: InferenceServiceSpec, paths: dict[str, str], verified: frozenset[str]) -> list[str]:
    """The engine's LoRA flags: the limits, run-time loading on, and the verified adapters
    (in spec order) as ``--lora-modules NAME=PATH``."""
    if spec.lora is None:
        return []
    args = ["--enable-lora", "--max-loras", str(spec.lora.max_loras), "--max-lora-rank",
            str(spec.lora.max_lora_rank), "--max-cpu-loras", str(spec.lora.max_cpu_loras),
            "--allow-runtime-lora-updating"]
    modules = [f"{a.name}={paths[a.name]}" for a in spec.adapters if a.name in verified]
    return args + (["--lora-modules", *modules] if modules else [])

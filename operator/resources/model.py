"""Model delivery: the volume, mounts and init container that put the weights on local disk.

- ``pvc://claim/path``: the claim is mounted read-only; the engine reads ``/models/path``.
- ``hf://org/name[@rev]``: an init container (engine image, ``kvpilot.operator.model_fetch``)
  fills the model cache (a claim that outlives pods, see ``storage``; an emptyDir when the
  cache is off), downloading only what the cache lacks; the engine mounts it read-only.
  ``hf://org/name/file.gguf[@rev]`` caches that one file and the engine serves the file.
- ``spec.model.tokenizer`` (``hf://org/name[@rev]``): a second init container fetches that
  repository's tokenizer files into a small emptyDir at each start; ``--tokenizer`` points there.
- ``s3://bucket/prefix``: the same with the AWS CLI image (``aws s3 sync``).
- ``/path``: weights baked into the image; nothing to mount.

Credentials (HF_TOKEN, AWS_*) come from ``spec.model.credentialsSecretRef`` as ``envFrom``
of the init container only: the engine container never sees them.
"""

from __future__ import annotations

import posixpath
from dataclasses import dataclass, field

from kvpilot.operator import constants as c
from kvpilot.operator.spec import ModelSource

MODEL_VOLUME = "model"
DOWNLOAD_DIR = f"{c.MODEL_MOUNT}/model"
TOKENIZER_VOLUME = "tokenizer"
TOKENIZER_MOUNT = "/tokenizer"
FETCH_ENV = ({"name": "HOME", "value": "/tmp"},
             {"name": "HF_HUB_DISABLE_TELEMETRY", "value": "1"},
             {"name": "HF_HUB_DISABLE_PROGRESS_BARS", "value": "1"})  # one log line per start


@dataclass(frozen=True, slots=True)
class ModelDelivery:
    """What the pod needs so that the engine finds the weights at ``model_path``."""

    model_path: str
    tokenizer_path: str | None = None
    volumes: list[dict] = field(default_factory=list)
    engine_mounts: list[dict] = field(default_factory=list)
    init_containers: list[dict] = field(default_factory=list)


def _fetch_container(name: str, image: str, command: list[str], model: ModelSource,
                     security_context: dict, tmp_mount: dict, volume: str = MODEL_VOLUME,
                     mount_path: str = c.MODEL_MOUNT) -> dict:
    container = {
        "name": name,
        "image": image,
        "command": command,
        "env": [dict(e) for e in FETCH_ENV],
        "volumeMounts": [{"name": volume, "mountPath": mount_path}, tmp_mount],
        "securityContext": security_context,
    }
    if model.credentials_secret:
        container["envFrom"] = [{"secretRef": {"name": model.credentials_secret}}]
    return container


def model_delivery(model: ModelSource, engine_image: str, s3_image: str,
                   security_context: dict, tmp_mount: dict, cache: dict | None = None) -> ModelDelivery:
    """Volumes, mounts and init containers for ``model``.

    Args:
        model: the parsed ``spec.model``.
        engine_image: image of the hf:// download init container (it has kvpilot).
        s3_image: image with the AWS CLI for s3:// downloads.
        security_context: container securityContext to give the init container.
        tmp_mount: the pod's writable /tmp mount (HOME of the download tools).
        cache: the volume source of the hf:// model cache (None: an emptyDir).
    """
    weights = _weights_delivery(model, engine_image, s3_image, security_context, tmp_mount, cache)
    if not model.tokenizer_uri:
        return weights
    command = ["python", "-m", "kvpilot.operator.model_fetch", "--uri", model.tokenizer_uri,
               "--dest", TOKENIZER_MOUNT, "--tokenizer-only"]
    fetch = _fetch_container("tokenizer-fetch", engine_image, command, model, security_context, tmp_mount,
                             TOKENIZER_VOLUME, TOKENIZER_MOUNT)
    return ModelDelivery(
        model_path=weights.model_path, tokenizer_path=TOKENIZER_MOUNT,
        volumes=[*weights.volumes, {"name": TOKENIZER_VOLUME, "emptyDir": {"sizeLimit": "1Gi"}}],
        engine_mounts=[*weights.engine_mounts,
                       {"name": TOKENIZER_VOLUME, "mountPath": TOKENIZER_MOUNT, "readOnly": True}],
        init_containers=[*weights.init_containers, fetch])


def _weights_delivery(model: ModelSource, engine_image: str, s3_image: str, security_context: dict,
                      tmp_mount: dict, cache: dict | None) -> ModelDelivery:
    mount = {"name": MODEL_VOLUME, "mountPath": c.MODEL_MOUNT, "readOnly": True}
    if model.scheme == "pvc":
        return ModelDelivery(
            model_path=posixpath.normpath(posixpath.join(c.MODEL_MOUNT, model.sub_path)),
            volumes=[{"name": MODEL_VOLUME,
                      "persistentVolumeClaim": {"claimName": model.claim, "readOnly": True}}],
            engine_mounts=[mount],
        )
    if model.scheme == "hf":
        command = ["python", "-m", "kvpilot.operator.model_fetch", "--uri", model.uri,
                   "--dest", DOWNLOAD_DIR]
        image = engine_image
    elif model.scheme == "s3":
        source = f"s3://{model.bucket}/{model.sub_path}".rstrip("/")
        command = ["aws", "s3", "sync", source, DOWNLOAD_DIR, "--only-show-errors"]
        image = s3_image
    else:  # a path inside the image
        return ModelDelivery(model_path=model.image_path or "/")
    return ModelDelivery(
        model_path=posixpath.join(DOWNLOAD_DIR, model.file) if model.file else DOWNLOAD_DIR,
        volumes=[{"name": MODEL_VOLUME, **(cache if cache and model.scheme == "hf" else {"emptyDir": {}})}],
        engine_mounts=[mount],
        init_containers=[_fetch_container("model-fetch", image, command, model,
                                          security_context, tmp_mount)],
    )

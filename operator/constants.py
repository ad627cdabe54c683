"""Names shared by the CRD, the builders and the handlers (group/version/plural, labels)."""

from __future__ import annotations

from kvpilot.contract.constants import DEFAULT_OFFLOAD_DISK_PATH

GROUP = "serving.kvpilot.dev"
VERSION = "v1alpha1"
PLURAL = "inferenceservices"
KIND = "InferenceService"
API_VERSION = f"{GROUP}/{VERSION}"

# app.kubernetes.io/* recommended labels, stamped on every child.
LABEL_NAME = "app.kubernetes.io/name"
LABEL_INSTANCE = "app.kubernetes.io/instance"
LABEL_MANAGED_BY = "app.kubernetes.io/managed-by"
LABEL_COMPONENT = "app.kubernetes.io/component"
APP_NAME = "kvpilot"
MANAGER = "kvpilot-operator"
# The operator's field manager: server-side applies of the children, status patches.
FIELD_MANAGER = "kvpilot"
# Annotation on an engine Deployment holding the replica count an autoscaler left when
# autoscaling was switched off: the operator keeps at least that many until spec.replicas
# is set (kvpilot.operator.replica_handover).
ANNOTATION_INHERITED_REPLICAS = f"{GROUP}/inherited-replicas"
# A new value (any) asks for a re-plan: scaling alone keeps the running plan (kvpilot.operator.scaling).
ANNOTATION_REPLAN = f"{GROUP}/replan"
# The finalizer operators before issue 43 kept on every InferenceService (kopf's, for its
# per-object daemon); the operator now removes it where it finds it (kvpilot.operator.main).
FINALIZER = f"{GROUP}/finalizer"

# Engine container layout.
ENGINE_CONTAINER = "engine"
HTTP_PORT = 8000
SERVICE_HTTP_PORT = 80
SERVICE_METRICS_PORT = 8000
MODEL_MOUNT = "/models"
KV_DISK_MOUNT = DEFAULT_OFFLOAD_DISK_PATH   # the engine's default --kv-offloading-disk-path
API_KEY_ENV = "KVPILOT_API_KEY"

# Condition types in status.conditions.
PLANNED = "Planned"
READY = "Ready"
PROGRESSING = "Progressing"
DEGRADED = "Degraded"
SIZING_DRIFT = "SizingDrift"      # the engines' KV capacity differs from the plan (sizing_drift)
ADAPTERS_READY = "AdaptersReady"  # every spec.adapters[] entry is served by every ready pod
REPLICAS_IGNORED = "ReplicasIgnored"  # spec.replicas is set while an autoscaler owns the count
CONDITION_TYPES = (PLANNED, READY, PROGRESSING, DEGRADED, SIZING_DRIFT, ADAPTERS_READY, REPLICAS_IGNORED)

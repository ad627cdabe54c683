"""Names, labels and quantities shared by the child builders."""

from __future__ import annotations

import math
from dataclasses import dataclass

from kvpilot.operator import constants as c

# A disaggregated service's pool of a pod (prefill | decode): llm-d's label, which vLLM's
# router discovers each pool by too.
ROLE_LABEL = "llm-d.ai/role"

# LeaderWorkerSet (kubernetes-sigs/lws): a replica of several pods, one a node.
LWS_API = ("leaderworkerset.x-k8s.io", "v1")
LWS_API_VERSION = "/".join(LWS_API)


@dataclass(frozen=True, slots=True)
class Owner:
    """The InferenceService a child belongs to.

    Args:
        name / namespace / uid: the CR's metadata (uid may be None before the server set one).
    """

    name: str
    namespace: str
    uid: str | None = None

    @property
    def selector_labels(self) -> dict[str, str]:
        """Labels that select this service's engine pods (Service, PDB, PodMonitor, status)."""
        return {c.LABEL_NAME: c.APP_NAME, c.LABEL_INSTANCE: self.name,
                c.LABEL_COMPONENT: "engine"}

    @property
    def selector(self) -> str:
        """``selector_labels`` as a label-selector string (status.selector)."""
        return ",".join(f"{k}={v}" for k, v in self.selector_labels.items())

    def pool_selector(self, role: str) -> dict[str, str]:
        """Labels that select the engine pods of one pool (``prefill`` / ``decode``) of a
        disaggregated service."""
        return {**self.selector_labels, ROLE_LABEL: role}

    def labels(self, component: str) -> dict[str, str]:
        """The recommended app.kubernetes.io labels of one child."""
        return {c.LABEL_NAME: c.APP_NAME, c.LABEL_INSTANCE: self.name,
                c.LABEL_MANAGED_BY: c.MANAGER, c.LABEL_COMPONENT: component}

    def metadata(self, component: str, name: str | None = None) -> dict:
        """``metadata`` of a child named after the owner (or ``name``)."""
        return {"name": name or self.name, "namespace": self.namespace,
                "labels": self.labels(component)}

    @property
    def group_name(self) -> str:
        """The LeaderWorkerSet of a replica spanning nodes, and its headless Service: not the
        owner's name, which the client Service has (LWS names its headless Service after itself)."""
        return f"{self.name}-group"

    @property
    def kv_disk_claim(self) -> str:
        return f"{self.name}-kv-disk"

    @property
    def model_cache_claim(self) -> str:
        return f"{self.name}-model-cache"


def gib_quantity(gib: float) -> str:
    """A memory/storage quantity for ``gib`` GiB, rounded up, in the API server's canonical form.

    Whole GiB stay ``"NGi"``; fractions become whole MiB (``1.5`` -> ``"1536Mi"``), which is
    how the server would print them back, so comparing desired and actual stays exact.
    """
    if gib < 0 or math.isnan(gib):
        raise ValueError(f"a size must be >= 0 GiB, got {gib}")
    mib = math.ceil(round(gib * 1024, 6))
    return f"{mib // 1024}Gi" if mib % 1024 == 0 else f"{mib}Mi"


def decimal_quantity(value: float) -> str:
    """A decimal quantity in canonical form: ``0.7`` -> ``"700m"``, ``8`` -> ``"8"``."""
    if value < 0 or math.isnan(value):
        raise ValueError(f"a quantity must be >= 0, got {value}")
    milli = round(value * 1000)
    return str(milli // 1000) if milli % 1000 == 0 else f"{milli}m"


def format_gib(gib: float) -> str:
    """A GiB count for a command-line flag: ``16`` not ``16.0``, at most 3 decimals."""
    text = f"{gib:.3f}".rstrip("0").rstrip(".")
    return text or "0"

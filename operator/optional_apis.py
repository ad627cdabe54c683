"""The optional APIs: other projects' CRDs that some services need, found by discovery.

| API                              | project                          | needed by                         | without it |
|----------------------------------|----------------------------------|-----------------------------------|------------|
| ``leaderworkerset.x-k8s.io/v1``  | LeaderWorkerSet                  | a plan whose replicas span nodes  | nothing is built |
| ``keda.sh/v1alpha1``             | KEDA                             | ``autoscaling.mode: keda``        | no ScaledObject: the Deployment keeps the count it was created with |
| ``inference.networking.k8s.io/v1`` | Gateway API inference extension | ``routing.router: gateway``       | no InferencePool for the gateway |
| ``monitoring.coreos.com/v1``     | Prometheus operator              | (nothing: used where served)      | no PodMonitor / PrometheusRule |

Every pass asks one thing per API, whether the cluster serves it (``Discovery``: asked of
the API server once, and again only after a CRD of that group changes); an API not served
has its children neither written, read nor deleted, so a missing CRD costs no request and
no failure. A service that needs one the cluster lacks gets ``Degraded=True``, reason
``MissingAPI``, naming each such API, what was left out and what to do. Installing the CRD
wakes every service's worker (the operator watches CRDs), and the service gets its
children within a pass. An API used only where served (the InferencePool outside the
gateway router, the Prometheus operator's monitors) is no condition when absent.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from kvpilot.operator.discovery import Discovery
from kvpilot.operator.resources.autoscaling import KEDA_API
from kvpilot.operator.resources.common import LWS_API
from kvpilot.operator.resources.inference_pool import INFERENCE_POOL_API
from kvpilot.operator.resources.monitoring import PODMONITOR_API
from kvpilot.operator.resources.sizing import EngineSizing
from kvpilot.operator.spec import InferenceServiceSpec


@dataclass(frozen=True, slots=True)
class OptionalApi:
    """A group/version another project serves, and where to get it."""

    group: str
    version: str
    project: str

    @property
    def name(self) -> str:
        return f"{self.group}/{self.version}"


PROMETHEUS = OptionalApi(*PODMONITOR_API, "the Prometheus operator (prometheus-operator/prometheus-operator)")
INFERENCE = OptionalApi(*INFERENCE_POOL_API,
                        "the Gateway API inference extension (kubernetes-sigs/gateway-api-inference-extension)")
LWS = OptionalApi(*LWS_API, "LeaderWorkerSet (kubernetes-sigs/lws)")
KEDA = OptionalApi(*KEDA_API, "KEDA (kedacore/keda)")
OPTIONAL_APIS = (PROMETHEUS, INFERENCE, LWS, KEDA)


@dataclass(frozen=True, slots=True)
class MissingApi:
    """An API a service needs that the cluster does not serve.

    Args:
        api: the API.
        needed_for: what in the spec (or its plan) needs it.
        otherwise: what to change instead of installing it.
        left_out: what the operator did not build for want of it.
        blocking: nothing at all is built without it (a half-built service would run the
            wrong thing).
    """

    api: OptionalApi
    needed_for: str
    otherwise: str
    left_out: str
    blocking: bool = False

    def __str__(self) -> str:
        return (f"{self.needed_for} needs {self.api.name}, which the cluster does not serve: install "
                f"{self.api.project} or {self.otherwise}; {self.left_out}")


async def served_apis(discovery: Discovery) -> dict[OptionalApi, bool]:
    """Whether the cluster serves each optional API (from the discovery cache; KubeError
    when the API server could not be asked)."""
    return {api: await discovery.has_api(api.group, api.version) for api in OPTIONAL_APIS}


def missing_apis(spec: InferenceServiceSpec, sizing: EngineSizing,
                 served: Mapping[OptionalApi, bool]) -> list[MissingApi]:
    """The APIs ``spec`` planned as ``sizing`` needs and the cluster does not serve."""
    missing = []
    if sizing.nodes > 1 and not served[LWS]:
        missing.append(MissingApi(
            LWS, "a plan whose replicas span nodes (pipeline parallelism, run as a LeaderWorkerSet)",
            "plan one node per replica (spec.gpu.nodes: 1)", "nothing was created", blocking=True))
    keda = ["autoscaling.mode: keda"] if spec.autoscaling.mode == "keda" else []
    keda += [f"disaggregation.{pool.role}.autoscaling.mode: keda" for pool in
             (spec.disaggregation.pools if spec.disaggregation is not None else ()) if pool.autoscaling.mode == "keda"]
    if keda and not served[KEDA]:
        missing.append(MissingApi(
            KEDA, " and ".join(keda), "use " + " and ".join(k.replace(": keda", ": hpa") for k in keda),
            "no ScaledObject was created: the replica count stays where it was created"))
    if spec.router.kind == "gateway" and spec.inference_pool.enabled and not served[INFERENCE]:
        missing.append(MissingApi(
            INFERENCE, "routing.router: gateway (an InferencePool for the endpoint picker)",
            "use routing.router: vllm-router", "no InferencePool was created"))
    return missing


def missing_message(missing: list[MissingApi]) -> str:
    """The ``MissingAPI`` condition's message: every missing API, what it left out, the remedy."""
    return "; ".join(str(m) for m in missing)

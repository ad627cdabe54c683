"""A replica that spans nodes: a LeaderWorkerSet group of pipeline stages, one pod a node.

When the plan has more than one pipeline stage (``EngineSizing.nodes``), the engine runs
as a ``leaderworkerset.x-k8s.io/v1`` LeaderWorkerSet (kubernetes-sigs/lws) instead of a
Deployment, under the name ``<service>-group``:

- ``replicas``: groups (one replica of the service each); ``size``: pods per group, the
  plan's nodes; the scale subresource counts groups, so ``kubectl scale``, the HPA and
  KEDA act on whole groups;
- the leader (worker index 0) runs the API server, the scheduler and stage 0; its template
  is the Deployment's pod (port, probes, drain, routing labels) with the group's rendezvous
  port added. Workers (indexes 1..size-1) run the later stages: the same image, flags and
  GPUs, no API port and no probes, labelled ``engine-worker`` so that the Service, the
  InferencePool, the PDB and the PodMonitor (which select ``engine``) reach leaders only;
- the LeaderWorkerSet controller gives every pod ``LWS_LEADER_ADDRESS``, ``LWS_GROUP_SIZE``
  and ``LWS_WORKER_INDEX``; the templates add ``KVPILOT_RENDEZVOUS_PORT`` (the leader's
  torch.distributed store, ``LWS_LEADER_ADDRESS:KVPILOT_RENDEZVOUS_PORT``);
- ``restartPolicy: RecreateGroupOnPodRestart``: a pod that fails takes its group down and
  up again (a pipeline cannot run with a stage missing); ``startupPolicy: LeaderCreated``:
  workers start with the leader, whose readiness waits for them (LeaderReady would deadlock
  the rendezvous);
- the headless Service ``<service>-group`` (selecting the group's pods, publishing them
  before they are ready so the rendezvous resolves) is the operator's child: the controller
  creates one of that name only when it is missing, and the client Service keeps the
  service's own name.
"""

from __future__ import annotations

from kvpilot.operator.constants import ANNOTATION_INHERITED_REPLICAS
from kvpilot.operator.resources.common import LWS_API_VERSION, Owner
from kvpilot.operator.resources.deployment import PodRole, ReplicaPolicy, engine_pod_template
from kvpilot.operator.resources.sizing import EngineSizing
from kvpilot.operator.settings import OperatorSettings
from kvpilot.operator.spec import InferenceServiceSpec

LWS_NAME_LABEL = "leaderworkerset.sigs.k8s.io/name"          # set by the controller on every pod
RENDEZVOUS_PORT = 29500
RENDEZVOUS_PORT_ENV = "KVPILOT_RENDEZVOUS_PORT"
LWS_ENV = ("LWS_LEADER_ADDRESS", "LWS_GROUP_SIZE", "LWS_WORKER_INDEX")   # what the controller injects
WORKER_COMPONENT = "engine-worker"
_RENDEZVOUS = {"name": "rendezvous", "containerPort": RENDEZVOUS_PORT, "protocol": "TCP"}
LEADER_ROLE = PodRole(extra_ports=(_RENDEZVOUS,))
WORKER_ROLE = PodRole(component=WORKER_COMPONENT, serves=False)


def _with_rendezvous(template: dict) -> dict:
    (container,) = template["spec"]["containers"]
    container["env"].append({"name": RENDEZVOUS_PORT_ENV, "value": str(RENDEZVOUS_PORT)})
    return template


def build_leader_worker_set(owner: Owner, spec: InferenceServiceSpec, sizing: EngineSizing,
                            settings: OperatorSettings, policy: ReplicaPolicy) -> dict:
    """The service's LeaderWorkerSet: ``policy.replicas`` groups of ``sizing.nodes`` pods."""
    leader = _with_rendezvous(engine_pod_template(owner, spec, sizing, settings, policy, LEADER_ROLE))
    worker = _with_rendezvous(engine_pod_template(owner, spec, sizing, settings, policy, WORKER_ROLE))
    metadata = owner.metadata("engine", owner.group_name)
    if policy.inherited is not None:  # as the Deployment's (replica_handover)
        metadata["annotations"] = {ANNOTATION_INHERITED_REPLICAS: str(policy.inherited)}
    return {
        "apiVersion": LWS_API_VERSION,
        "kind": "LeaderWorkerSet",
        "metadata": metadata,
        "spec": {
            "replicas": policy.replicas,
            "startupPolicy": "LeaderCreated",
            "networkConfig": {"subdomainPolicy": "Shared"},
            "leaderWorkerTemplate": {
                "size": sizing.nodes,
                "restartPolicy": "RecreateGroupOnPodRestart",
                "leaderTemplate": leader,
                "workerTemplate": worker,
            },
        },
    }


def build_group_service(owner: Owner) -> dict:
    """The groups' headless Service: stable DNS names for the rendezvous (``LWS_LEADER_ADDRESS``
    is ``<group>-<index>.<group>.<namespace>``), published before the pods are ready."""
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": owner.metadata("engine-group", owner.group_name),
        "spec": {
            "clusterIP": "None",
            "publishNotReadyAddresses": True,
            "selector": {LWS_NAME_LABEL: owner.group_name},
            "ports": [{"name": "rendezvous", "port": RENDEZVOUS_PORT, "targetPort": RENDEZVOUS_PORT,
                       "protocol": "TCP"}],
        },
    }

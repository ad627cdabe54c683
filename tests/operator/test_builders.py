"""Pure child builders: valid Kubernetes objects whose engine flags the engine accepts.

Oracles: kubernetes-validate (strict, Kubernetes 1.33) for every built-in kind, the real
``kvpilot serve`` argument parser for the Deployment's args, and the planner's Plan for
the numbers the flags and sizes must carry.
"""

from __future__ import annotations

import copy
import math

import kopf
import kubernetes_validate
import pytest
import yaml

from kvpilot.engine.server import routes_probes
from kvpilot.engine.server.args import engine_args_from_namespace, make_serve_parser
from kvpilot.operator import constants as c
from kvpilot.operator.planner.plan import make_plan
from kvpilot.operator.resources import desired_children
from kvpilot.operator.resources.common import Owner, decimal_quantity, gib_quantity
from kvpilot.operator.settings import OperatorSettings
from kvpilot.operator.spec import SpecError, parse_spec
from kvpilot.operator.spec_to_plan import plan_request, plan_service

from support import crd_schema
from support.engine_workload import leader_template, lws_errors

SETTINGS = OperatorSettings(engine_image="registry.example/kvpilot:1.2.3")
K8S_VERSION = "1.33"
BUILTIN = {"Deployment", "Service", "PersistentVolumeClaim", "HorizontalPodAutoscaler",
           "PodDisruptionBudget", "ServiceAccount", "NetworkPolicy"}
FENCE = {"ServiceAccount", "NetworkPolicy"}   # every service's identity and network fence


def _cr(name: str, spec: dict) -> dict:
    return {"apiVersion": c.API_VERSION, "kind": c.KIND,
            "metadata": {"name": name, "namespace": "serving", "uid": f"uid-{name}"}, "spec": spec}


def _build(cr: dict, podmonitor_api: bool = True):
    """(children by kind, the plan) for a CR, stamped by kopf.adopt as the operator does."""
    spec = parse_spec(cr["spec"], cr["metadata"]["name"])
    outcome = plan_service(spec)
    assert outcome.feasible, outcome.message
    owner = Owner(cr["metadata"]["name"], cr["metadata"]["namespace"], cr["metadata"]["uid"])
    children = desired_children(owner, spec, outcome.sizing, SETTINGS, podmonitor_api=podmonitor_api)
    for child in children:
        kopf.adopt(child.body, owner=cr)
    plan = make_plan(plan_request(spec))
    # by kind; the model cache claim apart from the disk tier's
    return {"ModelCache" if ch.name == owner.model_cache_claim else ch.kind.kind: ch for ch in children}, plan


def _example(stem: str) -> dict:
    path = next(p for p in crd_schema.EXAMPLES if p.stem == stem)
    obj = yaml.safe_load(path.read_text())
    obj["metadata"].update(namespace="serving", uid=f"uid-{stem}")
    return obj


def _engine(children) -> dict:
    return leader_template(children)["spec"]["containers"][0]


def _pod(children) -> dict:
    return leader_template(children)["spec"]


def _flag(args: list[str], name: str) -> str:
    return args[args.index(name) + 1]


BASE = {"model": {"uri": "hf://Qwen/Qwen3-0.6B"}, "gpu": {"type": "l4"},
        "slo": {"maxContext": 8192, "p95PromptTokens": 2048, "p95OutputTokens": 512, "concurrency": 8}}


@pytest.mark.parametrize("path", crd_schema.ONE_POOL_EXAMPLES, ids=lambda p: p.stem)
def test_every_child_of_every_example_is_a_valid_object(path):
    cr = _example(path.stem)
    children, _ = _build(cr)
    for kind, child in children.items():
        if child.kind.kind in BUILTIN:
            assert kubernetes_validate.validate(child.body, K8S_VERSION, strict=True) == K8S_VERSION
        elif kind == "LeaderWorkerSet":  # its CRD's schema (kubernetes-sigs/lws), pod templates strict
            assert lws_errors(child.body) == []
        else:  # CRD kinds of other projects: no schema offline; check the fields we rely on
            assert kind in ("PodMonitor", "PrometheusRule", "ScaledObject")
            assert child.body["apiVersion"] in ("monitoring.coreos.com/v1", "keda.sh/v1alpha1")
            if kind == "PrometheusRule":  # the Prometheus operator's own model of the kind
                from cloudcoil.models.prometheus_operator import v1
                parsed = v1.PrometheusRule.model_validate(child.body)
                assert parsed.model_dump(by_alias=True, exclude_unset=True, mode="json") == child.body
        meta = child.body["metadata"]
        assert meta["namespace"] == "serving"
        assert meta["labels"][c.LABEL_MANAGED_BY] == c.MANAGER
        assert meta["labels"][c.LABEL_INSTANCE] == cr["metadata"]["name"]
        assert {c.LABEL_NAME, c.LABEL_COMPONENT} <= set(meta["labels"])
        (ref,) = meta["ownerReferences"]
        assert ref == {"apiVersion": c.API_VERSION, "kind": c.KIND, "name": cr["metadata"]["name"],
                       "uid": f"uid-{path.stem}", "controller": True, "blockOwnerDeletion": True}


@pytest.mark.parametrize("path", crd_schema.ONE_POOL_EXAMPLES, ids=lambda p: p.stem)
def test_deployment_args_parse_with_the_real_serve_parser(path):
    cr = _example(path.stem)
    children, plan = _build(cr)
    engine = _engine(children)
    assert engine["command"] == ["kvpilot", "serve"]
    args = engine["args"]
    if plan.pipeline_parallel_size > 1 and not _parses(args):
        # until the engine serves pipeline parallelism (issue 31's engine half) the parser
        # refuses the flag: its value is the plan's, the rest must parse
        i = args.index("--pipeline-parallel-size")
        assert int(args[i + 1]) == plan.pipeline_parallel_size
        args = args[:i] + args[i + 2:]
    ns = make_serve_parser().parse_args(args)
    assert ns.served_model_name == [cr["spec"]["model"].get("servedName", cr["metadata"]["name"])]
    assert ns.port == c.HTTP_PORT and ns.host == "0.0.0.0"
    assert ns.max_model_len == cr["spec"]["slo"]["maxContext"] == plan.max_model_len
    assert ns.max_num_seqs == plan.max_num_seqs
    assert ns.max_num_batched_tokens == plan.max_num_batched_tokens
    assert ns.kv_cache_dtype == plan.kv_cache_dtype
    assert ns.kv_cache_memory_bytes == plan.kv_cache_memory_bytes
    assert ns.block_size == plan.block_size
    assert ns.enable_prefix_caching is plan.enable_prefix_caching
    assert "--api-key" not in " ".join(engine["args"])
    # the model path is where the pod puts the weights
    mounts = {m["mountPath"] for m in engine["volumeMounts"]}
    assert any(ns.model == m or ns.model.startswith(m + "/") for m in mounts), (ns.model, mounts)


def _parses(args: list[str]) -> bool:
    try:
        make_serve_parser().parse_args(args)
    except SystemExit:
        return False
    return True


def test_long_context_example_plans_an_fp8_cache():
    children, plan = _build(_example("long-context-fp8"))
    assert plan.kv_cache_dtype.startswith("fp8")
    assert _flag(_engine(children)["args"], "--kv-cache-dtype") == plan.kv_cache_dtype


def test_70b_example_is_one_pod_of_four_tensor_parallel_gpus():
    """Issue 13, acceptance 4: gpu.count -> --tensor-parallel-size, the pod's GPUs, /dev/shm."""
    children, plan = _build(_example("llama-70b-tensor-parallel"))
    assert (plan.model, plan.gpu, plan.tensor_parallel_size) == ("Llama-3.1-70B-Instruct", "h100-80gb", 4)
    assert plan.num_kv_heads_per_gpu == 2                    # 8 KV heads over 4 GPUs
    assert plan.kv_bytes_per_token == 2 * 80 * 2 * 128 * 2   # per GPU: K+V x layers x heads x dim x bf16
    assert plan.memory["weight_bytes_per_gpu"] * 4 >= plan.memory["weight_bytes_total"] > 80 << 30
    deployment = children["Deployment"].body
    engine, pod = _engine(children), _pod(children)
    assert deployment["spec"]["replicas"] == plan.replicas
    assert len(pod["containers"]) == 1                       # one pod holds the whole replica
    for kind in ("limits", "requests"):
        assert engine["resources"][kind]["nvidia.com/gpu"] == "4"
        assert engine["resources"][kind]["memory"] == gib_quantity(plan.pod_memory_gib)
    ns = make_serve_parser().parse_args(engine["args"])
    assert ns.tensor_parallel_size == 4
    assert ns.kv_cache_memory_bytes == plan.kv_cache_memory_bytes   # per GPU
    assert engine_args_from_namespace(ns).tensor_parallel_size == 4
    shm = {v["name"]: v for v in pod["volumes"]}["dshm"]["emptyDir"]
    assert plan.shm_gib == 1 + 3                             # IPC + NCCL room per further rank
    assert shm == {"medium": "Memory", "sizeLimit": gib_quantity(plan.shm_gib)}
    assert plan.pod_memory_gib == 4 + 2 * 4 + plan.shm_gib   # base + per GPU worker + /dev/shm
    assert pod["affinity"]["nodeAffinity"]                   # on nodes with that GPU type
    assert kubernetes_validate.validate(deployment, K8S_VERSION, strict=True) == K8S_VERSION


def test_offload_sizes_map_to_flags_shm_memory_and_the_claim():
    """Issue 6, acceptance 5: cpu_offload_gib / disk_offload_gib -> flags, /dev/shm, memory, PVC."""
    children, plan = _build(_example("offload-cpu-disk"))
    assert plan.cpu_offload_gib > 0 and plan.disk_offload_gib > 0 and plan.replicas == 1
    engine, pod = _engine(children), _pod(children)
    ns = make_serve_parser().parse_args(engine["args"])
    assert ns.kv_offloading_size == pytest.approx(plan.cpu_offload_gib)
    assert ns.kv_offloading_disk_size == pytest.approx(plan.disk_offload_gib)
    assert ns.kv_offloading_backend == "native"
    disk_mount = next(m for m in engine["volumeMounts"] if m["name"] == "kv-disk")
    assert ns.kv_offloading_disk_path == disk_mount["mountPath"]
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes["kv-disk"]["persistentVolumeClaim"]["claimName"] == children["PersistentVolumeClaim"].name
    shm = volumes["dshm"]["emptyDir"]
    assert shm["medium"] == "Memory" and shm["sizeLimit"] == gib_quantity(plan.shm_gib)
    assert plan.shm_gib >= plan.cpu_offload_gib  # the CPU tier lives in /dev/shm
    assert {"name": "dshm", "mountPath": "/dev/shm"} in engine["volumeMounts"]
    for kind in ("limits", "requests"):
        assert engine["resources"][kind]["memory"] == gib_quantity(plan.pod_memory_gib)
    assert plan.pod_memory_gib >= plan.shm_gib
    claim = children["PersistentVolumeClaim"].body
    requested = claim["spec"]["resources"]["requests"]["storage"]
    assert requested == gib_quantity(plan.disk_offload_gib * 1.05 + 1)
    assert claim["spec"]["storageClassName"] == "local-nvme"
    # a single replica on a ReadWriteOnce claim is replaced, not surged
    assert children["Deployment"].body["spec"]["strategy"] == {"type": "Recreate"}


def test_pinned_offload_sizes_win_and_disabled_offload_adds_nothing():
    spec = copy.deepcopy(BASE)
    spec["slo"].update(p95PromptTokens=6000, sharedPrefixTokens=4096, distinctPrefixes=2000)
    children, plan = _build(_cr("spill", spec))
    assert plan.cpu_offload_gib == 0 and plan.disk_offload_gib == 0
    assert not any(a.startswith("--kv-offloading") for a in _engine(children)["args"])
    assert "PersistentVolumeClaim" not in children
    spec["offload"] = {"enabled": True, "cpuGiB": 12, "disk": {"sizeGiB": 40}}
    children, plan = _build(_cr("pinned", spec))
    ns = make_serve_parser().parse_args(_engine(children)["args"])
    assert (ns.kv_offloading_size, ns.kv_offloading_disk_size) == (12, 40)
    assert _pod(children)["volumes"][-1]["name"] == "kv-disk"


def test_multi_replica_disk_tier_uses_per_pod_claims():
    spec = copy.deepcopy(BASE)
    spec.update(replicas=3, offload={"enabled": True, "cpuGiB": 4, "disk": {"sizeGiB": 20,
                                                                          "storageClassName": "ssd"}})
    children, _ = _build(_cr("multi", spec))
    assert "PersistentVolumeClaim" not in children
    volume = next(v for v in _pod(children)["volumes"] if v["name"] == "kv-disk")
    template = volume["ephemeral"]["volumeClaimTemplate"]["spec"]
    assert template["resources"]["requests"]["storage"] == gib_quantity(20 * 1.05 + 1)
    assert template["storageClassName"] == "ssd"
    assert children["Deployment"].body["spec"]["strategy"]["type"] == "RollingUpdate"
    assert kubernetes_validate.validate(children["Deployment"].body, K8S_VERSION, strict=True)


def test_lmcache_backend_is_configured_through_its_environment():
    spec = copy.deepcopy(BASE)
    spec["offload"] = {"enabled": True, "backend": "lmcache", "cpuGiB": 6, "disk": {"sizeGiB": 30},
                       "lmcache": {"remoteUrl": "lm://lmcache.cache:65432", "chunkSize": 256}}
    children, _ = _build(_cr("lmc", spec))
    engine = _engine(children)
    ns = make_serve_parser().parse_args(engine["args"])
    assert ns.kv_offloading_backend == "lmcache"
    env = {e["name"]: e.get("value") for e in engine["env"]}
    assert env["LMCACHE_TRACK_USAGE"] == "false"
    assert env["LMCACHE_MAX_LOCAL_CPU_SIZE"] == "6"
    assert env["LMCACHE_REMOTE_URL"] == "lm://lmcache.cache:65432"
    assert env["LMCACHE_LOCAL_DISK"] == f"file://{ns.kv_offloading_disk_path}/"
    assert env["LMCACHE_CHUNK_SIZE"] == "256"


def test_api_key_comes_from_the_secret_never_the_command_line(monkeypatch):
    monkeypatch.delenv(c.API_KEY_ENV, raising=False)
    children, _ = _build(_example("offload-cpu-disk"))
    engine = _engine(children)
    key_env = next(e for e in engine["env"] if e["name"] == c.API_KEY_ENV)
    assert key_env["valueFrom"] == {"secretKeyRef": {"name": "qwen3-8b-api-key", "key": "api-key"}}
    assert make_serve_parser().parse_args(engine["args"]).api_key is None
    assert "envFrom" not in engine  # download credentials stay in the init container


def test_model_delivery_by_scheme():
    pvc, _ = _build(_example("long-context-fp8"))
    volume = next(v for v in _pod(pvc)["volumes"] if v["name"] == "model")
    assert volume["persistentVolumeClaim"] == {"claimName": "models", "readOnly": True}
    assert next(m for m in _engine(pvc)["volumeMounts"] if m["name"] == "model")["readOnly"] is True
    assert _flag(_engine(pvc)["args"], "--model") == "/models/meta-llama/Llama-3.1-8B-Instruct"
    assert "initContainers" not in _pod(pvc)

    hf, _ = _build(_example("offload-cpu-disk"))
    (init,) = _pod(hf)["initContainers"]
    assert init["command"][:3] == ["python", "-m", "kvpilot.operator.model_fetch"]
    assert _flag(init["command"], "--uri") == "hf://Qwen/Qwen3-8B"
    assert _flag(init["command"], "--dest") == _flag(_engine(hf)["args"], "--model")
    assert init["envFrom"] == [{"secretRef": {"name": "hf-token"}}]
    assert init["image"] == SETTINGS.engine_image
    assert next(v for v in _pod(hf)["volumes"] if v["name"] == "model")["persistentVolumeClaim"] == \
        {"claimName": hf["ModelCache"].name}  # the model cache (tests/operator/test_model_cache_claims.py)

    spec = copy.deepcopy(BASE)
    spec["model"] = {"uri": "s3://weights/qwen3/0.6b", "architecture": "qwen3-0.6b",
                     "credentialsSecretRef": {"name": "aws"}}
    s3, _ = _build(_cr("s3", spec))
    (init,) = _pod(s3)["initContainers"]
    assert init["command"][:4] == ["aws", "s3", "sync", "s3://weights/qwen3/0.6b"]
    assert init["image"] == SETTINGS.s3_fetch_image

    spec["model"] = {"uri": "/opt/models/Qwen3-0.6B"}
    baked, _ = _build(_cr("baked", spec))
    assert _flag(_engine(baked)["args"], "--model") == "/opt/models/Qwen3-0.6B"
    assert not any(v["name"] == "model" for v in _pod(baked)["volumes"])


def test_pod_gets_gpus_probes_metrics_and_a_graceful_non_root_runtime():
    spec = copy.deepcopy(BASE)
    spec.update(gpu={"type": "h100-80gb", "count": 1}, nodeSelector={"gpu": "h100"},
                serviceAccountName="engine", resources={"requests": {"cpu": 4}},
                env=[{"name": "LOG", "value": "debug"}])
    children, plan = _build(_cr("gpus", spec))
    engine, pod = _engine(children), _pod(children)
    assert engine["resources"]["limits"]["nvidia.com/gpu"] == "1" == str(plan.tensor_parallel_size)
    assert engine["resources"]["requests"]["cpu"] == 4
    assert "--tensor-parallel-size" not in engine["args"]
    # startup and readiness on the engine's readiness route, liveness on its liveness route
    served = {route.path for route in routes_probes.router.routes}
    assert engine["startupProbe"]["httpGet"] == {"path": "/health", "port": "http"}
    assert engine["readinessProbe"]["httpGet"] == {"path": "/health", "port": "http"}
    assert engine["livenessProbe"]["httpGet"] == {"path": "/livez", "port": "http"}
    assert {"/health", "/livez"} <= served
    startup = engine["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 30 * 60   # loading time
    annotations = children["Deployment"].body["spec"]["template"]["metadata"]["annotations"]
    assert annotations["prometheus.io/scrape"] == "true" and annotations["prometheus.io/path"] == "/metrics"
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert engine["securityContext"]["allowPrivilegeEscalation"] is False
    # the drain: the server's own parser reads --shutdown-timeout; the grace period covers
    # the preStop sleep, that drain and a margin
    pre_stop = engine["lifecycle"]["preStop"]["sleep"]["seconds"]
    assert pre_stop > 0
    drain = make_serve_parser().parse_args(engine["args"]).shutdown_timeout
    assert drain == SETTINGS.termination_grace_seconds
    assert pod["terminationGracePeriodSeconds"] >= pre_stop + drain + 10
    assert pod["nodeSelector"] == {"gpu": "h100"} and pod["serviceAccountName"] == "engine"
    assert {"name": "LOG", "value": "debug"} in engine["env"]
    service = children["Service"].body["spec"]
    assert [p["name"] for p in service["ports"]] == ["http", "metrics"]
    assert service["selector"] == children["Deployment"].body["spec"]["selector"]["matchLabels"]


def test_extra_args_shutdown_timeout_sets_the_grace_period():
    spec = {**BASE, "engine": {"extraArgs": ["--shutdown-timeout", "300"]}}
    children, _ = _build(_cr("slow-drain", spec))
    engine, pod = _engine(children), _pod(children)
    assert make_serve_parser().parse_args(engine["args"]).shutdown_timeout == 300
    pre_stop = engine["lifecycle"]["preStop"]["sleep"]["seconds"]
    assert pre_stop + 300 + 10 <= pod["terminationGracePeriodSeconds"] <= pre_stop + 300 + 30
    spec["engine"]["extraArgs"] = ["--shutdown-timeout=forever"]
    with pytest.raises(SpecError, match="--shutdown-timeout needs a number of seconds"):
        parse_spec(spec, "bad-drain")


def test_hpa_scales_the_deployment_on_kv_usage_and_queue_length():
    children, plan = _build(_example("autoscaled-kv-usage"))
    hpa = children["HorizontalPodAutoscaler"].body["spec"]
    assert hpa["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment",
                                     "name": "qwen3-4b-autoscaled"}
    assert (hpa["minReplicas"], hpa["maxReplicas"]) == (1, 6)
    metrics = {m["pods"]["metric"]["name"]: m["pods"]["target"] for m in hpa["metrics"]}
    assert metrics == {"vllm_kv_cache_usage_perc": {"type": "AverageValue", "averageValue": "700m"},
                       "vllm_num_requests_waiting": {"type": "AverageValue", "averageValue": "8"},
                       "vllm_num_preemptions_per_second": {"type": "AverageValue", "averageValue": "100m"}}
    # scale up within a minute, down slowly (a pod's prefix cache and a model load are at stake)
    behavior = hpa["behavior"]
    assert behavior["scaleUp"]["stabilizationWindowSeconds"] < behavior["scaleDown"]["stabilizationWindowSeconds"]
    assert behavior["scaleDown"]["policies"] == [{"type": "Pods", "value": 1, "periodSeconds": 120}]
    deployment = children["Deployment"]
    assert deployment.create_only == ("spec.replicas",)  # the HPA owns the count after creation
    assert deployment.body["spec"]["replicas"] == min(max(plan.replicas, 1), 6)
    assert "PodDisruptionBudget" not in children  # minReplicas 1


def test_keda_scaledobject_queries_the_engine_series():
    spec = copy.deepcopy(BASE)
    spec["autoscaling"] = {"mode": "keda", "minReplicas": 2, "maxReplicas": 5, "kvCacheUsageTarget": 0.6,
                           "waitingRequestsTarget": 4}
    children, _ = _build(_cr("keda", spec))
    assert "HorizontalPodAutoscaler" not in children and "PodDisruptionBudget" in children
    so = children["ScaledObject"].body["spec"]
    assert (so["minReplicaCount"], so["maxReplicaCount"]) == (2, 5)
    queries = [t["metadata"]["query"] for t in so["triggers"]]
    assert queries == ['sum(vllm:kv_cache_usage_perc{namespace="serving",model_name="keda"})',
                       'sum(vllm:num_requests_waiting{namespace="serving",model_name="keda"})',
                       'sum(rate(vllm:num_preemptions_total{namespace="serving",model_name="keda"}[1m]))']
    assert [t["metadata"]["threshold"] for t in so["triggers"]] == ["0.6", "4", "0.1"]
    assert {t["metricType"] for t in so["triggers"]} == {"AverageValue"}  # per pod, as the HPA's
    assert all(isinstance(v, str) for t in so["triggers"] for v in t["metadata"].values())
    assert so["advanced"]["horizontalPodAutoscalerConfig"]["behavior"]["scaleDown"]["policies"]


def test_keda_scales_to_zero_only_when_asked():
    spec = copy.deepcopy(BASE)
    spec["autoscaling"] = {"mode": "keda", "maxReplicas": 3}
    default, _ = _build(_cr("warm", spec))
    assert default["ScaledObject"].body["spec"]["minReplicaCount"] == 1
    spec["autoscaling"]["minReplicas"] = 0
    idle, plan = _build(_cr("idle", spec))
    assert idle["ScaledObject"].body["spec"]["minReplicaCount"] == 0
    assert idle["Deployment"].body["spec"]["replicas"] == max(plan.replicas, 1)  # starts serving
    spec["autoscaling"]["mode"] = "hpa"  # the HPA cannot scale to zero
    with pytest.raises(SpecError, match="needs autoscaling.mode keda"):
        parse_spec(spec, "hpa-zero")


def test_pdb_and_podmonitor_only_when_they_apply():
    one, _ = _build(_cr("one", {**BASE, "replicas": 1}), podmonitor_api=False)
    assert set(one) == {"Deployment", "Service", "ModelCache", *FENCE}  # one replica: a ReadWriteOnce cache claim
    two, _ = _build(_cr("two", {**BASE, "replicas": 2}), podmonitor_api=True)
    assert two["PodDisruptionBudget"].body["spec"]["maxUnavailable"] == 1
    monitor = two["PodMonitor"].body["spec"]
    assert monitor["podMetricsEndpoints"] == [{"port": "http", "path": "/metrics", "interval": "15s"}]
    assert monitor["selector"]["matchLabels"] == two["Deployment"].body["spec"]["selector"]["matchLabels"]


def test_quantities_are_canonical():
    assert [gib_quantity(x) for x in (1, 1.5, 0.25, 161, 0)] == ["1Gi", "1536Mi", "256Mi", "161Gi", "0Gi"]
    assert gib_quantity(1 / 3) == f"{math.ceil(1024 / 3)}Mi"
    assert [decimal_quantity(x) for x in (0.7, 8, 0.05, 1.0)] == ["700m", "8", "50m", "1"]
    with pytest.raises(ValueError):
        gib_quantity(-1)

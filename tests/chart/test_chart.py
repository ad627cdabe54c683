"""The Helm chart: lint, strict validation of every rendered manifest, the values schema,
one source for the CRDs, the engine image the operator is given, and the Dockerfiles.

Oracles: the real ``helm`` (lint, template, the values schema), ``kubernetes-validate``,
the CRDs' own schemas, the Prometheus operator's models and ``hadolint``.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import shutil
import subprocess

import pytest
import yaml

from kvpilot.operator.resources.common import Owner
from kvpilot.operator.resources.deployment import build_deployment
from kvpilot.operator.settings import OperatorSettings
from kvpilot.operator.spec import parse_spec
from kvpilot.operator.spec_to_plan import plan_service

from support import crd_schema
from support.chart import (
    CHART,
    CI_VALUES,
    MONITORING_API,
    ROOT,
    helm,
    of_kind,
    operator_container,
    operator_env,
    render,
    tool,
)
from support.manifests import crd_schemas, validate

CHART_CRDS = [doc for path in sorted((CHART / "crds").glob("*.yaml"))
              for doc in yaml.safe_load_all(path.read_text()) if doc]
SCHEMAS = crd_schemas(CHART_CRDS)
EXAMPLE = ROOT / "crds" / "examples" / "qwen3-0.6b.yaml"


def _load_script(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_helm_lint_is_clean():
    for values in (None, *CI_VALUES):
        args = ["lint", "--strict", *(["--values", str(values)] if values else [])]
        run = helm(*args)
        assert run.returncode == 0, run.stdout + run.stderr
        assert "1 chart(s) linted, 0 chart(s) failed" in run.stdout
        assert "[WARNING]" not in run.stdout and "[ERROR]" not in run.stdout, run.stdout


@pytest.mark.parametrize("monitoring_api", [False, True], ids=["plain-cluster", "with-prometheus-operator"])
@pytest.mark.parametrize("values", [None, *CI_VALUES], ids=lambda v: v.stem if v else "chart-defaults")
def test_every_rendered_manifest_validates_strictly(values, monitoring_api):
    docs = render([values] if values else [], api_versions=[MONITORING_API] if monitoring_api else [])
    oracles = [validate(doc, SCHEMAS) for doc in docs]
    kinds = {d["kind"] for d in docs}
    assert {"CustomResourceDefinition", "Deployment", "ServiceAccount", "ClusterRole",
            "ClusterRoleBinding", "Service"} <= kinds
    assert ("ServiceMonitor" in kinds) == monitoring_api  # only where the API exists
    assert oracles.count("kubernetes-validate") >= 6
    if monitoring_api:
        assert "prometheus-operator-model" in oracles


def test_a_manifest_with_an_unknown_field_fails_validation():
    docs = render(api_versions=[MONITORING_API])
    for kind, path in (("Deployment", ("spec", "template", "spec")), ("ServiceMonitor", ("spec",)),
                       ("KopfPeering", ())):
        (doc,) = of_kind(docs, kind)
        node = doc
        for part in path:
            node = node[part]
        node["replicaz"] = 2
        with pytest.raises(AssertionError, match="replicaz|unknown|prune"):
            validate(doc, SCHEMAS)


def test_the_values_schema_rejects_wrong_types_and_unknown_keys():
    for sets, message in ((["replicaCount=two"], "at '/replicaCount': got string, want integer"),
                          (["replicaCnt=2"], "additional properties 'replicaCnt' not allowed"),
                          (["rbac.scope=everything"], "/rbac/scope"),
                          (["monitoring.serviceMonitor.enabled=maybe"], "/monitoring/serviceMonitor/enabled"),
                          (["image.pullPolicy=Sometimes"], "/image/pullPolicy")):
        run = helm("template", "kvpilot", *[a for s in sets for a in ("--set", s)])
        assert run.returncode != 0, sets
        assert message in run.stderr, run.stderr


def test_combinations_the_schema_cannot_express_fail_with_a_reason():
    run = helm("template", "kvpilot", "--set", "replicaCount=3", "--set", "peering.enabled=false")
    assert run.returncode != 0 and "replicaCount > 1 needs peering.enabled=true" in run.stderr


def test_the_chart_ships_the_crds_folder_verbatim(tmp_path):
    sync = _load_script("sync_chart_crds")
    assert sync.differences() == [], "run: python scripts/sync_chart_crds.py"
    # the check itself notices an edited, a missing and a stale copy
    source, target = tmp_path / "src", tmp_path / "dst"
    shutil.copytree(ROOT / "crds", source, ignore=shutil.ignore_patterns("examples"))
    assert len(sync.sync(source, target)) == len(list(source.glob("*.yaml")))
    assert sync.differences(source, target) == []
    (source / "serving.kvpilot.dev_inferenceservices.yaml").write_text("# edited\n")
    (target / "kopf.dev_peerings.yaml").unlink()
    (target / "old.yaml").write_text("{}")
    problems = sync.differences(source, target)
    assert len(problems) == 3 and any("differs" in p for p in problems)
    names = {doc["metadata"]["name"] for doc in CHART_CRDS}
    assert names == {crd_schema.load_crd()["metadata"]["name"], "clusterkopfpeerings.kopf.dev",
                     "kopfpeerings.kopf.dev"}


def test_defaults_are_two_peered_replicas_watching_the_release_namespace():
    docs = render()
    deployment = of_kind(docs, "Deployment")[0]["spec"]
    assert deployment["replicas"] == 2 and deployment["strategy"]["type"] == "RollingUpdate"
    args = operator_container(docs)["args"]
    assert args == ["--namespace=kvpilot", "--peering=kvpilot"]
    (peering,) = of_kind(docs, "KopfPeering")
    assert (peering["metadata"]["name"], peering["metadata"]["namespace"]) == ("kvpilot", "kvpilot")
    assert of_kind(docs, "PodDisruptionBudget")[0]["spec"]["minAvailable"] == 1
    # least privilege by default: what the operator writes is granted in its namespace only
    (role,) = of_kind(docs, "Role")
    assert role["metadata"]["namespace"] == "kvpilot"
    bound = [b for b in of_kind(docs, "ClusterRoleBinding") if b["subjects"][0]["name"] == "kvpilot"]
    (cluster_role,) = [r for r in of_kind(docs, "ClusterRole") if r["metadata"]["name"] == bound[0]["roleRef"]["name"]]
    assert {v for rule in cluster_role["rules"] for v in rule["verbs"]} == {"list", "watch"}
    env = operator_env(docs)
    settings = OperatorSettings.from_env(env)
    assert (settings.peering_lifetime, settings.metrics_port) == (30, 8081)  # the watch: --namespace above
    ports = {p["name"]: p["containerPort"] for p in operator_container(docs)["ports"]}
    assert settings.liveness_endpoint == f"http://0.0.0.0:{ports['health']}/healthz"
    assert ports["metrics"] == settings.metrics_port
    # Prometheus scrapes the pod IP: the chart binds /metrics there (the process alone: loopback)
    assert settings.metrics_bind_address == "0.0.0.0" != OperatorSettings().metrics_bind_address
    # hf:// caches on the cluster's default StorageClass unless one is named
    assert (settings.model_cache, settings.model_cache_storage_class, settings.rwx_storage_classes) == \
        (True, None, ())


def test_metrics_bind_address_and_model_cache_classes_are_chart_values():
    docs = render(sets=["ports.metricsBindAddress=127.0.0.1", "operator.modelCache.storageClassName=fast-ssd",
                        "operator.modelCache.readWriteManyClasses={efs,filestore}"])
    settings = OperatorSettings.from_env(operator_env(docs))
    assert settings.metrics_bind_address == "127.0.0.1"
    assert (settings.model_cache_storage_class, settings.rwx_storage_classes) == ("fast-ssd", ("efs", "filestore"))
    assert not OperatorSettings.from_env(operator_env(render(sets=["operator.modelCache.enabled=false"]))).model_cache
    for sets, where in ((["ports.metricsBindAddress=everywhere"], "/ports/metricsBindAddress"),
                        (["operator.modelCache.storageClass=x"], "storageClass")):
        run = helm("template", "kvpilot", *[a for s in sets for a in ("--set", s)])
        assert run.returncode != 0 and where in run.stderr, run.stderr


def test_cluster_rbac_is_an_explicit_choice():
    docs = render([CHART / "ci" / "cluster-rbac-values.yaml"])
    assert operator_container(docs)["args"] == ["--all-namespaces", "--peering=kvpilot"]
    assert of_kind(docs, "Role") == [] and of_kind(docs, "KopfPeering") == []
    (peering,) = of_kind(docs, "ClusterKopfPeering")
    assert peering["metadata"]["name"] == "kvpilot"
    (role,) = [r for r in of_kind(docs, "ClusterRole") if r["metadata"]["name"] == "kvpilot"]
    assert {"deployments", "inferenceservices"} <= {r for rule in role["rules"] for r in rule["resources"]}


def test_user_roles_aggregate_into_edit_and_view():
    roles = {r["metadata"]["name"]: r for r in of_kind(render(), "ClusterRole")}
    edit, view = roles["kvpilot-edit"], roles["kvpilot-view"]
    assert edit["metadata"]["labels"]["rbac.authorization.k8s.io/aggregate-to-edit"] == "true"
    assert edit["metadata"]["labels"]["rbac.authorization.k8s.io/aggregate-to-admin"] == "true"
    assert view["metadata"]["labels"]["rbac.authorization.k8s.io/aggregate-to-view"] == "true"
    by_resource = {}
    for role in (edit, view):
        for rule in role["rules"]:
            assert rule["apiGroups"] == ["serving.kvpilot.dev"]
            for resource in rule["resources"]:
                by_resource.setdefault((role["metadata"]["name"], resource), set()).update(rule["verbs"])
    assert by_resource[("kvpilot-edit", "inferenceservices")] >= {"create", "patch", "delete"}
    assert by_resource[("kvpilot-view", "inferenceservices")] == {"get", "list", "watch"}
    assert by_resource[("kvpilot-view", "inferenceservices/status")] == {"get", "list", "watch"}
    # no role for people grants anything on the operator's children or on Secrets
    assert {r for _, r in by_resource} <= {"inferenceservices", "inferenceservices/status",
                                             "inferenceservices/scale"}
    off = render(sets=["rbac.aggregateUserRoles=false"])
    assert not {"kvpilot-edit", "kvpilot-view"} & {r["metadata"]["name"] for r in of_kind(off, "ClusterRole")}


def test_namespaced_rbac_grants_children_only_in_the_watched_namespaces():
    docs = render([CHART / "ci" / "namespaced-rbac-values.yaml"])
    (cluster_role,) = [r for r in of_kind(docs, "ClusterRole") if r["metadata"]["name"] == "kvpilot"]
    assert {r for rule in cluster_role["rules"] for r in rule["resources"]} == \
        {"customresourcedefinitions", "namespaces"}  # kopf's discovery, nothing it writes
    assert {v for rule in cluster_role["rules"] for v in rule["verbs"]} == {"list", "watch"}
    roles = {r["metadata"]["namespace"]: r for r in of_kind(docs, "Role")}
    bindings = {b["metadata"]["namespace"]: b for b in of_kind(docs, "RoleBinding")}
    peerings = {p["metadata"]["namespace"] for p in of_kind(docs, "KopfPeering")}
    assert set(roles) == set(bindings) == peerings == {"team-a", "team-b"}
    assert of_kind(docs, "ClusterKopfPeering") == []
    for ns, binding in bindings.items():
        assert binding["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role",
                                      "name": roles[ns]["metadata"]["name"]}
        assert binding["subjects"][0]["namespace"] == "kvpilot"
    assert operator_container(docs)["args"] == ["--namespace=team-a", "--namespace=team-b", "--peering=kvpilot"]


def test_ha_off_is_one_standalone_replica():
    docs = render([CHART / "ci" / "ha-off-values.yaml"])
    deployment = of_kind(docs, "Deployment")[0]["spec"]
    assert deployment["replicas"] == 1 and deployment["strategy"] == {"type": "Recreate"}
    assert operator_container(docs)["args"] == ["--namespace=kvpilot", "--standalone"]
    kinds = {d["kind"] for d in docs}
    assert not kinds & {"ClusterKopfPeering", "KopfPeering", "PodDisruptionBudget"}
    rules = [rule for role in of_kind(docs, "ClusterRole") + of_kind(docs, "Role") for rule in role["rules"]]
    assert not [r for r in rules if "kopf.dev" in r["apiGroups"]]


def _example_deployment(env: dict[str, str]) -> dict:
    """The Deployment the operator builds for the example, with the settings ``env`` gives."""
    obj = yaml.safe_load(EXAMPLE.read_text())
    spec = parse_spec(obj["spec"], obj["metadata"]["name"])
    outcome = plan_service(spec)
    assert outcome.sizing is not None, outcome.message
    owner = Owner(obj["metadata"]["name"], "team-a", "uid-1")
    return build_deployment(owner, spec, outcome.sizing, OperatorSettings.from_env(env))


@pytest.mark.parametrize("sets, image", [
    ([], f"ghcr.io/kvpilot/kvpilot:{importlib.metadata.version('kvpilot')}"),
    (["engine.image.repository=registry.example/ml/kvpilot", "engine.image.tag=0.2.0-cu128"],
     "registry.example/ml/kvpilot:0.2.0-cu128"),
])
def test_the_engine_image_reaches_the_deployments_the_operator_builds(sets, image):
    docs = render(sets=sets)
    env = operator_env(docs)
    assert env["KVPILOT_ENGINE_IMAGE"] == image
    pod = _example_deployment(env)["spec"]["template"]["spec"]
    assert [c["image"] for c in pod["containers"]] == [image]
    assert [c["image"] for c in pod["initContainers"]] == [image]  # hf:// download
    assert env["KVPILOT_S3_FETCH_IMAGE"] == image  # the engine image has the AWS CLI


def test_image_tags_default_to_the_app_version():
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    assert chart["appVersion"] == importlib.metadata.version("kvpilot")
    docs = render()
    assert operator_container(docs)["image"] == f"ghcr.io/kvpilot/kvpilot-operator:{chart['appVersion']}"
    assert operator_env(docs)["KVPILOT_ENGINE_IMAGE"] == OperatorSettings().engine_image


def test_dashboards_and_rules_come_from_the_chart_files(tmp_path):
    chart = tmp_path / "kvpilot"
    shutil.copytree(CHART, chart)
    for shipped in ("dashboards", "rules"):   # the chart's own files: replaced by the test's
        shutil.rmtree(chart / "files" / shipped, ignore_errors=True)
    dashboard = {"title": "kvpilot test", "panels": [], "schemaVersion": 39}
    (chart / "files" / "dashboards").mkdir()
    (chart / "files" / "dashboards" / "engine.json").write_text(json.dumps(dashboard, indent=2))
    rules = {"groups": [{"name": "kvpilot.test", "rules": [
        {"alert": "KVCacheNearlyFull", "expr": "avg(vllm:kv_cache_usage_perc) > 0.95", "for": "10m",
         "labels": {"severity": "warning"}, "annotations": {"summary": "KV cache over 95%"}}]}]}
    (chart / "files" / "rules").mkdir()
    (chart / "files" / "rules" / "engine.yaml").write_text(yaml.safe_dump(rules))
    docs = render([CHART / "ci" / "monitoring-values.yaml"], api_versions=[MONITORING_API], chart=chart)
    for doc in docs:
        validate(doc, SCHEMAS)
    (configmap,) = of_kind(docs, "ConfigMap")
    assert configmap["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert configmap["metadata"]["namespace"] == "monitoring"
    assert json.loads(configmap["data"]["engine.json"]) == dashboard
    (rule,) = of_kind(docs, "PrometheusRule")
    assert rule["spec"]["groups"] == rules["groups"]
    assert rule["metadata"]["labels"]["release"] == "prometheus"
    # switched off, or without the Prometheus operator's API: nothing
    off = render(sets=["monitoring.dashboards.enabled=false", "monitoring.prometheusRule.enabled=false"],
                 api_versions=[MONITORING_API], chart=chart)
    assert not of_kind(off, "ConfigMap") and not of_kind(off, "PrometheusRule")
    assert not of_kind(render(chart=chart), "PrometheusRule")


def test_notes_say_what_was_installed_and_what_to_do_next():
    run = helm("install", "kv", "--namespace", "ml", "--dry-run=client")
    assert run.returncode == 0, run.stderr
    notes = run.stdout.split("NOTES:", 1)[1]
    assert "Deployment kv-kvpilot, 2 replica(s)" in notes
    assert "ghcr.io/kvpilot/kvpilot:" in notes
    # the example goes into the namespace the release watches (its own, by default), and the
    # notes say what an InferenceService elsewhere looks like (issue 43)
    assert "kubectl apply -n ml -f crds/examples/qwen3-0.6b.yaml" in notes and "kubectl get kvis -n ml" in notes
    assert "Only ml is watched" in notes and "kubectl get kvis -A" in notes
    cluster = helm("install", "kv", "--namespace", "ml", "--dry-run=client", "--set", "rbac.scope=cluster")
    assert "in any namespace" in cluster.stdout and "Only " not in cluster.stdout.split("NOTES:", 1)[1]
    assert "kubectl apply --server-side -f crds/" in notes
    assert "Grafana dashboards" in notes


@pytest.mark.parametrize("dockerfile", ["Dockerfile.engine", "Dockerfile.operator", "Dockerfile.router"])
def test_dockerfiles_pass_hadolint(dockerfile):
    run = subprocess.run([tool("hadolint"), "--no-color", str(ROOT / dockerfile)],
                         capture_output=True, text=True, timeout=60)
    assert (run.returncode, run.stdout + run.stderr) == (0, "")


def test_hadolint_does_flag_a_bad_dockerfile(tmp_path):
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM python:latest\nRUN pip install torch\nRUN cd /src\n")
    run = subprocess.run([tool("hadolint"), "--no-color", str(bad)], capture_output=True, text=True,
                         timeout=60)
    assert run.returncode != 0
    for rule in ("DL3007", "DL3013", "DL3042", "DL3003"):
        assert rule in run.stdout, run.stdout


def test_router_off_takes_away_what_only_the_router_needs():
    def rules(docs):
        """The operator's grants: its Roles and ClusterRoles (not the users' aggregated ones)."""
        roles = [d for d in of_kind(docs, "Role") + of_kind(docs, "ClusterRole")
                 if not any(k.startswith("rbac.authorization.k8s.io/aggregate-to")
                            for k in d["metadata"].get("labels") or {})]
        assert roles
        return {(g, r, v) for role in roles for rule in role["rules"] for g in rule["apiGroups"]
                for r in rule["resources"] for v in rule["verbs"]}

    on, off = render(), render([CHART / "ci" / "router-off-values.yaml"])
    only_on = rules(on) - rules(off)
    # the engine pods' own ServiceAccount is created and patched whether or not the router is on;
    # Services are deleted without the router too (a LeaderWorkerSet group's headless Service)
    assert only_on == {(g, r, v) for g, r in (("rbac.authorization.k8s.io", "roles"),
                                               ("rbac.authorization.k8s.io", "rolebindings"))
                       for v in ("get", "create", "patch", "delete")} | {
        ("", "serviceaccounts", "delete"), ("apps", "deployments", "delete"),
        ("monitoring.coreos.com", "podmonitors", "delete"), ("", "pods", "get")}
    assert ("", "services", "delete") in rules(off)
    assert rules(off) <= rules(on)
    assert operator_env(on)["KVPILOT_ROUTER_IMAGE"] == "ghcr.io/kvpilot/router:0.1.17"
    assert "KVPILOT_ROUTER_IMAGE" not in operator_env(off)


def test_the_router_image_is_the_version_the_operator_deploys():
    from kvpilot.operator.settings import OperatorSettings

    text = (ROOT / "Dockerfile.router").read_text()
    version = text.split("ARG VLLM_ROUTER_VERSION=", 1)[1].split()[0]
    assert OperatorSettings().router_image.endswith(":" + version)
    assert '"vllm-router==${VLLM_ROUTER_VERSION}"' in text and 'ENTRYPOINT ["vllm-router"]' in text


def test_the_engine_image_installs_what_the_tests_install():
    text = (ROOT / "Dockerfile.engine").read_text()
    assert '"torch==2.13.0"' in text  # the pin scripts/bootstrap.sh uses
    assert '".[triton,fetch,nixl]"' in text and "ENTRYPOINT [\"kvpilot\", \"serve\"]" in text
    assert "HEALTHCHECK" not in text.replace("No HEALTHCHECK", "")
    assert "USER 1000:1000" in text


def _stages(dockerfile: str) -> list[list[str]]:
    """The instructions of each stage of ``dockerfile`` (continuation lines joined)."""
    text = (ROOT / dockerfile).read_text().replace("\\\n", " ")
    stages: list[list[str]] = []
    for line in text.splitlines():
        line = line.strip()
        if line.startswith("FROM "):
            stages.append([])
        if stages and line and not line.startswith("#"):
            stages[-1].append(line)
    return stages


@pytest.mark.parametrize("dockerfile", ["Dockerfile.engine", "Dockerfile.operator"])
def test_base_images_are_pinned_by_digest(dockerfile):
    import re

    text = (ROOT / dockerfile).read_text()
    (image,) = re.findall(r"^ARG PYTHON_IMAGE=(\S+)$", text, re.MULTILINE)
    assert re.fullmatch(r"python:3\.11-slim@sha256:[0-9a-f]{64}", image), image
    froms = [s[0] for s in _stages(dockerfile)]
    assert froms and all(f.split()[1] == "${PYTHON_IMAGE}" for f in froms), froms
    same = re.findall(r"^ARG PYTHON_IMAGE=(\S+)$", (ROOT / "Dockerfile.operator").read_text(), re.MULTILINE)
    assert same == [image]  # one base for both images


def test_the_engine_runtime_image_has_no_compiler():
    builder, runtime = _stages("Dockerfile.engine")
    assert builder[0].endswith("AS builder") and any("gcc g++" in i for i in builder)
    assert not any(i.startswith("RUN apt-get") for i in runtime)   # nothing installed there
    assert any("python -m kvpilot.kernels.prebuilt /opt/kvpilot/native" in i for i in builder)
    assert {"COPY --from=builder /opt/venv /opt/venv", "COPY --from=builder /opt/kvpilot /opt/kvpilot"} <= set(runtime)
    env = next(i for i in runtime if i.startswith("ENV "))
    for setting in ("KVPILOT_PREBUILT_KERNELS=/opt/kvpilot/native/cpu", "KVPILOT_PREBUILT_TRITON=/opt/kvpilot/native/triton",
                    "TRITON_CACHE_MANAGER=kvpilot.kernels.triton_cache:PrebuiltFirstCacheManager"):
        assert setting in env
    stub = "TRITON_LIBCUDA_PATH=/opt/kvpilot/native/cuda-stub"
    assert stub in env and stub in next(i for i in builder if i.startswith("ENV "))  # Triton's key
    check = next(i for i in runtime if "check_triton_driver" in i)
    assert "command -v" in check   # the build fails if a compiler is there or Triton would need one


def test_the_operator_image_installs_only_hash_locked_dependencies():
    import re

    _, = stages = _stages("Dockerfile.operator")
    runs = [i for i in stages[0] if i.startswith("RUN ")]
    assert runs[0] == "RUN pip install --no-cache-dir --require-hashes -r requirements-operator.lock"
    assert "--no-deps --no-build-isolation --no-index ." in runs[1]
    lock = (ROOT / "requirements-operator.lock").read_text()
    pins = re.findall(r"^([A-Za-z0-9_.-]+)==([^ \\]+) \\$", lock, re.MULTILINE)
    blocks = re.split(r"^(?=[A-Za-z0-9_.-]+==)", lock, flags=re.MULTILINE)[1:]
    assert len(pins) == len(blocks) >= 10
    assert all("--hash=sha256:" in block for block in blocks)
    wanted = {re.split(r"[<>=]", line)[0].lower() for line in (ROOT / "requirements-operator.in").read_text().splitlines()
              if line and not line.startswith("#")}
    assert wanted <= {name.lower() for name, _ in pins}

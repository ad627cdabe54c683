"""The InferenceService contract, one row per field: the CRD and the operator's checks.

``SPEC`` is the schema of ``spec`` (types, bounds, enums, defaults, descriptions and CEL
rules); ``operator/spec.py`` checks every spec with it (``SPEC.check``) before reading the
typed values, and ``crd.inference_service_crd()`` renders it into
``crds/serving.kvpilot.dev_inferenceservices.yaml`` (``scripts/sync_chart_crds.py``
writes the file and fails ``--check`` when it differs). Adding a field is one row here
(plus where the operator reads it); the CRD, its chart copy and the Python validation
follow.

Shared values come from their one source: the GPU catalogue, the KV dtypes and offload
backends of the engine, the endpoint picker's failure modes of the settings.
"""

from __future__ import annotations

import re

from kvpilot.contract.constants import OFFLOAD_BACKENDS
from kvpilot.operator.constants import HTTP_PORT
from kvpilot.operator.contract.engine_fields import (  # noqa: F401 - re-exported
    AUTOSCALING,
    DEFAULT_KV_USAGE_TARGET,
    DEFAULT_PREEMPTION_RATE_TARGET,
    DEFAULT_PROMETHEUS,
    DEFAULT_WAITING_REQUESTS_TARGET,
    ENGINE,
    QUANTITIES,
)
from kvpilot.operator.contract.pools import (
    DEFAULT_DECODE_POLICY,
    DEFAULT_PREFILL_POLICY,
    DISAGGREGATION,
    DISAGGREGATION_RULES,
    PD_ROUTER_POLICIES,
)
from kvpilot.operator.contract.rules import Rule, f, has
from kvpilot.operator.contract.schema import Arr, Bool, Free, Int, Map, Num, Obj, Str
from kvpilot.operator.planner.gpu import gpu_names
from kvpilot.operator.settings import EPP_FAILURE_MODES

ACCESS_MODES = ("ReadWriteMany", "ReadWriteOnce")

# The forms of spec.model.uri, with the parts the operator reads (spec.py matches them).
URI_FORMS = {
    "hf": (r"hf://(?P<repo>[A-Za-z0-9][-A-Za-z0-9_.]*/[A-Za-z0-9][-A-Za-z0-9_.]*)"
           r"(/(?P<file>([-A-Za-z0-9_][-A-Za-z0-9_.]*/)*[-A-Za-z0-9_][-A-Za-z0-9_.]*\.gguf))?"   # no dot segments
           r"(@(?P<rev>[-A-Za-z0-9_./]+))?"),
    "pvc": r"pvc://(?P<claim>[a-z0-9]([-a-z0-9]*[a-z0-9])?)(/(?P<path>\S*))?",
    "s3": r"s3://(?P<bucket>[a-z0-9][-a-z0-9.]*[a-z0-9])(/(?P<prefix>\S*))?",
    "path": r"(?P<image_path>/\S*)",
}
# spec.adapters[].source: the remote forms of spec.model.uri (a repository, an s3 prefix, a claim path).
ADAPTER_URI_FORMS = {scheme: URI_FORMS[scheme] for scheme in ("hf", "s3", "pvc")}
MAX_ADAPTERS = 64
MAX_LORA_RANK = 512   # the engine's slots are this wide at most (vLLM allows up to 512)
# spec.model.tokenizer: a repository (no file part), fetched for its tokenizer files only.
TOKENIZER_URI = r"hf://(?P<repo>[A-Za-z0-9][-A-Za-z0-9_.]*/[A-Za-z0-9][-A-Za-z0-9_.]*)(@(?P<rev>[-A-Za-z0-9_./]+))?"
_UNNAMED = re.compile(r"\(\?P<\w+>")


def _any_of(forms: dict[str, str]) -> str:
    """One anchored pattern matching any of ``forms`` (group names dropped: RE2 and the
    API server's validators need none)."""
    return "^(" + "|".join(_UNNAMED.sub("(", p) for p in forms.values()) + ")$"


def _ref(what: str) -> Obj:
    return Obj(required=("name",), description=what, properties={"name": Str(max_length=253)})


MODEL = Obj(required=("uri",), rules=(
    Rule(~has("credentialsSecretRef") | f("uri").starts_with("hf://") | f("uri").starts_with("s3://"),
         "model.credentialsSecretRef is only used with hf:// and s3:// URIs"),
    Rule(~has("cache") | f("uri").starts_with("hf://"), "model.cache is only used with hf:// URIs"),
), properties={
    "uri": Str(max_length=512, pattern=_any_of(URI_FORMS), expected=(
        "hf://org/name[/file.gguf][@revision], pvc://claim/path, s3://bucket/prefix or an absolute path "
        "in the image"),
        description=(
        "Where the weights come from: hf://org/name[@revision] (downloaded by an init container; "
        "hf://org/name/path/file.gguf[@revision] downloads that one GGUF file only), "
        "pvc://claim/path (mounted read-only; a path ending in .gguf names one GGUF file), "
        "s3://bucket/prefix (downloaded by an init container) or an absolute path inside the image.")),
    "tokenizer": Str(max_length=512, pattern="^" + _UNNAMED.sub("(", TOKENIZER_URI) + "$",
                     expected="hf://org/name[@revision]", description=(
        "A Hub repository whose tokenizer files (tokenizer.json, tokenizer_config.json, chat "
        "template, ...) the engine uses instead of the model's own (--tokenizer); commonly the base "
        "model's repository for a GGUF file. Fetched at each pod start (small files).")),
    "servedName": Str(max_length=128, pattern=r"^[A-Za-z0-9][-A-Za-z0-9_./:]*$", expected="a valid model name",
                      description="The model name clients send in API requests (default: the resource name)."),
    "architecture": Str(max_length=128, description=(
        "A model in the planner's catalogue (`kvpilot plan --help` lists them) whose architecture "
        "describes these weights; needed when the URI does not name one.")),
    "credentialsSecretRef": _ref(
        "A Secret whose keys become environment variables of the download init container (HF_TOKEN; "
        "AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_REGION, ...)."),
    "cache": Obj(description=(
        "Where hf:// weights are kept between pod starts: a claim per service (ReadWriteMany: shared "
        "by all replicas; ReadWriteOnce: one replica, else a claim per pod that lives as long as the "
        "pod). The claim's spec is set when it is created."), properties={
        "enabled": Bool(default=True, description=(
            "false: an emptyDir, filled at every pod start (as without the operator's cache).")),
        "accessMode": Str(enum=ACCESS_MODES, description=(
            "Unset: ReadWriteMany when the storage class is one of the operator's "
            "KVPILOT_RWX_STORAGE_CLASSES.")),
        "storageClassName": Str(max_length=253),
        "sizeGiB": Num(minimum=1, maximum=65536, description="Unset: the planner's checkpoint size + 10% + 2 GiB."),
    }),
})

GPU = Obj(required=("type",), properties={
    "type": Str(enum=tuple(gpu_names()), description="A GPU in the planner's catalogue."),
    "count": Int(minimum=1, maximum=8, default=1, description=(
        "GPUs per pod (tensor parallel size); a replica of several nodes has this many in each.")),
    "perNode": Int(minimum=1, maximum=64, description=(
        "GPUs in one node of this type (default: the planner's catalogue, 8 for data-centre GPUs). "
        "Tensor parallelism stays within a node.")),
    "nodes": Int(minimum=1, maximum=8, description=(
        "Nodes per replica (pipeline stages, one pod each). Unset: one, unless one node cannot hold "
        "the weights and the SLO's KV; above 1 the replica is a LeaderWorkerSet group "
        "(leaderworkerset.x-k8s.io/v1 must be installed).")),
    "nodeSelector": Map(values=Str(max_length=63), max_properties=16, description=(
        "Node labels that mean this GPU type in your cluster (a cloud's accelerator label, say). "
        "Replaces the default match: the operator's KVPILOT_GPU_NODE_LABEL (nvidia.com/gpu.product, "
        "set by NVIDIA GPU feature discovery) equal to one of the type's product names.")),
})

# spec.slo becomes the planner's ServiceLevel: each field's planner name is its snake_case.
SLO = Obj(required=("maxContext", "p95PromptTokens", "p95OutputTokens"), rules=(
    Rule(has("concurrency") | has("requestsPerSecond"), "slo needs a target concurrency, a request rate, or both"),
    Rule(~has("p50PromptTokens") | (f("p50PromptTokens") <= f("p95PromptTokens")),
         "slo.p50PromptTokens must be <= slo.p95PromptTokens"),
    Rule(~has("p50OutputTokens") | (f("p50OutputTokens") <= f("p95OutputTokens")),
         "slo.p50OutputTokens must be <= slo.p95OutputTokens"),
    Rule(f("p95PromptTokens") + f("p95OutputTokens") <= f("maxContext"),
         "slo.p95PromptTokens + slo.p95OutputTokens must fit in slo.maxContext"),
    Rule(~has("sharedPrefixTokens") | (f("sharedPrefixTokens") <= f("p95PromptTokens")),
         "slo.sharedPrefixTokens is part of the prompt and must be <= slo.p95PromptTokens"),
), properties={
    "maxContext": Int(minimum=16, maximum=2097152,
                      description="Longest sequence (prompt + output) served; becomes --max-model-len."),
    "p50PromptTokens": Int(minimum=1),
    "p95PromptTokens": Int(minimum=1),
    "p50OutputTokens": Int(minimum=1),
    "p95OutputTokens": Int(minimum=1),
    "concurrency": Int(minimum=1, maximum=100000, description="Sequences in flight across the service at peak."),
    "requestsPerSecond": Num(minimum=0, exclusive_minimum=True, maximum=100000),
    "ttftP95Ms": Num(minimum=0, exclusive_minimum=True, description="Time-to-first-token target (p95, milliseconds)."),
    "itlP95Ms": Num(minimum=0, exclusive_minimum=True, description="Inter-token-latency target (p95, milliseconds)."),
    "sharedPrefixTokens": Int(minimum=0, description=(
        "Tokens of a prompt prefix shared by many requests (system prompt, few-shot).")),
    "distinctPrefixes": Int(minimum=1, maximum=1000000, description="How many different shared prefixes are in use."),
    "allowFp8KvCache": Bool(default=False, description="Let the planner choose an FP8 KV cache when capacity needs it."),
})

OFFLOAD = Obj(description="KV offload tiers that extend the prefix cache beyond GPU memory.", rules=(
    Rule(f("enabled") | (~has("cpuGiB") & ~has("disk") & ~has("lmcache")),
         "offload.cpuGiB, offload.disk and offload.lmcache need offload.enabled=true"),
    Rule(~has("lmcache") | (f("backend") == "lmcache"), "offload.lmcache needs offload.backend=lmcache"),
), properties={
    "enabled": Bool(default=False),
    "backend": Str(enum=OFFLOAD_BACKENDS, default="native"),
    "cpuGiB": Num(minimum=0, exclusive_minimum=True, maximum=4096,
                  description="Host-memory KV tier per replica (GiB); unset = the planner's size."),
    "disk": Obj(description="A disk KV tier on a PersistentVolumeClaim (one per replica).", properties={
        "sizeGiB": Num(minimum=1, maximum=65536, description="Disk KV tier per replica (GiB); unset = the planner's size."),
        "storageClassName": Str(max_length=253),
    }),
    "lmcache": Obj(properties={
        "remoteUrl": Str(max_length=512, pattern=r"^lm://[^\s/:]+:[0-9]+$", expected="lm://host:port",
                         description="An `lmcache server` shared by all replicas (lm://host:port)."),
        "chunkSize": Int(minimum=16, maximum=8192),
    }),
})

# spec.adapters[]: LoRA adapters on the base model. On the InferenceService rather than a kind
# of their own: an adapter lives exactly as long as the engine pods of its base model (they
# fetch it, load it, and reload it on every restart), and one object is one GitOps unit.
ADAPTERS = Arr(max_items=MAX_ADAPTERS, map_keys=("name",), description=(
    "LoRA adapters served on the base model (each a PEFT checkpoint: adapter_config.json + "
    "adapter_model.safetensors). Clients select one with the OpenAI `model` field; status.adapters "
    "says where each stands."), items=Obj(required=("name", "source"), properties={
    "name": Str(max_length=63, pattern=r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$", expected="a DNS-1123 label",
                description="The model name clients send for this adapter; unique in the service."),
    "source": Str(max_length=512, pattern=_any_of(ADAPTER_URI_FORMS),
                  expected="hf://org/name[@revision], s3://bucket/prefix or pvc://claim/path", description=(
        "Where the adapter comes from, as spec.model.uri: hf://org/name[@revision] and s3://bucket/prefix "
        "are fetched into the model cache by an init container (once per revision), pvc://claim/path is "
        "mounted read-only.")),
    "rank": Int(minimum=1, maximum=MAX_LORA_RANK, description=(
        "The adapter's rank (r), if known: checked against lora.maxLoraRank and used for its default.")),
}))

LORA = Obj(description="LoRA serving limits (--max-loras, --max-lora-rank, --max-cpu-loras).", rules=(
    Rule(~has("maxCpuLoras") | ~has("maxLoras") | (f("maxCpuLoras") >= f("maxLoras")),
         "lora.maxCpuLoras must be >= lora.maxLoras"),
), properties={
    "maxLoras": Int(minimum=1, maximum=MAX_ADAPTERS, description=(
        "Adapters in one batch (device slots; their memory comes out of the KV cache). Unset: the "
        "number of adapters, at most 4.")),
    "maxLoraRank": Int(minimum=1, maximum=MAX_LORA_RANK, description=(
        "The largest rank served (slots are this wide). Unset: the largest declared rank, else 16.")),
    "maxCpuLoras": Int(minimum=1, maximum=1024, description=(
        "Adapters kept in host memory. Unset: every adapter of the spec.")),
})

ROUTERS = ("gateway", "vllm-router")   # spec.routing.router
ROUTER_POLICIES = ("kv_aware", "cache_aware", "round_robin", "power_of_two", "consistent_hash")

ROUTING = Obj(description="Routing to the engine pods: the Gateway API inference extension, or vLLM's router.", properties={
    "router": Str(enum=ROUTERS, description=(
        "Prefix-aware routing: gateway (the InferencePool, with the pod labels and KV events llm-d's "
        "endpoint picker reads) or vllm-router (vLLM's router in front of the engines); absent: "
        "no KV events.")),
    "vllmRouter": Obj(description="vLLM's router (router: vllm-router).", rules=(
        Rule(~has("sessionAffinityTTLSeconds") | (f("policy") == "kv_aware"),
             "routing.vllmRouter.sessionAffinityTTLSeconds applies to the kv_aware policy only "
             "(consistent_hash always keys on the session)"),
    ), properties={
        "policy": Str(enum=ROUTER_POLICIES, default="kv_aware", description=(
            "The router's policy; kv_aware is fed by every engine pod's KV events. P/D mode uses "
            "prefillPolicy and decodePolicy instead.")),
        "replicas": Int(minimum=1, maximum=100, default=2),
        "prefillPolicy": Str(enum=PD_ROUTER_POLICIES, description=(
            f"P/D mode (spec.disaggregation): the policy among the prefill pods (unset: {DEFAULT_PREFILL_POLICY}); "
            "the router's --prefill-policy. kv_aware is not offered: it needs static KV event sources.")),
        "decodePolicy": Str(enum=PD_ROUTER_POLICIES, description=(
            f"P/D mode: the policy among the decode pods (unset: {DEFAULT_DECODE_POLICY}); --decode-policy.")),
        "sessionAffinityTTLSeconds": Int(minimum=1, maximum=31_536_000, description=(
            "kv_aware only: keep a session's requests (the X-Session-ID header) on the engine pod "
            "its first request chose while the session has been idle less than this many seconds "
            "(the router's --kv-aware-session-affinity-ttl-secs); unset: every request is routed "
            "on the pods' KV events alone.")),
    }),
    "inferencePool": Obj(description=(
        "An InferencePool of the engine pods, created when the cluster serves "
        "inference.networking.k8s.io/v1 (the Gateway API inference extension)."), properties={
        "enabled": Bool(default=True),
        "endpointPickerRef": Obj(required=("name",), description=(
            "The endpoint picker Service that routes requests among the pods (default: the operator's "
            "KVPILOT_EPP_NAME, KVPILOT_EPP_PORT, KVPILOT_EPP_FAILURE_MODE)."), properties={
            "name": Str(min_length=1, max_length=253),
            "port": Int(minimum=1, maximum=65535),
            "failureMode": Str(enum=EPP_FAILURE_MODES),
        }),
    }),
})

SPEC = Obj(required=("model", "gpu", "slo"), rules=(
    Rule(~has("engine") | ~has("engine.maxNumBatchedTokens") | ~has("engine.maxNumSeqs")
         | (f("engine.maxNumBatchedTokens") >= f("engine.maxNumSeqs")),
         "engine.maxNumBatchedTokens must be >= engine.maxNumSeqs (every running sequence needs a token per step)"),
    Rule(~has("adapters") | (f("gpu.count") == 1),
         "adapters are served on one GPU per pod: gpu.count must be 1"),
    *DISAGGREGATION_RULES,
), properties={
    "model": MODEL,
    "gpu": GPU,
    "slo": SLO,
    "engine": ENGINE,
    "offload": OFFLOAD,
    "adapters": ADAPTERS,
    "lora": LORA,
    "replicas": Int(minimum=0, maximum=1000, description="Replicas while autoscaling is off (unset = the planner's count)."),
    "autoscaling": AUTOSCALING,
    "image": Str(max_length=512, description="Engine image (default: the operator's KVPILOT_ENGINE_IMAGE)."),
    "imagePullPolicy": Str(enum=("Always", "IfNotPresent", "Never")),
    "resources": Obj(description="Extra requests/limits for the engine container; nvidia.com/gpu is always gpu.count.",
                     properties={"limits": QUANTITIES, "requests": QUANTITIES}),
    "env": Arr(max_items=128, items=Obj(required=("name",), properties={
        "name": Str(min_length=1, max_length=256), "value": Str(), "valueFrom": Free()})),
    "nodeSelector": Map(values=Str()),
    "tolerations": Arr(max_items=64, items=Obj(properties={
        "key": Str(), "operator": Str(enum=("Exists", "Equal")), "value": Str(),
        "effect": Str(enum=("NoSchedule", "PreferNoSchedule", "NoExecute")), "tolerationSeconds": Int()})),
    "affinity": Free(description=(
        "A pod Affinity for the engine pods. The GPU-type match is added to each of its required node "
        "selector terms; pod (anti-)affinity is used as given.")),
    "port": Int(minimum=1024, maximum=65535, default=HTTP_PORT,
                description="The port the engine serves its API and metrics on (pods run as non-root)."),
    "routing": ROUTING,
    "disaggregation": DISAGGREGATION,
    "serviceAccountName": Str(max_length=253, description=(
        "The engine pods' account (default: NAME-engine, which the operator creates, without an "
        "API token); others only where the platform allows them.")),
    # security: the platform restricts which names may be declared (kvpilot.operator.security)
    "envSecrets": Arr(max_items=32, items=Str(min_length=1, max_length=253), description=(
        "The Secrets that env may read (valueFrom.secretKeyRef); env reading any other Secret is "
        "refused, as are Secrets the platform does not allow.")),
    "apiKeySecretRef": Obj(required=("name",), description=(
        "The API key clients must send; given to the engine as KVPILOT_API_KEY."), properties={
        "name": Str(max_length=253), "key": Str(max_length=253, default="api-key")}),
})

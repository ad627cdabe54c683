"""The InferenceService ``status`` schema: what the operator writes, declared so that the
API server keeps it (fields a CRD does not declare are pruned).

``status.plan`` holds ``spec_to_plan.STATUS_FIELDS`` (camelCase) plus the generation, what
it was planned for (``scaling``), the serve flags and the KV estimate (with
``spec.disaggregation``: the decode pool's, and ``status.plan.disaggregation`` both pools');
tests/operator/test_crd.py keeps them equal.
"""

from __future__ import annotations

from kvpilot.operator.constants import CONDITION_TYPES
from kvpilot.operator.contract.schema import Arr, Bool, Int, Map, Num, Obj, Str


def _strings() -> Arr:
    return Arr(items=Str())


CONDITION = Obj(required=("type", "status"), properties={
    "type": Str(enum=CONDITION_TYPES),
    "status": Str(enum=("True", "False", "Unknown")),
    "reason": Str(),
    "message": Str(),
    "lastTransitionTime": Str(format="date-time"),
    "observedGeneration": Int(int64=True),
})

PLAN_ERROR = Obj(description="Why the latest spec could not be planned (cleared once it can).", properties={
    "generation": Int(int64=True),
    "reason": Str(),
    "message": Str(),
    "bindingConstraint": Str(),
    "suggestions": _strings(),
})

OBSERVED = Obj(description=(
    "What the engine pods running the plan report about their KV cache, for the pod furthest from the "
    "plan (absent until one was read); SizingDrift compares it with the plan."), properties={
    "pods": Int(description="Engine pods read (ready, running this plan)."),
    "pod": Str(description="The pod furthest from the plan, whose figures these are."),
    "numGpuBlocks": Int(),
    "blockSize": Int(),
    "cacheDtype": Str(),
    "tokenCapacity": Int(int64=True),
    "profiledKvBytes": Int(int64=True, description=(
        "What start-up profiling left for the KV cache (engines that profile a GPU).")),
    "comparedOn": Str(enum=("numGpuBlocks", "profiledKvBytes"), description=(
        "The comparison relativeError is about: the profiled KV memory against the plan's kvEstimateBytes "
        "where engines export it, else the blocks against numGpuBlocks.")),
    "relativeError": Num(description="observed / planned - 1."),
})

POOL_PLAN = Obj(description="One pool's plan: what its pods were given.", properties={
    "replicas": Int(description="Replicas the pool was given at this plan (the planner's, the pinned or the "
                                "autoscaler's starting count)."),
    "plannedReplicas": Int(description="The replicas the planner's ratio asks for."),
    "maxNumSeqs": Int(),
    "maxNumBatchedTokens": Int(),
    "kvTokenCapacity": Int(int64=True),
    "numGpuBlocks": Int(),
    "kvCacheMemoryBytes": Int(int64=True),
    "bindingConstraint": Str(),
    "serveArgs": _strings(),
})

PLAN_POOLS = Obj(description=(
    "spec.disaggregation: both pools and the prefill:decode ratio the planner derived from spec.slo "
    "(status.plan's other fields are the decode pool's plan)."), properties={
    "ratio": Str(description="Prefill:decode replicas the planner asks for (3:2)."),
    "kvConnector": Str(),
    "bindingConstraint": Str(),
    "prefill": POOL_PLAN,
    "decode": POOL_PLAN,
    "estimates": Map(values=Num(), description="The ratio's figures (milliseconds, tokens/s, requests/s)."),
    "derivation": _strings(),
})

PLAN = Obj(description="What the running pods were given, with the planner's derivation.", properties={
    "generation": Int(int64=True, description="The spec generation this plan was made for."),
    "plannedFor": Obj(description=(
        "What the plan was made from: scaling (spec.replicas alone) keeps it; any other spec change, or a new "
        "serving.kvpilot.dev/replan annotation, re-plans."), properties={
        "specDigest": Str(description="Digest of the spec without replicas, and of the replan annotation."),
        "replicas": Int(description="The replica count the planner was given (absent: its own choice)."),
    }),
    "model": Str(),
    "gpu": Str(),
    "tensorParallelSize": Int(),
    "pipelineParallelSize": Int(description="Nodes (pipeline stages) per replica; above 1 a LeaderWorkerSet group."),
    "gpusPerNode": Int(),
    "replicas": Int(),
    "kvCacheDtype": Str(),
    "kvDtypeBytes": Int(),
    "kvBytesPerToken": Int(),
    "gpuMemoryUtilization": Num(),
    "kvCacheMemoryBytes": Int(int64=True),
    "kvEstimateBytes": Int(int64=True, description=(
        "What the planner expects start-up profiling to leave for the KV cache per GPU.")),
    "numGpuBlocks": Int(),
    "blockSize": Int(),
    "kvTokenCapacity": Int(int64=True),
    "maxModelLen": Int(),
    "maxNumSeqs": Int(),
    "maxNumBatchedTokens": Int(),
    "enablePrefixCaching": Bool(),
    "residentPrefixTokens": Int(int64=True),
    "cpuOffloadGib": Num(),
    "diskOffloadGib": Num(),
    "offloadBackend": Str(),
    "podMemoryGib": Num(),
    "shmGib": Num(),
    "bindingConstraint": Str(),
    "bindingDetail": Str(),
    "estimates": Map(values=Num(), description="Roofline estimates (milliseconds, requests/s) behind the plan."),
    "limits": Map(values=Int(), description="max_num_seqs allowed by each constraint."),
    "serveArgs": _strings(),
    "derivation": _strings(),
    "warnings": _strings(),
    "disaggregation": PLAN_POOLS,
})

ADAPTER_PHASES = ("Pending", "Loading", "Ready", "Failed")
ADAPTER = Obj(required=("name", "phase"), properties={
    "name": Str(),
    "source": Str(description="The spec.adapters[] source this entry is about."),
    "phase": Str(enum=ADAPTER_PHASES, description=(
        "Pending (no ready engine pod yet), Loading (on some ready pods), Ready (on every ready pod; "
        "then loaded at each pod start, before the pod is ready), Failed (refused by the engine after "
        "the operator's retries; tried again when its source changes).")),
    "reason": Str(),
    "readyPods": Int(description="Ready engine pods serving it."),
    "attempts": Int(description="Loads tried by the operator."),
    "verified": Bool(description=(
        "Seen to load from this source: passed to the engine at each pod start (--lora-modules), "
        "also while no ready pod serves it; false once Failed.")),
})

POOL_STATE = Obj(properties={
    "replicas": Int(description="Pods of the pool's Deployment."),
    "readyReplicas": Int(),
    "desiredReplicas": Int(description="The Deployment's spec.replicas (an autoscaler's, where one scales it)."),
})

PREFIX_CACHE = Obj(description=(
    "The engine pods' prefix-cache hit rate over the last window (their counters' increase between "
    "two reads), and when it fell by 0.1 or more from the window before, the reason that counted "
    "the most uncached prompt tokens (kvpilot:prefix_cache_miss_tokens_total)."), properties={
    "hitRate": Num(description="Hit tokens / looked-up prompt tokens in the window."),
    "previousHitRate": Num(description="The window before's."),
    "queriedTokens": Int(int64=True, description="Prompt tokens looked up in the window."),
    "windowSeconds": Num(),
    "topMissReason": Str(description="When the hit rate dropped: the miss reason with the most tokens."),
    "topMissReasonShare": Num(description="Its share of the window's uncached prompt tokens."),
    "message": Str(),
})

STATUS = Obj(properties={
    "observedGeneration": Int(int64=True),
    "replicas": Int(),
    "readyReplicas": Int(),
    "selector": Str(),
    "endpoint": Str(),
    "conditions": Arr(items=CONDITION, map_keys=("type",)),
    "planError": PLAN_ERROR,
    "observed": OBSERVED,
    "prefixCache": PREFIX_CACHE,
    "plan": PLAN,
    "adapters": Arr(items=ADAPTER, map_keys=("name",), description="Each spec.adapters[] entry's state."),
    "adaptersReady": Str(description="Ready / declared adapters (3/4)."),
    "disaggregation": Obj(description="spec.disaggregation: each pool's replicas (replicas and readyReplicas "
                                      "above are both pools together).",
                          properties={"prefill": POOL_STATE, "decode": POOL_STATE}),
})

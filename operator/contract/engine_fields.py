"""Fields the InferenceService shares between its parts: the engine settings (``spec.engine``,
and each disaggregated pool's own, ``contract.pools``), resource quantities, and the
autoscaler (``spec.autoscaling``; a pool's takes its modes, targets and defaults)."""

from __future__ import annotations

from kvpilot.contract.constants import KV_CACHE_DTYPES
from kvpilot.contract.speculative import SPEC_METHODS
from kvpilot.operator.contract.rules import Rule, each, f, has
from kvpilot.operator.contract.schema import Arr, Bool, Int, IntOrStr, Map, Num, Obj, Str

BLOCK_SIZES = (8, 16, 32, 64, 128)
AUTOSCALING_MODES = ("none", "hpa", "keda")
DEFAULT_PROMETHEUS = "http://prometheus-operated.monitoring.svc:9090"
# The composite scale signal's defaults: ~5 queued requests per replica is the usual
# vLLM queue-depth target; one preemption per 10 s per pod means the KV cache thrashes.
DEFAULT_WAITING_REQUESTS_TARGET = 5
DEFAULT_PREEMPTION_RATE_TARGET = 0.1
DEFAULT_KV_USAGE_TARGET = 0.7

QUANTITIES = Map(values=IntOrStr())

# spec.engine.speculative: vLLM's --speculative-config fields (camelCase here); passed to the
# engine as its JSON, and a draft model's or EAGLE head's weights and KV sized by the planner.
SPECULATIVE = Obj(description=(
    "Speculative decoding (kvpilot serve --speculative-config, vLLM's fields): drafts proposed by "
    "n-gram lookup, a draft model or an EAGLE head, verified by the model. `model` is the draft's "
    "checkpoint path in the engine container; the planner sizes a draft model by its catalogue "
    "preset (the path's last parts) and an EAGLE head as one layer of the model."), rules=(
    Rule((f("method") == "ngram") | has("model"), "engine.speculative.model is required for a draft model or EAGLE head"),
    Rule(~(f("method") == "ngram") | ~has("model"), "engine.speculative: the ngram method takes no model"),
), required=("method", "numSpeculativeTokens"), properties={
    "method": Str(enum=SPEC_METHODS),
    "numSpeculativeTokens": Int(minimum=1, maximum=32),
    "promptLookupMin": Int(minimum=1),
    "promptLookupMax": Int(minimum=1),
    "model": Str(max_length=512),
    "draftTensorParallelSize": Int(enum=(1,)),
    "disableByBatchSize": Int(minimum=2),
})

# spec.engine's settings become the planner's Overrides (snake_case names); extraArgs the command line.
ENGINE = Obj(description="Explicit engine settings; each wins over the planner and is checked by it.", properties={
    "gpuMemoryUtilization": Num(minimum=0.05, maximum=0.99),
    "maxNumSeqs": Int(minimum=1, maximum=65536),
    "maxNumBatchedTokens": Int(minimum=1, maximum=4194304),
    "kvCacheDtype": Str(enum=KV_CACHE_DTYPES),
    "blockSize": Int(enum=BLOCK_SIZES),
    "enablePrefixCaching": Bool(),
    "kvSafetyMargin": Num(minimum=0, maximum=0.49, description=(
        "Plan the KV cache this fraction below the planner's calibrated estimate (default 0.03).")),
    "kvCacheMemoryBytes": Int(minimum=1, int64=True, description=(
        "Pin the KV cache size per GPU (bytes; --kv-cache-memory-bytes) instead of what the planner "
        "leaves for it: for a GPU shared with other processes, or a small cache. The planner checks "
        "that it fits and sizes max_num_seqs for it.")),
    "speculative": SPECULATIVE,
    "extraArgs": Arr(items=Str(max_length=256), max_items=32,
                     description="Appended verbatim to the `kvpilot serve` command line.",
                     rules=(Rule(each(lambda a: ~a.starts_with("--api-key")),
                                 "pass the API key through spec.apiKeySecretRef, never on the command line"),)),
})

AUTOSCALING = Obj(description=(
    "Scale on a composite signal: the autoscaler follows whichever of KV cache usage, queued requests "
    "and preemptions per pod asks for the most replicas."), rules=(
    Rule((f("mode") == "none") | has("maxReplicas"),
         "autoscaling.maxReplicas is required when autoscaling.mode is hpa or keda"),
    Rule(~has("maxReplicas") | (f("minReplicas") <= f("maxReplicas")),
         "autoscaling.minReplicas must be <= autoscaling.maxReplicas"),
    Rule((f("minReplicas") >= 1) | (f("mode") == "keda"),
         "autoscaling.minReplicas 0 (scale to zero) needs autoscaling.mode keda"),
), properties={
    "mode": Str(enum=AUTOSCALING_MODES, default="none"),
    "minReplicas": Int(minimum=0, maximum=1000, default=1,
                       description="Fewest replicas; 0 (scale to zero when idle) with mode keda only."),
    "maxReplicas": Int(minimum=1, maximum=1000),
    "kvCacheUsageTarget": Num(minimum=0.05, maximum=1, default=DEFAULT_KV_USAGE_TARGET,
                              description="Average KV cache usage (0..1) per pod that the autoscaler aims for."),
    "waitingRequestsTarget": Int(minimum=1, default=DEFAULT_WAITING_REQUESTS_TARGET,
                                 description="Average queued requests per pod that the autoscaler aims for."),
    "preemptionRateTarget": Num(minimum=0, exclusive_minimum=True, default=DEFAULT_PREEMPTION_RATE_TARGET,
                                description=("Average preemptions per second per pod (KV cache thrash) "
                                             "that the autoscaler aims for.")),
    "prometheusServerAddress": Str(max_length=512, default=DEFAULT_PROMETHEUS,
                                   description="Prometheus that KEDA's triggers query (mode keda)."),
})

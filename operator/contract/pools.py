"""``spec.disaggregation``: prefill and decode on separate pools of engine pods.

Each pool is a Deployment of ``kvpilot serve`` replicas started with the matching
``--kv-transfer-config`` (prefill: ``kv_producer``, decode: ``kv_consumer``) and labelled
``llm-d.ai/role: prefill|decode``; vLLM's router (``spec.routing.router: vllm-router``) in
P/D mode sends each request to a prefill pod, then to a decode pod, which pulls the
prompt's KV blocks. The planner sizes the prefill:decode ratio from ``spec.slo``; a pool's
``replicas`` or its autoscaler (prefill on queue depth and TTFT, decode on KV usage and
preemptions) decide instead where set.

The rules that tie ``disaggregation`` to the rest of the spec (no ``spec.replicas``, the
router required, ...) are on the spec (``inference_service.SPEC``): ``DISAGGREGATION_RULES``.
"""

from __future__ import annotations

from kvpilot.contract.kv_transfer import (
    DEFAULT_NIXL_SIDE_CHANNEL_PORT,
    NIXL_CONNECTOR,
    PD_CONNECTORS,
)
from kvpilot.operator.contract.engine_fields import AUTOSCALING, ENGINE, QUANTITIES
from kvpilot.operator.contract.rules import Rule, f, has
from kvpilot.operator.contract.schema import Int, Obj, Str

# vllm-router's P/D policies that work with Kubernetes discovery (kv_aware needs static KV
# event sources per prefill URL, which discovered pods do not have).
PD_ROUTER_POLICIES = ("cache_aware", "round_robin", "power_of_two", "consistent_hash")
DEFAULT_PREFILL_POLICY = "cache_aware"     # prompts sharing a prefix on the replica that has it
DEFAULT_DECODE_POLICY = "power_of_two"     # the less loaded of two decode replicas
# Both pools lay out KV blocks alike (the transfer copies them block for block): these stay
# the service's (spec.engine), not a pool's.
SERVICE_WIDE_ENGINE = ("blockSize", "kvCacheDtype")

POOL_ENGINE = Obj(description=(
    "This pool's engine settings, over spec.engine's (extraArgs are appended to spec.engine's); "
    "blockSize and kvCacheDtype are the service's, alike on both pools."), rules=(
    Rule(~has("maxNumBatchedTokens") | ~has("maxNumSeqs") | (f("maxNumBatchedTokens") >= f("maxNumSeqs")),
         "a pool's engine.maxNumBatchedTokens must be >= its engine.maxNumSeqs"),
), properties={name: sub for name, sub in ENGINE.properties.items() if name not in SERVICE_WIDE_ENGINE})


def _autoscaling(role: str, signals: tuple[str, ...], what: str) -> Obj:
    """A pool's autoscaler: spec.autoscaling's mode, bounds (at least one replica) and the
    targets of the pool's own ``signals``."""
    fields = AUTOSCALING.properties
    return Obj(description=f"An autoscaler on the {role} pool alone: {what}.", rules=(
        Rule((f("mode") == "none") | has("maxReplicas"),
             f"disaggregation.{role}.autoscaling.maxReplicas is required when its mode is hpa or keda"),
        Rule(~has("maxReplicas") | (f("minReplicas") <= f("maxReplicas")),
             f"disaggregation.{role}.autoscaling.minReplicas must be <= its maxReplicas"),
    ), properties={
        "mode": fields["mode"],
        "minReplicas": Int(minimum=1, maximum=1000, default=1, description=(
            "Fewest replicas (at least one: a pool at zero fails every request)")),
        "maxReplicas": fields["maxReplicas"],
        **{name: fields[name] for name in signals},
        "prometheusServerAddress": fields["prometheusServerAddress"],
    })


def _pool(role: str, autoscaling: Obj, what: str) -> Obj:
    return Obj(description=what, rules=(
        Rule(~has("replicas") | ~has("autoscaling") | (f("autoscaling.mode") == "none"),
             f"disaggregation.{role}.replicas is not used while its autoscaling.mode is hpa or keda "
             "(the autoscaler owns the count): set one of them"),
    ), properties={
        "replicas": Int(minimum=1, maximum=1000, description=(
            f"{role.capitalize()} replicas while the pool's autoscaling is off (unset: the planner's count, "
            "status.plan.disaggregation)")),
        "resources": Obj(description=f"Extra requests/limits for the {role} pool's engine container, over "
                                     "spec.resources.", properties={"limits": QUANTITIES, "requests": QUANTITIES}),
        "engine": POOL_ENGINE,
        "autoscaling": autoscaling,
    })


PREFILL_POOL = _pool("prefill", _autoscaling("prefill", ("waitingRequestsTarget",), (
    "queued requests per pod, and the pool's p95 time to first token against spec.slo.ttftP95Ms when the "
    "SLO declares one")), "The replicas that compute prompts (kv_producer) and hand their KV blocks out.")

DECODE_POOL = _pool("decode", _autoscaling("decode", ("kvCacheUsageTarget", "preemptionRateTarget"),
                                           "KV cache usage and preemptions per pod"),
                    "The replicas that pull the prompts' KV blocks (kv_consumer) and stream the output.")

DISAGGREGATION = Obj(required=("prefill", "decode"), description=(
    "Prefill and decode on separate pools (vLLM's disaggregated serving): a prefill pool computes "
    "each prompt and a decode pool, which pulls the prompt's KV blocks over NIXL, streams the "
    "output, behind vLLM's router in P/D mode (routing.router: vllm-router). The planner sizes the "
    "prefill:decode ratio from spec.slo (status.plan.disaggregation)."), properties={
    "prefill": PREFILL_POOL,
    "decode": DECODE_POOL,
    "kvConnector": Str(enum=tuple(PD_CONNECTORS), default=NIXL_CONNECTOR, description=(
        "The engines' KV connector (--kv-transfer-config) and the router's --kv-connector.")),
    "sideChannelPort": Int(minimum=1024, maximum=65535, default=DEFAULT_NIXL_SIDE_CHANNEL_PORT, description=(
        "The port of NIXL's handshake side channel on every engine pod (VLLM_NIXL_SIDE_CHANNEL_PORT).")),
})


def _unset(path: str):
    """``path`` (dotted, below spec) is absent, its parents absent included."""
    parts = path.split(".")
    expr = ~has(parts[0])
    for i in range(1, len(parts)):
        expr = expr | ~has(".".join(parts[:i + 1]))
    return expr


DISAGGREGATION_RULES = (
    Rule(~has("disaggregation") | (~has("replicas") & (~has("autoscaling") | (f("autoscaling.mode") == "none"))),
         "spec.disaggregation sizes its two pools: set disaggregation.prefill/decode replicas or autoscaling "
         "instead of spec.replicas and spec.autoscaling"),
    Rule(~has("disaggregation") | (has("routing") & has("routing.router") & (f("routing.router") == "vllm-router")),
         "spec.disaggregation needs routing.router: vllm-router (vLLM's router in P/D mode sends each request "
         "to a prefill pod, then to a decode pod)"),
    Rule(has("disaggregation") | (_unset("routing.vllmRouter.prefillPolicy")
                                  & _unset("routing.vllmRouter.decodePolicy")),
         "routing.vllmRouter.prefillPolicy and decodePolicy are the P/D router's: they need spec.disaggregation"),
    Rule(~has("disaggregation") | _unset("routing.vllmRouter.sessionAffinityTTLSeconds"),
         "routing.vllmRouter.sessionAffinityTTLSeconds is kv_aware's session affinity, not used in P/D mode"),
    Rule(~has("disaggregation") | ~has("adapters"),
         "LoRA adapters are not served on disaggregated pools yet: remove spec.adapters or spec.disaggregation"),
    Rule(~has("disaggregation") | ~has("offload") | (f("offload.enabled") == False),  # noqa: E712 - a CEL literal
         "KV offload tiers are not combined with spec.disaggregation yet: set offload.enabled false"),
    Rule(~has("disaggregation") | (_unset("engine.speculative") & _unset("disaggregation.prefill.engine.speculative")
                                   & _unset("disaggregation.decode.engine.speculative")),
         "speculative decoding is not combined with spec.disaggregation yet (the engine refuses NIXL with "
         "--speculative-config): remove engine.speculative"),
    Rule(~has("disaggregation") | _unset("gpu.nodes") | (f("gpu.nodes") == 1),
         "a disaggregated pool's replica is one node: gpu.nodes must be 1 (or unset)"),
)

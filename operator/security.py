"""What an InferenceService may make the operator do, and the fence around its engine pods.

Whoever may create an InferenceService must not get more through the operator than the
platform team allows (the operator is a deputy with rights to create Deployments):

- ``SpecPolicy``: the images a spec may name, the service accounts it may run under and
  the Secrets it may declare. ``check_spec`` refuses a spec that goes beyond them; the
  reconcile pass then creates nothing and says why (``Planned=False``, reason
  ``ImageNotAllowed`` / ``ServiceAccountNotAllowed`` / ``SecretNotAllowed`` /
  ``UndeclaredSecret``, and a Warning Event). The chart's ValidatingAdmissionPolicy
  (``charts/kvpilot/templates/admission-policy.yaml``) applies the same rules at the API
  server, from the same values, so they hold while the operator is down.
- ``NetworkFence``: the NetworkPolicy each service's engine pods get
  (``resources.network_policy``): who may reach the engine port, where the pods may go.

Patterns are globs in which only ``*`` (any run of characters, ``/`` included) and ``?``
(one character) are special; ``glob_regex`` is the one translation, used here and (as
the same rule in Helm) by the admission policy.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kvpilot.operator.contract.schema import SpecError

if TYPE_CHECKING:   # settings imports this module, and the spec imports the settings
    from kvpilot.operator.spec import InferenceServiceSpec

DEFAULT_CLIENT_LABELS = {"serving.kvpilot.dev/client": "true"}
DEFAULT_DNS_LABELS = {"k8s-app": "kube-dns"}   # CoreDNS and kube-dns both carry it


def glob_regex(pattern: str) -> str:
    """The anchored regular expression of a glob (``*`` any run, ``?`` one character)."""
    return "^" + "".join(".*" if ch == "*" else "." if ch == "?" else re.escape(ch) for ch in pattern) + "$"


def matches(value: str, patterns: tuple[str, ...]) -> bool:
    return any(re.match(glob_regex(p), value) for p in patterns)


def engine_service_account(name: str) -> str:
    """The service account the operator creates for service ``name`` (no API token)."""
    return f"{name}-engine"


class PolicyViolation(SpecError):
    """A spec the platform's policy refuses; ``reason`` is the Planned condition's reason."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


@dataclass(frozen=True, slots=True)
class SpecPolicy:
    """The platform team's limits on what a spec may ask for.

    Args:
        allowed_images: globs of images ``spec.image`` may name; empty: only the
            operator's engine image (``KVPILOT_ENGINE_IMAGE``).
        allowed_service_accounts: names ``spec.serviceAccountName`` may take besides the
            per-service account the operator creates (``engine_service_account``).
        allowed_secrets: globs of Secret names a spec may declare (``spec.envSecrets``,
            ``spec.model.credentialsSecretRef``, ``spec.apiKeySecretRef``); ``env`` may
            read only declared Secrets.
    """

    allowed_images: tuple[str, ...] = ()
    allowed_service_accounts: tuple[str, ...] = ()
    allowed_secrets: tuple[str, ...] = ("*",)

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> SpecPolicy:
        secrets = _names(env, "KVPILOT_ALLOWED_SECRETS")
        return cls(_names(env, "KVPILOT_ALLOWED_IMAGES"), _names(env, "KVPILOT_ALLOWED_SERVICE_ACCOUNTS"),
                   secrets if "KVPILOT_ALLOWED_SECRETS" in env else cls().allowed_secrets)


def _secret_refs(spec: InferenceServiceSpec) -> list[str]:
    """The Secrets ``spec.env`` reads (``valueFrom.secretKeyRef``)."""
    out = []
    for entry in spec.env:
        ref = (entry.get("valueFrom") or {}).get("secretKeyRef")
        if ref is not None:
            name = ref.get("name") if isinstance(ref, Mapping) else None
            if not isinstance(name, str) or not name:
                raise PolicyViolation("UndeclaredSecret", f"spec.env {entry.get('name')!r}: secretKeyRef "
                                                          "needs the name of a Secret in spec.envSecrets")
            out.append(name)
    return out


def check_spec(spec: InferenceServiceSpec, name: str, policy: SpecPolicy, engine_image: str) -> None:
    """Refuse ``spec`` (of the service ``name``) where it goes beyond ``policy``.

    Raises:
        PolicyViolation: naming the field, the value and what is allowed.
    """
    image = spec.image
    if image is not None and image != engine_image and not matches(image, policy.allowed_images):
        allowed = ", ".join(policy.allowed_images) or f"only the operator's engine image {engine_image}"
        raise PolicyViolation("ImageNotAllowed", f"spec.image {image!r} is not allowed (allowed: {allowed})")
    account = spec.service_account_name
    if account is not None and account != engine_service_account(name) \
            and account not in policy.allowed_service_accounts:
        allowed = ", ".join([engine_service_account(name), *policy.allowed_service_accounts])
        raise PolicyViolation("ServiceAccountNotAllowed",
                              f"spec.serviceAccountName {account!r} is not allowed (allowed: {allowed})")
    declared = {"spec.envSecrets": list(spec.env_secrets),
                "spec.model.credentialsSecretRef": [spec.model.credentials_secret] if spec.model.credentials_secret
                else [],
                "spec.apiKeySecretRef": [spec.api_key_secret[0]] if spec.api_key_secret else []}
    for where, names in declared.items():
        for secret in names:
            if not matches(secret, policy.allowed_secrets):
                raise PolicyViolation("SecretNotAllowed", f"{where}: Secret {secret!r} is not allowed "
                                                          f"(allowed: {', '.join(policy.allowed_secrets) or 'none'})")
    for secret in _secret_refs(spec):
        if secret not in spec.env_secrets:
            raise PolicyViolation("UndeclaredSecret", f"spec.env reads Secret {secret!r}, which spec.envSecrets "
                                                      "does not declare")


@dataclass(frozen=True, slots=True)
class NetworkFence:
    """The NetworkPolicy of each service's engine pods (``resources.network_policy``).

    Args:
        enabled: build one (else the pods are as open as the namespace's own policies leave them).
        client_pod_labels: labels of the pods that may call the engine port (the gateway,
            the router / endpoint picker, clients).
        client_namespace_labels: labels of the namespaces those pods may be in; None: the
            service's own namespace only.
        monitoring_namespace: a namespace whose pods may scrape the engine port (None: none).
        operator_namespace: the operator's namespace: its pods may read the engines'
            ``/metrics`` (``KVPILOT_ENGINE_METRICS=pod``); None: not allowed.
        dns_pod_labels: the cluster DNS pods (any namespace) the engine pods may query.
        model_egress_cidrs / model_egress_ports: where hf:// and s3:// downloads and an
            LMCache remote server may be reached.
    """

    enabled: bool = True
    client_pod_labels: Mapping[str, str] = field(default_factory=lambda: dict(DEFAULT_CLIENT_LABELS))
    client_namespace_labels: Mapping[str, str] | None = None
    monitoring_namespace: str | None = "monitoring"
    operator_namespace: str | None = None
    dns_pod_labels: Mapping[str, str] = field(default_factory=lambda: dict(DEFAULT_DNS_LABELS))
    model_egress_cidrs: tuple[str, ...] = ("0.0.0.0/0", "::/0")
    model_egress_ports: tuple[int, ...] = (443,)

    def __post_init__(self) -> None:
        if not self.client_pod_labels:
            raise ValueError("KVPILOT_NETWORK_CLIENT_LABELS must name at least one label: the pods "
                             "that may call the engines")
        if not all(1 <= p <= 65535 for p in self.model_egress_ports):
            raise ValueError(f"KVPILOT_NETWORK_MODEL_EGRESS_PORTS must be ports, got {self.model_egress_ports}")

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> NetworkFence:
        d = cls()
        raw = env.get("KVPILOT_NETWORK_POLICY", "on").strip().lower()
        if raw not in ("on", "off", "true", "false", "1", "0", "yes", "no"):
            raise ValueError(f"KVPILOT_NETWORK_POLICY must be on or off, got {raw!r}")
        try:
            ports = tuple(int(p) for p in _names(env, "KVPILOT_NETWORK_MODEL_EGRESS_PORTS")) or d.model_egress_ports
        except ValueError:
            raise ValueError("KVPILOT_NETWORK_MODEL_EGRESS_PORTS must be comma-separated ports") from None
        namespaces = env.get("KVPILOT_NETWORK_CLIENT_NAMESPACE_LABELS")
        return cls(
            enabled=raw in ("on", "true", "1", "yes"),
            client_pod_labels=labels(env["KVPILOT_NETWORK_CLIENT_LABELS"]) if "KVPILOT_NETWORK_CLIENT_LABELS" in env
            else d.client_pod_labels,
            client_namespace_labels=None if namespaces is None else labels(namespaces),
            monitoring_namespace=env.get("KVPILOT_NETWORK_MONITORING_NAMESPACE", d.monitoring_namespace) or None,
            operator_namespace=env.get("KVPILOT_OPERATOR_NAMESPACE") or None,
            dns_pod_labels=labels(env["KVPILOT_NETWORK_DNS_LABELS"]) if "KVPILOT_NETWORK_DNS_LABELS" in env
            else d.dns_pod_labels,
            model_egress_cidrs=_names(env, "KVPILOT_NETWORK_MODEL_EGRESS_CIDRS") or d.model_egress_cidrs,
            model_egress_ports=ports,
        )


def labels(text: str) -> dict[str, str]:
    """``"a=b,c=d"`` -> ``{"a": "b", "c": "d"}`` (a label selector of equalities)."""
    out = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"{text!r} is not a list of label=value pairs")
        out[key.strip()] = value.strip()
    return out


def _names(env: Mapping[str, str], name: str) -> tuple[str, ...]:
    return tuple(n.strip() for n in env.get(name, "").split(",") if n.strip())

"""The confused-deputy specs of issue 26 and a good one, shared by the operator's policy tests
(``test_security``, ``test_operator``) and the chart's admission-policy test.

Each bad spec asks the operator for more than its author may have: a foreign image, a
foreign service account, an env entry reading a Secret the spec does not declare.
"""

from __future__ import annotations

GOOD = {"model": {"uri": "hf://Qwen/Qwen3-0.6B", "credentialsSecretRef": {"name": "hf-token"}},
        "gpu": {"type": "l4"},
        "slo": {"maxContext": 8192, "p95PromptTokens": 2048, "p95OutputTokens": 512, "concurrency": 8},
        "apiKeySecretRef": {"name": "chat-api-key"}, "envSecrets": ["tracing"],
        "env": [{"name": "OTEL_TOKEN", "valueFrom": {"secretKeyRef": {"name": "tracing", "key": "token"}}},
                {"name": "LOG", "value": "debug"}]}
FOREIGN_IMAGE = {**GOOD, "image": "docker.io/attacker/miner:latest"}
FOREIGN_ACCOUNT = {**GOOD, "serviceAccountName": "cluster-admin-sa"}
UNDECLARED_SECRET = {**GOOD, "env": [{"name": "DB", "valueFrom": {"secretKeyRef": {"name": "prod-db", "key": "pw"}}}]}
# case -> (spec, the Planned condition's reason)
DEPUTY_SPECS = {"foreign-image": (FOREIGN_IMAGE, "ImageNotAllowed"),
                "foreign-account": (FOREIGN_ACCOUNT, "ServiceAccountNotAllowed"),
                "undeclared-secret": (UNDECLARED_SECRET, "UndeclaredSecret")}

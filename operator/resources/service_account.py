"""The engine pods' own ServiceAccount: an identity that holds no API token.

Each InferenceService gets one (``security.engine_service_account``), bound to no role,
with ``automountServiceAccountToken: false``; its pods run under it unless the spec names
an account the platform allows (``KVPILOT_ALLOWED_SERVICE_ACCOUNTS``). The pod spec turns
the token off as well, so an allowed account that mounts tokens still gives the engine none.
"""

from __future__ import annotations

from kvpilot.operator.resources.common import Owner
from kvpilot.operator.security import engine_service_account


def build_service_account(owner: Owner) -> dict:
    return {
        "apiVersion": "v1",
        "kind": "ServiceAccount",
        "metadata": owner.metadata("engine", name=engine_service_account(owner.name)),
        "automountServiceAccountToken": False,
    }

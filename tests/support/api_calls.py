"""Which API call a request is, in RBAC's terms: (verb, group, resource, subresource).

The emulator records one ``ApiCall`` per request to a resource path, so that a test can
check that a set of RBAC rules grants what a client really did (and nothing more).
Discovery paths (``/api``, ``/apis``, ``/apis/GROUP/VERSION``, ``/version``) are
non-resource URLs that every authenticated user may read (``system:discovery``): None.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from support import kube_emulator_api as api


@dataclass(frozen=True)
class ApiCall:
    verb: str                    # get list watch create update patch delete deletecollection
    group: str                   # "" for the core group
    resource: str                # the plural
    subresource: str | None
    namespace: str | None        # None: cluster-scoped, or a list/watch across all namespaces
    name: str | None
    user_agent: str


def api_call(method: str, path: str, query: Mapping[str, str], user_agent: str) -> ApiCall | None:
    """The RBAC view of one request (None for a discovery or otherwise non-resource path)."""
    p = api.parse_path(path)
    if p is None or p.plural is None:
        return None
    watch = query.get("watch") in ("true", "1")
    if method == "GET":
        verb = "watch" if watch else ("get" if p.name else "list")
    elif method == "DELETE":
        verb = "delete" if p.name else "deletecollection"
    else:
        verb = {"POST": "create", "PUT": "update", "PATCH": "patch"}.get(method, method.lower())
    # RBAC names a subresource by its first segment (pods/NAME/proxy/metrics is pods/proxy)
    subresource = p.subresource.split("/")[0] if p.subresource else None
    return ApiCall(verb, p.group, p.plural, subresource, p.namespace, p.name, user_agent)

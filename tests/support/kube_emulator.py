"""A stateful Kubernetes API server on loopback, built on kmock, for kopf and kubectl.

kmock 0.8's ``KubernetesEmulator`` stores objects but lacks what an operator and kubectl
rely on (see /work/shared/ENVIRONMENT.md). ``KubeEmulator`` extends kmock's ``RawHandler``
(request recording, DSL reactions for fault injection, the aiohttp ``Server``) with:

- server-set ``uid``, ``resourceVersion``, ``creationTimestamp`` and ``generation`` (bumped
  only when something outside metadata/status changes), ``generateName``; a Deployment's
  ``spec.replicas`` defaulted to 1 when absent;
- status subresource isolation (writes to ``/status`` change only status; writes to the
  main resource keep status) and the ``/scale`` subresource (autoscaling/v1 Scale);
- managed fields per manager, server-side apply (conflicts, ``force``, removal of fields
  a manager stops applying, lists merged by their keys) and strategic merge patch by
  patch merge key, from the real API server's schemas (``kube_field_manager``);
- merge and JSON patches; PUT with resourceVersion preconditions (409 Conflict);
- lists with ``kind`` / ``apiVersion`` / ``resourceVersion``, label and field selectors;
  watch streams that resume from a resourceVersion and honour ``timeoutSeconds``;
- discovery (/api, /apis, group versions with subresources) including resources
  registered by POSTing a CustomResourceDefinition (which also gets Established);
- custom resources defaulted, pruned and validated against the CRD's openAPIV3Schema and
  its CEL rules (422 Invalid, as the API server answers);
- ``meta.k8s.io/v1`` Table answers with the CRD's printer columns for ``kubectl get``;
- a garbage collector: deleting an object deletes the objects it owns (ownerReferences),
  and an object created for an owner that no longer exists goes at once;
- the pod proxy (``GET .../pods/NAME:PORT/proxy/PATH`` is forwarded to the pod's IP);
- finalizers and ``deletionTimestamp``; ``/api/v1/namespaces`` (mis-parsed by kmock);
- namespace deletion in the real order (``kube_namespaces``): Terminating at once, creates
  in it refused (403), then its pods, then its ServiceAccounts, Roles and RoleBindings, then
  the rest; objects with finalizers stay Terminating; the namespace goes once empty;
- ServiceAccount tokens (``service_account_token``): a request with the token of a
  ServiceAccount that was deleted (or deleted and made again) is refused with 401, as the
  API server refuses a bound token; any other token is the cluster admin;
- Nodes, and a kube-scheduler the tests run (``kube_scheduler``: filters and FitError
  messages as kube-scheduler writes them);
- watch bookmarks (``allowWatchBookmarks``) every ``bookmark_seconds``, and, on a watch
  with a label selector, ``DELETED`` / ``ADDED`` when an object stops / starts matching it
  (as the API server's watch cache does);
- fault injection (``faults``, a ``kube_faults.FaultPolicy``): error answers (409, 429
  with ``Retry-After``, 500, 503), slow answers and dropped watch streams.

Every write is recorded in ``writes`` (method, path, user agent) so tests can count them,
and every request to a resource in ``calls`` as RBAC sees it (``api_calls.ApiCall``).

Still not modelled: authorization (RBAC is proven from the recorded ``calls`` instead:
``support.rbac``), admission webhooks and ValidatingAdmissionPolicies, foreground and
orphan deletion propagation (the garbage collector deletes dependents in the background,
``blockOwnerDeletion`` is not enforced), graceful pod termination, controllers (no
ReplicaSet, Deployment, HPA or kubelet: tests play them, ``support.kubelet``), namespaces
that must exist before objects are created in them, version conversion and openapi.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import datetime
import json
import random
import string
import traceback
import uuid
from dataclasses import dataclass
from typing import Any, TypeVar

import aiohttp.web
import attrs
import kmock
import yaml
from kmock._internal import parsing

from support import api_calls, crd_schema
from support import kube_emulator_api as api
from support import kube_field_manager as fm
from support.kube_faults import FaultPolicy
from support.kube_namespaces import NamespaceLifecycle, terminating_message

T = TypeVar("T")
Key = tuple[str, str, str | None, str]  # group, plural, namespace, name


@dataclass(frozen=True)
class Writer:
    """Who writes, for managed fields: the manager (``fieldManager``, else from the
    User-Agent) and, for an apply, whether it forces conflicts."""

    manager: str
    force: bool = False

    @classmethod
    def of(cls, params: dict, user_agent: str) -> Writer:
        return cls(fm.manager_name(params.get("fieldManager"), user_agent),
                   params.get("force") in ("true", "1"))


IN_PROCESS = Writer("emulator-test")   # writes the tests make on the store directly


@dataclass(frozen=True)
class Write:
    method: str
    path: str
    user_agent: str
    status: int
    body: Any = None

    @property
    def subresource(self) -> str | None:
        parts = self.path.strip("/").split("/")
        return parts[-1] if parts[-1] in ("status", "scale") else None


class ApiError(Exception):
    """An API failure rendered as a ``Status`` object."""

    def __init__(self, code: int, reason: str, message: str) -> None:
        super().__init__(message)
        self.code, self.reason, self.message = code, reason, message


def _now() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _status(code: int, reason: str, message: str) -> dict:
    return {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
            "message": message, "reason": reason, "code": code}


def _json(data: Any, status: int = 200) -> aiohttp.web.Response:
    return aiohttp.web.Response(text=json.dumps(data), status=status, content_type="application/json")


def _spec_part(obj: dict) -> dict:
    return {k: v for k, v in obj.items() if k not in ("metadata", "status")}


@attrs.define(kw_only=True)
class KubeEmulator(kmock.RawHandler):
    """The emulated API server (an aiohttp handler: serve it with ``kmock.Server``)."""

    types: dict[tuple[str, str, str], api.ResourceType] = attrs.field(factory=dict)
    objects: dict[Key, dict] = attrs.field(factory=dict)
    writes: list[Write] = attrs.field(factory=list)
    calls: list[api_calls.ApiCall] = attrs.field(factory=list)
    failures: list[Exception] = attrs.field(factory=list)
    # fault injection: requests whose path contains a key wait that many seconds first
    latency: dict[str, float] = attrs.field(factory=dict)
    faults: FaultPolicy = attrs.field(factory=FaultPolicy)
    bookmark_seconds: float = 60.0  # the API server sends a bookmark about once a minute
    namespace_lifecycle: NamespaceLifecycle = attrs.field(factory=NamespaceLifecycle)
    # bearer token -> the ServiceAccount it was issued for (namespace, name, uid)
    tokens: dict[str, tuple[str, str, str]] = attrs.field(factory=dict)
    _rv: int = 1
    # rv, group/plural, type, obj, and the object before a MODIFIED (for selector transitions)
    _log: list[tuple[int, str, str, dict, dict | None]] = attrs.field(factory=list)
    _changed: asyncio.Condition | None = None
    _lock: asyncio.Lock | None = None
    _closing: bool = False

    def __attrs_post_init__(self) -> None:
        for rtype in api.BUILTIN_TYPES:
            self.register(rtype)
        for ns in ("default", "kube-system"):
            self._store_create(self.types[("", "v1", "namespaces")], None, {"metadata": {"name": ns}})

    # ------------------------------------------------------------------ lifecycle

    async def __aenter__(self) -> KubeEmulator:
        await super().__aenter__()
        self._changed = asyncio.Condition()
        self._lock = asyncio.Lock()
        return self

    async def __aexit__(self, *exc: Any) -> None:
        self._closing = True
        await self.namespace_lifecycle.close()
        if self._changed is not None:
            async with self._changed:
                self._changed.notify_all()
        await super().__aexit__(*exc)

    # ------------------------------------------------------------------ resources

    def register(self, rtype: api.ResourceType) -> None:
        self.types[(rtype.group, rtype.version, rtype.plural)] = rtype

    def install_crd(self, crd: dict) -> dict:
        """Create a CRD as if POSTed (registers its resources); returns the stored CRD."""
        rtype = self.types[("apiextensions.k8s.io", "v1", "customresourcedefinitions")]
        return self._store_create(rtype, None, crd)

    def history(self, group: str, plural: str, namespace: str | None, name: str) -> list[dict]:
        """Every version of one object the store held, oldest first (deletions included)."""
        return [copy.deepcopy(entry[3]) for entry in self._log  # (rv, group/plural, type, object, ...)
                if entry[1] == f"{group}/{plural}" and entry[3]["metadata"].get("namespace") == namespace
                and entry[3]["metadata"].get("name") == name]

    def service_account_token(self, namespace: str, name: str) -> str:
        """A token of ServiceAccount ``namespace/name`` (which must exist): valid while that
        very account (its uid) exists, refused with 401 once it is deleted."""
        account = self._get(self.types[("", "v1", "serviceaccounts")], namespace, name)
        token = f"sa-{uuid.uuid4().hex}"
        self.tokens[token] = (namespace, name, account["metadata"]["uid"])
        return token

    def _authenticated(self, raw: aiohttp.web.BaseRequest) -> bool:
        auth = raw.headers.get("Authorization", "")
        account = self.tokens.get(auth[len("Bearer "):]) if auth.startswith("Bearer ") else None
        if account is None:
            return True
        namespace, name, uid = account
        live = self.objects.get(("", "serviceaccounts", namespace, name))
        return live is not None and live["metadata"].get("uid") == uid

    def _type_for(self, group: str, plural: str) -> api.ResourceType | None:
        return next((t for t in self.types.values() if t.group == group and t.plural == plural), None)

    # ------------------------------------------------------------------ HTTP entry

    async def __call__(self, raw: aiohttp.web.BaseRequest) -> aiohttp.web.StreamResponse:
        body = await raw.read()
        try:
            data = json.loads(body) if body else None
        except ValueError:
            data = None
        p = api.parse_path(raw.path)
        parsed = parsing.ParsedPath(*(p.group, p.version, p.plural, p.namespace, p.name, p.subresource)) \
            if p else parsing.ParsedPath()
        resource = kmock.resource(group=p.group, version=p.version, plural=p.plural) if p else None
        request = kmock.Request(
            id=len(self._requests), raw_request=raw, url=raw.url, method=raw.method,
            params=dict(raw.query), headers=dict(raw.headers), body=body,
            text=body.decode(errors="replace"), data=data,
            action=parsing.guess_k8s(parsed, kmock.method(raw.method), dict(raw.query)),
            resource=resource, namespace=p.namespace if p else None,
            name=p.name if p else None, subresource=p.subresource if p else None,
        )
        self._requests.append(request)
        call = api_calls.api_call(raw.method, raw.path, raw.query, raw.headers.get("User-Agent", ""))
        if call is not None:
            self.calls.append(call)
        delay = max((d for part, d in self.latency.items() if part in raw.path), default=0.0)
        fault = self.faults.match(raw.method, raw.path, raw.headers.get("User-Agent", ""))
        if fault is not None:
            delay += fault.delay
        if delay:
            await asyncio.sleep(delay)
        if not self._authenticated(raw):   # a deleted ServiceAccount's token
            return self._record_write(raw, data, _json(_status(401, "Unauthorized", "Unauthorized"), 401))
        try:
            if fault is not None and fault.status is not None:
                code, headers, status = fault.answer()
                response = _json(status, code)
                response.headers.update(headers)
                return self._record_write(raw, data, response)
            for payload in self._payloads:  # user-defined reactions (fault injection) win
                if request in payload._source and not payload._disabled.is_set():
                    return await super()._handle(request)
            response = await self._dispatch(request, raw)
        except ApiError as exc:
            response = _json(_status(exc.code, exc.reason, exc.message), exc.code)
        except Exception as exc:  # an emulator bug: answer 500 and keep it for the test to see
            self.failures.append(exc)
            response = _json(_status(500, "InternalError", "".join(traceback.format_exception(exc))), 500)
        return self._record_write(raw, data, response)

    def _record_write(self, raw: aiohttp.web.BaseRequest, data: Any,
                      response: aiohttp.web.StreamResponse) -> aiohttp.web.StreamResponse:
        if raw.method in ("POST", "PUT", "PATCH", "DELETE"):
            self.writes.append(Write(raw.method, raw.path, raw.headers.get("User-Agent", ""),
                                     response.status, data))
        return response

    async def _dispatch(self, req: kmock.Request, raw: aiohttp.web.BaseRequest) -> aiohttp.web.StreamResponse:
        path = raw.path.rstrip("/") or "/"
        if path == "/version":
            return _json({"major": "1", "minor": "33", "gitVersion": "v1.33.0-kvpilot-emulator",
                          "platform": "linux/amd64"})
        if path == "/api":
            return _json({"kind": "APIVersions", "versions": ["v1"],
                          "serverAddressByClientCIDRs": [{"clientCIDR": "0.0.0.0/0",
                                                          "serverAddress": f"{raw.host}"}]})
        if path == "/apis":
            return _json(self._group_list())
        p = api.parse_path(path)
        if p is None:
            raise ApiError(404, "NotFound", "the server could not find the requested resource")
        if p.plural is None:
            return _json(self._resource_list(p.group, p.version))
        rtype = self.types.get((p.group, p.version, p.plural))
        if rtype is None:
            if p.group and not any(t.group == p.group for t in self.types.values()):
                raise ApiError(404, "NotFound", "the server could not find the requested resource")
            raise ApiError(404, "NotFound", f"the server could not find the requested resource ({p.plural})")
        namespace = p.namespace if rtype.namespaced else None
        method = raw.method
        if method == "GET" and req.params.get("watch") in ("true", "1"):
            return await self._watch(rtype, namespace, req.params, raw)  # takes the lock itself
        if method == "GET" and rtype.plural == "pods" and (p.subresource or "").split("/")[0] == "proxy":
            return await self._proxy_to_pod(namespace, p.name, p.subresource.partition("/")[2], raw)
        async with self._lock:
            if method == "GET" and p.name is None:
                items = self._select(rtype, namespace, req.params)
                if "as=Table" in raw.headers.get("Accept", ""):
                    return _json(api.table(rtype, items, str(self._rv)))
                return _json({"kind": f"{rtype.kind}List", "apiVersion": rtype.api_version,
                              "metadata": {"resourceVersion": str(self._rv)}, "items": items})
            elif method == "GET":
                obj = self._get(rtype, namespace, p.name)
                if p.subresource == "scale":
                    return _json(self._scale_of(rtype, obj))
                if "as=Table" in raw.headers.get("Accept", ""):
                    return _json(api.table(rtype, [obj], str(self._rv)))
                return _json(obj)
            writer = Writer.of(req.params, raw.headers.get("User-Agent", ""))
            ctype = raw.headers.get("Content-Type", "").split(";")[0].strip().lower()
            if method == "POST" and p.name is None:
                if not isinstance(req.data, dict):
                    raise ApiError(400, "BadRequest", "the body must be a JSON object")
                if rtype.namespaced and not namespace:
                    raise ApiError(405, "MethodNotAllowed", "create needs a namespace in the path")
                return _json(self._store_create(rtype, namespace, req.data, writer), 201)
            elif method == "PATCH" and p.name and ctype == api.APPLY:
                config = req.data if req.data is not None else yaml.safe_load(req.text or "null")
                obj, created = self._apply(rtype, namespace, p.name, p.subresource, config, writer,
                                           req.params, raw.headers.get("User-Agent", ""))
                return _json(obj, 201 if created else 200)
            elif method in ("PATCH", "PUT") and p.name:
                return _json(self._write(rtype, namespace, p.name, p.subresource, method, ctype,
                                         req.data, writer))
            elif method == "DELETE" and p.name:
                return _json(self._delete(rtype, namespace, p.name))
            raise ApiError(405, "MethodNotAllowed", f"{method} is not supported on {path}")

    async def _proxy_to_pod(self, namespace: str | None, target: str, rest: str,
                            raw: aiohttp.web.BaseRequest) -> aiohttp.web.Response:
        """``GET .../pods/NAME[:PORT]/proxy/PATH``: the API server's pod proxy (HTTP to the pod's IP)."""
        name, _, port = target.partition(":")
        async with self._lock:
            pod = self._get(self.types[("", "v1", "pods")], namespace, name)
        ip = (pod.get("status") or {}).get("podIP")
        if not ip or not port.isdigit():
            raise ApiError(503, "ServiceUnavailable", f"pod {name} has no IP, or no port was named")
        url = f"http://{ip}:{port}/{rest}" + (f"?{raw.query_string}" if raw.query_string else "")
        try:
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as session, \
                    session.get(url) as answer:
                body = await answer.read()
                return aiohttp.web.Response(body=body, status=answer.status,
                                            content_type=answer.content_type or "text/plain")
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise ApiError(503, "ServiceUnavailable", f"error trying to reach pod {name}: {exc}") from None

    # ------------------------------------------------------------------ discovery

    def _group_list(self) -> dict:
        groups: dict[str, list[str]] = {}
        for t in self.types.values():
            if t.group:
                groups.setdefault(t.group, [])
                if t.version not in groups[t.group]:
                    groups[t.group].append(t.version)
        return {"kind": "APIGroupList", "apiVersion": "v1", "groups": [
            {"name": g, "versions": [{"groupVersion": f"{g}/{v}", "version": v} for v in vs],
             "preferredVersion": {"groupVersion": f"{g}/{vs[0]}", "version": vs[0]}}
            for g, vs in groups.items()]}

    def _resource_list(self, group: str, version: str) -> dict:
        types = [t for t in self.types.values() if t.group == group and t.version == version]
        if not types:
            raise ApiError(404, "NotFound", "the server could not find the requested resource")
        gv = f"{group}/{version}" if group else version
        return {"kind": "APIResourceList", "apiVersion": "v1", "groupVersion": gv,
                "resources": [e for t in types for e in t.discovery()]}

    # ------------------------------------------------------------------ store

    def _key(self, rtype: api.ResourceType, namespace: str | None, name: str) -> Key:
        return (rtype.group, rtype.plural, namespace if rtype.namespaced else None, name)

    def _get(self, rtype: api.ResourceType, namespace: str | None, name: str) -> dict:
        obj = self.objects.get(self._key(rtype, namespace, name))
        if obj is None:
            group = f".{rtype.group}" if rtype.group else ""
            raise ApiError(404, "NotFound", f'{rtype.plural}{group} "{name}" not found')
        return copy.deepcopy(obj)

    def _select(self, rtype: api.ResourceType, namespace: str | None, params: dict) -> list[dict]:
        out = []
        for (g, plural, ns, _), obj in sorted(self.objects.items(), key=lambda kv: (kv[0][2] or '', kv[0][3])):
            if (g, plural) != (rtype.group, rtype.plural) or (namespace and ns != namespace):
                continue
            if not api.label_selector_matches(params.get("labelSelector"), obj["metadata"].get("labels")):
                continue
            if not api.field_selector_matches(params.get("fieldSelector"), obj):
                continue
            out.append(copy.deepcopy(obj))
        return out

    def _emit(self, rtype: api.ResourceType, etype: str, obj: dict, old: dict | None = None) -> None:
        self._log.append((self._rv, f"{rtype.group}/{rtype.plural}", etype, copy.deepcopy(obj),
                          copy.deepcopy(old) if old is not None else None))
        if self._changed is not None:
            asyncio.get_running_loop().create_task(self._notify())

    def drop_watches(self) -> None:
        """Cut every open watch stream (see ``kube_faults.FaultPolicy.drop_watches``)."""
        self.faults.drop_watches()
        if self._changed is not None:
            asyncio.get_running_loop().create_task(self._notify())

    async def _notify(self) -> None:
        async with self._changed:
            self._changed.notify_all()

    def _bump(self, obj: dict) -> None:
        self._rv += 1
        obj["metadata"]["resourceVersion"] = str(self._rv)

    def _admit(self, rtype: api.ResourceType, obj: dict, name: str) -> dict:
        """Default, prune and validate a custom resource against its CRD schema."""
        if rtype.schema is None:
            return obj
        stored, errors = crd_schema.admit(rtype.schema, obj)
        if errors:
            group = f".{rtype.group}" if rtype.group else ""
            raise ApiError(422, "Invalid", f'{rtype.kind}{group} "{name}" is invalid: ' + "; ".join(errors))
        return stored

    def _store_create(self, rtype: api.ResourceType, namespace: str | None, body: dict,
                      writer: Writer | None = None, applied: bool = False) -> dict:
        """Create ``body``; ``writer`` owns its fields (an Update entry, or with ``applied``
        the Apply entry ``_apply`` already wrote); None: the emulator's own set-up objects."""
        obj = copy.deepcopy(body)
        meta = obj.setdefault("metadata", {})
        if not applied:
            meta.pop("managedFields", None)
        if not meta.get("name"):
            if not meta.get("generateName"):
                raise ApiError(422, "Invalid", "metadata.name or metadata.generateName is required")
            meta["name"] = meta["generateName"] + "".join(random.choices(string.ascii_lowercase + string.digits, k=5))
        if rtype.namespaced:
            if meta.get("namespace") not in (None, namespace):
                raise ApiError(400, "BadRequest", "the namespace of the provided object does not match "
                                                  "the namespace sent on the request")
            meta["namespace"] = namespace
        if rtype.namespaced and self.namespace_lifecycle.terminating(self, namespace):
            raise ApiError(403, "Forbidden", f'{rtype.plural} "{meta["name"]}" is forbidden: '
                                             + terminating_message(namespace))
        key = self._key(rtype, namespace, meta["name"])
        if key in self.objects:
            group = f".{rtype.group}" if rtype.group else ""
            raise ApiError(409, "AlreadyExists", f'{rtype.plural}{group} "{meta["name"]}" already exists')
        obj["apiVersion"], obj["kind"] = rtype.api_version, rtype.kind
        if rtype.status:
            obj.pop("status", None)
        obj = api.apply_builtin_defaults(rtype, self._admit(rtype, obj, meta["name"]))
        if writer is not None and not applied:
            fm.record_update(None, obj, rtype.shape, writer.manager, rtype.api_version, rtype.status)
        meta = obj["metadata"]
        meta.update(uid=str(uuid.uuid4()), creationTimestamp=_now(), generation=1)
        if rtype.kind == "CustomResourceDefinition":
            self._register_crd(obj)
        self._bump(obj)
        self.objects[key] = obj
        self._emit(rtype, "ADDED", obj)
        if self._owners_gone(obj):  # the garbage collector: created for an owner deleted meanwhile
            self._delete(rtype, namespace, meta["name"])
        return copy.deepcopy(obj)

    def _owners_gone(self, obj: dict) -> bool:
        """Whether every owner ``obj`` names is of a kind served here and no longer exists
        (an owner of a kind the emulator does not serve cannot be looked up: kept)."""
        refs = obj["metadata"].get("ownerReferences") or []
        if not refs:
            return False
        kinds = {(t.api_version, t.kind) for t in self.types.values()}
        if any((r.get("apiVersion"), r.get("kind")) not in kinds for r in refs):
            return False
        live = {o["metadata"].get("uid") for o in self.objects.values()}
        return not any(r.get("uid") in live for r in refs)

    def _register_crd(self, crd: dict) -> None:
        for rtype in api.types_from_crd(crd):
            self.register(rtype)
        names = crd["spec"]["names"]
        crd["status"] = {
            "acceptedNames": names,
            "storedVersions": [v["name"] for v in crd["spec"]["versions"] if v.get("storage")],
            "conditions": [{"type": t, "status": "True", "reason": r, "lastTransitionTime": _now(),
                            "message": m} for t, r, m in (
                ("NamesAccepted", "NoConflicts", "no conflicts found"),
                ("Established", "InitialNamesAccepted", "the initial names have been accepted"))],
        }

    def _apply(self, rtype: api.ResourceType, namespace: str | None, name: str, subresource: str | None,
               config: Any, writer: Writer, params: dict, user_agent: str) -> tuple[dict, bool]:
        """Server-side apply of ``config``; (the object as stored, whether it was created)."""
        if not params.get("fieldManager"):
            raise ApiError(400, "BadRequest", "PATCH with apply requires a fieldManager parameter")
        if not isinstance(config, dict):
            raise ApiError(400, "BadRequest", "the applied configuration must be an object")
        meta = config.get("metadata") or {}
        if meta.get("name") not in (None, name) or (rtype.namespaced and meta.get("namespace") not in
                                                      (None, namespace)):
            raise ApiError(400, "BadRequest", "the name (or namespace) of the object does not match the path")
        if (config.get("apiVersion"), config.get("kind")) != (rtype.api_version, rtype.kind):
            raise ApiError(400, "BadRequest", f"apply needs apiVersion {rtype.api_version} and kind {rtype.kind}")
        key = self._key(rtype, namespace, name)
        old = self.objects.get(key)
        if old is None and subresource is not None:
            self._get(rtype, namespace, name)  # raises the 404
        try:
            merged = fm.apply(old, config, rtype.shape, writer.manager, writer.force, rtype.api_version,
                              rtype.status, subresource)
        except fm.Conflict as exc:
            raise ApiError(409, "Conflict", str(exc)) from None
        except fm.InvalidConfig as exc:
            raise ApiError(422, "Invalid", str(exc)) from None
        if old is None:  # SSA creates: the API server authorizes it as create too
            self.calls.append(api_calls.ApiCall("create", rtype.group, rtype.plural, None,
                                                namespace if rtype.namespaced else None, name, user_agent))
            merged.setdefault("metadata", {}).update(name=name)
            return self._store_create(rtype, namespace, merged, writer, applied=True), True
        return self._write(rtype, namespace, name, subresource, "APPLY", api.APPLY, merged, writer), False

    def _write(self, rtype: api.ResourceType, namespace: str | None, name: str, subresource: str | None,
               method: str, content_type: str, data: Any, writer: Writer = IN_PROCESS) -> dict:
        """PUT or PATCH (``method`` APPLY: ``data`` is the object ``_apply`` merged, managed
        fields included); ``writer``: the test code's own writes by default."""
        key = self._key(rtype, namespace, name)
        old = self.objects.get(key)
        if old is None:
            self._get(rtype, namespace, name)  # raises the 404
        if subresource == "scale":
            return self._write_scale(rtype, key, old, method, content_type, data, writer)
        if subresource not in (None, "status"):
            raise ApiError(404, "NotFound", f"no subresource {subresource!r}")
        if method == "PUT":
            if not isinstance(data, dict):
                raise ApiError(400, "BadRequest", "the body must be a JSON object")
            sent_rv = (data.get("metadata") or {}).get("resourceVersion")
            if sent_rv and sent_rv != old["metadata"]["resourceVersion"]:
                raise ApiError(409, "Conflict", f'Operation cannot be fulfilled on {rtype.plural} "{name}": '
                                                "the object has been modified; please apply your changes "
                                                "to the latest version and try again")
            new = copy.deepcopy(data)
        elif method == "APPLY":
            new = copy.deepcopy(data)
        else:
            try:
                new = api.apply_patch(old, content_type, data, rtype.shape if rtype.schema is None else None)
            except LookupError:
                raise ApiError(415, "UnsupportedMediaType",
                               f"the body of the request was in an unknown format - accepted media types "
                               f"include: {api.JSON_PATCH}, {api.MERGE}, {api.STRATEGIC}") from None
            except api.PatchError as exc:
                raise ApiError(422, "Invalid", str(exc)) from None
        managed = (new.get("metadata") or {}).get("managedFields") if method == "APPLY" else None
        new = self._isolate(rtype, old, new, subresource)
        new = api.apply_builtin_defaults(rtype, self._admit(rtype, new, name))
        if method == "APPLY":
            new["metadata"]["managedFields"] = managed
            if not managed:
                new["metadata"].pop("managedFields")
        else:
            fm.record_update(old, new, rtype.shape, writer.manager, rtype.api_version, rtype.status, subresource)
        if new == old:
            return copy.deepcopy(old)  # a no-op write changes nothing, not even resourceVersion
        if _spec_part(new) != _spec_part(old):
            new["metadata"]["generation"] = old["metadata"].get("generation", 1) + 1
        self._bump(new)
        if rtype.kind == "CustomResourceDefinition":
            self._register_crd(new)
        meta = new["metadata"]
        if meta.get("deletionTimestamp") and not meta.get("finalizers"):
            return self._remove(rtype, key)
        self.objects[key] = new
        self._emit(rtype, "MODIFIED", new, old)
        return copy.deepcopy(new)

    def _isolate(self, rtype: api.ResourceType, old: dict, new: dict, subresource: str | None) -> dict:
        """Keep the server-owned fields, and status vs. the rest apart when there is /status."""
        if subresource == "status":
            result = copy.deepcopy(old)
            if "status" in new:
                result["status"] = new["status"]
            else:
                result.pop("status", None)
            return result
        result = copy.deepcopy(new)
        meta = result.setdefault("metadata", {})
        for field in ("uid", "creationTimestamp", "generation", "resourceVersion", "deletionTimestamp",
                      "name", "namespace", "managedFields"):  # a client's managedFields are ignored
            if field in old["metadata"]:
                meta[field] = old["metadata"][field]
            else:
                meta.pop(field, None)
        result["apiVersion"], result["kind"] = old["apiVersion"], old["kind"]
        if rtype.status:
            if "status" in old:
                result["status"] = old["status"]
            else:
                result.pop("status", None)
        return result

    def _scale_of(self, rtype: api.ResourceType, obj: dict) -> dict:
        if rtype.scale is None:
            raise ApiError(404, "NotFound", f"{rtype.plural} has no scale subresource")
        spec = api.jsonpath_values(obj, rtype.scale["specReplicasPath"])
        status = api.jsonpath_values(obj, rtype.scale["statusReplicasPath"])
        selector = api.jsonpath_values(obj, rtype.scale.get("labelSelectorPath") or ".none")
        meta = obj["metadata"]
        return {"kind": "Scale", "apiVersion": "autoscaling/v1",
                "metadata": {k: meta[k] for k in ("name", "namespace", "uid", "resourceVersion",
                                                  "creationTimestamp") if k in meta},
                "spec": {"replicas": spec[0] if spec else 0},
                "status": {"replicas": status[0] if status else 0,
                           **({"selector": selector[0]} if selector else {})}}

    def _write_scale(self, rtype: api.ResourceType, key: Key, old: dict, method: str,
                     content_type: str, data: Any, writer: Writer) -> dict:
        scale = self._scale_of(rtype, old)
        try:
            scale = data if method == "PUT" else api.apply_patch(scale, content_type, data)
        except (LookupError, api.PatchError) as exc:
            raise ApiError(422, "Invalid", str(exc)) from None
        replicas = (scale.get("spec") or {}).get("replicas")
        if not isinstance(replicas, int) or replicas < 0:
            raise ApiError(422, "Invalid", f"spec.replicas must be a non-negative integer, got {replicas!r}")
        new = copy.deepcopy(old)
        api.set_path(new, rtype.scale["specReplicasPath"], replicas)
        new = self._admit(rtype, new, old["metadata"]["name"])
        fm.record_update(old, new, rtype.shape, writer.manager, rtype.api_version, rtype.status, "scale")
        if new != old:
            new["metadata"]["generation"] = old["metadata"].get("generation", 1) + 1
            self._bump(new)
            self.objects[key] = new
            self._emit(rtype, "MODIFIED", new, old)
        return self._scale_of(rtype, new)

    def _delete(self, rtype: api.ResourceType, namespace: str | None, name: str) -> dict:
        if (rtype.group, rtype.plural) == ("", "namespaces"):
            return self.namespace_lifecycle.delete(self, name)
        key = self._key(rtype, namespace, name)
        obj = self._get(rtype, namespace, name)
        if obj["metadata"].get("finalizers"):
            if not obj["metadata"].get("deletionTimestamp"):
                old = self.objects[key]
                obj["metadata"]["deletionTimestamp"] = _now()
                obj["metadata"]["deletionGracePeriodSeconds"] = 0
                self._bump(obj)
                self.objects[key] = obj
                self._emit(rtype, "MODIFIED", obj, old)
            return copy.deepcopy(obj)
        return self._remove(rtype, key)

    def _remove(self, rtype: api.ResourceType, key: Key) -> dict:
        obj = self.objects.pop(key)
        self._bump(obj)
        self._emit(rtype, "DELETED", obj)
        if rtype.kind == "CustomResourceDefinition":
            for t in api.types_from_crd(obj):
                self.types.pop((t.group, t.version, t.plural), None)
                for k in [k for k in self.objects if k[:2] == (t.group, t.plural)]:
                    self._remove(t, k)
        self._collect_garbage(obj["metadata"].get("uid"))
        return obj

    def _collect_garbage(self, owner_uid: str | None) -> None:
        """Delete dependents whose owners are all gone (background propagation)."""
        if owner_uid is None:
            return
        live = {o["metadata"].get("uid") for o in self.objects.values()}
        for key, obj in list(self.objects.items()):
            refs = obj["metadata"].get("ownerReferences") or []
            if any(r.get("uid") == owner_uid for r in refs) and not any(r.get("uid") in live for r in refs):
                rtype = self._type_for(key[0], key[1])
                if key in self.objects and rtype is not None:
                    self._delete(rtype, key[2], key[3])

    # ------------------------------------------------------------------ watch

    async def _watch(self, rtype: api.ResourceType, namespace: str | None, params: dict,
                     raw: aiohttp.web.BaseRequest) -> aiohttp.web.StreamResponse:
        timeout = float(params.get("timeoutSeconds") or 3600)
        since = params.get("resourceVersion") or "0"
        async with self._lock:
            if since == "0":  # "any": the current state as ADDED events, then changes
                backlog = [("ADDED", o) for o in self._select(rtype, namespace, params)]
                position = len(self._log)
            else:
                position = next((i for i, e in enumerate(self._log) if e[0] > int(since)), len(self._log))
                backlog = []
        response = aiohttp.web.StreamResponse(headers={"Content-Type": "application/json"})
        await response.prepare(raw)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        bookmarks = params.get("allowWatchBookmarks") in ("true", "1")
        next_bookmark = loop.time() + self.bookmark_seconds
        generation = self.faults.watch_generation
        kind = f"{rtype.group}/{rtype.plural}"

        def selected(obj: dict | None) -> bool:
            if obj is None:
                return False
            meta = obj["metadata"]
            return (not namespace or meta.get("namespace") == namespace) and \
                api.label_selector_matches(params.get("labelSelector"), meta.get("labels")) and \
                api.field_selector_matches(params.get("fieldSelector"), obj)

        async def send(etype: str, obj: dict) -> None:
            await response.write(json.dumps({"type": etype, "object": obj}).encode() + b"\n")

        try:
            for etype, obj in backlog:
                await send(etype, obj)
            while not self._closing:
                if self.faults.watch_generation != generation:  # an injected drop: cut the line
                    raw.transport.close()
                    return response
                while position < len(self._log):
                    _, what, etype, obj, old = self._log[position]
                    position += 1
                    if what != kind:
                        continue
                    now, before = selected(obj), selected(old)
                    if etype == "MODIFIED" and old is not None and now != before:
                        etype = "ADDED" if now else "DELETED"  # it entered / left the selection
                        now = True
                    if now:
                        await send(etype, obj)
                if bookmarks and loop.time() >= next_bookmark:
                    await send("BOOKMARK", {"kind": rtype.kind, "apiVersion": rtype.api_version,
                                            "metadata": {"resourceVersion": str(self._rv)}})
                    next_bookmark = loop.time() + self.bookmark_seconds
                remaining = deadline - loop.time()
                if remaining <= 0:
                    break
                async with self._changed:
                    if position >= len(self._log) and not self._closing:
                        # asyncio.timeout, not wait_for: on Python 3.11, a handler cancelled (its
                        # client gone) while wait_for was cancelling the timed-out wait() left
                        # before wait() had taken the lock back, and the `async with` then
                        # released a lock it did not hold ("Lock is not acquired", a CI teardown
                        # failure of test_operator_faults); here wait() runs in this task and
                        # takes the lock back before any exception leaves it
                        with contextlib.suppress(TimeoutError):
                            async with asyncio.timeout(min(remaining, 1.0)):
                                await self._changed.wait()
            await response.write_eof()
        except (ConnectionResetError, aiohttp.ClientConnectionResetError):
            pass
        return response

"""The Kubernetes API adapter: the only module that reaches the API server.

Raw REST, JSON in and out, rather than the typed APIs: the plugin and the agent pass API objects around
as plain dicts (the PodSnapshot has no generated model; pod specs are recorded and replayed verbatim),
and the typed models drop fields they do not know. Two connections behind the same `request`:

- `kubeconn.LightApi` (the plugin's, from a kubeconfig): urllib3 and the standard library's TLS; it
  saves the plugin the official client's import (about 0.3 s per command);
- `OfficialApi`: the official `kubernetes` client's ``ApiClient.call_api`` (imported only here, only when
  used): the agent's in-cluster ServiceAccount (token refresh), and kubeconfigs the light one hands over
  (auth-provider plugins, proxies: kubeconn's docstring).

Every answer outside 2xx (an `ApiError`) becomes a project error:

    401 -> PermissionDenied (kubeconfig hint)     403 -> PermissionDenied (the server's message)
    404 -> NotFound                               409 -> FailedPrecondition (retryable: a conflict)
    422/400 -> InvalidArgument                    connection errors -> Unavailable (names the server)
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol
from urllib.parse import quote

import urllib3

if TYPE_CHECKING:  # imported where used: the plugin's commands mostly go without it (kubeconn)
    from kubernetes import client as k8s_client

from kubectl_snapshot.adapters import kubeconn
from kubectl_snapshot.adapters.kubeconn import ApiError
from kubectl_snapshot.core import kubeconfig as KC
from kubectl_snapshot.core import kubenames as K
from kubectl_snapshot.core import timestamps as T
from kubectl_snapshot.core.errors import (
    AlreadyExists,
    Expired,
    FailedPrecondition,
    Internal,
    InvalidArgument,
    NotFound,
    PermissionDenied,
    SnapshotError,
    Unavailable,
)

log = logging.getLogger(__name__)

FIELD_MANAGER = "kubectl-snapshot"
JSON = "application/json"
MERGE_PATCH = "application/merge-patch+json"
APPLY_PATCH = "application/apply-patch+yaml"
LIST_PAGE = 500  # objects per list page: a large list never sits whole in one response
_KUBECONFIG_HINT = "check --kubeconfig/--context (or $KUBECONFIG) and that your credentials are still valid"


def _q(part: str) -> str:
    return quote(part, safe="")


def _resource_path(plural: str, ns: str | None, name: str | None = None, sub: str | None = None) -> str:
    """The API path of the project's `plural` resources (all namespaces without `ns`), one, or its `sub`."""
    base = f"/apis/{K.GROUP}/{K.VERSION}"
    path = f"{base}/namespaces/{_q(ns)}/{plural}" if ns else f"{base}/{plural}"
    if name:
        path += f"/{_q(name)}"
    if sub:
        path += f"/{sub}"
    return path


def _snapshots_path(ns: str | None, name: str | None = None, sub: str | None = None) -> str:
    return _resource_path(K.PLURAL, ns, name, sub)


def _policies_path(ns: str | None, name: str | None = None, sub: str | None = None) -> str:
    return _resource_path(K.POLICY_PLURAL, ns, name, sub)


def _pods_path(ns: str | None, name: str | None = None) -> str:
    path = f"/api/v1/namespaces/{_q(ns)}/pods" if ns else "/api/v1/pods"
    return f"{path}/{_q(name)}" if name else path


def _api_status(e: ApiError) -> dict[str, Any]:
    """The API server's Status object in the error's body, or {}."""
    body: Any = e.body
    if isinstance(body, bytes):
        body = body.decode("utf-8", "replace")
    try:
        status = json.loads(body) if body else {}
    except ValueError:
        return {}
    return status if isinstance(status, dict) else {}


def _api_message(e: ApiError) -> str:
    message = _api_status(e).get("message")
    return str(message) if message else f"{e.status} {e.reason}".strip()


def _api_reason(e: ApiError) -> str:
    """The Status object's `reason` (AlreadyExists, Conflict, ...), or ''."""
    return str(_api_status(e).get("reason") or "")


_ADMISSION_MARK = "ValidatingAdmissionPolicy 'kubectl-snapshot-"
# another admission policy's or webhook's refusal (the API server's wording), not RBAC's
_OTHER_ADMISSION_MARKS = ("denied request", "admission webhook", "AdmissionPolicy '")
_ADMISSION_HINTS = (
    (K.RESTORE_VERB + " verb", "ask an admin of the namespace for the kubectl-snapshot-restore role (a RoleBinding)"),
    (
        K.ANN_ALLOWED_DESTINATIONS,
        "use a registry/repository the namespace allows, or ask a cluster admin to list yours in the namespace "
        f"annotation {K.ANN_ALLOWED_DESTINATIONS}",
    ),
    (K.ANN_INSECURE_REGISTRIES, "use TLS, or ask a cluster admin to list the registry in " + K.ANN_INSECURE_REGISTRIES),
    ("cannot get secret", "name a Secret you can read (kubectl auth can-i get secret/NAME), or ask for get on it"),
)


def _admission_hint(msg: str) -> str:
    """What to do when kubectl-snapshot's admission policies (deploy/admission.py) refused a request."""
    for needle, hint in _ADMISSION_HINTS:
        if needle in msg:
            return hint + "; see docs/security.md"
    return "kubectl-snapshot's admission policy refused it (the reason is above); see docs/security.md"


def map_api_error(e: ApiError, what: str, server: str) -> SnapshotError:
    """An answer outside 2xx as the project's error, keeping the API server's own words."""
    msg = _api_message(e)
    if e.status == 401:
        return PermissionDenied(
            f"{what}: the API server at {server} rejected the credentials ({msg})", hint=_KUBECONFIG_HINT
        )
    if e.status == 403 and _ADMISSION_MARK in msg:
        return PermissionDenied(f"{what}: {msg}", hint=_admission_hint(msg))
    if e.status == 403 and any(mark in msg for mark in _OTHER_ADMISSION_MARKS):
        return PermissionDenied(
            f"{what}: {msg}",
            hint="an admission policy or webhook of the cluster refused it (named above): change the request to "
            "satisfy it, or ask its owner",
        )
    if e.status == 403:
        return PermissionDenied(
            f"{what}: {msg}",
            hint="ask a cluster admin for the RBAC permission named above (kubectl auth can-i ...)",
        )
    if e.status == 404:
        return NotFound(f"{what}: {msg}")
    if e.status == 409 and _api_reason(e) == "AlreadyExists":
        return AlreadyExists(f"{what}: {msg}")
    if e.status == 409:
        return FailedPrecondition(f"{what}: {msg}", retryable=True)
    if e.status == 410:
        return Expired(f"{what}: {msg}")
    if e.status in (400, 422):
        return InvalidArgument(f"{what}: {msg}")
    if e.status in (429, 500, 502, 503, 504):
        return Unavailable(f"{what}: the API server at {server} answered {e.status}: {msg}")
    if e.status == 0 or e.status is None:
        return Unavailable(f"{what}: cannot reach the API server at {server}: {e.reason}", hint=_KUBECONFIG_HINT)
    return Internal(f"{what}: unexpected answer {e.status} from the API server: {msg}")


def kubeconfig_contexts(kubeconfig: str | None = None) -> list[str]:
    """The context names of a kubeconfig ($KUBECONFIG, else ~/.kube/config), for completion."""
    return KC.context_names(kubeconn.read_kubeconfig(kubeconfig))


class Api(Protocol):
    """One connection to the API server: `request` returns a 2xx answer, its body not read yet, and
    raises ApiError for any other (urllib3's errors where none came)."""

    host: str

    def request(
        self,
        method: str,
        path: str,
        *,
        query: Mapping[str, Any] | None = None,
        headers: Mapping[str, str] | None = None,
        body: Any = None,
        timeout: float | tuple[float, float] | None = None,
    ) -> urllib3.BaseHTTPResponse: ...


class OfficialApi:
    """The official client's ApiClient behind `Api`."""

    def __init__(self, client: k8s_client.ApiClient) -> None:
        self.client = client
        self.host = str(client.configuration.host)

    def request(
        self,
        method: str,
        path: str,
        *,
        query: Mapping[str, Any] | None = None,
        headers: Mapping[str, str] | None = None,
        body: Any = None,
        timeout: float | tuple[float, float] | None = None,
    ) -> urllib3.BaseHTTPResponse:
        from kubernetes.client.exceptions import ApiException

        try:
            resp: urllib3.BaseHTTPResponse = self.client.call_api(
                path,
                method,
                query_params=list((query or {}).items()),
                header_params=dict(headers or {}),
                body=body,
                auth_settings=["BearerToken"],
                _preload_content=False,
                _request_timeout=timeout,
            )
        except ApiException as e:
            raise ApiError(int(e.status or 0), str(e.reason or ""), e.body) from e
        return resp


def apply_overrides(
    api: k8s_client.ApiClient,
    *,
    server: str | None = None,
    token: str | None = None,
    impersonate: str | None = None,
    impersonate_groups: tuple[str, ...] = (),
) -> None:
    """kubectl's connection flags on top of what the kubeconfig set (the official client's)."""
    cfg = api.configuration
    host = (server if "://" in server else f"https://{server}") if server else None

    def override(c: Any) -> None:
        if host:
            c.host = host
        if token:
            c.api_key = {"authorization": f"Bearer {token}"}
            c.api_key_prefix = {}
            c.username = c.password = None

    override(cfg)
    if host or token:
        # the kubeconfig loader's hook re-applies the kubeconfig (host, credentials) before requests
        # to refresh tokens: keep it (exec plugins) and apply the flags again after it
        loader_hook = cfg.refresh_api_key_hook

        def refresh(c: Any) -> None:
            if loader_hook is not None:
                loader_hook(c)
            override(c)

        cfg.refresh_api_key_hook = refresh
    if impersonate_groups and not impersonate:
        raise InvalidArgument("--as-group needs --as", hint="name the user to impersonate with --as USER")
    if impersonate:
        api.set_default_header("Impersonate-User", impersonate)
    if len(impersonate_groups) > 1:
        # the official client sends a dict of headers (one value each) and the API server wants one
        # Impersonate-Group header per group: refuse rather than impersonate fewer groups than asked
        raise InvalidArgument(
            "only one --as-group can be given where the kubeconfig needs the official kubernetes client",
            hint="impersonate a single group (kubeconn's docstring says which kubeconfigs need it)",
        )
    if impersonate_groups:
        api.set_default_header("Impersonate-Group", impersonate_groups[0])


class KubeClient:
    """A thin, dict-in/dict-out client for the calls the plugin and the agent make."""

    def __init__(self, api: Api, *, namespace: str = "default") -> None:
        self.api = api
        self.namespace = namespace  # the context's namespace (or the in-cluster pod's), for defaults
        self.server = api.host
        self._resources: dict[tuple[str, str], tuple[str, bool]] = {}

    # --- construction --------------------------------------------------------------------------------

    @classmethod
    def from_config(
        cls,
        kubeconfig: str | None = None,
        context: str | None = None,
        *,
        server: str | None = None,
        token: str | None = None,
        impersonate: str | None = None,
        impersonate_groups: tuple[str, ...] = (),
    ) -> KubeClient:
        """Load a kubeconfig like kubectl does ($KUBECONFIG, else ~/.kube/config; --context), then apply
        kubectl's overrides: --server, --token (replaces the kubeconfig's user credentials for bearer
        auth), --as/--as-group (Impersonate-* headers). With --server and no kubeconfig, none is needed.
        The light connection serves it unless the kubeconfig needs the official client (kubeconn)."""
        light = kubeconn.load(
            kubeconfig,
            context,
            server=server,
            token=token,
            impersonate=impersonate,
            impersonate_groups=impersonate_groups,
        )
        if light is not None:
            return cls(light, namespace=light.namespace)
        return cls._official_from_config(
            kubeconfig,
            context,
            server=server,
            token=token,
            impersonate=impersonate,
            impersonate_groups=impersonate_groups,
        )

    @classmethod
    def _official_from_config(
        cls,
        kubeconfig: str | None,
        context: str | None,
        *,
        server: str | None,
        token: str | None,
        impersonate: str | None,
        impersonate_groups: tuple[str, ...],
    ) -> KubeClient:
        from kubernetes import client as k8s_client
        from kubernetes import config as k8s_config
        from kubernetes.config.config_exception import ConfigException

        where = kubeconn.kubeconfig_name(kubeconfig)
        chosen: dict[str, Any] | None = None
        try:
            try:
                contexts, current = k8s_config.list_kube_config_contexts(kubeconfig)
            except ConfigException:
                if not server or kubeconfig or context:
                    raise
                contexts, current = [], None  # kubectl --server URL --token T: no kubeconfig needed
            chosen = current
            if context:
                chosen = next((c for c in contexts if c.get("name") == context), None)
                if chosen is None:
                    names = ", ".join(str(c.get("name")) for c in contexts) or "none"
                    raise InvalidArgument(f"context {context!r} is not in {where}", hint=f"contexts there: {names}")
            if contexts:
                api = k8s_config.new_client_from_config(config_file=kubeconfig, context=context, persist_config=False)
            else:
                api = k8s_client.ApiClient(configuration=k8s_client.Configuration())
        except (ConfigException, OSError, TypeError, ValueError) as e:
            raise FailedPrecondition(f"cannot load kubeconfig {where}: {e}", hint=kubeconn.LOAD_HINT) from e
        apply_overrides(api, server=server, token=token, impersonate=impersonate, impersonate_groups=impersonate_groups)
        ns = str(((chosen or {}).get("context") or {}).get("namespace") or "default")
        return cls(OfficialApi(api), namespace=ns)

    @classmethod
    def in_cluster(cls) -> KubeClient:
        """Use the pod's ServiceAccount (the agent), through the official client (its token refresh)."""
        from kubernetes import client as k8s_client
        from kubernetes import config as k8s_config
        from kubernetes.config.config_exception import ConfigException

        cfg = k8s_client.Configuration()
        try:
            k8s_config.load_incluster_config(client_configuration=cfg)
        except ConfigException as e:
            raise FailedPrecondition(
                f"not running in a Kubernetes pod: {e}", hint="run the agent as the DaemonSet or pass a kubeconfig"
            ) from e
        ns_file = "/var/run/secrets/kubernetes.io/serviceaccount/namespace"
        try:
            with open(ns_file) as f:
                ns = f.read().strip() or "default"
        except OSError:
            ns = "default"
        return cls(OfficialApi(k8s_client.ApiClient(configuration=cfg)), namespace=ns)

    # --- transport -----------------------------------------------------------------------------------

    def _call(
        self,
        method: str,
        path: str,
        *,
        what: str,
        body: Any = None,
        query: Mapping[str, Any] | None = None,
        content_type: str = JSON,
        timeout: float | tuple[float, float] | None = 60,
        stream: bool = False,
    ) -> Any:
        try:
            resp = self.api.request(
                method,
                path,
                query={k: v for k, v in (query or {}).items() if v is not None},
                headers={"Accept": JSON, "Content-Type": content_type},
                body=body,
                timeout=timeout,
            )
        except ApiError as e:
            raise map_api_error(e, what, self.server) from e
        except (urllib3.exceptions.HTTPError, OSError) as e:
            raise Unavailable(
                f"{what}: cannot reach the API server at {self.server}: {_reason(e)}", hint=_KUBECONFIG_HINT
            ) from e
        if stream:
            return resp
        try:
            data = resp.data
        except (urllib3.exceptions.HTTPError, OSError) as e:
            raise Unavailable(f"{what}: the answer of the API server at {self.server} broke off: {_reason(e)}") from e
        finally:
            resp.release_conn()
        if not data:
            return {}
        try:
            return json.loads(data)
        except ValueError as e:
            raise Internal(f"{what}: the API server answered non-JSON: {data[:200]!r}") from e

    def _watch(
        self,
        path: str,
        *,
        what: str,
        query: Mapping[str, Any],
        timeout_s: int,
        resource_version: str | None = None,
    ) -> Iterator[tuple[str, dict[str, Any]]]:
        """(type, object) events. From ``resource_version`` (a list's or the last event's) the watch
        resumes exactly where it left off and asks for BOOKMARK events, which carry only a newer
        resourceVersion; without it, it starts with an ADDED event for every existing match. An
        expired resourceVersion raises Expired: list again."""
        q = {
            **query,
            "watch": "true",
            "timeoutSeconds": str(timeout_s),
            "allowWatchBookmarks": "true" if resource_version else "false",
            "resourceVersion": resource_version,
        }
        resp = self._call("GET", path, what=what, query=q, timeout=(10, timeout_s + 30), stream=True)
        buf = b""
        try:
            for chunk in resp.stream(64 << 10, decode_content=True):
                buf += chunk
                while b"\n" in buf:
                    line, buf = buf.split(b"\n", 1)
                    event = _parse_event(line, what)
                    if event is not None:
                        yield event
        except (urllib3.exceptions.HTTPError, OSError) as e:
            raise Unavailable(f"{what}: watch interrupted: {_reason(e)}") from e
        finally:
            resp.release_conn()
        event = _parse_event(buf, what)
        if event is not None:
            yield event

    def _list(self, path: str, *, what: str, query: Mapping[str, Any]) -> tuple[list[dict[str, Any]], str]:
        """A list read in pages of LIST_PAGE (the API server keeps a consistent snapshot across the
        pages); returns the items and the resourceVersion to watch from."""
        items: list[dict[str, Any]] = []
        cont: str | None = None
        while True:
            data = self._call("GET", path, what=what, query={**query, "limit": str(LIST_PAGE), "continue": cont})
            items.extend(data.get("items") or [])
            meta = data.get("metadata") or {}
            cont = meta.get("continue") or None
            if not cont:
                return items, str(meta.get("resourceVersion") or "")

    # --- pods ----------------------------------------------------------------------------------------

    def get_pod(self, ns: str, name: str) -> dict[str, Any]:
        return dict(self._call("GET", _pods_path(ns, name), what=f"get pod {ns}/{name}"))

    def list_pods(
        self, ns: str | None, *, label_selector: str | None = None, field_selector: str | None = None
    ) -> list[dict[str, Any]]:
        return self.list_pods_versioned(ns, label_selector=label_selector, field_selector=field_selector)[0]

    def list_pods_versioned(
        self, ns: str | None, *, label_selector: str | None = None, field_selector: str | None = None
    ) -> tuple[list[dict[str, Any]], str]:
        """The matching pods and the list's resourceVersion (to watch from), read in pages."""
        q = {"labelSelector": label_selector, "fieldSelector": field_selector}
        return self._list(_pods_path(ns), what=f"list pods in {ns or 'all namespaces'}", query=q)

    def watch_pods(
        self,
        *,
        field_selector: str | None,
        namespace: str | None = None,
        timeout_s: int = 300,
        resource_version: str | None = None,
    ) -> Iterator[tuple[str, dict[str, Any]]]:
        """(type, pod) events, ending after timeout_s (see _watch for resource_version)."""
        return self._watch(
            _pods_path(namespace),
            what=f"watch pods in {namespace or 'all namespaces'}",
            query={"fieldSelector": field_selector},
            timeout_s=timeout_s,
            resource_version=resource_version,
        )

    def create_pod(self, ns: str, body: dict[str, Any], *, dry_run: bool = False) -> dict[str, Any]:
        """Create a pod; with dry_run the API server admits it (defaulting, admission, quota) but stores nothing."""
        name = body.get("metadata", {}).get("name", "?")
        return dict(self._call("POST", _pods_path(ns), what=f"create pod {ns}/{name}", body=body, query=_dry(dry_run)))

    def delete_pod(self, ns: str, name: str, *, grace_period_seconds: int | None = None) -> None:
        body = None if grace_period_seconds is None else {"gracePeriodSeconds": grace_period_seconds}
        self._call("DELETE", _pods_path(ns, name), what=f"delete pod {ns}/{name}", body=body)

    def patch_pod_annotations(
        self, ns: str, name: str, annotations: dict[str, str | None], *, status: bool = False
    ) -> dict[str, Any]:
        """Merge-patch annotations; a None value removes the key. `status`: through ``pods/status`` (the
        agent: it has no ``pods patch``, and admission lets it change only its own annotation there)."""
        return dict(
            self._call(
                "PATCH",
                _pods_path(ns, name) + ("/status" if status else ""),
                what=f"annotate pod {ns}/{name}",
                body={"metadata": {"annotations": annotations}},
                content_type=MERGE_PATCH,
            )
        )

    # --- PodSnapshots --------------------------------------------------------------------------------

    def get_snapshot(self, ns: str, name: str) -> dict[str, Any]:
        return dict(self._call("GET", _snapshots_path(ns, name), what=f"get podsnapshot {ns}/{name}"))

    def create_snapshot(self, ns: str, body: dict[str, Any], *, dry_run: bool = False) -> dict[str, Any]:
        name = body.get("metadata", {}).get("name", "?")
        return dict(
            self._call(
                "POST", _snapshots_path(ns), what=f"create podsnapshot {ns}/{name}", body=body, query=_dry(dry_run)
            )
        )

    def list_snapshots(self, ns: str | None, *, label_selector: str | None = None) -> list[dict[str, Any]]:
        return self.list_snapshots_versioned(ns, label_selector=label_selector)[0]

    def list_snapshots_versioned(
        self, ns: str | None, *, field_selector: str | None = None, label_selector: str | None = None
    ) -> tuple[list[dict[str, Any]], str]:
        """The matching PodSnapshots and the list's resourceVersion (to watch from), read in pages."""
        what = f"list podsnapshots in {ns or 'all namespaces'}"
        q = {"fieldSelector": field_selector, "labelSelector": label_selector or None}
        return self._list(_snapshots_path(ns), what=what, query=q)

    def delete_snapshot(self, ns: str, name: str, *, dry_run: bool = False) -> None:
        self._call("DELETE", _snapshots_path(ns, name), what=f"delete podsnapshot {ns}/{name}", query=_dry(dry_run))

    def watch_snapshots(
        self,
        namespace: str | None,
        timeout_s: int = 300,
        *,
        field_selector: str | None = None,
        label_selector: str | None = None,
        resource_version: str | None = None,
    ) -> Iterator[tuple[str, dict[str, Any]]]:
        return self._watch(
            _snapshots_path(namespace),
            what=f"watch podsnapshots in {namespace or 'all namespaces'}",
            query={"fieldSelector": field_selector, "labelSelector": label_selector or None},
            timeout_s=timeout_s,
            resource_version=resource_version,
        )

    def watch_snapshot(self, ns: str, name: str, timeout_s: int = 300) -> Iterator[tuple[str, dict[str, Any]]]:
        """Events for one PodSnapshot (a field selector on metadata.name)."""
        return self._watch(
            _snapshots_path(ns),
            what=f"watch podsnapshot {ns}/{name}",
            query={"fieldSelector": f"metadata.name={name}"},
            timeout_s=timeout_s,
        )

    def patch_snapshot_status(
        self, ns: str, name: str, status: dict[str, Any], *, resource_version: str | None = None
    ) -> dict[str, Any]:
        """Merge-patch the status subresource; with resource_version, a concurrent change is a
        FailedPrecondition(retryable=True) (how agents claim a PodSnapshot exactly once)."""
        body: dict[str, Any] = {"status": status}
        if resource_version:
            body["metadata"] = {"resourceVersion": resource_version}
        return dict(
            self._call(
                "PATCH",
                _snapshots_path(ns, name, "status"),
                what=f"update status of podsnapshot {ns}/{name}",
                body=body,
                content_type=MERGE_PATCH,
            )
        )

    # --- SnapshotPolicies (autosave) -----------------------------------------------------------------

    def get_policy(self, ns: str, name: str) -> dict[str, Any]:
        return dict(self._call("GET", _policies_path(ns, name), what=f"get snapshotpolicy {ns}/{name}"))

    def list_policies(self, ns: str | None, *, label_selector: str | None = None) -> list[dict[str, Any]]:
        return self.list_policies_versioned(ns, label_selector=label_selector)[0]

    def list_policies_versioned(
        self, ns: str | None, *, label_selector: str | None = None
    ) -> tuple[list[dict[str, Any]], str]:
        what = f"list snapshotpolicies in {ns or 'all namespaces'}"
        return self._list(_policies_path(ns), what=what, query={"labelSelector": label_selector or None})

    def watch_policies(
        self, namespace: str | None, timeout_s: int = 300, *, resource_version: str | None = None
    ) -> Iterator[tuple[str, dict[str, Any]]]:
        return self._watch(
            _policies_path(namespace),
            what=f"watch snapshotpolicies in {namespace or 'all namespaces'}",
            query={},
            timeout_s=timeout_s,
            resource_version=resource_version,
        )

    def create_policy(self, ns: str, body: dict[str, Any], *, dry_run: bool = False) -> dict[str, Any]:
        name = body.get("metadata", {}).get("name", "?")
        return dict(
            self._call(
                "POST", _policies_path(ns), what=f"create snapshotpolicy {ns}/{name}", body=body, query=_dry(dry_run)
            )
        )

    def delete_policy(self, ns: str, name: str, *, dry_run: bool = False) -> None:
        self._call("DELETE", _policies_path(ns, name), what=f"delete snapshotpolicy {ns}/{name}", query=_dry(dry_run))

    def apply_policy_pods(
        self, ns: str, name: str, pods: list[dict[str, Any]], *, field_manager: str
    ) -> dict[str, Any]:
        """Server-side apply status.pods entries as `field_manager` (one per node): the entries this
        manager applied before and leaves out now are removed; other managers' entries stay."""
        body = {
            "apiVersion": K.API_VERSION,
            "kind": K.POLICY_KIND,
            "metadata": {"name": name, "namespace": ns},
            # none left: own nothing under status (an explicit [] could read as "the list is empty")
            "status": {"pods": pods} if pods else {},
        }
        return dict(
            self._call(
                "PATCH",
                _policies_path(ns, name, "status"),
                what=f"apply status of snapshotpolicy {ns}/{name}",
                body=body,
                content_type=APPLY_PATCH,
                query={"fieldManager": field_manager, "force": "true"},
            )
        )

    def list_events(self, ns: str, *, field_selector: str | None = None) -> list[dict[str, Any]]:
        path = f"/api/v1/namespaces/{_q(ns)}/events"
        q = {"fieldSelector": field_selector}
        return list(self._call("GET", path, what=f"list events in {ns}", query=q).get("items") or [])

    def patch_snapshot_metadata(
        self,
        ns: str,
        name: str,
        *,
        labels: Mapping[str, str | None] | None = None,
        annotations: Mapping[str, str | None] | None = None,
        resource_version: str | None = None,
    ) -> dict[str, Any]:
        """Merge-patch a PodSnapshot's labels/annotations (None removes a key); with resource_version a
        concurrent change is a FailedPrecondition(retryable=True) (how a resuming pod claims a save once)."""
        meta: dict[str, Any] = {}
        if labels is not None:
            meta["labels"] = dict(labels)
        if annotations is not None:
            meta["annotations"] = dict(annotations)
        if resource_version:
            meta["resourceVersion"] = resource_version
        return dict(
            self._call(
                "PATCH",
                _snapshots_path(ns, name),
                what=f"label podsnapshot {ns}/{name}",
                body={"metadata": meta},
                content_type=MERGE_PATCH,
            )
        )

    def get_replicaset(self, ns: str, name: str) -> dict[str, Any] | None:
        """A ReplicaSet (its ownerReferences say which Deployment owns it), None when it is gone."""
        try:
            return dict(
                self._call(
                    "GET",
                    f"/apis/apps/v1/namespaces/{_q(ns)}/replicasets/{_q(name)}",
                    what=f"get replicaset {ns}/{name}",
                )
            )
        except NotFound:
            return None

    # --- events, secrets, nodes, daemonsets ----------------------------------------------------------

    def create_event(
        self,
        ns: str,
        *,
        involved: dict[str, Any],
        reason: str,
        message: str,
        type: str = "Normal",
        component: str = K.AGENT_NAME,
    ) -> dict[str, Any]:
        import uuid

        meta = involved.get("metadata", {})
        now = T.rfc3339(time.time())
        body = {
            "apiVersion": "v1",
            "kind": "Event",
            "metadata": {"name": f"{meta.get('name', 'object')}.{uuid.uuid4().hex[:12]}", "namespace": ns},
            "involvedObject": {
                "apiVersion": involved.get("apiVersion", "v1"),
                "kind": involved.get("kind", "Pod"),
                "name": meta.get("name", ""),
                "namespace": meta.get("namespace", ns),
                "uid": meta.get("uid", ""),
                "resourceVersion": meta.get("resourceVersion", ""),
            },
            "reason": reason,
            "message": message[:1024],
            "type": type,
            "source": {"component": component},
            "firstTimestamp": now,
            "lastTimestamp": now,
            "count": 1,
        }
        return dict(self._call("POST", f"/api/v1/namespaces/{_q(ns)}/events", what=f"record event {reason}", body=body))

    def list_snapshot_grants(self, ns: str) -> list[dict[str, Any]]:
        """The SnapshotGrants of one namespace (what its snapshots may be restored into)."""
        path = f"/apis/{K.GROUP}/{K.VERSION}/namespaces/{_q(ns)}/{K.GRANT_PLURAL}"
        return list(self._call("GET", path, what=f"list snapshotgrants in {ns}").get("items") or [])

    def token_review(self, token: str, *, audiences: Sequence[str] = ()) -> dict[str, Any]:
        """Who a bearer token belongs to (authentication.k8s.io TokenReview), if it was issued for one of
        `audiences` (none: the API server's own); status.audiences says which."""
        spec: dict[str, Any] = {"token": token}
        if audiences:
            spec["audiences"] = list(audiences)
        body = {"apiVersion": "authentication.k8s.io/v1", "kind": "TokenReview", "spec": spec}
        return dict(self._call("POST", "/apis/authentication.k8s.io/v1/tokenreviews", what="review a token", body=body))

    def subject_access_review(self, user: Mapping[str, Any], *, path: str, verb: str) -> dict[str, Any]:
        """Whether `user` (a TokenReview's status.user) may `verb` the non-resource URL `path`."""
        spec: dict[str, Any] = {
            "user": user.get("username", ""),
            "groups": list(user.get("groups") or []),
            "uid": user.get("uid", ""),
            "nonResourceAttributes": {"path": path, "verb": verb},
        }
        if user.get("extra"):
            spec["extra"] = dict(user["extra"])
        body = {"apiVersion": "authorization.k8s.io/v1", "kind": "SubjectAccessReview", "spec": spec}
        return dict(
            self._call(
                "POST",
                "/apis/authorization.k8s.io/v1/subjectaccessreviews",
                what=f"check whether {spec['user']} may {verb} {path}",
                body=body,
            )
        )

    def get_secret(self, ns: str, name: str) -> dict[str, Any]:
        return dict(
            self._call("GET", f"/api/v1/namespaces/{_q(ns)}/secrets/{_q(name)}", what=f"get secret {ns}/{name}")
        )

    def replace_secret(self, ns: str, name: str, body: dict[str, Any]) -> dict[str, Any]:
        """PUT (with body.metadata.resourceVersion: a conflict raises FailedPrecondition, retryable)."""
        return dict(
            self._call(
                "PUT", f"/api/v1/namespaces/{_q(ns)}/secrets/{_q(name)}", what=f"update secret {ns}/{name}", body=body
            )
        )

    def get_config_map(self, ns: str, name: str) -> dict[str, Any]:
        return dict(
            self._call("GET", f"/api/v1/namespaces/{_q(ns)}/configmaps/{_q(name)}", what=f"get configmap {ns}/{name}")
        )

    def patch_config_map_data(self, ns: str, name: str, data: dict[str, str]) -> dict[str, Any]:
        """Merge `data` into the ConfigMap's data (entries not named are left as they are)."""
        return dict(
            self._call(
                "PATCH",
                f"/api/v1/namespaces/{_q(ns)}/configmaps/{_q(name)}",
                what=f"update configmap {ns}/{name}",
                body={"data": data},
                content_type=MERGE_PATCH,
            )
        )

    def get_node(self, name: str) -> dict[str, Any]:
        return dict(self._call("GET", f"/api/v1/nodes/{_q(name)}", what=f"get node {name}"))

    def list_namespaces(self) -> list[dict[str, Any]]:
        return list(self._call("GET", "/api/v1/namespaces", what="list namespaces").get("items") or [])

    def list_nodes(self) -> list[dict[str, Any]]:
        return list(self._call("GET", "/api/v1/nodes", what="list nodes").get("items") or [])

    def patch_node_annotations(self, name: str, annotations: dict[str, str | None]) -> dict[str, Any]:
        return dict(
            self._call(
                "PATCH",
                f"/api/v1/nodes/{_q(name)}",
                what=f"annotate node {name}",
                body={"metadata": {"annotations": annotations}},
                content_type=MERGE_PATCH,
            )
        )

    def get_daemonset(self, ns: str, name: str) -> dict[str, Any] | None:
        """The DaemonSet, or None when it does not exist (PermissionDenied still raises)."""
        try:
            return dict(
                self._call(
                    "GET", f"/apis/apps/v1/namespaces/{_q(ns)}/daemonsets/{_q(name)}", what=f"get daemonset {ns}/{name}"
                )
            )
        except NotFound:
            return None

    def get_crd(self, name: str) -> dict[str, Any] | None:
        try:
            path = f"/apis/apiextensions.k8s.io/v1/customresourcedefinitions/{_q(name)}"
            return dict(self._call("GET", path, what=f"get crd {name}"))
        except NotFound:
            return None

    def get_object(self, obj: Mapping[str, Any]) -> dict[str, Any] | None:
        """The live version of `obj` (matched by apiVersion, kind, namespace, name), or None."""
        try:
            return dict(self._call("GET", self._object_path(obj), what=f"get {_describe(obj)}"))
        except NotFound:
            return None

    # --- install / uninstall -------------------------------------------------------------------------

    def _resource(self, api_version: str, kind: str) -> tuple[str, bool]:
        """(plural, namespaced) for a kind, from the API server's discovery document."""
        key = (api_version, kind)
        if key not in self._resources:
            base = "/api/v1" if api_version == "v1" else f"/apis/{api_version}"
            doc = self._call("GET", base, what=f"discover {api_version}")
            for r in doc.get("resources") or []:
                if "/" not in r.get("name", "") and r.get("kind"):
                    self._resources[(api_version, r["kind"])] = (r["name"], bool(r.get("namespaced")))
            if key not in self._resources:
                raise NotFound(f"the API server does not serve {kind} in {api_version}")
        return self._resources[key]

    def _object_path(self, obj: Mapping[str, Any], *, collection: bool = False) -> str:
        api_version, kind = str(obj.get("apiVersion", "")), str(obj.get("kind", ""))
        meta = obj.get("metadata") or {}
        plural, namespaced = self._resource(api_version, kind)
        base = "/api/v1" if api_version == "v1" else f"/apis/{api_version}"
        if namespaced:
            base += f"/namespaces/{_q(str(meta.get('namespace') or 'default'))}"
        path = f"{base}/{plural}"
        return path if collection else f"{path}/{_q(str(meta.get('name', '')))}"

    def apply(self, objects: list[dict[str, Any]], *, dry_run: bool = False) -> list[dict[str, Any]]:
        """Server-side apply each object in order (field manager kubectl-snapshot, conflicts forced);
        returns the objects as the API server has (or, with dry_run, would have) them."""
        applied: list[dict[str, Any]] = []
        for obj in objects:
            if (
                obj.get("kind") == "CustomResourceDefinition"
                or (obj.get("apiVersion"), obj.get("kind")) not in self._resources
            ):
                # a CRD applied just before may add kinds: rediscover lazily
                self._resources.pop((str(obj.get("apiVersion")), str(obj.get("kind"))), None)
            applied.append(
                dict(
                    self._call(
                        "PATCH",
                        self._object_path(obj),
                        what=f"apply {_describe(obj)}",
                        body=obj,
                        content_type=APPLY_PATCH,
                        query={"fieldManager": FIELD_MANAGER, "force": "true", **_dry(dry_run)},
                    )
                )
            )
        return applied

    def delete_objects(self, objects: list[dict[str, Any]], *, dry_run: bool = False) -> None:
        """Delete each object in the given order; absent objects (or kinds) are skipped."""
        for obj in objects:
            try:
                self._call(
                    "DELETE",
                    self._object_path(obj),
                    what=f"delete {_describe(obj)}",
                    query={"propagationPolicy": "Background", **_dry(dry_run)},
                )
            except NotFound:
                continue


def _dry(dry_run: bool) -> dict[str, str]:
    """The API server's dry run (`kubectl --dry-run=server`): admission runs, nothing is persisted."""
    return {"dryRun": "All"} if dry_run else {}


def _describe(obj: Mapping[str, Any]) -> str:
    meta = obj.get("metadata") or {}
    ns = meta.get("namespace")
    return f"{str(obj.get('kind', '?')).lower()} {ns + '/' if ns else ''}{meta.get('name', '?')}"


def _reason(e: BaseException) -> str:
    inner = getattr(e, "reason", None)
    text = str(inner or e)
    for marker in ("Connection refused", "timed out", "Name or service not known", "No route to host"):
        if marker in text:
            return marker.lower()
    return text[:300]


def _parse_event(line: bytes, what: str) -> tuple[str, dict[str, Any]] | None:
    line = line.strip()
    if not line:
        return None
    try:
        event = json.loads(line)
    except ValueError as e:
        raise Internal(f"{what}: malformed watch event {line[:200]!r}") from e
    etype, obj = str(event.get("type", "")), event.get("object") or {}
    if etype == "ERROR":
        code = int(obj.get("code") or 0)
        if code == 410:
            raise Expired(f"{what}: watch expired ({obj.get('message', '')})")
        raise _watch_error(code, str(obj.get("message", "")), what)
    return etype, dict(obj)


def _watch_error(code: int, message: str, what: str) -> SnapshotError:
    """An in-stream watch ERROR (a Status object), mapped like the same HTTP error."""
    return map_api_error(ApiError(code, message, json.dumps({"message": message}).encode()), what, "the API server")

"""Which API server and credentials a kubeconfig names, read as kubectl reads it (client-go's loading
rules), for the plugin's own light connection (adapters/kubeconn.py):

- the files of $KUBECONFIG (or the one --kubeconfig names) merged first-wins: the first file that names
  a cluster, user or context gives it, and the first that sets current-context chooses;
- a relative path (certificate-authority, client-certificate, client-key, tokenFile, exec's command when
  it has a '/') is relative to the file that names it;
- kubectl's flags on top: --context, --server, --token (replaces the user's credentials), --as/--as-group.

What this does not carry out itself (auth-provider plugins, a proxy-url, impersonation set in the
kubeconfig, an exec plugin of an API version other than client.authentication.k8s.io/v1 or v1beta1) is
named in `Connection.unsupported`: the adapter then hands the kubeconfig to the official client, as
before. Pure: the files' contents come in as mappings.
"""

from __future__ import annotations

import base64
import binascii
import posixpath
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from kubectl_snapshot.core.errors import InvalidArgument

EXEC_API_VERSIONS = ("client.authentication.k8s.io/v1", "client.authentication.k8s.io/v1beta1")
INTERACTIVE_MODES = ("Never", "IfAvailable", "Always")


class KubeconfigInvalid(ValueError):
    """The kubeconfig cannot be used (the adapter says which file and what to do)."""


@dataclass(frozen=True)
class FileOrData:
    """A PEM (or token) given inline (`data`, decoded) or as a file (`path`, resolved)."""

    path: str = ""
    data: bytes = b""


@dataclass(frozen=True)
class ExecPlugin:
    """A credential plugin (users[].user.exec): run for an ExecCredential."""

    api_version: str
    command: str
    args: tuple[str, ...] = ()
    env: tuple[tuple[str, str], ...] = ()
    install_hint: str = ""
    provide_cluster_info: bool = False
    interactive_mode: str = "IfAvailable"


@dataclass(frozen=True)
class Connection:
    """One API server and the credentials to use with it."""

    server: str
    context: str = ""
    namespace: str = "default"
    ca: FileOrData | None = None
    insecure: bool = False
    tls_server_name: str = ""
    client_cert: FileOrData | None = None
    client_key: FileOrData | None = None
    token: str = ""
    token_file: str = ""
    username: str = ""
    password: str = ""
    exec: ExecPlugin | None = None
    impersonate: str = ""
    impersonate_groups: tuple[str, ...] = ()
    cluster: Mapping[str, Any] = field(default_factory=dict)  # as written (exec's provideClusterInfo)
    unsupported: str = ""  # why only the official client can use this kubeconfig ('' when this one can)


@dataclass
class Merged:
    """Named clusters, users and contexts of the files, each with the directory of the file naming it."""

    clusters: dict[str, tuple[Mapping[str, Any], str]] = field(default_factory=dict)
    users: dict[str, tuple[Mapping[str, Any], str]] = field(default_factory=dict)
    contexts: dict[str, tuple[Mapping[str, Any], str]] = field(default_factory=dict)
    current: str = ""


def merge(files: Sequence[tuple[str, Any]]) -> Merged:
    """(path, parsed YAML) of each file in order (missing files left out by the caller); first wins."""
    out = Merged()
    for path, doc in files:
        if doc is None:
            continue  # an empty file
        if not isinstance(doc, Mapping):
            raise KubeconfigInvalid(f"{path} is not a kubeconfig (a YAML mapping)")
        base = posixpath.dirname(path)
        for key, into in (("clusters", out.clusters), ("users", out.users), ("contexts", out.contexts)):
            entries = doc.get(key) or []
            if not isinstance(entries, list):
                raise KubeconfigInvalid(f"{path}: {key} is not a list")
            inner = key[:-1]  # cluster, user, context
            for entry in entries:
                if not isinstance(entry, Mapping) or not entry.get("name"):
                    raise KubeconfigInvalid(f"{path}: an entry of {key} has no name")
                body = entry.get(inner) or {}
                if not isinstance(body, Mapping):
                    raise KubeconfigInvalid(f"{path}: {key} {entry['name']!r} has no {inner} mapping")
                into.setdefault(str(entry["name"]), (body, base))
        if not out.current and doc.get("current-context"):
            out.current = str(doc["current-context"])
    return out


def context_names(merged: Merged) -> list[str]:
    return list(merged.contexts)


def _path(value: Any, base: str) -> str:
    text = str(value)
    return text if not text or posixpath.isabs(text) else posixpath.normpath(posixpath.join(base, text))


def _file_or_data(entry: Mapping[str, Any], key: str, base: str, what: str) -> FileOrData | None:
    data = entry.get(f"{key}-data")
    if data:
        try:
            return FileOrData(data=base64.b64decode(str(data), validate=True))
        except (binascii.Error, ValueError) as e:
            raise KubeconfigInvalid(f"{what}: {key}-data is not base64 ({e})") from e
    path = entry.get(key)
    return FileOrData(path=_path(path, base)) if path else None


def _exec_plugin(spec: Mapping[str, Any], base: str, what: str) -> ExecPlugin | str:
    """The plugin, or why this client does not run it."""
    version = str(spec.get("apiVersion") or "")
    if version not in EXEC_API_VERSIONS:
        return f"{what}: exec plugin apiVersion {version or '(none)'}"
    command = str(spec.get("command") or "")
    if not command:
        raise KubeconfigInvalid(f"{what}: exec has no command")
    if "/" in command:  # a bare name is looked up on $PATH, as kubectl does
        command = _path(command, base)
    env = []
    for item in spec.get("env") or []:
        if not isinstance(item, Mapping) or "name" not in item:
            raise KubeconfigInvalid(f"{what}: an exec env entry has no name")
        env.append((str(item["name"]), str(item.get("value") or "")))
    mode = str(spec.get("interactiveMode") or ("IfAvailable" if version.endswith("v1beta1") else ""))
    if mode not in INTERACTIVE_MODES:
        raise KubeconfigInvalid(f"{what}: exec interactiveMode must be one of {', '.join(INTERACTIVE_MODES)}")
    return ExecPlugin(
        api_version=version,
        command=command,
        args=tuple(str(a) for a in spec.get("args") or []),
        env=tuple(env),
        install_hint=str(spec.get("installHint") or ""),
        provide_cluster_info=bool(spec.get("provideClusterInfo")),
        interactive_mode=mode,
    )


def resolve(
    merged: Merged,
    *,
    where: str,
    context: str | None = None,
    server: str | None = None,
    token: str | None = None,
    impersonate: str | None = None,
    impersonate_groups: tuple[str, ...] = (),
) -> Connection:
    """The connection `context` (else the current context) names, with kubectl's flags applied. With
    --server and no context (no kubeconfig at all), only the flags."""
    if impersonate_groups and not impersonate:
        raise InvalidArgument("--as-group needs --as", hint="name the user to impersonate with --as USER")
    host = (server if "://" in server else f"https://{server}") if server else ""
    name = context or merged.current
    if context and context not in merged.contexts:
        names = ", ".join(merged.contexts) or "none"
        raise InvalidArgument(f"context {context!r} is not in {where}", hint=f"contexts there: {names}")
    if not name:
        if host:
            return Connection(server=host, token=token or "", impersonate=impersonate or "",
                              impersonate_groups=tuple(impersonate_groups))  # fmt: skip
        raise KubeconfigInvalid(f"{where} names no current-context" if merged.contexts else f"{where} has no context")
    if name not in merged.contexts:
        raise KubeconfigInvalid(f"{where}: current-context {name!r} is not one of its contexts")
    ctx, _ = merged.contexts[name]
    cluster_name, user_name = str(ctx.get("cluster") or ""), str(ctx.get("user") or "")
    if cluster_name not in merged.clusters:
        raise KubeconfigInvalid(f"{where}: context {name!r} names cluster {cluster_name!r}, which it does not have")
    cluster, cbase = merged.clusters[cluster_name]
    user, ubase = merged.users.get(user_name, ({}, ""))
    if user_name and user_name not in merged.users and not token:
        raise KubeconfigInvalid(f"{where}: context {name!r} names user {user_name!r}, which it does not have")
    what = f"{where}: user {user_name!r}"
    unsupported = []
    if cluster.get("proxy-url"):
        unsupported.append(f"cluster {cluster_name!r}: proxy-url")
    if not token:
        if user.get("auth-provider"):
            unsupported.append(f"{what}: auth-provider")
        if any(user.get(k) for k in ("as", "as-groups", "as-uid", "as-user-extra")):
            unsupported.append(f"{what}: impersonation in the kubeconfig")
    plugin = None
    if user.get("exec") and not token:
        found = _exec_plugin(user["exec"], ubase, what)
        if isinstance(found, str):
            unsupported.append(found)
        else:
            plugin = found
    base_server = str(cluster.get("server") or "")
    if not (host or base_server):
        raise KubeconfigInvalid(f"{where}: cluster {cluster_name!r} has no server")
    creds: dict[str, Any] = {"token": token} if token else {
        "client_cert": _file_or_data(user, "client-certificate", ubase, what),
        "client_key": _file_or_data(user, "client-key", ubase, what),
        "token": str(user.get("token") or ""),
        "token_file": _path(user.get("tokenFile") or "", ubase),
        "username": str(user.get("username") or ""),
        "password": str(user.get("password") or ""),
        "exec": plugin,
    }  # fmt: skip
    return Connection(
        server=host or base_server,
        context=name,
        namespace=str(ctx.get("namespace") or "default"),
        ca=_file_or_data(cluster, "certificate-authority", cbase, f"{where}: cluster {cluster_name!r}"),
        insecure=bool(cluster.get("insecure-skip-tls-verify")),
        tls_server_name=str(cluster.get("tls-server-name") or ""),
        impersonate=impersonate or "",
        impersonate_groups=tuple(impersonate_groups),
        cluster=cluster,
        unsupported="; ".join(unsupported),
        **creds,
    )

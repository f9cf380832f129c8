"""core/kubeconfig.py: a kubeconfig read as kubectl reads it (client-go's loading rules), and what the
light connection hands to the official client."""

from __future__ import annotations

import base64
from typing import Any

import pytest

from kubectl_snapshot.core import kubeconfig as KC
from kubectl_snapshot.core.errors import InvalidArgument

PEM = b"-----BEGIN CERTIFICATE-----\nMIIB\n-----END CERTIFICATE-----\n"


def config(*, current: str = "main", clusters: Any = None, users: Any = None, contexts: Any = None) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Config",
        "current-context": current,
        "clusters": clusters
        if clusters is not None
        else [{"name": "c", "cluster": {"server": "https://10.0.0.1:6443"}}],
        "users": users if users is not None else [{"name": "u", "user": {"token": "t0"}}],
        "contexts": contexts
        if contexts is not None
        else [{"name": "main", "context": {"cluster": "c", "user": "u", "namespace": "team"}}],
    }


def resolve(*files: tuple[str, Any], **kw: Any) -> KC.Connection:
    return KC.resolve(KC.merge(list(files)), where="KUBECONFIG", **kw)


def test_the_current_context_names_server_credentials_and_namespace() -> None:
    conn = resolve(("/home/a/.kube/config", config()))
    assert (conn.server, conn.token, conn.namespace, conn.context) == ("https://10.0.0.1:6443", "t0", "team", "main")
    assert conn.unsupported == ""


def test_files_merge_first_wins_and_the_first_current_context_chooses() -> None:
    first = config(current="", users=[{"name": "u", "user": {"token": "first"}}], contexts=[], clusters=[])
    second = config(current="main", users=[{"name": "u", "user": {"token": "second"}}])
    conn = resolve(("/a/one", first), ("/b/two", second))
    assert conn.token == "first"  # the user named first wins; the context and cluster come from the second
    assert conn.server == "https://10.0.0.1:6443"
    third = config(current="other", contexts=[{"name": "other", "context": {"cluster": "c", "user": "u"}}])
    assert resolve(("/b/two", second), ("/c/three", third)).context == "main"


def test_relative_paths_are_relative_to_the_file_that_names_them() -> None:
    users = [{"name": "u", "user": {"client-certificate": "certs/me.crt", "client-key": "/abs/me.key"}}]
    clusters = [{"name": "c", "cluster": {"server": "https://s", "certificate-authority": "ca.crt"}}]
    conn = resolve(("/etc/kube/admin.conf", config(users=users, clusters=clusters)))
    assert conn.client_cert == KC.FileOrData(path="/etc/kube/certs/me.crt")
    assert conn.client_key == KC.FileOrData(path="/abs/me.key")
    assert conn.ca == KC.FileOrData(path="/etc/kube/ca.crt")
    token_file = [{"name": "u", "user": {"tokenFile": "tok"}}]
    assert resolve(("/x/y/conf", config(users=token_file))).token_file == "/x/y/tok"


def test_inline_data_is_decoded_and_wins_over_a_path() -> None:
    b64 = base64.b64encode(PEM).decode()
    clusters = [
        {
            "name": "c",
            "cluster": {"server": "https://s", "certificate-authority": "x", "certificate-authority-data": b64},
        }
    ]
    assert resolve(("/k", config(clusters=clusters))).ca == KC.FileOrData(data=PEM)
    bad = [{"name": "c", "cluster": {"server": "https://s", "certificate-authority-data": "not base64!"}}]
    with pytest.raises(KC.KubeconfigInvalid, match="certificate-authority-data is not base64"):
        resolve(("/k", config(clusters=bad)))


def test_context_flag_and_its_absence() -> None:
    two = config(contexts=[{"name": "main", "context": {"cluster": "c", "user": "u"}},
                           {"name": "dev", "context": {"cluster": "c", "user": "u", "namespace": "dev"}}])  # fmt: skip
    assert resolve(("/k", two), context="dev").namespace == "dev"
    with pytest.raises(InvalidArgument, match="context 'nope' is not in KUBECONFIG") as e:
        resolve(("/k", two), context="nope")
    assert "main, dev" in (e.value.hint or "")
    with pytest.raises(KC.KubeconfigInvalid, match="names no current-context"):
        resolve(("/k", config(current="")))
    with pytest.raises(KC.KubeconfigInvalid, match="has no context"):
        resolve()


def test_the_flags_override_the_kubeconfig() -> None:
    conn = resolve(
        ("/k", config()), server="1.2.3.4:6443", token="flag", impersonate="bob", impersonate_groups=("a", "b")
    )
    assert (conn.server, conn.token, conn.impersonate, conn.impersonate_groups) == (
        "https://1.2.3.4:6443",
        "flag",
        "bob",
        ("a", "b"),
    )
    # --token replaces the user's credentials, including what only the official client could use
    provider = [{"name": "u", "user": {"auth-provider": {"name": "oidc"}, "client-certificate": "c"}}]
    replaced = resolve(("/k", config(users=provider)), token="flag")
    assert (replaced.unsupported, replaced.client_cert, replaced.token) == ("", None, "flag")
    with pytest.raises(InvalidArgument, match="--as-group needs --as"):
        resolve(("/k", config()), impersonate_groups=("a",))


def test_server_and_token_flags_need_no_kubeconfig() -> None:
    conn = resolve(server="https://api:6443", token="t")
    assert (conn.server, conn.token, conn.namespace) == ("https://api:6443", "t", "default")


def test_exec_plugins_resolve_with_their_defaults() -> None:
    users = [
        {
            "name": "u",
            "user": {
                "exec": {
                    "apiVersion": "client.authentication.k8s.io/v1beta1",
                    "command": "./bin/login",
                    "args": ["get-token"],
                    "env": [{"name": "A", "value": "1"}],
                    "provideClusterInfo": True,
                }
            },
        }
    ]
    plugin = resolve(("/home/k/config", config(users=users))).exec
    assert plugin == KC.ExecPlugin(
        api_version="client.authentication.k8s.io/v1beta1",
        command="/home/k/bin/login",
        args=("get-token",),
        env=(("A", "1"),),
        provide_cluster_info=True,
        interactive_mode="IfAvailable",
    )
    on_path = [{"name": "u", "user": {"exec": {"apiVersion": KC.EXEC_API_VERSIONS[0], "command": "gke-auth",
                                               "interactiveMode": "Never"}}}]  # fmt: skip
    found = resolve(("/k", config(users=on_path))).exec
    assert found is not None and (found.command, found.interactive_mode) == ("gke-auth", "Never")
    v1_without_mode = [{"name": "u", "user": {"exec": {"apiVersion": KC.EXEC_API_VERSIONS[0], "command": "x"}}}]
    with pytest.raises(KC.KubeconfigInvalid, match="interactiveMode"):
        resolve(("/k", config(users=v1_without_mode)))  # v1 requires it, as client-go does


@pytest.mark.parametrize(
    ("cluster", "user", "named"),
    [
        ({"proxy-url": "http://proxy:3128"}, {"token": "t"}, "proxy-url"),
        ({}, {"auth-provider": {"name": "oidc", "config": {}}}, "auth-provider"),
        ({}, {"token": "t", "as": "admin"}, "impersonation in the kubeconfig"),
        ({}, {"exec": {"apiVersion": "client.authentication.k8s.io/v1alpha1", "command": "x"}}, "v1alpha1"),
    ],
)
def test_what_only_the_official_client_serves_is_named(cluster: Any, user: Any, named: str) -> None:
    clusters = [{"name": "c", "cluster": {"server": "https://s", **cluster}}]
    conn = resolve(("/k", config(clusters=clusters, users=[{"name": "u", "user": user}])))
    assert named in conn.unsupported


@pytest.mark.parametrize(
    ("doc", "match"),
    [
        ("just text", "not a kubeconfig"),
        ({"clusters": {"c": 1}}, "clusters is not a list"),
        ({"users": [{"user": {}}]}, "has no name"),
        ({"contexts": [{"name": "x", "context": "nope"}]}, "has no context mapping"),
    ],
)
def test_malformed_files_are_refused_naming_the_file(doc: Any, match: str) -> None:
    with pytest.raises(KC.KubeconfigInvalid, match=match) as e:
        KC.merge([("/etc/bad", doc)])
    assert "/etc/bad" in str(e.value)


def test_dangling_names_are_refused() -> None:
    with pytest.raises(KC.KubeconfigInvalid, match="names cluster 'gone'"):
        resolve(("/k", config(contexts=[{"name": "main", "context": {"cluster": "gone", "user": "u"}}])))
    with pytest.raises(KC.KubeconfigInvalid, match="names user 'gone'"):
        resolve(("/k", config(contexts=[{"name": "main", "context": {"cluster": "c", "user": "gone"}}])))
    with pytest.raises(KC.KubeconfigInvalid, match="has no server"):
        resolve(("/k", config(clusters=[{"name": "c", "cluster": {}}])))
    assert resolve(("/k", config()), context=None).context == "main"
    assert resolve(("/k", None), ("/j", config())).server == "https://10.0.0.1:6443"  # an empty file

"""Namespace key stores (adapters/keystore.py): created once on first use, never replaced, found again
by key id after a rotation; the Secret store survives concurrent agents (resourceVersion conflicts),
and its Secret is created by `kubectl snapshot install`, never by the agent.

The Secret store is tested against an in-memory API with the API server's optimistic-concurrency rule
(a stale resourceVersion is a 409); the real one runs in the e2e tests of the agent."""

from __future__ import annotations

import base64
import copy
import os
import stat
from pathlib import Path
from typing import Any

import pytest

from kubectl_snapshot.adapters import keystore
from kubectl_snapshot.adapters.keystore import FileKeyProvider, SecretKeyProvider
from kubectl_snapshot.app.install import key_objects
from kubectl_snapshot.core import keysecret
from kubectl_snapshot.core import kubenames as K
from kubectl_snapshot.core.errors import FailedPrecondition, InvalidArgument, NotFound
from kubectl_snapshot.core.sealing import LocalNamespaceKey, Sealer, key_id_of, new_key
from kubectl_snapshot.deploy import LABELS, keys, render
from tests.support.fakeplugin import FakeKube


def test_file_keys_are_created_once_private_and_per_namespace(tmp_path: Path) -> None:
    p = FileKeyProvider(str(tmp_path / "keys"))
    with pytest.raises(NotFound):
        p.namespace_key("team-a", create=False)
    a1 = p.namespace_key("team-a", create=True)
    a2 = FileKeyProvider(str(tmp_path / "keys")).namespace_key("team-a", create=True)
    b = p.namespace_key("team-b", create=True)
    assert a1.key_id == a2.key_id != b.key_id
    assert stat.S_IMODE(os.stat(tmp_path / "keys").st_mode) == 0o700
    assert stat.S_IMODE(os.stat(tmp_path / "keys" / "team-a.key").st_mode) == 0o600
    assert p.namespace_key("team-a", create=False, key_id=a1.key_id).key_id == a1.key_id


def test_file_keys_after_a_rotation_still_open_older_snapshots(tmp_path: Path) -> None:
    d = tmp_path / "keys"
    p = FileKeyProvider(str(d))
    old = p.namespace_key("ns", create=True)
    (d / "ns.key").rename(d / f"ns.{old.key_id}.key")  # the documented rotation
    new = p.namespace_key("ns", create=True)
    assert new.key_id != old.key_id
    assert p.namespace_key("ns", create=False, key_id=old.key_id).key_id == old.key_id
    with pytest.raises(NotFound):
        p.namespace_key("ns", create=False, key_id="k1-" + "0" * 16)
    with pytest.raises(FailedPrecondition):
        p.namespace_key("ns", create=False, key_id="../../etc/passwd")


def test_bad_namespace_names_and_damaged_keys_are_refused(tmp_path: Path) -> None:
    p = FileKeyProvider(str(tmp_path))
    for bad in ("", "../x", "a/b", ".hidden", "x" * 300):
        with pytest.raises(InvalidArgument):
            p.namespace_key(bad, create=True)
    (tmp_path / "ns.key").write_text("not a key")
    with pytest.raises(FailedPrecondition, match="not 32"):
        p.namespace_key("ns", create=True)


class FakeSecretsAPI:
    """Secrets by name with the API server's resourceVersion rule; `race` makes the next N writes lose."""

    def __init__(self) -> None:
        self.objects: dict[tuple[str, str], dict[str, Any]] = {}
        self.rv = 0
        self.race = 0
        self.writes = 0

    def _store(self, ns: str, body: dict[str, Any]) -> dict[str, Any]:
        self.rv += 1
        obj = copy.deepcopy(body)
        obj["metadata"]["resourceVersion"] = str(self.rv)
        self.objects[(ns, obj["metadata"]["name"])] = obj
        self.writes += 1
        return obj

    def _interfere(self, ns: str, name: str) -> None:
        if self.race:
            self.race -= 1
            other = new_key()
            cur = self.objects.get((ns, name)) or {"metadata": {"name": name}, "data": {}}
            cur = copy.deepcopy(cur)
            cur.setdefault("data", {})[f"other-{self.race}"] = base64.b64encode(other).decode()
            self._store(ns, cur)

    def get_secret(self, ns: str, name: str) -> dict[str, Any]:
        if (ns, name) not in self.objects:
            raise NotFound(f"secret {ns}/{name}")
        return copy.deepcopy(self.objects[(ns, name)])

    def replace_secret(self, ns: str, name: str, body: dict[str, Any]) -> dict[str, Any]:
        self._interfere(ns, name)
        if body["metadata"].get("resourceVersion") != self.objects[(ns, name)]["metadata"]["resourceVersion"]:
            raise FailedPrecondition("conflict", retryable=True)
        return self._store(ns, body)


def installed() -> FakeSecretsAPI:
    """The API with the empty key Secret `kubectl snapshot install` creates (the agent never creates it)."""
    api = FakeSecretsAPI()
    [secret] = key_objects(FakeKube())
    api._store(K.AGENT_NAMESPACE, secret)
    api.writes = 0
    return api


def test_install_creates_the_key_secret_once_and_the_agent_only_fills_it() -> None:
    plugin_api = FakeKube()
    plugin_api.add({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": K.AGENT_NAMESPACE}})
    [secret] = key_objects(plugin_api)
    assert secret == keysecret.key_secret({}) and secret["data"] == {}
    assert (secret["metadata"]["namespace"], secret["metadata"]["name"]) == (K.AGENT_NAMESPACE, keys.KEY_SECRET)
    plugin_api.apply([secret])
    assert key_objects(plugin_api) == []  # a second install leaves the Secret (and every key in it) alone
    api = installed()
    key = SecretKeyProvider(api).namespace_key("team-a", create=True)
    data = api.objects[(K.AGENT_NAMESPACE, keystore.KEY_SECRET)]["data"]
    assert key_id_of(base64.b64decode(data["team-a"])) == key.key_id and api.writes == 1  # one update


def test_without_the_installed_secret_the_agent_creates_nothing_and_says_to_install() -> None:
    api = FakeSecretsAPI()  # no create_secret at all: the agent's port has none either
    with pytest.raises(FailedPrecondition, match="creates no Secrets") as e:
        SecretKeyProvider(api).namespace_key("team-a", create=True)
    assert e.value.hint is not None and "kubectl snapshot install" in e.value.hint
    assert api.objects == {} and api.writes == 0
    with pytest.raises(NotFound):  # a restore asks for an existing key only: not found, as before
        SecretKeyProvider(api).namespace_key("team-a", create=False)


def test_secret_keys_live_in_one_secret_of_the_agent_namespace() -> None:
    api = installed()
    p = SecretKeyProvider(api)
    a = p.namespace_key("team-a", create=True)
    b = p.namespace_key("team-b", create=True)
    assert list(api.objects) == [(K.AGENT_NAMESPACE, keystore.KEY_SECRET)]
    data = api.objects[(K.AGENT_NAMESPACE, keystore.KEY_SECRET)]["data"]
    assert set(data) == {"team-a", "team-b"}
    assert key_id_of(base64.b64decode(data["team-a"])) == a.key_id != b.key_id
    # another agent (another node) with its own cache finds the same keys and writes nothing
    writes = api.writes
    other = SecretKeyProvider(api)
    assert other.namespace_key("team-a", create=True).key_id == a.key_id
    assert other.namespace_key("team-b", create=False, key_id=b.key_id).key_id == b.key_id
    assert api.writes == writes
    with pytest.raises(NotFound):
        other.namespace_key("team-c", create=False)


def test_secret_keys_survive_concurrent_writers_without_losing_a_key() -> None:
    api = installed()
    p = SecretKeyProvider(api)
    api.race = 1  # another agent adds its key first
    first = p.namespace_key("ns1", create=True)
    api.race = 3  # three more conflicting updates before ours lands
    second = p.namespace_key("ns2", create=True)
    data = api.objects[(K.AGENT_NAMESPACE, keystore.KEY_SECRET)]["data"]
    assert {"ns1", "ns2", "other-0"} <= set(data)
    assert key_id_of(base64.b64decode(data["ns1"])) == first.key_id
    assert key_id_of(base64.b64decode(data["ns2"])) == second.key_id
    api.race = 100
    with pytest.raises(FailedPrecondition, match="conflicting updates"):
        p.namespace_key("ns3", create=True)


def test_a_cached_secret_is_reread_for_a_key_it_lacks() -> None:
    api = installed()
    p1, p2 = SecretKeyProvider(api), SecretKeyProvider(api)
    p1.namespace_key("x", create=True)
    p2.namespace_key("x", create=False)  # p2 caches the Secret
    y = p1.namespace_key("y", create=True)  # written by another agent after p2's read
    assert p2.namespace_key("y", create=False).key_id == y.key_id


def test_keys_from_the_store_seal_and_open() -> None:
    api = installed()
    key = SecretKeyProvider(api).namespace_key("ns", create=True)
    s = Sealer(key, "ns")
    sealed, digest = s.seal_chunk(b"chunk" * 1000)
    again = SecretKeyProvider(api).namespace_key("ns", create=False, key_id=key.key_id)
    from kubectl_snapshot.core.sealing import Opener

    assert Opener(s.info([digest]), again).open_chunk(digest, sealed) == b"chunk" * 1000
    assert isinstance(again, LocalNamespaceKey)


def test_the_agent_may_touch_only_its_key_secret() -> None:
    assert keys.KEY_SECRET == keystore.KEY_SECRET
    objs = {(o["kind"], o["metadata"]["name"]): o for o in render("img:1")}
    role = objs[("Role", keys.ROLE)]
    assert role["metadata"]["namespace"] == K.AGENT_NAMESPACE
    named = [r for r in role["rules"] if r.get("resourceNames")]
    assert named == [
        {"apiGroups": [""], "resources": ["secrets"], "resourceNames": [keys.KEY_SECRET], "verbs": ["get", "update"]}
    ]
    # no create: a Role that may create Secrets lets a stolen agent token mint a token Secret that never expires
    assert [r for r in role["rules"] if not r.get("resourceNames")] == []
    binding = objs[("RoleBinding", keys.ROLE)]
    assert binding["roleRef"]["name"] == keys.ROLE and binding["metadata"]["namespace"] == K.AGENT_NAMESPACE
    assert binding["subjects"][0]["name"] == K.AGENT_NAME
    assert not any(o["kind"] == "Secret" for o in render("img:1"))  # never re-applied over the keys
    assert role["metadata"]["labels"] == LABELS

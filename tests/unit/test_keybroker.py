"""The key broker (shim/service/keybroker.py) and the agent's `BrokerKeyProvider` (adapters/keybroker.py),
over the real wire format on loopback TLS, the API server faked (tests/support/fakekube.StrictKube).

Each refusal beside the legitimate save or restore it must let through; the broker's bounds (request
size, new tokens per second, a client that says nothing)."""

from __future__ import annotations

import base64
import datetime
import hashlib
import json
import socket
import ssl
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from kubectl_snapshot.adapters.keybroker import BUSY_WAIT_S, BrokerKeyProvider, BrokerNamespaceKey, _Coalesced
from kubectl_snapshot.adapters.keystore import FileKeyProvider
from kubectl_snapshot.core import constants as C
from kubectl_snapshot.core import keyaccess as KA
from kubectl_snapshot.core import kubenames as K
from kubectl_snapshot.core.encryption import EncryptionInfo
from kubectl_snapshot.core.errors import FailedPrecondition, NotFound, PermissionDenied, Unavailable
from kubectl_snapshot.core.model import ContainerRecord, HostFacts, SnapshotConfig, parse_config
from kubectl_snapshot.core.oci import Descriptor, build_manifest, sha256_digest
from kubectl_snapshot.core.sealing import KeyUse, Opener, Sealer, open_bytes, wrap_aad
from kubectl_snapshot.core.servingcert import serving_cert
from shim.engine.restore import opener_for
from shim.service import keybroker
from shim.service.metrics_auth import RateLimit
from tests.support.fakekube import StrictKube
from tests.support.snapshotbytes import snapshot_bytes

DIGEST = "sha256:" + "ab" * 32
SNAP = f"registry.example:5000/team/app@{DIGEST}"


class Cluster(StrictKube):
    """Pods by (namespace, name); tokens by value -> node."""

    def __init__(self) -> None:
        self.pods: dict[tuple[str, str], dict[str, Any]] = {}
        self.tokens: dict[str, str] = {}
        self.grants: dict[str, list[dict[str, Any]]] = {}
        self.reviews = 0

    def add_pod(self, ns: str, name: str, node: str, *, phase: str = "Running", **annotations: str) -> KeyUse:
        uid = f"uid-{ns}-{name}"
        self.pods[(ns, name)] = {
            "metadata": {"namespace": ns, "name": name, "uid": uid, "annotations": annotations},
            "spec": {"nodeName": node},
            "status": {"phase": phase},
        }
        return KeyUse(ns, name, uid, snapshot=annotations.get(K.ANN_RESTORE_FROM, ""))

    def token_review(self, token: str, *, audiences: Sequence[str] = ()) -> dict[str, Any]:
        self.reviews += 1
        node = self.tokens.get(token)
        user = {"username": K.AGENT_USER, "extra": {KA.NODE_EXTRA: [node]}}
        return {"status": {"authenticated": node is not None, "audiences": list(audiences), "user": user}}

    def get_pod(self, ns: str, name: str) -> dict[str, Any]:
        try:
            return self.pods[(ns, name)]
        except KeyError:
            raise NotFound(f"pod {ns}/{name} not found") from None

    def list_snapshots(self, ns: str | None, *, label_selector: str | None = None) -> list[dict[str, Any]]:
        return []

    def list_snapshot_grants(self, ns: str) -> list[dict[str, Any]]:
        return self.grants.get(ns, [])


@pytest.fixture
def tls(tmp_path: Path) -> tuple[str, str]:
    cert, key = serving_cert(["localhost", "127.0.0.1"], now=datetime.datetime.now(datetime.UTC))
    (tmp_path / "tls.crt").write_bytes(cert)
    (tmp_path / "tls.key").write_bytes(key)
    return str(tmp_path / "tls.crt"), str(tmp_path / "tls.key")


@pytest.fixture
def cluster() -> Cluster:
    return Cluster()


@pytest.fixture
def broker(cluster: Cluster, tls: tuple[str, str], tmp_path: Path) -> Iterator[str]:
    server = keybroker.serve(
        keybroker.Broker(cluster, FileKeyProvider(str(tmp_path / "keys"))),
        host="127.0.0.1",
        port=0,
        cert_file=tls[0],
        key_file=tls[1],
        deadline_s=2.0,
    )
    try:
        yield f"https://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def agent_of(node: str, url: str, cluster: Cluster, tls: tuple[str, str], tmp_path: Path) -> BrokerKeyProvider:
    token = tmp_path / f"token-{node}"
    token.write_text(f"token-of-{node}\n")
    cluster.tokens[f"token-of-{node}"] = node
    return BrokerKeyProvider(url, token_file=str(token), ca_file=tls[0])


def test_a_save_and_its_restore_through_the_broker(
    broker: str, cluster: Cluster, tls: tuple[str, str], tmp_path: Path
) -> None:
    """The legitimate case: node A saves its pod of namespace x (key made on first use, blobs and chunks
    sealed), then node A's restore pod of that snapshot opens them; the key never reached the agent."""
    agent = agent_of("node-a", broker, cluster, tls, tmp_path)
    use = cluster.add_pod("x", "app", "node-a")
    sealer = Sealer(agent.namespace_key("x", create=True, use=use), "x")
    chunk, chunk_digest = sealer.seal_chunk(b"page" * 1024)
    again, _ = sealer.seal_chunk(b"page" * 1024)
    assert again == chunk  # convergent through the broker's mac, as with a local key
    dek = sealer.stream_key()
    layer = b"".join(sealer.seal_stream([b"layer bytes"], dek))
    layer_digest = "sha256:" + hashlib.sha256(layer).hexdigest()
    sealer.record(layer_digest, dek)
    info = sealer.info([chunk_digest, layer_digest])

    snap, manifest, config = sealed_snapshot(info, layer_digest, chunk_digest)
    restore_use = cluster.add_pod("x", "app-restored", "node-a", phase="Pending", **{K.ANN_RESTORE_FROM: snap})
    restore_use = replace(restore_use, manifest=manifest, config=config)
    opener = opener_for(parse_config(config), agent, "x", use=restore_use)
    assert isinstance(opener, Opener)
    assert bytes(opener.open_chunk(chunk_digest, chunk)) == b"page" * 1024
    assert bytes(open_bytes(layer, opener.data_key(layer_digest))) == b"layer bytes"


def sealed_snapshot(info: EncryptionInfo, layer: str, volumes: str) -> tuple[str, bytes, bytes]:
    """A snapshot (reference by digest, manifest, config) whose config names a container layer and a
    volumes layer sealed with `info`'s keys."""
    manifest, cfg = snapshot_bytes(info.namespace, layer, volumes, info)
    return f"registry.example:5000/team/app@{sha256_digest(manifest)}", manifest, cfg


def two_sealed_snapshots(
    agent: BrokerKeyProvider, cluster: Cluster
) -> tuple[tuple[str, bytes, bytes, str, bytes], tuple[str, bytes, bytes, str, bytes]]:
    """Two saves of node A's pod of namespace x, each (reference, manifest, config, its layer's digest, the
    layer's wrapped data key)."""
    out = []
    for n in (1, 2):
        use = cluster.add_pod("x", "app", "node-a")
        sealer = Sealer(agent.namespace_key("x", create=True, use=use), "x")
        dek = sealer.stream_key()
        layer = b"".join(sealer.seal_stream([f"layer {n}".encode()], dek))
        layer_digest = "sha256:" + hashlib.sha256(layer).hexdigest()
        sealer.record(layer_digest, dek)
        vol = b"".join(sealer.seal_stream([f"volumes {n}".encode()], dek2 := sealer.stream_key()))
        vol_digest = "sha256:" + hashlib.sha256(vol).hexdigest()
        sealer.record(vol_digest, dek2)
        info = sealer.info([layer_digest, vol_digest])
        snap, manifest, config = sealed_snapshot(info, layer_digest, vol_digest)
        out.append((snap, manifest, config, layer_digest, base64.b64decode(info.keys[layer_digest])))
    return out[0], out[1]


def test_a_restore_opens_only_the_data_keys_of_its_own_snapshot(
    broker: str, cluster: Cluster, tls: tuple[str, str], tmp_path: Path
) -> None:
    """D14: node A holds a restore pod of snapshot 1 of namespace x. The broker unwraps snapshot 1's data
    keys for it (the legitimate case), and refuses a data key of snapshot 2 of the same namespace that A
    sends in that restore's name (before: any wrapped key of x was unwrapped for any restore pod of x on A)."""
    agent = agent_of("node-a", broker, cluster, tls, tmp_path)
    (snap1, man1, cfg1, layer1, wrapped1), (_snap2, _man2, _cfg2, layer2, wrapped2) = two_sealed_snapshots(
        agent, cluster
    )
    use = replace(
        cluster.add_pod("x", "restored", "node-a", phase="Pending", **{K.ANN_RESTORE_FROM: snap1}),
        manifest=man1, config=cfg1,
    )  # fmt: skip
    key = agent.namespace_key("x", create=False, use=use)
    assert key.unwrap(wrapped1, wrap_aad("x", layer1))  # its own
    with pytest.raises(PermissionDenied, match="not in the snapshot opened for this restore"):
        key.unwrap(wrapped2, wrap_aad("x", layer2))
    with pytest.raises(PermissionDenied, match="not in the snapshot opened for this restore"):
        key.unwrap(wrapped2, wrap_aad("x", layer1))  # another key under its blob's name


def test_an_open_must_show_the_snapshot_the_pod_names(
    broker: str, cluster: Cluster, tls: tuple[str, str], tmp_path: Path
) -> None:
    """The manifest and config sent must be the ones the pod's restore-from digest names: snapshot 2's,
    sent for a restore of snapshot 1, is refused, and so is a config the manifest does not name."""
    agent = agent_of("node-a", broker, cluster, tls, tmp_path)
    first, second = two_sealed_snapshots(agent, cluster)
    snap1, man1, _cfg1, layer1, wrapped1 = first
    _s2, man2, cfg2, layer2, wrapped2 = second
    pod = cluster.add_pod("x", "restored", "node-a", phase="Pending", **{K.ANN_RESTORE_FROM: snap1})
    for manifest, config, why in ((man2, cfg2, "not the one"), (man1, cfg2, "not the one the manifest")):
        key = agent.namespace_key("x", create=False, use=replace(pod, manifest=manifest, config=config))
        with pytest.raises(Unavailable, match=why):
            key.unwrap(wrapped2, wrap_aad("x", layer2))
    # without them (an agent that does not open): refused, never unwrapped
    key = agent.namespace_key("x", create=False, use=pod)
    with pytest.raises(FailedPrecondition, match="did not pass its manifest and config"):
        key.unwrap(wrapped1, wrap_aad("x", layer1))


def test_an_unwrap_before_any_open_is_refused_by_the_broker(
    broker: str, cluster: Cluster, tls: tuple[str, str], tmp_path: Path
) -> None:
    """What an agent that never opens the snapshot (an older one) sends: 409, nothing unwrapped."""
    agent = agent_of("node-a", broker, cluster, tls, tmp_path)
    (snap1, _m, _c, layer1, wrapped1), _ = two_sealed_snapshots(agent, cluster)
    use = cluster.add_pod("x", "restored", "node-a", phase="Pending", **{K.ANN_RESTORE_FROM: snap1})
    body = KA.request_body(
        KA.KeyRequest("restore", "unwrap", "x", "restored", use.pod_uid, snapshot=snap1),
        wrapped=base64.b64encode(wrapped1).decode(),
        aad=base64.b64encode(wrap_aad("x", layer1)).decode(),
    )
    code, answer = _post(broker, tls[0], json.dumps(body).encode(), headers={"Authorization": "Bearer token-of-node-a"})
    assert code == 409 and "open" in answer["error"] and "dek" not in answer


def test_a_restore_into_another_namespace_opens_only_where_a_grant_allows_it(
    broker: str, cluster: Cluster, tls: tuple[str, str], tmp_path: Path
) -> None:
    """A snapshot sealed for namespace x restored by a pod of namespace y (the agent's grant check passed):
    the broker opens x's data keys for it only while a SnapshotGrant of x lists y (before: refused always,
    since the broker looked for the pod in x; a granted restore failed in this mode)."""
    agent = agent_of("node-a", broker, cluster, tls, tmp_path)
    (snap1, man1, cfg1, layer1, wrapped1), _ = two_sealed_snapshots(agent, cluster)
    use = replace(
        cluster.add_pod("y", "restored", "node-a", phase="Pending", **{K.ANN_RESTORE_FROM: snap1}),
        manifest=man1, config=cfg1,
    )  # fmt: skip
    with pytest.raises(PermissionDenied, match="no SnapshotGrant in 'x' grants 'y'"):
        agent.namespace_key("x", create=False, use=use)
    cluster.grants["y"] = [_grant("y", ["y"])]  # y granting itself x's snapshots counts for nothing
    with pytest.raises(PermissionDenied, match="no SnapshotGrant in 'x' grants 'y'"):
        agent.namespace_key("x", create=False, use=use)
    cluster.grants["x"] = [_grant("x", ["y"])]
    opener = opener_for(parse_config(cfg1), agent, "y", other_namespace_ok=True, use=use)
    assert isinstance(opener, Opener)
    assert opener.data_key(layer1) == agent.namespace_key("x", create=False, use=use).unwrap(
        wrapped1, wrap_aad("x", layer1)
    )
    cluster.grants["x"] = []  # the grant withdrawn: no further key (the broker reads grants per request)
    with pytest.raises(PermissionDenied, match="no SnapshotGrant"):
        agent.namespace_key("x", create=False, use=use).unwrap(wrapped1, wrap_aad("x", layer1))


def test_a_snapshots_data_keys_cross_the_wire_in_batches(
    broker: str, cluster: Cluster, tls: tuple[str, str], tmp_path: Path
) -> None:
    """A save of 300 chunks wraps their keys in 3 requests (not 300), its restore unwraps them in 3 after
    one open; a batch holding one key of another snapshot is refused whole."""
    agent = agent_of("node-a", broker, cluster, tls, tmp_path)
    sent: list[str] = []
    post = agent.post

    def counted(body: dict[str, Any]) -> dict[str, Any]:
        sent.append(str(body["op"]))
        return post(body)

    agent.post = counted  # type: ignore[method-assign]
    sealer = Sealer(agent.namespace_key("x", create=True, use=cluster.add_pod("x", "app", "node-a")), "x")
    blobs = dict(sealer.seal_chunk(i.to_bytes(4, "big") * 16)[::-1] for i in range(300))
    info = sealer.info(blobs)
    assert sent.count("wrap") == 3, sent
    layer, vol, *chunks = list(blobs)
    manifest, cfg = snapshot_bytes("x", layer, vol, info, chunks)
    snap = f"registry.example:5000/team/app@{sha256_digest(manifest)}"
    use = replace(
        cluster.add_pod("x", "restored", "node-a", phase="Pending", **{K.ANN_RESTORE_FROM: snap}),
        manifest=manifest, config=cfg,
    )  # fmt: skip
    sent.clear()
    opener = opener_for(parse_config(cfg), agent, "x", use=use)
    assert isinstance(opener, Opener)
    for digest, sealed in blobs.items():
        assert bytes(opener.open_chunk(digest, sealed)) == int.to_bytes(list(blobs).index(digest), 4, "big") * 16
    assert sent == ["key", "unwrap", "unwrap", "unwrap"], sent  # each shows the snapshot itself: no open
    (_, _, _, other_layer, other_wrapped), _ = two_sealed_snapshots(agent, cluster)
    key = agent.namespace_key("x", create=False, use=use)
    assert isinstance(key, BrokerNamespaceKey)
    own = [(base64.b64decode(info.keys[layer]), wrap_aad("x", layer))]
    assert key.unwrap_many(own) == [opener.data_key(layer)]  # the legitimate one
    with pytest.raises(PermissionDenied, match="not in the snapshot opened"):
        key.unwrap_many([*own, (other_wrapped, wrap_aad("x", other_layer))])


def test_any_replica_answers_a_restores_unwrap(cluster: Cluster, tls: tuple[str, str], tmp_path: Path) -> None:
    """Two brokers (replicas: the same keys, nothing else shared) behind one address that sends each
    request to the other one: every unwrap shows the snapshot, so a replica that saw no open answers it
    (before, an open on one and the unwrap on the other was 409, twice: "keys unavailable"); an unwrap
    showing another snapshot's manifest is refused by either."""
    keys = FileKeyProvider(str(tmp_path / "keys"))
    servers = [
        keybroker.serve(keybroker.Broker(cluster, keys), host="127.0.0.1", port=0, cert_file=tls[0], key_file=tls[1])
        for _ in range(2)
    ]
    try:
        ports = [s.server_address[1] for s in servers]
        agent = agent_of("node-a", f"https://127.0.0.1:{ports[0]}", cluster, tls, tmp_path)
        post = agent._post

        def round_robin(body: dict[str, Any], *, last: bool = False, reachable_only: bool = True) -> dict[str, Any]:
            agent.port = ports[1] if agent.port == ports[0] else ports[0]
            return post(body, last=last, reachable_only=reachable_only)

        agent._post = round_robin  # type: ignore[method-assign]
        (snap1, man1, cfg1, layer1, wrapped1), (_, man2, _, _, _) = two_sealed_snapshots(agent, cluster)
        use = replace(
            cluster.add_pod("x", "restored", "node-a", phase="Pending", **{K.ANN_RESTORE_FROM: snap1}),
            manifest=man1, config=cfg1,
        )  # fmt: skip
        key = agent.namespace_key("x", create=False, use=use)
        assert key.unwrap(wrapped1, wrap_aad("x", layer1)) == key.unwrap(wrapped1, wrap_aad("x", layer1))
        for _ in range(2):  # on each replica
            key = agent.namespace_key("x", create=False, use=replace(use, manifest=man2))
            with pytest.raises(Unavailable, match="not the one"):
                key.unwrap(wrapped1, wrap_aad("x", layer1))
    finally:
        for s in servers:
            s.shutdown()
            s.server_close()


def _grant(ns: str, targets: list[str]) -> dict[str, Any]:
    return {"metadata": {"name": "g", "namespace": ns}, "spec": {"targetNamespaces": targets}}


def test_mac_is_batched(broker: str, cluster: Cluster, tls: tuple[str, str], tmp_path: Path) -> None:
    agent = agent_of("node-a", broker, cluster, tls, tmp_path)
    key = agent.namespace_key("x", create=True, use=cluster.add_pod("x", "app", "node-a"))
    assert isinstance(key, BrokerNamespaceKey)
    macs = key.mac_many([i.to_bytes(2, "big") for i in range(KA.MAX_MACS + 3)])
    assert len(macs) == KA.MAX_MACS + 3 and macs[258] == key.mac((258).to_bytes(2, "big"))


def _callers(call: Any, items: list[bytes]) -> tuple[list[threading.Thread], dict[bytes, Any]]:
    got: dict[bytes, Any] = {}

    def one(item: bytes) -> None:
        try:
            got[item] = call(item)
        except Exception as e:
            got[item] = e

    return [threading.Thread(target=one, args=(i,)) for i in items], got


def _first_then_the_rest(
    macs: _Coalesced, items: list[bytes], first_sent: Any, held: threading.Event
) -> dict[bytes, Any]:
    """The first item's call sent (and held in `many` until `held`), then the others' calls made and
    waiting, then the first released; each call's result (or error) by item."""
    threads, got = _callers(macs, items)
    threads[0].start()
    deadline = time.monotonic() + 10
    while not first_sent() and time.monotonic() < deadline:
        time.sleep(0.005)
    for t in threads[1:]:
        t.start()
    while len(macs._waiting) < len(items) - 1 and time.monotonic() < deadline:
        time.sleep(0.005)
    held.set()
    for t in threads:
        t.join(10)
    return got


def test_macs_asked_at_once_by_several_threads_share_requests() -> None:
    """The first caller's request is held until seven more wait: they go together in one request, each
    gets its own answer; a caller with nothing in flight sends at once (no added wait)."""
    sent: list[list[bytes]] = []
    held = threading.Event()

    def many(items: Sequence[bytes]) -> list[bytes]:
        sent.append(list(items))
        if len(sent) == 1:
            held.wait(10)
        return [b"mac:" + i for i in items]

    macs = _Coalesced(many, limit=5)
    got = _first_then_the_rest(macs, [bytes([i]) for i in range(8)], lambda: bool(sent), held)
    assert got == {bytes([i]): b"mac:" + bytes([i]) for i in range(8)}
    assert [len(b) for b in sent] == [1, 5, 2] and macs.requests == 3  # 3 requests for 8, at most 5 each
    assert macs(b"z") == b"mac:z" and sent[-1] == [b"z"]  # alone: at once, in a request of its own


def test_a_failed_request_fails_only_the_calls_it_held() -> None:
    held = threading.Event()
    calls = [0]

    def many(items: Sequence[bytes]) -> list[bytes]:
        calls[0] += 1
        if calls[0] == 1:
            held.wait(10)
            return [b"ok" for _ in items]
        raise Unavailable("keys unavailable: the broker went away")

    macs = _Coalesced(many, limit=256)
    got = _first_then_the_rest(macs, [b"a", b"b", b"c"], lambda: calls[0] > 0, held)
    assert got[b"a"] == b"ok"
    assert all(isinstance(got[k], Unavailable) for k in (b"b", b"c")), got
    calls[0] = 0  # nothing is left stuck: the next call leads its own request
    assert macs(b"d") == b"ok"


def test_a_saves_chunk_keys_from_several_workers_share_the_brokers_requests(
    broker: str, cluster: Cluster, tls: tuple[str, str], tmp_path: Path
) -> None:
    """Through the real broker: 64 chunks sealed by 8 threads ask fewer `mac`s than chunks, and each
    chunk's key is the one a single call gives (the restore opens every chunk)."""
    agent = agent_of("node-a", broker, cluster, tls, tmp_path)
    sent: list[str] = []
    post = agent.post

    def counted(body: dict[str, Any]) -> dict[str, Any]:
        sent.append(str(body["op"]))
        time.sleep(0.01)  # a broker a network away: the others' chunks queue meanwhile
        return post(body)

    agent.post = counted  # type: ignore[method-assign]
    key = agent.namespace_key("x", create=True, use=cluster.add_pod("x", "app", "node-a"))
    sealer = Sealer(key, "x")
    plains = [i.to_bytes(4, "big") * 64 for i in range(64)]
    threads, got = _callers(lambda p: sealer.seal_chunk(p), plains)
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert all(isinstance(v, tuple) for v in got.values()) and len(got) == 64, got
    assert 1 <= sent.count("mac") < 32, sent  # at most one per chunk before
    alone = Sealer(key, "x")
    assert all(alone.seal_chunk(p)[1] == got[p][1] for p in plains[:4])  # the same convergent keys


def test_another_nodes_pod_gets_no_key(broker: str, cluster: Cluster, tls: tuple[str, str], tmp_path: Path) -> None:
    """Node A's token: namespace x (a pod on A) answered; namespace y (its pods on B) refused, whatever
    pod of y it names, and so is A's own pod once it is gone."""
    agent_a = agent_of("node-a", broker, cluster, tls, tmp_path)
    mine = cluster.add_pod("x", "app", "node-a")
    agent_a.namespace_key("x", create=True, use=mine).wrap(b"k" * 32, b"aad")  # the legitimate one
    theirs = cluster.add_pod("y", "db", "node-b")
    with pytest.raises(PermissionDenied, match="on node node-b, not on the caller's node node-a"):
        agent_a.namespace_key("y", create=True, use=theirs)
    # B's own agent gets it
    agent_b = agent_of("node-b", broker, cluster, tls, tmp_path)
    agent_b.namespace_key("y", create=True, use=theirs).wrap(b"k" * 32, b"aad")
    # A names its own pod in y's namespace: there is no such pod
    with pytest.raises(PermissionDenied, match="does not exist"):
        agent_a.namespace_key("y", create=False, use=KeyUse("y", "app", mine.pod_uid))
    del cluster.pods[("x", "app")]
    with pytest.raises(PermissionDenied, match="does not exist"):
        agent_a.namespace_key("x", create=False, use=mine)


def test_a_restore_of_another_snapshot_is_refused(
    broker: str, cluster: Cluster, tls: tuple[str, str], tmp_path: Path
) -> None:
    agent = agent_of("node-a", broker, cluster, tls, tmp_path)
    agent.namespace_key("x", create=True, use=cluster.add_pod("x", "app", "node-a"))
    use = cluster.add_pod("x", "restored", "node-a", phase="Pending", **{K.ANN_RESTORE_FROM: SNAP})
    agent.namespace_key("x", create=False, use=use)  # the legitimate one
    other = KeyUse("x", "restored", use.pod_uid, snapshot=f"registry.example:5000/team/app@sha256:{'cd' * 32}")
    with pytest.raises(PermissionDenied, match="restores"):
        agent.namespace_key("x", create=False, use=other)


def test_a_namespace_without_a_key_is_not_found_on_restore(
    broker: str, cluster: Cluster, tls: tuple[str, str], tmp_path: Path
) -> None:
    agent = agent_of("node-a", broker, cluster, tls, tmp_path)
    use = cluster.add_pod("z", "restored", "node-a", phase="Pending", **{K.ANN_RESTORE_FROM: SNAP})
    with pytest.raises(NotFound):
        agent.namespace_key("z", create=False, use=use)


def test_a_key_asked_for_no_pod_is_refused_by_the_agent_itself(tls: tuple[str, str]) -> None:
    with pytest.raises(FailedPrecondition, match="no pod's save or restore"):
        BrokerKeyProvider("https://127.0.0.1:1", ca_file=tls[0]).namespace_key("x", create=True)


def test_an_unreachable_broker_says_keys_unavailable(tls: tuple[str, str], tmp_path: Path) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # nothing listens there once closed
    token = tmp_path / "token"
    token.write_text("t")
    agent = BrokerKeyProvider(
        f"https://127.0.0.1:{port}", token_file=str(token), ca_file=tls[0], timeout_s=2, unreachable_s=1.5
    )
    t0 = time.monotonic()
    with pytest.raises(Unavailable, match=r"keys unavailable: the key broker at .* cannot be reached") as e:
        agent.namespace_key("x", create=True, use=KeyUse("x", "app", "u"))
    assert e.value.retryable and e.value.hint
    assert 1.5 <= time.monotonic() - t0 < 10  # asked again for its bound, then given up


def test_a_broker_that_comes_back_within_the_bound_answers(
    cluster: Cluster, tls: tuple[str, str], tmp_path: Path
) -> None:
    """A replica restarting, or rescheduled by a drain of its node: the save asks again and goes on."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    agent = agent_of("node-a", f"https://127.0.0.1:{port}", cluster, tls, tmp_path)
    started: list[Any] = []

    def start() -> None:
        broker = keybroker.Broker(cluster, FileKeyProvider(str(tmp_path / "keys")))
        started.append(
            keybroker.serve(broker, host="127.0.0.1", port=port, cert_file=tls[0], key_file=tls[1], deadline_s=2.0)
        )

    timer = threading.Timer(1.5, start)
    timer.start()
    try:
        key = agent.namespace_key("x", create=True, use=cluster.add_pod("x", "app", "node-a"))
        assert key.key_id
    finally:
        timer.join()
        for server in started:
            server.shutdown()
            server.server_close()


def test_a_broker_with_another_certificate_is_not_trusted(
    broker: str, cluster: Cluster, tls: tuple[str, str], tmp_path: Path
) -> None:
    agent = agent_of("node-a", broker, cluster, tls, tmp_path)
    use = cluster.add_pod("x", "app", "node-a")
    agent.namespace_key("x", create=True, use=use)  # the pinned certificate: answered
    other, _ = serving_cert(["127.0.0.1"], now=datetime.datetime.now(datetime.UTC))
    (tmp_path / "other.crt").write_bytes(other)
    agent.ca_file = str(tmp_path / "other.crt")
    with pytest.raises(Unavailable, match="cannot be reached"):
        agent.namespace_key("x", create=True, use=use)


def test_a_token_that_is_not_an_agents_is_refused(
    broker: str, cluster: Cluster, tls: tuple[str, str], tmp_path: Path
) -> None:
    agent = agent_of("node-a", broker, cluster, tls, tmp_path)
    use = cluster.add_pod("x", "app", "node-a")
    agent.namespace_key("x", create=True, use=use)  # the legitimate one
    Path(agent.token_file).write_text("stolen-or-made-up")
    with pytest.raises(Unavailable, match="401"):
        agent.namespace_key("x", create=True, use=use)


def _post(url: str, ca: str, body: bytes, *, headers: dict[str, str] | None = None) -> tuple[int, dict[str, Any]]:
    import http.client

    host, port = url.removeprefix("https://").split(":")
    conn = http.client.HTTPSConnection(host, int(port), timeout=5, context=ssl.create_default_context(cafile=ca))
    try:
        conn.request("POST", KA.PATH, body=body, headers=headers or {})
        resp = conn.getresponse()
        return resp.status, json.loads(resp.read() or b"{}")
    finally:
        conn.close()


def test_an_oversized_request_is_refused_unread(broker: str, cluster: Cluster, tls: tuple[str, str]) -> None:
    cluster.tokens["t"] = "node-a"
    small = json.dumps(KA.request_body(KA.KeyRequest("save", "key", "x", "app", "u"))).encode()
    assert _post(broker, tls[0], small, headers={"Authorization": "Bearer t"})[0] == 403  # read and decided
    # announced too long: answered before a byte of the body is read
    too_long = {"Authorization": "Bearer t", "Content-Length": str(KA.MAX_OPEN_BYTES + 1)}
    code, answer = _post(broker, tls[0], b"{}", headers=too_long)
    assert code == 413 and "at most" in answer["error"]
    # longer than a key request (an open's size): read for an agent's token only
    open_size = {"Authorization": "Bearer nobody", "Content-Length": str(keybroker.MAX_REQUEST_BYTES + 1)}
    code, answer = _post(broker, tls[0], b"{}", headers=open_size)
    assert code == 401 and "agent token" in answer["error"]
    # an agent's, but not an open: refused once read
    body = json.dumps({**KA.request_body(KA.KeyRequest("save", "key", "x", "app", "u")), "pad": "x" * 70000})
    code, answer = _post(broker, tls[0], body.encode(), headers={"Authorization": "Bearer t"})
    assert code == 413 and "key request has at most" in answer["error"]


def test_a_client_that_says_nothing_holds_no_one_up(
    broker: str, cluster: Cluster, tls: tuple[str, str], tmp_path: Path
) -> None:
    host, port = broker.removeprefix("https://").split(":")
    idle = [socket.create_connection((host, int(port))) for _ in range(3)]  # no handshake, ever
    try:
        agent = agent_of("node-a", broker, cluster, tls, tmp_path)
        started = time.monotonic()
        agent.namespace_key("x", create=True, use=cluster.add_pod("x", "app", "node-a"))
        assert time.monotonic() - started < 1.5
    finally:
        for s in idle:
            s.close()


def test_new_tokens_are_reviewed_at_a_bounded_rate(cluster: Cluster, tmp_path: Path) -> None:
    now = [0.0]
    broker = keybroker.Broker(cluster, FileKeyProvider(str(tmp_path / "keys")), clock=lambda: now[0])
    body = json.dumps(KA.request_body(KA.KeyRequest("save", "key", "x", "app", "u"))).encode()
    codes = [broker.answer(f"Bearer made-up-{i}", body).code for i in range(keybroker.REVIEW_BURST + 5)]
    assert codes.count(401) == keybroker.REVIEW_BURST and codes[-1] == 429
    assert cluster.reviews == keybroker.REVIEW_BURST
    # a known token is not reviewed again (cached), and is answered while new ones wait
    cluster.tokens["agent"] = "node-a"
    now[0] += 1.0
    assert broker.answer("Bearer agent", body).code == 403  # reviewed: the pod does not exist
    reviews = cluster.reviews
    assert broker.answer("Bearer agent", body).code == 403
    assert cluster.reviews == reviews


def test_the_agent_waits_out_the_brokers_rate_bound(cluster: Cluster, tls: tuple[str, str], tmp_path: Path) -> None:
    """A save of many chunks is throttled by the broker's 429s (one request a second here), not failed."""
    now = [0.0]
    b = keybroker.Broker(cluster, FileKeyProvider(str(tmp_path / "keys")), clock=lambda: now[0])
    b._requests = RateLimit(1.0, 1, lambda: now[0])
    server = keybroker.serve(b, host="127.0.0.1", port=0, cert_file=tls[0], key_file=tls[1])
    try:
        agent = agent_of("node-a", f"https://127.0.0.1:{server.server_address[1]}", cluster, tls, tmp_path)
        waited: list[float] = []

        def sleep(s: float) -> None:
            waited.append(s)
            now[0] += s

        agent.sleep = sleep
        key = agent.namespace_key("x", create=True, use=cluster.add_pod("x", "app", "node-a"))
        assert waited == []
        assert len(key.wrap(b"k" * 32, b"aad")) == 60  # the bucket was empty: answered after one wait
        assert waited == [BUSY_WAIT_S]
    finally:
        server.shutdown()
        server.server_close()

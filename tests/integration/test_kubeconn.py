"""The plugin's light connection (adapters/kubeconn.py) over real TLS on loopback: an HTTPS server of
this test's own with a CA, a server certificate and a client certificate made here, standing in for the
API server's authentication (the e2e suite runs every plugin command through it against the real one).

Each kind of kubeconfig credential reaches the server as the API server reads it, and what must fail
fails: a server certificate of another CA, a name the certificate does not carry; an exec plugin runs
again when its credential expires or is refused; a tokenFile is read again.
"""

from __future__ import annotations

import base64
import datetime
import http.server
import json
import ssl
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from kubectl_snapshot.adapters import kubeconn
from kubectl_snapshot.adapters.kube import KubeClient
from kubectl_snapshot.core.errors import FailedPrecondition, NotFound, PermissionDenied, Unavailable

pytestmark = pytest.mark.integration
NOW = datetime.datetime.now(datetime.UTC)


def _pem(cert: x509.Certificate) -> bytes:
    return cert.public_bytes(serialization.Encoding.PEM)


def _key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )


Issued = tuple[x509.Certificate, ec.EllipticCurvePrivateKey]


def _issue(cn: str, issuer: Issued | None, *, sans: tuple[x509.GeneralName, ...] = (), usage: Any = None) -> Issued:
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])
    b = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(issuer[0].subject if issuer else name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(NOW - datetime.timedelta(minutes=5))
        .not_valid_after(NOW + datetime.timedelta(days=1))
    )
    if issuer is None:
        b = b.add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
    if sans:
        b = b.add_extension(x509.SubjectAlternativeName(list(sans)), critical=False)
    if usage is not None:
        b = b.add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
    return b.sign(issuer[1] if issuer else key, hashes.SHA256()), key


class Pki:
    def __init__(self, d: Path) -> None:
        import ipaddress

        self.ca = _issue("test-ca", None)
        self.other_ca = _issue("other-ca", None)
        sans = (x509.IPAddress(ipaddress.ip_address("127.0.0.1")), x509.DNSName("kube.test"))
        self.server = _issue("apiserver", self.ca, sans=sans, usage=ExtendedKeyUsageOID.SERVER_AUTH)
        self.client = _issue("alice", self.ca, usage=ExtendedKeyUsageOID.CLIENT_AUTH)
        self.dir = d
        for name, (cert, key) in (("ca", self.ca), ("server", self.server), ("client", self.client)):
            (d / f"{name}.crt").write_bytes(_pem(cert))
            (d / f"{name}.key").write_bytes(_key_pem(key))
        (d / "other-ca.crt").write_bytes(_pem(self.other_ca[0]))


class ApiServer:
    """Answers as the API server would for this test: the caller it authenticated (a client certificate's
    CN, a known bearer token, basic auth) and the request; 401 Status otherwise, 404 for /missing, and a
    watch stream of two events for ?watch=true."""

    def __init__(self, pki: Pki) -> None:
        self.tokens: dict[str, str] = {}
        self.seen: list[dict[str, Any]] = []
        server = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, *_a: Any) -> None:
                pass

            def _answer(self, code: int, obj: Any) -> None:
                body = json.dumps(obj).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def _user(self) -> str:
                peer = self.connection.getpeercert()
                if peer:
                    return "cert:" + str(dict(x[0] for x in peer["subject"])["commonName"])
                auth = self.headers.get("Authorization") or ""
                if auth.startswith("Bearer ") and auth[7:] in server.tokens:
                    return "token:" + server.tokens[auth[7:]]
                if auth == "Basic " + base64.b64encode(b"bob:pw").decode():
                    return "basic:bob"
                return ""

            def do_GET(self) -> None:
                user = self._user()
                server.seen.append(
                    {"path": self.path, "user": user, "headers": [(k, v) for k, v in self.headers.items()]}
                )
                if not user:
                    self._answer(401, {"kind": "Status", "message": "Unauthorized", "code": 401})
                elif self.path.startswith("/missing"):
                    self._answer(404, {"kind": "Status", "message": 'pods "x" not found', "code": 404})
                elif "watch=true" in self.path:
                    lines = b"".join(
                        json.dumps({"type": t, "object": {"metadata": {"name": "p", "resourceVersion": rv}}}).encode()
                        + b"\n"
                        for t, rv in (("ADDED", "1"), ("MODIFIED", "2"))
                    )
                    self.send_response(200)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(lines)))
                    self.end_headers()
                    self.wfile.write(lines)
                else:
                    self._answer(200, {"user": user, "path": self.path})

        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        ctx.load_cert_chain(pki.dir / "server.crt", pki.dir / "server.key")
        ctx.load_verify_locations(pki.dir / "ca.crt")
        ctx.verify_mode = ssl.CERT_OPTIONAL  # a client certificate, or a token
        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.socket = ctx.wrap_socket(self.httpd.socket, server_side=True)
        self.url = f"https://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def pki(tmp_path: Path) -> Pki:
    return Pki(tmp_path)


@pytest.fixture
def api(pki: Pki) -> Iterator[ApiServer]:
    s = ApiServer(pki)
    yield s
    s.close()


def kubeconfig(path: Path, server: str, user: dict[str, Any], **cluster: Any) -> str:
    cluster = {"server": server, "certificate-authority": "ca.crt", **cluster}
    path.write_text(
        yaml.safe_dump(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "current-context": "t",
                "clusters": [{"name": "c", "cluster": cluster}],
                "users": [{"name": "u", "user": user}],
                "contexts": [{"name": "t", "context": {"cluster": "c", "user": "u", "namespace": "ns1"}}],
            }
        )
    )
    return str(path)


def whoami(kube: KubeClient) -> str:
    return str(kube._call("GET", "/whoami", what="who am i")["user"])


def test_client_certificate_files_and_inline_data(pki: Pki, api: ApiServer) -> None:
    files = KubeClient.from_config(
        kubeconfig(pki.dir / "kc", api.url, {"client-certificate": "client.crt", "client-key": "client.key"})
    )
    assert isinstance(files.api, kubeconn.LightApi)
    assert (whoami(files), files.namespace) == ("cert:alice", "ns1")
    inline = {
        "client-certificate-data": base64.b64encode((pki.dir / "client.crt").read_bytes()).decode(),
        "client-key-data": base64.b64encode((pki.dir / "client.key").read_bytes()).decode(),
    }
    ca = base64.b64encode((pki.dir / "ca.crt").read_bytes()).decode()
    kc = kubeconfig(pki.dir / "kc2", api.url, inline, **{"certificate-authority-data": ca})
    assert whoami(KubeClient.from_config(kc)) == "cert:alice"


def test_tokens_basic_auth_and_impersonation(pki: Pki, api: ApiServer) -> None:
    api.tokens["s3cret"] = "carol"
    kube = KubeClient.from_config(kubeconfig(pki.dir / "kc", api.url, {"token": "s3cret"}))
    assert whoami(kube) == "token:carol"
    basic = KubeClient.from_config(kubeconfig(pki.dir / "kb", api.url, {"username": "bob", "password": "pw"}))
    assert whoami(basic) == "basic:bob"
    # --token replaces the kubeconfig's credentials; --as/--as-group become one header per group
    flagged = KubeClient.from_config(
        kubeconfig(pki.dir / "kf", api.url, {"token": "wrong"}),
        token="s3cret",
        impersonate="dave",
        impersonate_groups=("g1", "g2"),
    )
    assert whoami(flagged) == "token:carol"
    headers = api.seen[-1]["headers"]
    assert ("Impersonate-User", "dave") in headers
    assert [v for k, v in headers if k == "Impersonate-Group"] == ["g1", "g2"]
    assert ("Authorization", "Bearer s3cret") in headers


def test_refused_and_missing_map_to_the_projects_errors(pki: Pki, api: ApiServer) -> None:
    kube = KubeClient.from_config(kubeconfig(pki.dir / "kc", api.url, {"token": "unknown"}))
    with pytest.raises(PermissionDenied, match="rejected the credentials"):
        whoami(kube)
    api.tokens["ok"] = "erin"
    good = KubeClient.from_config(kubeconfig(pki.dir / "kg", api.url, {"token": "ok"}))
    with pytest.raises(NotFound, match='pods "x" not found'):
        good._call("GET", "/missing", what="get pod")


def test_the_server_certificate_is_verified(pki: Pki, api: ApiServer) -> None:
    api.tokens["ok"] = "erin"
    wrong_ca = KubeClient.from_config(
        kubeconfig(pki.dir / "kc", api.url, {"token": "ok"}, **{"certificate-authority": "other-ca.crt"})
    )
    with pytest.raises(Unavailable, match="cannot reach the API server"):
        whoami(wrong_ca)
    assert not [s for s in api.seen if s["user"]]  # the token never went to a server it could not verify
    by_name = api.url.replace("127.0.0.1", "localhost")  # the certificate names 127.0.0.1 and kube.test only
    with pytest.raises(Unavailable):
        whoami(KubeClient.from_config(kubeconfig(pki.dir / "kn", by_name, {"token": "ok"})))
    named = KubeClient.from_config(
        kubeconfig(pki.dir / "kt", by_name, {"token": "ok"}, **{"tls-server-name": "kube.test"})
    )
    assert whoami(named) == "token:erin"
    insecure = KubeClient.from_config(
        kubeconfig(
            pki.dir / "ki",
            by_name,
            {"token": "ok"},
            **{"certificate-authority": None, "insecure-skip-tls-verify": True},
        )
    )
    assert whoami(insecure) == "token:erin"


def test_a_watch_streams_its_events(pki: Pki, api: ApiServer) -> None:
    api.tokens["ok"] = "erin"
    kube = KubeClient.from_config(kubeconfig(pki.dir / "kc", api.url, {"token": "ok"}))
    events = list(kube.watch_pods(field_selector="metadata.name=p", namespace="ns1", timeout_s=5))
    assert [(t, o["metadata"]["resourceVersion"]) for t, o in events] == [("ADDED", "1"), ("MODIFIED", "2")]


def _plugin(d: Path, api: ApiServer, tokens: list[str], expires_in: int) -> Path:
    """An exec credential plugin printing the next of `tokens` each run (its runs counted in a file)."""
    runs = d / "runs"
    runs.write_text("0")
    script = d / "login.py"
    script.write_text(
        f"""#!/usr/bin/env python3
import base64, datetime, json, os
runs = {str(runs)!r}
n = int(open(runs).read())
open(runs, "w").write(str(n + 1))
info = json.loads(os.environ["KUBERNETES_EXEC_INFO"])
assert info["spec"]["cluster"]["server"] == {api.url!r}, info
assert "BEGIN CERTIFICATE" in base64.b64decode(info["spec"]["cluster"]["certificate-authority-data"]).decode()
assert os.environ["FROM_KUBECONFIG"] == "yes"
exp = datetime.datetime.now(datetime.UTC) + datetime.timedelta(seconds={expires_in})
print(json.dumps({{"apiVersion": info["apiVersion"], "kind": "ExecCredential",
                  "status": {{"token": {tokens!r}[min(n, {len(tokens) - 1})],
                             "expirationTimestamp": exp.strftime("%Y-%m-%dT%H:%M:%SZ")}}}}))
"""
    )
    script.chmod(0o755)
    return script


def _exec_user(script: Path) -> dict[str, Any]:
    return {
        "exec": {
            "apiVersion": "client.authentication.k8s.io/v1",
            "command": f"./{script.name}",
            "env": [{"name": "FROM_KUBECONFIG", "value": "yes"}],
            "interactiveMode": "Never",
            "provideClusterInfo": True,
        }
    }


def test_an_exec_plugin_runs_once_and_again_when_its_credential_expires_or_is_refused(pki: Pki, api: ApiServer) -> None:
    api.tokens["first"] = "frank"
    script = _plugin(pki.dir, api, ["first", "second"], expires_in=3600)
    kube = KubeClient.from_config(kubeconfig(pki.dir / "kc", api.url, _exec_user(script)))
    assert [whoami(kube), whoami(kube)] == ["token:frank", "token:frank"]
    assert (pki.dir / "runs").read_text() == "1"  # cached until it expires
    del api.tokens["first"]  # revoked: the 401 makes it ask again, once
    api.tokens["second"] = "frank2"
    assert whoami(kube) == "token:frank2"
    assert (pki.dir / "runs").read_text() == "2"
    short = pki.dir / "short"
    short.mkdir()
    api.tokens.update(first="g1", second="g2")
    (short / "ca.crt").write_bytes((pki.dir / "ca.crt").read_bytes())
    expiring = KubeClient.from_config(
        kubeconfig(short / "kc", api.url, _exec_user(_plugin(short, api, ["first", "second"], 5)))
    )
    assert [whoami(expiring), whoami(expiring)] == ["token:g1", "token:g2"]  # within the 10 s margin: asked again


def test_an_exec_plugin_that_fails_says_so(pki: Pki, api: ApiServer) -> None:
    failing = pki.dir / "fail.sh"
    failing.write_text("#!/bin/sh\necho 'no session: run login first' >&2\nexit 3\n")
    failing.chmod(0o755)
    kube = KubeClient.from_config(kubeconfig(pki.dir / "kc", api.url, _exec_user(failing)))
    with pytest.raises(PermissionDenied, match="exited with 3"):
        whoami(kube)
    user = _exec_user(failing)
    user["exec"].update(command="no-such-login-tool", installHint="install no-such-login-tool from your IdP")
    absent = KubeClient.from_config(kubeconfig(pki.dir / "ka", api.url, user))
    always = _exec_user(failing)
    always["exec"]["interactiveMode"] = "Always"  # pytest's stdin is no terminal
    with pytest.raises(FailedPrecondition, match="must ask on a terminal"):
        whoami(KubeClient.from_config(kubeconfig(pki.dir / "kw", api.url, always)))
    with pytest.raises(FailedPrecondition, match="not on \\$PATH") as e:
        whoami(absent)
    assert e.value.hint == "install no-such-login-tool from your IdP"


def test_a_token_file_is_read_again_after_a_minute(pki: Pki, api: ApiServer, monkeypatch: pytest.MonkeyPatch) -> None:
    api.tokens.update(old="h1", new="h2")
    (pki.dir / "token").write_text("old\n")
    kube = KubeClient.from_config(kubeconfig(pki.dir / "kc", api.url, {"tokenFile": "token"}))
    assert whoami(kube) == "token:h1"
    (pki.dir / "token").write_text("new\n")
    assert whoami(kube) == "token:h1"
    later = time.time() + kubeconn.TOKEN_FILE_TTL + 1
    monkeypatch.setattr(time, "time", lambda: later)
    assert whoami(kube) == "token:h2"


def test_what_it_does_not_serve_goes_to_the_official_client(
    pki: Pki, api: ApiServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    api.tokens["ok"] = "ivan"
    kc = kubeconfig(pki.dir / "kc", api.url, {"token": "ok"})
    monkeypatch.setenv(kubeconn.CLIENT_ENV, "official")
    official = KubeClient.from_config(kc)
    assert not isinstance(official.api, kubeconn.LightApi)
    assert (whoami(official), official.namespace) == ("token:ivan", "ns1")
    monkeypatch.delenv(kubeconn.CLIENT_ENV)
    provider = kubeconfig(pki.dir / "kp", api.url, {"token": "ok", "as": "admin"})
    assert not isinstance(KubeClient.from_config(provider).api, kubeconn.LightApi)
    assert isinstance(KubeClient.from_config(kc).api, kubeconn.LightApi)


def test_an_unreadable_kubeconfig_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(FailedPrecondition, match="cannot load kubeconfig") as e:
        KubeClient.from_config(str(tmp_path / "absent"))
    assert "--kubeconfig" in (e.value.hint or "")
    (tmp_path / "bad").write_text("clusters: [unclosed\n")
    with pytest.raises(FailedPrecondition, match="not valid YAML"):
        KubeClient.from_config(str(tmp_path / "bad"))


def test_a_file_the_kubeconfig_names_that_is_absent_is_named(pki: Pki, api: ApiServer) -> None:
    api.tokens["ok"] = "judy"
    kube = KubeClient.from_config(
        kubeconfig(pki.dir / "kc", api.url, {"token": "ok"}, **{"certificate-authority": "gone.crt"})
    )
    with pytest.raises(FailedPrecondition, match=f"cannot read {pki.dir}/gone.crt, which the kubeconfig names"):
        whoami(kube)

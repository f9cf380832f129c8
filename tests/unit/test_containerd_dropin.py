"""The runtime handler's drop-in in the format of the node's containerd (shim/controller/dropin.py).
containerd itself reads these in tests/integration/test_containerd_versions.py."""

from __future__ import annotations

import datetime as dt
import tomllib
from pathlib import Path
from typing import Any

import pytest

from kubectl_snapshot.core import kubenames as K
from kubectl_snapshot.core.errors import FailedPrecondition
from shim.controller import dropin
from shim.service import nodecheck

LAUNCHER = "/opt/kubectl-snapshot/n1/kubectl-snapshot-runc"


def test_the_major_version_of_what_containerd_reports() -> None:
    assert dropin.major_version("v1.7.35") == 1
    assert dropin.major_version("1.7.24~ds1-6") == 1  # Debian's package
    assert dropin.major_version("v2.3.7") == 2
    with pytest.raises(FailedPrecondition):
        dropin.major_version("dev")


def test_containerd_2_gets_the_handler_alone_in_config_version_3() -> None:
    doc = tomllib.loads(dropin.render("v2.1.9", LAUNCHER))
    assert doc["version"] == 3
    assert list(doc["plugins"]) == [dropin.CRI_RUNTIME_V2]
    runtimes = doc["plugins"][dropin.CRI_RUNTIME_V2]["containerd"]["runtimes"]
    assert runtimes == {K.RUNTIME_CLASS: dropin.handler(LAUNCHER)}


def test_containerd_1_gets_the_nodes_cri_table_with_the_handler_in_config_version_2() -> None:
    node: dict[str, Any] = {
        "sandbox_image": "registry.example/pause:3.9",
        "containerd": {
            "runtimes": {"runc": {"runtime_type": "io.containerd.runc.v2", "options": {"SystemdCgroup": True}}}
        },
        "registry": {"config_path": "/etc/containerd/certs.d"},
    }
    doc = tomllib.loads(dropin.render("v1.7.35", LAUNCHER, node))
    assert doc["version"] == 2
    cri = doc["plugins"][dropin.CRI_V1]
    assert cri["sandbox_image"] == node["sandbox_image"] and cri["registry"] == node["registry"]
    assert cri["containerd"]["runtimes"]["runc"] == node["containerd"]["runtimes"]["runc"]
    assert cri["containerd"]["runtimes"][K.RUNTIME_CLASS] == dropin.handler(LAUNCHER)
    assert K.RUNTIME_CLASS not in node["containerd"]["runtimes"]  # the caller's table is not changed


@pytest.mark.parametrize("version", ["v1.7.35", "v2.0.14", "v2.2.9"])
def test_both_layouts_pass_the_resume_and_restore_annotations_and_the_node_reads_them_back(
    tmp_path: Path, version: str
) -> None:
    """The wrapper holds a resuming or a (lazy, gateless) restore pod's containers only when containerd
    passes it their annotation; the agent publishes what its drop-in passes (node facts), which the
    plugin reads before it leaves the gate init container out (core/podspec.gate_needed)."""
    f = tmp_path / "kubectl-snapshot.toml"
    f.write_text(dropin.render(version, LAUNCHER, {"containerd": {"runtimes": {"runc": {}}}}))
    assert nodecheck.dropin_pod_annotations(str(f)) == [K.ANN_RESUME_POLICY, K.ANN_RESTORE_FROM]
    f.write_text("version = 3\n")  # a drop-in without the handler (or none, or not TOML): nothing passed
    assert nodecheck.dropin_pod_annotations(str(f)) == []
    assert nodecheck.dropin_pod_annotations(str(tmp_path / "absent.toml")) == []
    f.write_text("not = [toml")
    assert nodecheck.dropin_pod_annotations(str(f)) == []


def test_unsupported_majors_are_refused() -> None:
    with pytest.raises(FailedPrecondition, match="not supported"):
        dropin.render("v0.2.1", LAUNCHER)


def write(path: Path, text: str) -> str:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return str(path)


def test_the_cri_table_containerd_1_loads_is_the_last_files(tmp_path: Path) -> None:
    config = write(
        tmp_path / "config.toml",
        'version = 2\nimports = ["conf.d/*.toml"]\n[plugins."io.containerd.grpc.v1.cri"]\n  sandbox_image = "main"\n',
    )
    dropin_file = str(tmp_path / "conf.d" / "kubectl-snapshot.toml")
    assert dropin.node_cri_table(config, dropin_file) == {"sandbox_image": "main"}
    write(tmp_path / "conf.d" / "a-gpu.toml", 'version = 2\n[plugins."io.containerd.grpc.v1.cri"]\n  x = 1\n')
    write(tmp_path / "conf.d" / "b-other.toml", "version = 2\n[plugins.other]\n  y = 2\n")
    # the drop-in's own earlier copy never counts: it is what is being replaced
    write(Path(dropin_file), 'version = 2\n[plugins."io.containerd.grpc.v1.cri"]\n  stale = true\n')
    assert dropin.node_cri_table(config, dropin_file) == {"x": 1}


def test_a_cri_table_loaded_after_the_drop_in_is_refused(tmp_path: Path) -> None:
    config = write(tmp_path / "config.toml", 'version = 2\nimports = ["/etc/ks-test-none/*.toml", "conf.d/*.toml"]\n')
    write(tmp_path / "conf.d" / "zz.toml", 'version = 2\n[plugins."io.containerd.grpc.v1.cri"]\n  x = 1\n')
    # the drop-in is not written yet: its place in the order counts all the same
    with pytest.raises(FailedPrecondition, match=r"zz\.toml") as e:
        dropin.node_cri_table(config, str(tmp_path / "conf.d" / "kubectl-snapshot.toml"))
    assert e.value.hint and "sorts last" in e.value.hint
    # not imported at all: nothing can replace it (and containerd will not read it: doctor says so)
    assert dropin.node_cri_table(config, str(tmp_path / "elsewhere" / "kubectl-snapshot.toml")) == {"x": 1}


def test_a_version_1_configuration_is_refused(tmp_path: Path) -> None:
    config = write(tmp_path / "config.toml", '[plugins.cri]\n  sandbox_image = "x"\n')
    with pytest.raises(FailedPrecondition, match="version 1") as e:
        dropin.node_cri_table(config, str(tmp_path / "conf.d" / "k.toml"))
    assert e.value.hint and "containerd config migrate" in e.value.hint


def test_files_are_read_under_the_nodes_root(tmp_path: Path) -> None:
    root = tmp_path / "proc-root"
    write(root / "etc/containerd/config.toml", 'version = 2\nimports = ["/etc/containerd/conf.d/*.toml"]\n')
    write(root / "etc/containerd/conf.d/a.toml", 'version = 2\n[plugins."io.containerd.grpc.v1.cri"]\n  x = 1\n')
    got = dropin.node_cri_table("/etc/containerd/config.toml", "/etc/containerd/conf.d/k.toml", root=str(root))
    assert got == {"x": 1}


def test_the_toml_writer_round_trips_what_containerd_configurations_hold() -> None:
    doc = {
        "version": 2,
        "oom_score": -999,
        "ratio": 0.5,
        "inf": float("inf"),
        "flag": False,
        "when": dt.datetime(2026, 1, 2, 3, 4, 5, tzinfo=dt.UTC),
        "text": 'quote " backslash \\ tab \t newline \n ü \x01',
        "plugins": {
            "io.containerd.grpc.v1.cri": {
                "containerd": {"runtimes": {"runc": {"options": {}}}},
                "registry": {"mirrors": {"docker.io": {"endpoint": ["https://a", "https://b"]}}},
                "list of tables": [{"a": 1}, {"b": [1, 2]}],
                "empty": [],
            },
            "key with spaces": {"x": 1},
        },
    }
    assert tomllib.loads(dropin.dumps(doc)) == doc


def test_containerd_1_imports_nothing_unless_its_configuration_says(tmp_path: Path) -> None:
    f = "/etc/containerd/conf.d/kubectl-snapshot.toml"
    defaults = nodecheck.Containerd(1, "/etc/containerd/config.toml", {"version": 2})
    assert not nodecheck.imports_dropin(defaults, f, "v1.7.35")
    assert nodecheck.imports_dropin(defaults, f, "v2.3.7")
    explicit = nodecheck.Containerd(1, "/etc/containerd/config.toml", {"imports": ["conf.d/*.toml"]})
    assert nodecheck.imports_dropin(explicit, f, "v1.7.35")

"""One declaration of the node settings (core/nodesettings.py) reaches every place that exposes them."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from kubectl_snapshot.cli.main import cli as plugin_cli
from kubectl_snapshot.core import nodesettings as NS
from kubectl_snapshot.core.errors import InvalidArgument
from kubectl_snapshot.deploy import agent as deploy_agent
from kubectl_snapshot.deploy import render
from shim.agent_cli import cli as agent_cli
from shim.controller.settings import apply_node_map

REPO = Path(__file__).resolve().parents[2]


def _options(group: Any, command: str) -> set[str]:
    cmd = group.commands[command]
    return {o for p in cmd.params for o in p.opts}


def test_every_agent_command_takes_every_cli_setting() -> None:
    for command in ("run", "install-node", "uninstall-node"):
        opts = _options(agent_cli, command)
        for name, opt, _ in NS.options():
            assert opt.cli and NS.flag(name) in opts, (command, name)


def test_install_takes_the_install_settings_and_render_accepts_them() -> None:
    opts = _options(plugin_cli, "install")
    for name in NS.INSTALL_KEYS:
        assert NS.flag(name) in opts, name
    assert "--state-dir" in opts  # the older spelling still works
    agent_fields = {f.name for f in dataclasses.fields(deploy_agent.AgentSettings)}
    assert set(NS.INSTALL_KEYS) <= agent_fields


def test_the_daemonset_passes_the_install_paths_to_both_agent_commands() -> None:
    objs = render("img", kubelet_root="/data/kubelet", state_root="/data/ks")
    ds = next(o for o in objs if o["kind"] == "DaemonSet")
    spec = ds["spec"]["template"]["spec"]
    for args in (spec["initContainers"][0]["args"], spec["containers"][0]["args"]):
        assert "--kubelet-root=/data/kubelet" in args and "--state-root=/data/ks" in args
        for name in NS.INSTALL_KEYS:
            if NS.option_of(name).kind == "path":
                assert any(a.startswith(NS.flag(name) + "=") for a in args), name


def test_the_helm_chart_has_a_value_per_install_setting() -> None:
    spec = importlib.util.spec_from_file_location("gen_chart", REPO / "hack" / "gen-chart.py")
    assert spec and spec.loader
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    for name in NS.INSTALL_KEYS:
        assert mod.SETTINGS[NS.camel(name)][0] == name, name


def test_node_map_overrides_only_per_node_settings_and_checks_them(tmp_path: Path) -> None:
    path = tmp_path / "nodes.json"
    path.write_text(
        json.dumps(
            {"n1": {"kubeletRoot": "/k1", "containerd_socket": "/c1/sock", "criuPath": "/x/criu", "opt_root": "/o"}}
        )
    )
    s = apply_node_map(NS.NodeSettings(node="n1"), str(path))
    assert (s.kubelet_root, s.containerd_socket, s.criu_path) == ("/k1", "/c1/sock", "/x/criu")
    assert s.opt_root == NS.DEFAULTS.opt_root  # not a per-node setting: ignored
    assert apply_node_map(NS.NodeSettings(node="n2"), str(path)) == NS.NodeSettings(node="n2")
    path.write_text(json.dumps({"n1": {"kubelet_root": "relative/dir"}}))
    with pytest.raises(InvalidArgument, match="normalized absolute path"):
        apply_node_map(NS.NodeSettings(node="n1"), str(path))


def test_values_are_checked_by_kind() -> None:
    assert NS.check_value("metrics_bind_address", ":9443") == ":9443"
    with pytest.raises(InvalidArgument, match="HOST:PORT"):
        NS.check_value("metrics_bind_address", "nowhere")
    with pytest.raises(InvalidArgument, match="one line"):
        NS.check_value("restart_command", "a\nb")
    with pytest.raises(InvalidArgument, match="unknown key"):
        deploy_agent.check_per_node_paths({"n1": {"opt_root": "/x"}})
    assert deploy_agent.check_per_node_paths({"n1": {"kubeletRoot": "/k"}}) == {"n1": {"kubelet_root": "/k"}}
    # the save queue's workers and the dump gate's slots (issue 43): a positive whole number, or empty
    assert NS.check_value("save_concurrency", "4") == "4" and NS.check_value("dump_concurrency", "") == ""
    for bad in ("0", "-2", "two", "1.5"):
        with pytest.raises(InvalidArgument, match="positive whole number"):
            NS.check_value("save_concurrency", bad, "--save-concurrency")
    assert deploy_agent.check_per_node_paths({"n1": {"saveConcurrency": "1"}}) == {"n1": {"save_concurrency": "1"}}


def test_agent_rejects_a_bad_path_with_the_flag_named() -> None:
    r = CliRunner().invoke(agent_cli, ["uninstall-node", "--node", "n1", "--kubelet-root", "var/lib"])
    assert r.exit_code != 0
    assert "--kubelet-root" in r.output and "absolute path" in r.output

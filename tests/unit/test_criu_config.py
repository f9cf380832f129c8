"""The node's runc CRIU configuration: written only when ours and probed, never over a foreign file."""

from __future__ import annotations

from pathlib import Path

from shim.criu import config as cc


def ok(_cmd: str) -> tuple[int, str]:
    return 0, ""


def refuse(_cmd: str) -> tuple[int, str]:
    return 1, "Error (criu/netfilter.c): nft: Operation not supported"


def test_written_after_a_successful_probe_then_unchanged(tmp_path: Path) -> None:
    conf = tmp_path / "criu" / "runc.conf"
    calls: list[str] = []

    def run(cmd: str) -> tuple[int, str]:
        calls.append(cmd)
        return 0, ""

    r = cc.ensure(str(conf), run=run, criu="/usr/sbin/criu")
    assert r.state == "written" and conf.read_text() == cc.render()
    assert "network-lock nftables" in conf.read_text() and conf.read_text().startswith(cc.MARKER)
    assert len(calls) == 1 and "/usr/sbin/criu dump" in calls[0] and "--network-lock nftables" in calls[0]
    assert cc.ensure(str(conf), run=run).state == "unchanged" and len(calls) == 1  # no second probe


def test_foreign_file_is_never_touched(tmp_path: Path) -> None:
    conf = tmp_path / "runc.conf"
    conf.write_text("tcp-established\n")
    assert cc.ensure(str(conf), run=ok).state == "foreign"
    assert cc.remove(str(conf)).state == "foreign"
    assert conf.read_text() == "tcp-established\n"


def test_unsupported_probe_writes_nothing_and_drops_an_old_file_of_ours(tmp_path: Path) -> None:
    conf = tmp_path / "runc.conf"
    r = cc.ensure(str(conf), run=refuse)
    assert r.state == "unsupported" and "Operation not supported" in r.detail and not conf.exists()
    conf.write_text(cc.MARKER + "\nnetwork-lock iptables\n")  # an older version of ours
    assert cc.ensure(str(conf), run=refuse).state == "unsupported" and not conf.exists()


def test_remove_only_ours(tmp_path: Path) -> None:
    conf = tmp_path / "runc.conf"
    assert cc.remove(str(conf)).state == "absent"
    cc.ensure(str(conf), run=ok)
    assert cc.remove(str(conf)).state == "removed" and not conf.exists()

"""shim/host/rcu.py against a stand-in for /sys/kernel (a directory with the two files)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from shim.host import rcu


@pytest.fixture
def sysfs(tmp_path: Path) -> Path:
    d = tmp_path / "sys"
    d.mkdir()
    (d / "rcu_expedited").write_text("0\n")
    (d / "rcu_normal").write_text("0\n")
    return d


@pytest.fixture
def state(tmp_path: Path, sysfs: Path) -> Path:
    s = tmp_path / "state"
    assert rcu.prepare(str(s), enable=True, sysfs=str(sysfs)) == "during dumps and restores"
    return s


def value(sysfs: Path) -> str:
    return (sysfs / "rcu_expedited").read_text().strip()


def tokens(state: Path) -> list[str]:
    return sorted(n for n in os.listdir(rcu.directory(str(state))) if n.startswith("t-"))


def test_on_while_any_holder_runs_and_back_after_the_last(state: Path, sysfs: Path) -> None:
    first = rcu.acquire(str(state), str(sysfs))
    assert first is not None and first.switched and value(sysfs) == "1"
    second = rcu.acquire(str(state), str(sysfs))
    assert second is not None and not second.switched and value(sysfs) == "1"
    first.release()
    assert value(sysfs) == "1"  # the second still runs
    second.release()
    second.release()  # idempotent
    assert value(sysfs) == "0" and tokens(state) == []


def test_the_context_manager_puts_back_on_an_error(state: Path, sysfs: Path) -> None:
    with pytest.raises(RuntimeError), rcu.expedited(str(state), str(sysfs)):
        assert value(sysfs) == "1"
        raise RuntimeError("runc failed")
    assert value(sysfs) == "0"


def test_a_switch_someone_else_set_is_never_put_back(state: Path, sysfs: Path) -> None:
    (sysfs / "rcu_expedited").write_text("1\n")
    with rcu.expedited(str(state), str(sysfs)) as token:
        assert token is not None and not token.switched
    assert value(sysfs) == "1"


def test_a_node_asking_for_normal_grace_periods_is_left_alone(state: Path, sysfs: Path) -> None:
    (sysfs / "rcu_normal").write_text("1\n")
    with rcu.expedited(str(state), str(sysfs)):
        assert value(sysfs) == "0"
    assert rcu.prepare(str(state), enable=True, sysfs=str(sysfs)) == "left alone: rcu_normal is set"


def test_without_the_directory_nothing_is_switched(tmp_path: Path, sysfs: Path) -> None:
    with rcu.expedited(str(tmp_path / "no-state"), str(sysfs)) as token:
        assert token is None and value(sysfs) == "0"
    with rcu.expedited(None, str(sysfs)) as token:
        assert token is None


def test_an_unwritable_switch_fails_nothing(state: Path, tmp_path: Path) -> None:
    ro = tmp_path / "ro"
    (ro / "rcu_expedited").mkdir(parents=True)  # opening it for writing fails, as on a read-only /sys
    with rcu.expedited(str(state), str(ro)) as token:
        assert token is not None and not token.switched


def test_a_holder_that_died_is_pruned_and_its_switch_put_back(state: Path, sysfs: Path) -> None:
    pid = os.fork()
    if pid == 0:  # acquires, then dies without releasing (SIGKILL-like: no cleanup)
        rcu.acquire(str(state), str(sysfs))
        os._exit(0)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert value(sysfs) == "1" and len(tokens(state)) == 1
    # the next holder sees the dead token, finds the switch on already, and puts it back at its end
    with rcu.expedited(str(state), str(sysfs)):
        assert tokens(state) and value(sysfs) == "1"
    assert value(sysfs) == "0" and tokens(state) == []


def test_the_agents_start_puts_back_a_leftover(state: Path, sysfs: Path) -> None:
    pid = os.fork()
    if pid == 0:
        rcu.acquire(str(state), str(sysfs))
        os._exit(0)
    os.waitpid(pid, 0)
    assert value(sysfs) == "1"
    assert rcu.prepare(str(state), enable=True, sysfs=str(sysfs)) == "during dumps and restores (a leftover put back)"
    assert value(sysfs) == "0" and tokens(state) == []


def test_a_live_holder_in_another_process_keeps_it_on(state: Path, sysfs: Path) -> None:
    r, w = os.pipe()
    go_r, go_w = os.pipe()
    pid = os.fork()
    if pid == 0:
        token = rcu.acquire(str(state), str(sysfs))
        os.write(w, b"1" if token is not None and token.switched else b"0")
        os.read(go_r, 1)  # holds until told
        assert token is not None
        token.release()
        os._exit(0)
    assert os.read(r, 1) == b"1"
    with rcu.expedited(str(state), str(sysfs)) as mine:
        assert mine is not None and not mine.switched
    assert value(sysfs) == "1"  # the other process still holds its token
    os.write(go_w, b"x")
    os.waitpid(pid, 0)
    assert value(sysfs) == "0"


def test_disabled_removes_the_directory_and_puts_back(state: Path, sysfs: Path) -> None:
    token = rcu.acquire(str(state), str(sysfs))
    assert token is not None and value(sysfs) == "1"
    token.release()
    pid = os.fork()
    if pid == 0:
        rcu.acquire(str(state), str(sysfs))
        os._exit(0)
    os.waitpid(pid, 0)
    assert rcu.prepare(str(state), enable=False, sysfs=str(sysfs)) == "off (put back)"
    assert value(sysfs) == "0" and not os.path.exists(rcu.directory(str(state)))
    assert rcu.prepare(str(state), enable=False, sysfs=str(sysfs)) == "off"


def test_enabled_reads_the_agents_environment() -> None:
    assert rcu.enabled({}) and rcu.enabled({rcu.ENV: "1"})
    assert not rcu.enabled({rcu.ENV: "0"})

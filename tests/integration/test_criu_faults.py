"""CRIU failing in the middle of a real dump (threats A2 and A4): CRIU's own fault injection.

CRIU reads ``CRIU_FAULT`` from its environment (criu/fault-injection.c). The codes that act on a dump,
from CRIU's source (criu/cr-dump.c, mem.c, parasite-syscall.c):

- 1 ``FI_DUMP_EARLY``: CRIU sends itself SIGKILL while dumping the first task, after it froze the tree
  and locked the network (``network_lock`` comes before ``dump_one_task``): a ``kill -9`` of CRIU in the
  middle of the dump, at the same point every time;
- 3 ``FI_DUMP_PAGES``: the dump of the memory pages fails with the parasite in the task;
- 5 ``FI_PARASITE_CONNECT``: the parasite's control socket does not connect;
- 136 ``FI_DUMP_CRASH``: CRIU aborts *when a dump failed*; on its own it changes nothing, so the dump
  succeeds (the legitimate case, beside the failures).

The dumps run as the agent runs them (shim/controller/snapshots.py): ``runc --criu`` names the CRIU to
run (here a script that sets ``CRIU_FAULT`` and execs the node's CRIU), through the node engine with
the node's CRIU configuration (``network-lock nftables``).
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from kubectl_snapshot.adapters.registry import RegistryClient
from kubectl_snapshot.core import criulock
from kubectl_snapshot.core.errors import CriuFailed, NotFound
from kubectl_snapshot.core.reference import Reference
from shim import freeze_guard
from shim.containerd.client import ContainerdClient
from shim.containerd.runc_checkpoint import RuncCheckpointer
from shim.criu import parasite
from shim.engine import criufail
from shim.engine.checkpoint import CheckpointRequest, checkpoint
from shim.engine.publish import CheckpointResult
from shim.engine.staging import StatePaths
from shim.host import freezer
from shim.net import dumplock, netns, nftlock
from tests.integration.test_agent_roundtrip import cleanup, client, read_counter, start_counter, unique, wait_for
from tests.support.containerd import CRIU, RUNC, ContainerdDaemon, containerd_a
from tests.support.images import busybox_image
from tests.support.nft import nft_tables
from tests.support.registry import registry

pytestmark = pytest.mark.integration

__all__ = ["cleanup", "containerd_a", "registry"]  # fixtures


def criu_with_fault(where: Path, code: int | None) -> str:
    """A CRIU for `runc --criu`: the node's CRIU with CRIU_FAULT=`code` in its environment (None: without;
    CRIU refuses 0 as out of bounds)."""
    script = where / f"criu-fault-{code}"
    fault = f"CRIU_FAULT={code} " if code is not None else ""
    script.write_text(f'#!/bin/sh\n{fault}exec {CRIU} "$@"\n')
    script.chmod(0o755)
    return str(script)


def dump(
    daemon: ContainerdDaemon, cid: str, criu: str, ref: str, *, lift: bool = True, guard: bool = True
) -> CheckpointResult:
    """The node engine's snapshot of `cid` with `criu` (the agent's runc checkpoint); `lift`: with the
    defence of threat A2 (shim/net/criulock.py), as the agent runs it. Frozen through the freeze guard
    (a private one, as ``ks-agent checkpoint`` does), as the agent freezes; without `guard`, through
    containerd (the engine's fallback where the cgroup freezer cannot be placed)."""
    checkpointer = RuncCheckpointer(criu=criu, runc=RUNC)
    with (
        freeze_guard.private_guard() as held,
        ContainerdClient(daemon.address, daemon.namespace, checkpointer=checkpointer) as containerd,
    ):
        return checkpoint(
            CheckpointRequest(containers=[cid], target=Reference.parse(ref), namespace="test"),
            containerd=containerd,
            registry=RegistryClient(),
            paths=StatePaths.from_env(),
            freezer_for=held.freezer_for if guard else None,
            memory_of=freezer.task_memory,
            net_lock=dumplock.pod_network_locked,
            criu_lock=criufail.cleaned_after_failure if lift else None,
            criu_cure=parasite.cured_after_failure if lift else None,
        )


def process_view(pid: int) -> dict[str, object]:
    """What CRIU's parasite could leave changed in a task: its open files, its mappings, its mounts, its
    signal mask and dispositions."""
    fd_dir = Path(f"/proc/{pid}/fd")
    fds = {}
    for fd in fd_dir.iterdir():
        with contextlib.suppress(FileNotFoundError):
            fds[fd.name] = os.readlink(fd)
    signals = [ln for ln in Path(f"/proc/{pid}/status").read_text().splitlines() if ln.startswith(SIGNAL_STATE)]
    return {
        "fds": fds,
        "maps": Path(f"/proc/{pid}/maps").read_text(),
        "mountinfo": Path(f"/proc/{pid}/mountinfo").read_text(),
        "signals": "\n".join(signals),
    }


# the parasite blocks every signal and sets its own handlers while it works: the task's own are put back
SIGNAL_STATE = ("SigBlk:", "SigIgn:", "SigCgt:")


def criu_tables(pid: int) -> list[str]:
    return [t for t in nft_tables(f"/proc/{pid}/ns/net") if criulock.is_criu_table(t)]


@pytest.fixture
def counter(containerd_a, cleanup):  # type: ignore[no-untyped-def]
    """A counting container in its own network namespace, and its init pid."""
    a = client(containerd_a)
    cid = unique("criufault")
    cleanup(a, cid)
    start_counter(a, containerd_a, cid, busybox_image(containerd_a))
    task = a.get_task(cid)
    assert task is not None
    assert os.readlink(f"/proc/{task.pid}/ns/net") != os.readlink("/proc/self/ns/net")
    return a, containerd_a, cid, task.pid


def assert_counting(a: ContainerdClient, cid: str) -> None:
    task = a.get_task(cid)
    assert task is not None and task.status == "running"
    _, v = read_counter(a, cid)
    wait_for(lambda: read_counter(a, cid)[1] > v + 2, what="the counter to keep counting")


def steady_view(pid: int) -> dict[str, object]:
    """The view once it no longer changes by itself (two readings 200 ms apart agree)."""
    import time

    for _ in range(20):
        first = process_view(pid)
        time.sleep(0.2)
        if process_view(pid) == first:
            return first
    pytest.fail("the container's fds, maps or mounts change by themselves: nothing to compare")


def assert_same_view(after: dict[str, object], before: dict[str, object]) -> None:
    for what in ("fds", "maps", "mountinfo", "signals"):
        if after[what] != before[what]:
            b, a = before[what], after[what]
            if isinstance(b, str) and isinstance(a, str):
                gone = sorted(set(b.splitlines()) - set(a.splitlines()))
                new = sorted(set(a.splitlines()) - set(b.splitlines()))
                pytest.fail(f"the task's {what} changed: gone {gone}, new {new}")
            pytest.fail(f"the task's {what} changed: {b} -> {a}")


FAULTS = [
    (1, "fault: CRIU sudden detach"),
    (3, "fault: Dump VMA pages failure!"),
    (5, "Can't"),  # the parasite's connect fails: CRIU's error lines name what it could not do
]


@pytest.mark.parametrize("code, in_log", FAULTS)
def test_an_injected_criu_fault_fails_the_dump_and_leaves_the_container_running(  # type: ignore[no-untyped-def]
    counter, registry, tmp_path, code, in_log
):
    """Threat A4: each failed dump resumes the container, keeps CRIU's log lines in the error, leaves the
    task's open files and mounts as they were and no CRIU lock in its network; no snapshot in the registry."""
    a, daemon, cid, pid = counter
    before = steady_view(pid)
    ref = registry.ref(f"fault{code}", "v1")
    with pytest.raises(CriuFailed) as failed:
        dump(daemon, cid, criu_with_fault(tmp_path, code), ref)
    err = failed.value
    assert in_log in (err.details or ""), err.details
    assert "CRIU dump failed" in err.message and err.hint
    assert_counting(a, cid)
    after = steady_view(pid)
    assert after["fds"] == before["fds"]
    assert after["mountinfo"] == before["mountinfo"]
    assert criu_tables(pid) == []
    with pytest.raises(NotFound):
        RegistryClient().get_manifest(Reference.parse(ref))


@pytest.mark.parametrize("code", [1, 3, 5])
def test_an_injected_criu_fault_leaves_the_tasks_memory_map_as_it_was(counter, registry, tmp_path, code):  # type: ignore[no-untyped-def]
    """Threat A4, the task's memory: after the failed dump its mappings are the ones it had. CRIU cures the
    task itself after 3; where CRIU dies (1) or loses its parasite (5), its parasite's two CRIUMFD mappings
    stay in the task and the agent unmaps them (shim/criu/parasite.py): without that, 1 and 5 fail here."""
    a, daemon, cid, pid = counter
    before = steady_view(pid)
    with pytest.raises(CriuFailed):
        dump(daemon, cid, criu_with_fault(tmp_path, code), registry.ref(f"faultmaps{code}", "v1"))
    assert_counting(a, cid)
    assert_same_view(steady_view(pid), before)


@pytest.mark.parametrize("code", [None, 136])
def test_a_dump_without_a_fault_that_acts_succeeds_and_changes_nothing(counter, registry, tmp_path, code):  # type: ignore[no-untyped-def]
    """The legitimate case beside A4: no fault, or one that acts only on a failed dump (136), and the
    same dump through the same script is pushed; the task's view is the same after it too."""
    a, daemon, cid, pid = counter
    before = steady_view(pid)
    result = dump(daemon, cid, criu_with_fault(tmp_path, code), registry.ref(f"fault{code or 0}", "v1"))
    assert RegistryClient().get_manifest(Reference.parse(str(result.reference)))
    assert_counting(a, cid)
    assert_same_view(steady_view(pid), before)
    assert criu_tables(pid) == []


def test_criu_killed_mid_dump_leaves_no_network_lock(counter, registry, tmp_path):  # type: ignore[no-untyped-def]
    """Threat A2: CRIU killed (SIGKILL, ``CRIU_FAULT=1``) after it locked the container's network: the
    container runs on, and its network namespace holds no ``CRIU-*`` table: the agent lifted it. Without
    the agent's defence (shown first, then put right by hand) the table stays and drops every packet."""
    a, daemon, cid, pid = counter
    killer = criu_with_fault(tmp_path, 1)
    with pytest.raises(CriuFailed):
        dump(daemon, cid, killer, registry.ref("a2", "v0"), lift=False)
    left = criu_tables(pid)
    assert len(left) == 1, f"CRIU's lock table was expected to outlive a killed CRIU: {left}"
    for table in left:  # what the defence does, by hand, for the case with it
        netns.run_in(f"/proc/{pid}/ns/net", lambda t=table: nftlock.unlock(t))  # type: ignore[misc]
    with pytest.raises(CriuFailed) as failed:
        dump(daemon, cid, killer, registry.ref("a2", "v1"))
    assert "fault: CRIU sudden detach" in (failed.value.details or "")
    assert criu_tables(pid) == []
    assert_counting(a, cid)


@contextlib.contextmanager
def foreign_criu_table(pid: int, name: str) -> Iterator[None]:
    """A table of CRIU's name that another CRIU holds in the namespace (made here, removed after)."""
    path = f"/proc/{pid}/ns/net"
    netns.run_in(path, lambda: nftlock.lock(name))
    try:
        yield
    finally:
        netns.run_in(path, lambda: nftlock.unlock(name))


def test_a_criu_table_that_was_there_before_the_dump_is_left_alone(counter, registry, tmp_path):  # type: ignore[no-untyped-def]
    """The legitimate case beside A2: a lock table of CRIU's name that was there before the dump (another
    CRIU, still working) is not the agent's to lift, even when the dump fails; the killed CRIU's is."""
    a, daemon, cid, pid = counter
    with foreign_criu_table(pid, "CRIU-someone-else"):
        with pytest.raises(CriuFailed):
            dump(daemon, cid, criu_with_fault(tmp_path, 1), registry.ref("a2keep", "v1"))
        assert criu_tables(pid) == ["CRIU-someone-else"]
    assert criu_tables(pid) == []
    assert_counting(a, cid)


def test_criu_killed_while_frozen_through_containerd_leaves_the_task_running_to_containerd(counter, registry, tmp_path):  # type: ignore[no-untyped-def]
    """Threat A2 on the engine's fallback freeze (containerd's Pause, where the cgroup freezer cannot be
    placed): CRIU thaws the cgroup once it has seized the tasks, so a CRIU killed mid-dump left them
    running while containerd's shim still called the task paused; runc refused the Resume ("container not
    paused") and containerd a new Pause ("cannot pause a paused container"), and every later snapshot was
    refused as "not running (paused)". The client now has runc pause it again and resumes it through
    containerd (shim/containerd/client.py::resume_task): the task is running to containerd, its lock
    lifted, and the next snapshot of it (the legitimate case) goes through."""
    a, daemon, cid, pid = counter
    with pytest.raises(CriuFailed):
        dump(daemon, cid, criu_with_fault(tmp_path, 1), registry.ref("a2pause", "v1"), guard=False)
    assert criu_tables(pid) == []
    assert_counting(a, cid)
    dump(daemon, cid, criu_with_fault(tmp_path, None), registry.ref("a2pause", "v2"), guard=False)
    assert_counting(a, cid)


def _criu_of(cid: str) -> list[int]:
    """The CRIU processes runc runs for `cid` (their parent's command line names it): never another's."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if (entry / "comm").read_text().strip() != "criu":
                continue
            ppid = (entry / "stat").read_text().rsplit(")", 1)[1].split()[1]
            parent = Path(f"/proc/{ppid}/cmdline").read_bytes().split(b"\0")
        except (OSError, IndexError):
            continue
        if cid.encode() in parent:
            found.append(int(entry.name))
    return found


BIG = "import os\nheld = bytearray(b'x') * (384 << 20)\ndef step(): pass\n"


def _dump_killed_under_lock(  # type: ignore[no-untyped-def]
    containerd_a, registry, cleanup, tmp_path, name: str, victims: Callable[[str], list[int]]
) -> tuple[ContainerdClient, str, int, list[int]]:
    """A container of BIG memory dumped by the node's CRIU (no fault) while a thread SIGKILLs the processes
    `victims(cid)` names the moment CRIU's ``CRIU-*`` table is in the container's namespace; the dump must
    fail. Returns the client, the container, its pid and what was killed."""
    from tests.integration.test_uncheckpointable import start

    a = client(containerd_a)
    cid = unique(name)
    cleanup(a, cid)
    start(a, containerd_a, cid, BIG, [])
    task = a.get_task(cid)
    assert task is not None
    pid = task.pid
    killed: list[int] = []
    stop = threading.Event()

    def killer() -> None:
        while not stop.is_set() and not killed:
            with contextlib.suppress(OSError):
                if criu_tables(pid):
                    for victim in victims(cid):
                        os.kill(victim, signal.SIGKILL)
                        killed.append(victim)
            time.sleep(0.002)

    thread = threading.Thread(target=killer, daemon=True)
    thread.start()
    try:
        with pytest.raises(CriuFailed):
            dump(containerd_a, cid, criu_with_fault(tmp_path, None), registry.ref(name, "v1"))
    finally:
        stop.set()
        thread.join(10)
    return a, cid, pid, killed


def test_criu_killed_from_outside_while_it_holds_the_lock_leaves_none(containerd_a, registry, cleanup, tmp_path):  # type: ignore[no-untyped-def]
    """Threat A2 with an outside ``kill -9``: a container with 384 MiB of memory (its dump lasts a while),
    the node's CRIU (no fault), killed by the test the moment its ``CRIU-*`` table is in the container's
    namespace: the dump fails, the container counts on, no table is left."""
    a, cid, pid, killed = _dump_killed_under_lock(containerd_a, registry, cleanup, tmp_path, "a2kill", _criu_of)
    assert killed, "CRIU was never seen holding its lock"
    assert criu_tables(pid) == []
    assert_counting(a, cid)


def _runc_checkpoint_of(cid: str) -> list[int]:
    """The ``runc checkpoint`` of `cid` (its command line names both): never another's."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if argv and argv[0].endswith(b"runc") and b"checkpoint" in argv and cid.encode() in argv:
            found.append(int(entry.name))
    return found


def test_runc_killed_while_its_criu_holds_the_lock_leaves_none(containerd_a, registry, cleanup, tmp_path):  # type: ignore[no-untyped-def]
    """Threat A2, runc's side: the ``runc checkpoint`` that runs CRIU is SIGKILLed the moment CRIU's table
    is in the container's namespace. The orphaned CRIU went on and, at its end, froze the cgroup again as
    it had found it (frozen by the agent, who had thawed it meanwhile): the container stayed frozen for
    good. Now the agent stops a CRIU still tracing the containers before it lifts the lock and thaws
    (shim/criu/tracers.py): the dump fails, the container counts on, no table is left."""
    a, cid, pid, killed = _dump_killed_under_lock(
        containerd_a, registry, cleanup, tmp_path, "a2runc", _runc_checkpoint_of
    )
    assert killed, "runc was never seen while CRIU held its lock"
    wait_for(lambda: criu_tables(pid) == [], what="no CRIU lock table in the container's namespace")
    assert_counting(a, cid)

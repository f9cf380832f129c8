"""What CRIU's parasite leaves after a failed dump, unmapped from inside the running process (threat A4):
the maps parsing, the restart of an interrupted call, and the cure on a real process (ptrace, as root).

The cure with a real CRIU dump that failed: tests/integration/test_criu_faults.py
(``test_an_injected_criu_fault_leaves_the_tasks_memory_map_as_it_was``)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
from collections.abc import Iterator

import pytest

from shim.criu import parasite
from shim.host import ptrace

MAPS = """\
55d0c0000000-55d0c0001000 r--p 00000000 08:01 131 /usr/bin/sleep
7f1c2a000000-7f1c2a00b000 rw-s 00000000 00:01 2272 /memfd:CRIUMFD (deleted)
7f1c2a00b000-7f1c2a00c000 rw-s 00000000 00:01 2273 /memfd:CRIUMFD2 (deleted)
7f1c2a010000-7f1c2a011000 rw-s 00000000 00:01 2274 /memfd:CRIUMFD
7f1c2a020000-7f1c2a023000 rw-p 00000000 00:00 0
7ffd1e000000-7ffd1e002000 r-xp 00000000 00:00 0 [vdso]
"""


def test_only_criu_s_deleted_memfd_counts_as_its_parasite() -> None:
    assert parasite.parasite_mappings(MAPS) == [parasite.Mapping(0x7F1C2A000000, 0x7F1C2A00B000, 2272)]


def regs(**values: int) -> ptrace.Regs:
    r = ptrace.Regs()
    for k, v in values.items():
        setattr(r, k, v & ((1 << 64) - 1))
    return r


@pytest.mark.parametrize("code", [ptrace.ERESTARTSYS, ptrace.ERESTARTNOINTR, ptrace.ERESTARTNOHAND])
def test_an_interrupted_restartable_call_is_run_again(code: int) -> None:
    r = ptrace.restarted(regs(orig_rax=7, rax=-code, rip=0x1002, rdi=5))
    assert (r.rax, r.rip, r.orig_rax, r.rdi) == (7, 0x1000, 7, 5)


def test_an_interrupted_sleep_goes_on_through_restart_syscall() -> None:
    r = ptrace.restarted(regs(orig_rax=230, rax=-ptrace.ERESTART_RESTARTBLOCK, rip=0x1002))
    assert (r.rax, r.rip) == (ptrace.NR_RESTART_SYSCALL, 0x1000)


@pytest.mark.parametrize(
    "orig_rax, rax",
    [(-1, 42), (0, 17), (0, -4)],  # user code; a call that returned 17; one that failed with EINTR
)
def test_anything_else_is_left_as_it_was(orig_rax: int, rax: int) -> None:
    r = ptrace.restarted(regs(orig_rax=orig_rax, rax=rax, rip=0x1002))
    assert (r.rax, r.rip) == (rax & ((1 << 64) - 1), 0x1002)


VICTIM = textwrap.dedent(
    """
    import mmap, os, sys, threading, time
    def criumfd(fill):
        fd = os.memfd_create("CRIUMFD")
        os.ftruncate(fd, 2 * 4096)
        m = mmap.mmap(fd, 2 * 4096)
        os.close(fd)
        m[:1] = fill
        return m
    own = criumfd(b"o")  # a CRIU of the process's own would hold such a mapping: not the parasite's
    ticks = [0]
    def tick():
        while True:
            ticks[0] += 1
            time.sleep(0.001)
    threading.Thread(target=tick, daemon=True).start()
    print("ready", flush=True)
    left = None
    for line in sys.stdin:
        if line.startswith("map"):
            left = criumfd(b"p")  # the parasite's, mapped after the listing
        else:
            before = ticks[0]
            time.sleep(0.05)
            print(own[:1].decode(), ticks[0] > before, flush=True)
    """
)


@pytest.fixture
def victim() -> Iterator[subprocess.Popen[str]]:
    p = subprocess.Popen([sys.executable, "-c", VICTIM], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert p.stdout is not None and p.stdout.readline() == "ready\n"
    yield p
    p.kill()
    p.wait()


def ask(p: subprocess.Popen[str], line: str) -> str:
    assert p.stdin is not None and p.stdout is not None
    p.stdin.write(line + "\n")
    p.stdin.flush()
    return p.stdout.readline().strip() if line != "map" else ""


def criumfd_count(pid: int) -> int:
    with open(f"/proc/{pid}/maps") as f:
        return len(parasite.parasite_mappings(f.read()))


@pytest.mark.skipif(os.geteuid() != 0 or os.uname().machine != "x86_64", reason="ptrace of a child, x86-64")
def test_the_parasite_s_mapping_is_unmapped_and_the_process_runs_on(victim: subprocess.Popen[str]) -> None:
    """The legitimate mapping listed before stays; the one that came after goes; the process (blocked in a
    read on its main thread, a second thread sleeping) answers as before, its own mapping intact."""
    before = parasite.present([victim.pid])
    assert list(before) == [victim.pid] and len(before[victim.pid]) == 1
    ask(victim, "map")
    assert ask(victim, "check") == "o True" and criumfd_count(victim.pid) == 2
    cured = parasite.cure([victim.pid], before)
    assert len(cured) == 1 and cured[0].startswith(f"{victim.pid}:")
    assert criumfd_count(victim.pid) == 1
    assert ask(victim, "check") == "o True"  # its own memfd reads back; its thread ticks on
    assert parasite.cure([victim.pid], before) == []  # nothing left to do


@pytest.mark.skipif(os.geteuid() != 0 or os.uname().machine != "x86_64", reason="ptrace of a child, x86-64")
def test_with_nothing_left_by_criu_the_process_is_not_touched(victim: subprocess.Popen[str]) -> None:
    before = parasite.present([victim.pid])
    assert parasite.cure([victim.pid], before) == []
    assert criumfd_count(victim.pid) == 1 and ask(victim, "check") == "o True"


@pytest.mark.skipif(os.geteuid() != 0 or os.uname().machine != "x86_64", reason="ptrace of a child, x86-64")
def test_system_calls_run_inside_a_busy_process_leave_it_running(victim: subprocess.Popen[str]) -> None:
    """Many injected calls (getpid) into a process with a thread in a sleep that they interrupt: each
    returns the process's pid, and the process works on."""
    for _ in range(50):
        assert ptrace.remote_syscalls(victim.pid, [(39, ()), (39, ())]) == [victim.pid, victim.pid]
    assert ask(victim, "check") == "o True"


@pytest.mark.skipif(os.geteuid() != 0 or os.uname().machine != "x86_64", reason="ptrace of a child, x86-64")
@pytest.mark.skipif(shutil.which("unshare") is None, reason="util-linux's unshare")
def test_a_process_of_another_pid_namespace_under_the_tree_is_not_traced() -> None:
    """Only processes in the containers' own pid namespaces are cured: a pid the walk listed may meanwhile
    belong to a process elsewhere (one in its own namespace stands for it here); beside it, the same
    process in the tree's namespace is cured (test_the_parasite_s_mapping_is_unmapped_and_the_process_runs_on)."""
    outer = subprocess.Popen(
        ["unshare", "--pid", "--fork", sys.executable, "-c", VICTIM],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert outer.stdout is not None and outer.stdout.readline() == "ready\n"
        inner = [p for p in parasite.processes([outer.pid]) if p != outer.pid]
        assert len(inner) == 1 and os.readlink(f"/proc/{inner[0]}/ns/pid") != os.readlink("/proc/self/ns/pid")
        ask(outer, "map")  # a mapping "left by CRIU" in the inner process
        assert ask(outer, "check") == "o True" and criumfd_count(inner[0]) == 2
        assert parasite.cure([outer.pid], {}) == []
        assert criumfd_count(inner[0]) == 2 and ask(outer, "check") == "o True"
    finally:
        outer.kill()
        outer.wait()

"""A system call run inside another process, through ptrace(2) (x86-64): what CRIU's compel does to cure a
task, for the one call the agent needs, ``munmap`` (shim/criu/parasite.py).

One thread of the process is seized and interrupted (PTRACE_SEIZE, PTRACE_INTERRUPT); its registers are
saved; it is pointed at a ``syscall`` instruction already in the process (its vDSO first: nothing is
written into the process's memory, so its other threads run on untouched), with the call's number and
arguments in its registers; it is let run to the call's exit (PTRACE_SYSCALL, twice) and its registers
are put back before it is detached. As in compel (compel/arch/x86/src/lib/infect.c, get_task_regs), a
thread stopped inside an interrupted system call is put back the way the kernel would have restarted it
(no handler ran: it runs the call again), since the kernel's own restart step saw the injected call instead.

Signals that reach the thread while it is held are kept from it and sent again (tgkill) once it is
detached. A tracer that dies detaches its tracees, so the caller runs this in a child process it can kill
(``python -m shim.host.ptrace``; `run_munmap`): a thread that never stops holds nothing for longer than
its deadline.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence

PTRACE_GETREGS, PTRACE_SETREGS = 12, 13
PTRACE_SYSCALL, PTRACE_CONT, PTRACE_DETACH = 24, 7, 17
PTRACE_SEIZE, PTRACE_INTERRUPT = 0x4206, 0x4207
PTRACE_O_TRACESYSGOOD = 1
PTRACE_EVENT_STOP = 128
WALL = 0x40000000
SYSCALL_INSN = b"\x0f\x05"
NR_MUNMAP, NR_RESTART_SYSCALL, NR_TGKILL = 11, 219, 234
USER_CS_64 = 0x33
# the kernel's restart codes (include/linux/errno.h), as a system call interrupted by a stop leaves them
ERESTARTSYS, ERESTARTNOINTR, ERESTARTNOHAND, ERESTART_RESTARTBLOCK = 512, 513, 514, 516
DEADLINE_S = 5.0


REG_NAMES = (
    "r15", "r14", "r13", "r12", "rbp", "rbx", "r11", "r10", "r9", "r8", "rax", "rcx", "rdx", "rsi", "rdi",
    "orig_rax", "rip", "cs", "eflags", "rsp", "ss", "fs_base", "gs_base", "ds", "es", "fs", "gs",
)  # fmt: skip


class Regs(ctypes.Structure):
    """struct user_regs_struct (x86-64, sys/user.h)."""

    _fields_ = [(name, ctypes.c_ulonglong) for name in REG_NAMES]


class PtraceError(OSError):
    pass


_libc = ctypes.CDLL(None, use_errno=True)
_ptrace = _libc.ptrace
_ptrace.argtypes = [ctypes.c_long, ctypes.c_long, ctypes.c_void_p, ctypes.c_void_p]
_ptrace.restype = ctypes.c_long


def _call(request: int, tid: int, addr: int | None = None, data: int | ctypes.Structure | None = None) -> None:
    arg = ctypes.byref(data) if isinstance(data, ctypes.Structure) else data
    ctypes.set_errno(0)
    if _ptrace(request, tid, addr, arg) == -1 and ctypes.get_errno():
        e = ctypes.get_errno()
        raise PtraceError(e, f"ptrace({request}) of thread {tid}: {os.strerror(e)}")


def _signed(v: int) -> int:
    return v - (1 << 64) if v >= 1 << 63 else v


def restarted(regs: Regs) -> Regs:
    """`regs` of a thread stopped in a system call, as the kernel would resume it with no signal handler
    run: an interrupted restartable call is run again (its number back in rax, rip on its instruction)."""
    out = Regs.from_buffer_copy(regs)
    if _signed(regs.orig_rax) < 0:
        return out
    err = -_signed(regs.rax)
    if err in (ERESTARTSYS, ERESTARTNOINTR, ERESTARTNOHAND):
        out.rax, out.rip = regs.orig_rax, regs.rip - 2
    elif err == ERESTART_RESTARTBLOCK:
        out.rax, out.rip = NR_RESTART_SYSCALL, regs.rip - 2
    return out


def find_syscall_insn(pid: int) -> int:
    """The address of a ``syscall`` instruction in `pid`'s executable mappings, its vDSO first."""
    regions: list[tuple[int, int, bool]] = []
    with open(f"/proc/{pid}/maps") as f:
        for line in f:
            parts = line.split()
            if len(parts) >= 2 and parts[1].startswith("r-x"):
                start, end = (int(x, 16) for x in parts[0].split("-"))
                regions.append((start, end, parts[-1] == "[vdso]"))
    regions.sort(key=lambda r: not r[2])
    with open(f"/proc/{pid}/mem", "rb", buffering=0) as mem:
        for start, end, _ in regions:
            try:
                mem.seek(start)
                data = mem.read(min(end - start, 1 << 20))
            except OSError:
                continue
            at = data.find(SYSCALL_INSN) if data else -1
            if at >= 0:
                return start + at
    raise PtraceError(errno.ENOEXEC, f"no syscall instruction in the executable mappings of process {pid}")


class _Held:
    """One seized thread, and the signals kept from it while held."""

    def __init__(self, pid: int, tid: int, deadline: float) -> None:
        self.pid, self.tid, self.deadline = pid, tid, deadline
        self.kept: list[int] = []

    def wait(self, want_syscall: bool, resume: int) -> None:
        """Wait for the thread's next stop of the kind wanted (its interrupt, or a system call's entry or
        exit); another signal's stop is kept for later and the thread resumed with `resume`."""
        while True:
            while True:
                got, status = os.waitpid(self.tid, os.WNOHANG | WALL)
                if got:
                    break
                if time.monotonic() > self.deadline:
                    raise PtraceError(errno.ETIMEDOUT, f"thread {self.tid} did not stop in time")
                time.sleep(0.001)
            if not os.WIFSTOPPED(status):
                raise PtraceError(errno.ESRCH, f"thread {self.tid} ended while held")
            sig, event = os.WSTOPSIG(status), status >> 16
            if want_syscall and sig == signal.SIGTRAP | 0x80:
                return
            if not want_syscall and event == PTRACE_EVENT_STOP:
                return
            if event == 0 and sig != signal.SIGTRAP | 0x80:
                self.kept.append(sig)  # a signal's delivery stop: kept from it, sent again after
            _call(resume, self.tid, None, 0)


def _live_thread(pid: int) -> int:
    """A thread of `pid` that has not exited (its main thread first: a leader may end before the others)."""
    tids = sorted((int(t) for t in os.listdir(f"/proc/{pid}/task")), key=lambda t: t != pid)
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X"):
                    return tid
        except (OSError, IndexError):
            continue
    raise PtraceError(errno.ESRCH, f"process {pid} has no live thread")


def remote_syscalls(pid: int, calls: Sequence[tuple[int, Sequence[int]]], deadline_s: float = DEADLINE_S) -> list[int]:
    """Run each (number, args) of `calls` in process `pid` (through one of its threads) and return their
    results (negative: -errno). The thread's registers are put back and it is detached, also on a failure."""
    held = _Held(pid, _live_thread(pid), time.monotonic() + deadline_s)
    _call(PTRACE_SEIZE, held.tid, None, PTRACE_O_TRACESYSGOOD)
    saved: Regs | None = None
    try:
        _call(PTRACE_INTERRUPT, held.tid)
        held.wait(False, PTRACE_CONT)
        saved = Regs()
        _call(PTRACE_GETREGS, held.tid, None, saved)
        if saved.cs != USER_CS_64:
            raise PtraceError(errno.ENOEXEC, f"process {pid} is not a 64-bit process")
        insn = find_syscall_insn(pid)
        return [_one(held, saved, insn, nr, args) for nr, args in calls]
    finally:
        try:
            if saved is not None:
                _put_back(held, restarted(saved))
        finally:
            _detach(held)


def _one(held: _Held, saved: Regs, insn: int, nr: int, args: Sequence[int]) -> int:
    regs = Regs.from_buffer_copy(saved)
    regs.rax, regs.orig_rax, regs.rip = nr, (1 << 64) - 1, insn  # orig_rax -1: no restart step on resume
    for name, value in zip(("rdi", "rsi", "rdx", "r10", "r8", "r9"), args, strict=False):
        setattr(regs, name, value & ((1 << 64) - 1))
    _call(PTRACE_SETREGS, held.tid, None, regs)
    _call(PTRACE_SYSCALL, held.tid, None, 0)
    held.wait(True, PTRACE_SYSCALL)  # its entry
    _call(PTRACE_SYSCALL, held.tid, None, 0)
    held.wait(True, PTRACE_SYSCALL)  # its exit
    _call(PTRACE_GETREGS, held.tid, None, regs)
    return _signed(regs.rax)


def _put_back(held: _Held, regs: Regs) -> None:
    """Set the thread's registers to `regs`; a thread that is not stopped (it missed a deadline: a frozen
    cgroup, say) is interrupted first, so that it never runs on with the injected ones."""
    try:
        _call(PTRACE_SETREGS, held.tid, None, regs)
        return
    except PtraceError as e:
        if e.errno != errno.ESRCH:
            raise
    _call(PTRACE_INTERRUPT, held.tid)
    held.deadline = time.monotonic() + DEADLINE_S
    held.wait(False, PTRACE_CONT)
    _call(PTRACE_SETREGS, held.tid, None, regs)


def _detach(held: _Held) -> None:
    with contextlib.suppress(PtraceError):  # not stopped: this process's end detaches it
        _call(PTRACE_DETACH, held.tid, None, 0)
    for sig in held.kept:
        _libc.syscall(NR_TGKILL, held.pid, held.tid, sig)  # a thread gone meanwhile: ESRCH, nothing to do


def run_munmap(pid: int, ranges: Sequence[tuple[int, int]], timeout_s: float = DEADLINE_S + 5) -> list[int]:
    """Unmap each [start, end) of `ranges` in process `pid`, from a child process (killed past `timeout_s`,
    which detaches the thread); returns the munmap results (0, or -errno)."""
    args = [sys.executable, "-m", "shim.host.ptrace", str(pid), *(f"{s:x}-{e:x}" for s, e in ranges)]
    done = subprocess.run(args, capture_output=True, text=True, timeout=timeout_s, check=False)
    if done.returncode != 0:
        raise PtraceError(errno.EIO, f"munmap in process {pid}: {done.stderr.strip() or done.returncode}")
    return [int(x) for x in done.stdout.split()]


def main(argv: Sequence[str]) -> int:
    pid, ranges = int(argv[0]), [tuple(int(x, 16) for x in r.split("-")) for r in argv[1:]]
    try:
        results = remote_syscalls(pid, [(NR_MUNMAP, (s, e - s)) for s, e in ranges])
    except OSError as e:
        print(e, file=sys.stderr)
        return 1
    print(" ".join(str(r) for r in results))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

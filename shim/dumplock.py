"""One network lock around the dumps of a pod's containers: the images of both ends of a connection
between two containers agree.

The agent freezes every container of a snapshot and then has CRIU dump them one after the other.
Frozen processes do not run, but their sockets do: CRIU locks a connection only while it dumps the
task that holds it and unlocks it afterwards (``--leave-running``). So between the dump of a server
container and that of its client, the client's kernel can still send what it held back (Nagle,
waiting for the server's delayed ACK, which the server's repair-off window probe then brings), the
server's kernel acknowledges it, and the client's image no longer holds bytes that the server's image
never received: after the restore the connection stalls for good (the client's "restored client
sends nothing", seen now and then in tests/integration/test_whole_pod_restore.py).

So while the containers are dumped, every packet in the pod's network namespace is dropped, the same
way as during a whole-pod restore (shim/podrestore.py, its own chain): TCP retransmits whatever was
held back once the lock is gone, or, after a restore, from the images. Only namespaces that two or
more of the snapshot's containers share are locked, never the host's or the agent's own. The tools
(``nsenter``, ``sh``, ``iptables-restore``) are the host's, run in its mount namespace when the agent
runs in a container (docs/deploy.md, known limits). If the agent dies during the dumps, the freeze
guard thaws the pod and the lock stays until the agent's next start lifts it (release_leftover, with
the containers recover_interrupted thaws).
"""

from __future__ import annotations

import contextlib
import os
import shlex
import subprocess
from collections.abc import Callable, Iterator, Sequence

from kubectl_snapshot.core.errors import FailedPrecondition
from shim.hostfacts import host_pid

LOCK_CHAIN = "KUBECTL-SNAPSHOT-DUMP-LOCK"
_LOCK = (
    f"*filter\n:{LOCK_CHAIN} - [0:0]\n-A {LOCK_CHAIN} -j DROP\n"
    f"-I INPUT 1 -j {LOCK_CHAIN}\n-I OUTPUT 1 -j {LOCK_CHAIN}\nCOMMIT\n"
)
_UNLOCK = f"*filter\n-D INPUT -j {LOCK_CHAIN}\n-D OUTPUT -j {LOCK_CHAIN}\n-F {LOCK_CHAIN}\n-X {LOCK_CHAIN}\nCOMMIT\n"
_SYSTEM_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"

# (argv) -> (exit status, output)
Runner = Callable[[list[str]], tuple[int, str]]


def lock_script() -> str:
    rules = shlex.quote(_LOCK)
    return (
        f"set -e; printf %s {rules} | iptables-restore --noflush; "
        f"if [ -e /proc/sys/net/ipv6 ]; then printf %s {rules} | ip6tables-restore --noflush; fi"
    )


def unlock_script() -> str:
    rules = shlex.quote(_UNLOCK)
    return (
        f"printf %s {rules} | iptables-restore --noflush; rc=$?; "
        f"if [ -e /proc/sys/net/ipv6 ]; then printf %s {rules} | ip6tables-restore --noflush || rc=1; fi; exit $rc"
    )


def run_host(argv: list[str]) -> tuple[int, str]:
    env = {**os.environ, "PATH": _SYSTEM_PATH + ":" + os.environ.get("PATH", "")}
    try:
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=30, check=False, env=env)
    except (OSError, subprocess.TimeoutExpired) as e:
        return 127, str(e)
    return proc.returncode, (proc.stdout + proc.stderr).strip()


def _netns(pid: int | str) -> str | None:
    try:
        return os.readlink(f"/proc/{pid}/ns/net")
    except OSError:
        return None


def shared_namespaces(pids: Sequence[int], exclude: Sequence[str | None]) -> dict[str, int]:
    """{netns: a pid in it} for namespaces that two or more of `pids` share, minus `exclude`."""
    seen: dict[str, list[int]] = {}
    for pid in pids:
        ns = _netns(pid)
        if ns is not None and ns not in exclude:
            seen.setdefault(ns, []).append(pid)
    return {ns: members[0] for ns, members in seen.items() if len(members) > 1}


def _enter(pid: int, script: str) -> list[str]:
    host = host_pid()
    mount = [f"--mount=/proc/{host}/ns/mnt"] if host else []
    return ["nsenter", *mount, f"--net=/proc/{pid}/ns/net", "--", "sh", "-c", script]


def release_leftover(pids: Sequence[int], run: Runner = run_host) -> int:
    """Lift a lock that a killed agent left (its next start, with the containers it thaws); returns
    how many namespaces had one. Namespaces without the chain are left as they are."""
    host = host_pid()
    released = 0
    for pid in shared_namespaces(pids, [_netns("self"), _netns(host or 1)]).values():
        rc, _ = run(_enter(pid, f"iptables -S {LOCK_CHAIN} >/dev/null 2>&1 || exit 3; {unlock_script()}"))
        released += rc == 0
    return released


@contextlib.contextmanager
def pod_network_locked(pids: Sequence[int], run: Runner = run_host) -> Iterator[None]:
    """Drop every packet in the namespaces the containers (init pids) share, for the block's length."""
    host = host_pid()
    targets = shared_namespaces(pids, [_netns("self"), _netns(host or 1)])
    locked: list[int] = []
    try:
        for pid in targets.values():
            rc, out = run(_enter(pid, lock_script()))
            if rc != 0:
                raise FailedPrecondition(
                    f"locking the pod's network for the dump failed (exit {rc}): {out[-300:]}",
                    hint="the node needs nsenter, sh and iptables-restore (docs/deploy.md, known limits)",
                )
            locked.append(pid)
        yield
    finally:
        for pid in locked:
            run(_enter(pid, unlock_script()))  # best effort: the namespace goes with the pod anyway

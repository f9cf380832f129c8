"""bench/criulog.action_wait (CRIU's wait for a step's answer, read from restore.log), after_memory, tmpfs_mounts and
bench/throttle.ThrottledLink (a bandwidth-limited loopback link) on real sockets."""

from __future__ import annotations

import socket
import threading
import time

from bench import criulog
from bench.throttle import ThrottledLink

LOG = """(00.100000) Running setup-namespaces scripts
(00.100010) \tRPC
(00.110000) Wait until namespaces are created
(00.130466) Running post-setup-namespaces scripts
(00.130494) \tRPC
(00.130731) \t[/opt/ks/kubectl-snapshot-runc]
(00.638578)      1: Preparing info about shared resources
(00.700000) Running post-restore scripts
"""


def test_the_wait_runs_from_the_actions_line_to_the_first_line_after_its_scripts() -> None:
    waited = criulog.action_wait(LOG, "post-setup-namespaces")
    assert waited is not None and abs(waited - 0.508112) < 1e-9
    setup = criulog.action_wait(LOG, "setup-namespaces")
    assert setup is not None and abs(setup - 0.01) < 1e-9
    assert criulog.action_wait(LOG, "pre-resume") is None  # not run
    assert criulog.action_wait("(00.1) Running post-restore scripts\n", "post-restore") is None  # nothing after


def test_after_the_memory_runs_from_post_restore_to_the_last_line() -> None:
    log = (
        LOG + "(00.710000) Running network-unlock scripts\n(00.750500) Restore finished successfully. Tasks resumed.\n"
    )
    tail = criulog.after_memory(log)
    assert tail is not None and abs(tail - 0.0505) < 1e-9
    assert criulog.after_memory(LOG.replace("post-restore", "pre-resume")) is None


TMPFS = """(00.032907)      1: mnt-v2: Mount 79 is detected as dir-mount
(00.032913)      1: mnt-v2: \tMounting tmpfs @79 (0)
(00.033000) cg: unrelated line of another process
(00.049655)      1: mnt-v2: Create plain mountpoint /tmp/.criu.mntns.JYCZgg/mnt-0000000079 for 79
(00.049729)      1: mnt-v2: \tMounting devpts @80 (0)
(00.049807)      1: mnt-v2: \tMounting tmpfs @81 (0)
(00.056130)      1: mnt-v2: Create plain mountpoint /tmp/.criu.mntns.JYCZgg/mnt-0000000081 for 81
(00.057000)      1: mnt-v2: \tMounting tmpfs @8 (0)
(00.058000)      1: mnt-v2: Create plain mountpoint /tmp/.criu.mntns.JYCZgg/mnt-0000000081 for 81
"""


def test_tmpfs_mounts_run_from_mounting_to_that_mounts_next_line() -> None:
    count, seconds = criulog.tmpfs_mounts(TMPFS)
    # @79 16.742 ms + @81 6.323 ms; @8 has no line of its own after it (81's does not count for it)
    assert count == 2 and abs(seconds - (0.016742 + 0.006323)) < 1e-9
    assert criulog.tmpfs_mounts("") == (0, 0.0)


def test_the_link_passes_the_bytes_at_its_rate() -> None:
    payload = bytes(range(256)) * (4 << 10)  # 1 MiB
    server = socket.create_server(("127.0.0.1", 0))

    def serve() -> None:
        conn, _ = server.accept()
        with conn:
            conn.recv(16)
            conn.sendall(payload)

    threading.Thread(target=serve, daemon=True).start()
    link = ThrottledLink(f"127.0.0.1:{server.getsockname()[1]}", 40)  # 5 MB/s: 1 MiB takes >= 0.2 s
    try:
        host, _, port = link.host.rpartition(":")
        with socket.create_connection((host, int(port))) as c:
            t = time.monotonic()
            c.sendall(b"go")
            got = bytearray()
            while data := c.recv(1 << 16):
                got += data
            took = time.monotonic() - t
    finally:
        link.close()
        server.close()
    assert bytes(got) == payload
    assert took >= 0.19, took

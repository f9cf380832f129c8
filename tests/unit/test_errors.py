"""Error helpers of kubectl_snapshot.core.errors."""

from __future__ import annotations

from kubectl_snapshot.core.errors import criu_first_error


def test_criu_first_error_names_the_cause_not_the_aftermath() -> None:
    log = (  # a real restore.log (a connection that left the pod, before the old address was lent)
        "(00.036329) Error (criu/util.c:1534): rlimit: Can't setup RLIMIT_NOFILE for self: Operation not permitted\n"
        "(00.075903)      7: Error (soccr/soccr.c:529): Can't connect inet socket back: Network is unreachable\n"
        "(00.075916)      7: Error (criu/files.c:1221): Unable to open fd=3 id=0xd\n"
        "(00.076934)      1: Error (criu/cr-restore.c:1265): 7 exited, status=1\n"
        "(00.077944) Error (criu/cr-restore.c:2331): Restoring FAILED.\n"
        "(00.079505) Error (criu/cgroup.c:2055): cg: cgroupd: recv req error: No such file or directory\n"
    )
    assert "Network is unreachable" in criu_first_error(log)
    assert criu_first_error("(00.1) Error (criu/cr-restore.c:2331): Restoring FAILED.\n") == ""

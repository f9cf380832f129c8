"""The essential round trip on every supported containerd release line, not only the installed one.

For each release in tests.support.containerd_versions.OTHER_VERSIONS (built from the Go module proxy by
hack/build-containerd.sh, cached by version) two private daemons of that release run; a counter
snapshotted from the first is restored on the second through the runtime wrapper and counts on. The
installed release (v2.3.x) runs the same test in test_agent_roundtrip.py.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from shim.containerd.client import ContainerdClient
from tests.integration.test_agent_roundtrip import (
    agent,
    cleanup,
    client,
    on,
    read_counter,
    restore_on,
    start_counter,
    task_status,
    unique,
    wait_for,
)
from tests.support.containerd import ContainerdDaemon, running_daemon
from tests.support.containerd_versions import OTHER_VERSIONS, built
from tests.support.images import busybox_image
from tests.support.registry import RegistryServer, registry

pytestmark = pytest.mark.integration

__all__ = ["cleanup", "registry"]


def serving_shim(c: ContainerdClient, cid: str) -> str:
    """The binary of the shim that parents the container's first process."""
    task = c.get_task(cid)
    assert task is not None
    ppid = Path(f"/proc/{task.pid}/stat").read_text().rsplit(")", 1)[1].split()[1]
    return os.readlink(f"/proc/{ppid}/exe")


@pytest.fixture(scope="module", params=OTHER_VERSIONS)
def daemons(
    request: pytest.FixtureRequest,
    tmp_path_factory: pytest.TempPathFactory,
    criu_node_config: object,
    memory_work_fs: object,
) -> Iterator[tuple[ContainerdDaemon, ContainerdDaemon]]:
    """Two daemons ("node A", "node B") of one release."""
    version: str = request.param
    binaries = built(version)
    with (
        running_daemon("a", tmp_path_factory.mktemp(f"containerd-{version}-a"), binaries) as a,
        running_daemon("b", tmp_path_factory.mktemp(f"containerd-{version}-b"), binaries) as b,
    ):
        for d in (a, b):
            served, _ = d.client().version()
            assert served == version, f"{d.binaries.containerd} says it is {served}, not {version}"
        yield a, b


def test_counter_continues_on_a_second_daemon_of_the_same_release(  # type: ignore[no-untyped-def]
    daemons: tuple[ContainerdDaemon, ContainerdDaemon],
    registry: RegistryServer,
    cleanup: Callable[[ContainerdClient, str], None],
):
    da, db = daemons
    a, b = client(da), client(db)
    image = busybox_image(da)
    assert busybox_image(db) == image
    cid, new = unique("counter"), unique("restored")
    cleanup(a, cid)
    cleanup(b, new)
    start_counter(a, da, cid, image)
    assert serving_shim(a, cid) == da.binaries.shim  # not the installed release's shim
    tok_before, v_before = read_counter(a, cid)

    version = da.binaries.version
    ref = agent("checkpoint", *on(da), "--stop", "--to", registry.ref("versions", version), cid).stdout.strip()
    assert re.fullmatch(rf"{re.escape(registry.host)}/versions@sha256:[0-9a-f]{{64}}", ref), ref
    task = a.get_task(cid)
    assert task is None or task.status == "stopped"

    agent(*restore_on(db), ref, new)
    assert task_status(b, new) == "running"
    assert serving_shim(b, new) == db.binaries.shim
    tok_after, v_after = read_counter(b, new)
    assert tok_after == tok_before  # the same process memory, not a fresh start
    assert v_after >= v_before
    wait_for(lambda: read_counter(b, new)[1] > v_after + 5, what="the restored counter to advance")
    b.kill_task(new, 9)
    assert b.wait_task(new, timeout=20) == 137

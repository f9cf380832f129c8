"""Plain values the containerd client returns and takes, free of protobuf types.

Callers (the agent, the restore wrapper's installer, tests) never see generated message classes: the
client converts at its edge, so the generated code can be regenerated or replaced without touching
them.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Final, Literal

from kubectl_snapshot.core.oci import Descriptor  # one OCI descriptor for the registry and containerd

TaskStatus = Literal["created", "running", "paused", "stopped", "unknown"]
TASK_STATUSES: Final[tuple[TaskStatus, ...]] = ("created", "running", "paused", "stopped", "unknown")


@dataclass(frozen=True)
class RuncOptions:
    """Options of containerd's runc shim (``containerd.runc.v1.Options``) that the project sets.

    `binary_name` selects a runc-compatible binary (the project's restore wrapper); `root` is runc's
    state directory, which must differ between containerd instances on one machine.
    """

    binary_name: str = ""
    root: str = ""
    systemd_cgroup: bool = False
    no_pivot_root: bool = False
    criu_image_path: str = ""
    criu_work_path: str = ""


@dataclass(frozen=True)
class Mount:
    """A mount as snapshotters return it (overlay with lowerdir/upperdir options, bind, ...)."""

    type: str
    source: str
    target: str = ""
    options: tuple[str, ...] = ()


@dataclass(frozen=True)
class ContainerInfo:
    """containerd's record of a container (metadata only; the process is a task)."""

    id: str
    image: str
    labels: Mapping[str, str]
    runtime_name: str
    runc_options: RuncOptions | None
    spec: dict[str, Any]
    snapshotter: str
    snapshot_key: str


@dataclass(frozen=True)
class TaskInfo:
    """A container's task (its init process): pid, status, and exit status once stopped."""

    pid: int
    status: TaskStatus
    exit_status: int


@dataclass(frozen=True)
class ImageInfo:
    """An image record: its name and the descriptor of its manifest or index."""

    name: str
    target: Descriptor
    labels: Mapping[str, str] = field(default_factory=dict)

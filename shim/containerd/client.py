"""containerd over gRPC: the only module that talks to containerd (and imports grpc for it).

Every call carries the ``containerd-namespace`` header of the client's namespace and a deadline, and
every failure becomes one of the project's errors naming the call and the container:

    UNAVAILABLE                          -> Unavailable  (socket missing or refused; retryable)
    DEADLINE_EXCEEDED                    -> Unavailable  (no answer in time; retryable)
    NOT_FOUND                            -> NotFound
    ALREADY_EXISTS, FAILED_PRECONDITION  -> FailedPrecondition
    anything else                        -> Internal     (CriuFailed for Tasks.Checkpoint)

The methods mirror what ``ctr`` does (``run -d``, ``task exec``, ``task checkpoint``), built from the
raw services, so the agent needs neither ctr nor containerd's Go client.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from types import TracebackType
from typing import Any, Final, TypeVar

import grpc
from google.protobuf import any_pb2, empty_pb2

from kubectl_snapshot.core import constants as c
from kubectl_snapshot.core import timestamps as T
from kubectl_snapshot.core.errors import (
    CriuFailed,
    FailedPrecondition,
    Internal,
    NotFound,
    SnapshotError,
    Unavailable,
    log_tail,
)
from kubectl_snapshot.core.oci import Descriptor
from shim.containerd import imageconfig
from shim.containerd.api.services.containers.v1 import containers_pb2, containers_pb2_grpc
from shim.containerd.api.services.content.v1 import content_pb2, content_pb2_grpc
from shim.containerd.api.services.images.v1 import images_pb2, images_pb2_grpc
from shim.containerd.api.services.leases.v1 import leases_pb2, leases_pb2_grpc
from shim.containerd.api.services.snapshots.v1 import snapshots_pb2, snapshots_pb2_grpc
from shim.containerd.api.services.tasks.v1 import tasks_pb2, tasks_pb2_grpc
from shim.containerd.api.services.version.v1 import version_pb2_grpc
from shim.containerd.api.types import mount_pb2
from shim.containerd.api.types.runc.options import oci_pb2
from shim.containerd.api.types.task import task_pb2
from shim.containerd.fifo import OutputFifos
from shim.containerd.model import (
    ContainerInfo,
    ImageInfo,
    Mount,
    RuncOptions,
    TaskInfo,
    TaskStatus,
)
from shim.containerd.runc_checkpoint import CheckpointArgs, RuncCheckpointer
from shim.containerd.spec import default_spec
from shim.host import private, rcu

__all__ = [
    "ContainerInfo",
    "ContainerdClient",
    "Descriptor",
    "ImageInfo",
    "Mount",
    "RuncOptions",
    "TaskInfo",
]

# typeurl names containerd registers for the OCI spec JSON documents it stores in Any.
SPEC_TYPE_URL: Final = "types.containerd.io/opencontainers/runtime-spec/1/Spec"
PROCESS_TYPE_URL: Final = "types.containerd.io/opencontainers/runtime-spec/1/Process"
SIGKILL: Final = 9

_STATUS: Final[dict[int, TaskStatus]] = {
    task_pb2.CREATED: "created",
    task_pb2.RUNNING: "running",
    task_pb2.PAUSED: "paused",
    task_pb2.PAUSING: "paused",
    task_pb2.STOPPED: "stopped",
}
_T = TypeVar("_T")


def _pack(msg: Any, type_url: str) -> any_pb2.Any:
    """Any with containerd's own type URL (the bare proto name, as its Go typeurl package writes)."""
    return any_pb2.Any(type_url=type_url, value=msg.SerializeToString())


def _type_name(type_url: str) -> str:
    return type_url.rsplit("/", 1)[-1] if type_url.startswith("type.googleapis.com/") else type_url


def _runc_options_to_proto(o: RuncOptions) -> oci_pb2.Options:
    return oci_pb2.Options(
        binary_name=o.binary_name,
        root=o.root,
        systemd_cgroup=o.systemd_cgroup,
        no_pivot_root=o.no_pivot_root,
        criu_image_path=o.criu_image_path,
        criu_work_path=o.criu_work_path,
    )


def _runc_options_from_any(a: any_pb2.Any) -> RuncOptions | None:
    if not a.type_url or _type_name(a.type_url) != c.RUNC_OPTIONS_TYPE:
        return None
    o = oci_pb2.Options()
    o.ParseFromString(a.value)
    return RuncOptions(
        binary_name=o.binary_name,
        root=o.root,
        systemd_cgroup=o.systemd_cgroup,
        no_pivot_root=o.no_pivot_root,
        criu_image_path=o.criu_image_path,
        criu_work_path=o.criu_work_path,
    )


def _mount_from_proto(m: mount_pb2.Mount) -> Mount:
    return Mount(type=m.type, source=m.source, target=m.target, options=tuple(m.options))


def _mount_to_proto(m: Mount) -> mount_pb2.Mount:
    return mount_pb2.Mount(type=m.type, source=m.source, target=m.target, options=list(m.options))


def _container_info(ct: containers_pb2.Container) -> ContainerInfo:
    spec: dict[str, Any] = {}
    if ct.spec.value:
        try:
            decoded = json.loads(ct.spec.value)
        except ValueError as e:
            raise Internal(f"container {ct.id}: its OCI spec is not JSON: {e}") from e
        spec = decoded if isinstance(decoded, dict) else {}
    return ContainerInfo(
        id=ct.id,
        image=ct.image,
        labels=dict(ct.labels),
        runtime_name=ct.runtime.name,
        runc_options=_runc_options_from_any(ct.runtime.options),
        spec=spec,
        snapshotter=ct.snapshotter,
        snapshot_key=ct.snapshot_key,
    )


def _file_uri(path: str) -> str:
    return path if "://" in path else "file://" + os.path.abspath(path)


def _read_dump_log(work_path: str) -> str | None:
    """CRIU's error lines (the cause is often far above the end) and the tail of its dump log."""
    for name in (c.DUMP_LOG_FILE, "criu-dump.log"):
        try:
            text = Path(work_path, name).read_text(errors="replace")
        except OSError:
            continue
        errors = [line for line in text.splitlines() if "Error (" in line][-10:]
        tail = log_tail(text)
        return "\n".join(errors) + "\n...\n" + tail if errors else tail
    return None


_DEADLINE_CODES = (grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED)
RUNC_NOT_PAUSED = "container not paused"  # runc resume of a container whose cgroup is not frozen


def _deadline_passed(e: grpc.RpcError) -> bool:
    """The call's own deadline: DEADLINE_EXCEEDED, CANCELLED when containerd resets the stream first, or
    UNKNOWN carrying containerd's "context deadline exceeded" (seen once in CI on a Wait)."""
    code = e.code()
    return code in _DEADLINE_CODES or (
        code == grpc.StatusCode.UNKNOWN and "context deadline exceeded" in (e.details() or "")
    )


class ContainerdClient:
    """A connection to one containerd socket, acting in one containerd namespace.

    Use as a context manager (or call ``close()``). `timeout` is the deadline of each unary call;
    calls that wait for something (``wait_task``, ``checkpoint_task``) take their own.
    """

    def __init__(
        self,
        address: str,
        namespace: str,
        *,
        timeout: float = 30.0,
        checkpointer: RuncCheckpointer | None = None,
        state_dir: str = "",
    ) -> None:
        self.address = address.removeprefix("unix://")
        self.namespace = namespace
        self.timeout = timeout
        self.checkpointer = checkpointer  # set: runc checkpoint with the installed CRIU (runc_checkpoint.py)
        self.state_dir = state_dir  # set: RCU grace periods expedited during a checkpoint (shim/host/rcu.py)
        self._lease: str | None = None
        self._channel = grpc.insecure_channel(
            "unix://" + self.address,
            options=[("grpc.max_receive_message_length", 64 << 20), ("grpc.enable_http_proxy", 0)],
        )
        self._containers = containers_pb2_grpc.ContainersStub(self._channel)
        self._tasks = tasks_pb2_grpc.TasksStub(self._channel)
        self._content = content_pb2_grpc.ContentStub(self._channel)
        self._images = images_pb2_grpc.ImagesStub(self._channel)
        self._snapshots = snapshots_pb2_grpc.SnapshotsStub(self._channel)
        self._leases = leases_pb2_grpc.LeasesStub(self._channel)
        self._version = version_pb2_grpc.VersionStub(self._channel)

    # --- plumbing --------------------------------------------------------------------------------

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> ContainerdClient:
        return self

    def __exit__(self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None) -> None:
        self.close()

    def _metadata(self) -> list[tuple[str, str]]:
        md = [(c.CONTAINERD_NAMESPACE_HEADER, self.namespace)]
        if self._lease:
            md.append((c.CONTAINERD_LEASE_HEADER, self._lease))
        return md

    def _error(self, err: grpc.RpcError, what: str, hint: str | None = None) -> SnapshotError:
        code = err.code() if hasattr(err, "code") else None
        detail = err.details() if hasattr(err, "details") else str(err)
        msg = f"{what}: {detail}"
        if code == grpc.StatusCode.UNAVAILABLE:
            return Unavailable(
                f"{what}: containerd at {self.address} is unreachable ({detail})",
                hint="is containerd running? check the socket path given with --address",
            )
        if code == grpc.StatusCode.DEADLINE_EXCEEDED:
            return Unavailable(
                f"{what}: no answer from containerd at {self.address} in time",
                hint="containerd may be overloaded; retry, or raise the timeout",
            )
        if code == grpc.StatusCode.NOT_FOUND:
            return NotFound(msg, hint=hint)
        if code in (grpc.StatusCode.ALREADY_EXISTS, grpc.StatusCode.FAILED_PRECONDITION):
            return FailedPrecondition(msg, hint=hint)
        return Internal(f"{msg} (grpc {code.name if code else 'error'})", hint=hint)

    def _call(
        self,
        method: Callable[..., _T],
        request: Any,
        what: str,
        *,
        timeout: float | None = None,
        hint: str | None = None,
    ) -> _T:
        try:
            return method(request, timeout=timeout or self.timeout, metadata=self._metadata())
        except grpc.RpcError as e:
            raise self._error(e, what, hint) from None

    def _ctr(self) -> str:
        return f"ctr --address {self.address} -n {self.namespace}"

    @contextlib.contextmanager
    def lease(self, *, expire: float = 3600.0) -> Iterator[str]:
        """Protect content and snapshots created inside from garbage collection until the block ends."""
        lid = "kubectl-snapshot-" + secrets.token_hex(8)
        labels = {"containerd.io/gc.expire": T.rfc3339(time.time() + expire)}
        self._call(self._leases.Create, leases_pb2.CreateRequest(id=lid, labels=labels), "create lease")
        previous, self._lease = self._lease, lid
        try:
            yield lid
        finally:
            self._lease = previous
            with contextlib.suppress(SnapshotError):
                self._call(self._leases.Delete, leases_pb2.DeleteRequest(id=lid), f"delete lease {lid}")

    # --- version -----------------------------------------------------------------------------------

    def version(self) -> tuple[str, str]:
        """(version, revision) of the containerd daemon."""
        r = self._call(self._version.Version, empty_pb2.Empty(), "containerd version")
        return r.version, r.revision

    # --- containers --------------------------------------------------------------------------------

    def get_container(self, cid: str) -> ContainerInfo:
        r = self._call(
            self._containers.Get,
            containers_pb2.GetContainerRequest(id=cid),
            f"get container {cid!r} (namespace {self.namespace})",
            hint=f"list containers with `{self._ctr()} containers ls`; "
            "for Kubernetes, containerd's namespace is k8s.io",
        )
        return _container_info(r.container)

    def list_containers(self) -> list[ContainerInfo]:
        r = self._call(
            self._containers.List,
            containers_pb2.ListContainersRequest(),
            f"list containers ({self.namespace})",
        )
        return [_container_info(ct) for ct in r.containers]

    def create_container(
        self,
        cid: str,
        *,
        image: str,
        spec: dict[str, Any],
        snapshotter: str,
        snapshot_key: str,
        runtime_name: str = c.RUNC_RUNTIME,
        runc_options: RuncOptions | None = None,
        labels: Mapping[str, str] | None = None,
    ) -> None:
        runtime = containers_pb2.Container.Runtime(name=runtime_name)
        if runc_options is not None:
            runtime.options.CopyFrom(_pack(_runc_options_to_proto(runc_options), c.RUNC_OPTIONS_TYPE))
        ct = containers_pb2.Container(
            id=cid,
            image=image,
            labels=dict(labels or {}),
            runtime=runtime,
            spec=any_pb2.Any(type_url=SPEC_TYPE_URL, value=json.dumps(spec).encode()),
            snapshotter=snapshotter,
            snapshot_key=snapshot_key,
        )
        self._call(
            self._containers.Create,
            containers_pb2.CreateContainerRequest(container=ct),
            f"create container {cid!r}",
            hint="pick another id, or remove the old container first",
        )

    def delete_container(self, cid: str) -> None:
        self._call(
            self._containers.Delete,
            containers_pb2.DeleteContainerRequest(id=cid),
            f"delete container {cid!r}",
        )

    # --- tasks -------------------------------------------------------------------------------------

    def get_task(self, cid: str) -> TaskInfo | None:
        """The container's task, or None when it has none (never started, or deleted)."""
        try:
            r = self._call(self._tasks.Get, tasks_pb2.GetRequest(container_id=cid), f"get task of {cid!r}")
        except NotFound:
            return None
        p = r.process
        return TaskInfo(pid=p.pid, status=_STATUS.get(p.status, "unknown"), exit_status=p.exit_status)

    def create_task(
        self,
        cid: str,
        *,
        rootfs: list[Mount],
        stdout: str = "",
        stderr: str = "",
        stdin: str = "",
        terminal: bool = False,
    ) -> int:
        """Create (not start) the task; returns its pid. stdout/stderr: FIFO paths or file:// URIs."""
        r = self._call(
            self._tasks.Create,
            tasks_pb2.CreateTaskRequest(
                container_id=cid,
                rootfs=[_mount_to_proto(m) for m in rootfs],
                stdin=stdin,
                stdout=stdout,
                stderr=stderr,
                terminal=terminal,
            ),
            f"create task of {cid!r}",
            timeout=max(self.timeout, 120.0),
        )
        return int(r.pid)

    def start_task(self, cid: str) -> int:
        r = self._call(self._tasks.Start, tasks_pb2.StartRequest(container_id=cid), f"start task of {cid!r}")
        return int(r.pid)

    def pause_task(self, cid: str) -> None:
        self._call(self._tasks.Pause, tasks_pb2.PauseTaskRequest(container_id=cid), f"pause task of {cid!r}")

    def resume_task(self, cid: str) -> None:
        what = f"resume task of {cid!r}"
        try:
            self._call(self._tasks.Resume, tasks_pb2.ResumeTaskRequest(container_id=cid), what)
        except SnapshotError as e:
            if RUNC_NOT_PAUSED not in e.message:
                raise
            # containerd's shim calls the task paused, runc finds it running: a CRIU killed mid-dump thawed the
            # cgroup that containerd's Pause froze (CRIU thaws it once it has seized the tasks) and never froze it
            # again. The shim refuses a new Pause, so runc freezes it again itself, and the Resume then thaws it
            # and puts the shim's state back in step (threat A2): otherwise every later snapshot is refused.
            self._runc_pause(cid, what)
            self._call(self._tasks.Resume, tasks_pb2.ResumeTaskRequest(container_id=cid), what)

    def _runc_pause(self, cid: str, what: str) -> None:
        runner = self.checkpointer or RuncCheckpointer(criu="")
        rc, err = runner.run(runner.pause_command(cid, self.namespace, self.get_container(cid)), 30.0)
        if rc != 0:
            raise FailedPrecondition(
                f"{what}: containerd calls it paused while runc finds it running, and `runc pause` failed: "
                f"{err[-300:] or f'runc exited with {rc}'}",
                hint="the container runs; containerd's view of it is stale until its task is restarted",
            )

    def checkpoint_task(
        self,
        cid: str,
        *,
        image_path: str,
        work_path: str,
        exit: bool = False,
        open_tcp: bool = True,
        file_locks: bool = False,
        external_unix_sockets: bool = False,
        terminal: bool = False,
        timeout: float | None = None,
    ) -> None:
        """Dump the task with CRIU into `image_path` (host path); dump.log lands in `work_path`.

        With `exit` the task stops after the dump, else it keeps running. A CRIU failure raises
        CriuFailed whose details are the tail of dump.log.
        """
        args = CheckpointArgs(image_path, work_path, exit, open_tcp, file_locks, external_unix_sockets, terminal)
        with rcu.expedited(self.state_dir or None):  # CRIU's mount namespaces wait for RCU grace periods
            self._checkpoint(cid, args, timeout)

    def _checkpoint(self, cid: str, a: CheckpointArgs, timeout: float | None) -> None:
        if self.checkpointer is not None:
            self._checkpoint_with_runc(cid, a, timeout or max(self.timeout, 600.0))
            return
        opts = oci_pb2.CheckpointOptions(
            exit=a.exit,
            open_tcp=a.open_tcp,
            external_unix_sockets=a.external_unix_sockets,
            terminal=a.terminal,
            file_locks=a.file_locks,
            image_path=a.image_path,
            work_path=a.work_path,
        )
        req = tasks_pb2.CheckpointTaskRequest(container_id=cid, options=_pack(opts, c.RUNC_CHECKPOINT_OPTIONS_TYPE))
        what = f"checkpoint container {cid!r}"
        try:
            self._tasks.Checkpoint(req, timeout=timeout or max(self.timeout, 600.0), metadata=self._metadata())
        except grpc.RpcError as e:
            err = self._error(e, what)
            if not isinstance(err, Internal):
                raise err from None
            raise CriuFailed(
                f"{what}: CRIU dump failed: {e.details()}",
                hint=f"see the CRIU log in {a.work_path}/{c.DUMP_LOG_FILE}; "
                "`criu check` tells what this kernel supports",
                details=_read_dump_log(a.work_path),
            ) from None
        # containerd's runc (and its CRIU) ran under the runtime's umask: the images are 0644 inside our 0700 dirs
        for path in {a.image_path, a.work_path}:
            private.tighten(path)

    def _checkpoint_with_runc(self, cid: str, args: CheckpointArgs, timeout: float) -> None:
        assert self.checkpointer is not None
        what = f"checkpoint container {cid!r}"
        task = self.get_task(cid)
        if task is None:
            raise NotFound(f"{what}: the container has no task")
        if task.status not in ("running", "paused"):
            raise FailedPrecondition(f"{what}: its task is {task.status}, not running")
        argv = self.checkpointer.command(cid, self.namespace, self.get_container(cid), args)
        try:
            rc, err = self.checkpointer.run(argv, timeout)
        except subprocess.TimeoutExpired:
            rc, err = -1, f"runc checkpoint did not finish within {timeout:.0f}s"
        if rc != 0:
            raise CriuFailed(
                f"{what}: CRIU dump failed: {err[-500:] or f'runc exited with {rc}'}",
                hint=f"see the CRIU log in {args.work_path}/{c.DUMP_LOG_FILE}; "
                f"`{self.checkpointer.criu} check` tells what this kernel supports",
                details=_read_dump_log(args.work_path),
            )

    def kill_task(self, cid: str, signal: int = 15, *, all: bool = False) -> None:
        self._call(
            self._tasks.Kill,
            tasks_pb2.KillRequest(container_id=cid, signal=signal, all=all),
            f"kill task of {cid!r} (signal {signal})",
        )

    def wait_task(self, cid: str, timeout: float | None = None) -> int:
        """Block until the task exits (at most `timeout` seconds, default: forever); its exit status."""
        try:
            r = self._tasks.Wait(tasks_pb2.WaitRequest(container_id=cid), timeout=timeout, metadata=self._metadata())
        except grpc.RpcError as e:
            if _deadline_passed(e) and timeout is not None:
                raise FailedPrecondition(
                    f"wait for task of {cid!r}: still running after {timeout}s",
                    hint="kill it first, or wait longer",
                    retryable=True,
                ) from None
            raise self._error(e, f"wait for task of {cid!r}") from None
        return int(r.exit_status)

    def delete_task(self, cid: str) -> int | None:
        """Delete a stopped (or created) task; its exit status, None when there was no task."""
        try:
            r = self._call(self._tasks.Delete, tasks_pb2.DeleteTaskRequest(container_id=cid), f"delete task of {cid!r}")
        except NotFound:
            return None
        return int(r.exit_status)

    def exec_in_task(
        self, cid: str, args: list[str], *, timeout: float = 30.0, env: list[str] | None = None
    ) -> tuple[int, bytes, bytes]:
        """Run `args` inside the running container (its namespaces, cwd, user, caps), like ``ctr task exec``.

        Returns (exit status, stdout, stderr). `env` replaces the container's environment when given.
        On timeout the process is killed and FailedPrecondition raised.
        """
        info = self.get_container(cid)
        process = dict(info.spec.get("process") or {})
        process["args"] = list(args)
        process["terminal"] = False
        process.pop("consoleSize", None)
        if env is not None:
            process["env"] = list(env)
        exec_id = "exec-" + secrets.token_hex(6)
        spec = any_pb2.Any(type_url=PROCESS_TYPE_URL, value=json.dumps(process).encode())
        what = f"exec {args[:1]} in {cid!r}"
        with tempfile.TemporaryDirectory(prefix="ks-exec-") as tmp, OutputFifos(tmp) as fifos:
            self._call(
                self._tasks.Exec,
                tasks_pb2.ExecProcessRequest(
                    container_id=cid,
                    exec_id=exec_id,
                    stdout=fifos.stdout_path,
                    stderr=fifos.stderr_path,
                    spec=spec,
                ),
                what,
            )
            try:
                self._call(self._tasks.Start, tasks_pb2.StartRequest(container_id=cid, exec_id=exec_id), what)
                try:
                    r = self._tasks.Wait(
                        tasks_pb2.WaitRequest(container_id=cid, exec_id=exec_id),
                        timeout=timeout,
                        metadata=self._metadata(),
                    )
                except grpc.RpcError as e:
                    if not _deadline_passed(e):
                        raise self._error(e, what) from None
                    with contextlib.suppress(SnapshotError):
                        self._call(
                            self._tasks.Kill,
                            tasks_pb2.KillRequest(container_id=cid, exec_id=exec_id, signal=SIGKILL),
                            what,
                        )
                    raise FailedPrecondition(
                        f"{what}: still running after {timeout}s (killed)", hint="raise the timeout"
                    ) from None
                out, err = fifos.collect()
            finally:
                with contextlib.suppress(SnapshotError):
                    self._call(
                        self._tasks.DeleteProcess,
                        tasks_pb2.DeleteProcessRequest(container_id=cid, exec_id=exec_id),
                        what,
                    )
        return int(r.exit_status), out, err

    # --- images and content -----------------------------------------------------------------------

    def get_image(self, name: str) -> ImageInfo:
        r = self._call(
            self._images.Get,
            images_pb2.GetImageRequest(name=name),
            f"get image {name!r}",
            hint=f"list images with `{self._ctr()} images ls`; import or pull it first",
        )
        t = r.image.target
        return ImageInfo(
            name=r.image.name,
            target=Descriptor(t.media_type, t.digest, int(t.size), dict(t.annotations)),
            labels=dict(r.image.labels),
        )

    def list_images(self) -> list[ImageInfo]:
        r = self._call(self._images.List, images_pb2.ListImagesRequest(), f"list images ({self.namespace})")
        return [
            ImageInfo(
                name=i.name,
                target=Descriptor(i.target.media_type, i.target.digest, int(i.target.size)),
                labels=dict(i.labels),
            )
            for i in r.images
        ]

    def read_content(self, digest: str, *, max_size: int = 16 << 20) -> bytes:
        """The blob `digest` from the content store, verified against its digest (at most `max_size`)."""
        what = f"read content {digest}"
        info = self._call(self._content.Info, content_pb2.InfoRequest(digest=digest), what)
        if info.info.size > max_size:
            raise FailedPrecondition(
                f"{what}: {info.info.size} bytes is more than the {max_size} allowed",
                hint="this call is for manifests and configs, not layers",
            )
        chunks: list[bytes] = []
        try:
            stream = self._content.Read(
                content_pb2.ReadContentRequest(digest=digest), timeout=self.timeout, metadata=self._metadata()
            )
            chunks.extend(resp.data for resp in stream)
        except grpc.RpcError as e:
            raise self._error(e, what) from None
        data = b"".join(chunks)
        imageconfig.verify_digest(digest, data)
        return data

    def image_chain_id(self, name: str) -> str:
        """The chain id of the image's layers for this machine (the snapshot its containers start from)."""
        target = self.get_image(name).target
        media_type, digest = target.media_type, target.digest
        doc = imageconfig.parse_json(self.read_content(digest), f"image {name} manifest {digest}")
        if imageconfig.is_index(media_type, doc):
            try:
                desc = imageconfig.select_manifest(doc)
            except NotFound as e:
                raise e.with_context(f"image {name}") from None
            media_type, digest = str(desc.get("mediaType", "")), str(desc["digest"])
            doc = imageconfig.parse_json(self.read_content(digest), f"image {name} manifest {digest}")
        config_digest = str((doc.get("config") or {}).get("digest", ""))
        if not config_digest:
            raise FailedPrecondition(f"image {name}: manifest {digest} names no config")
        config = imageconfig.parse_json(self.read_content(config_digest), f"image {name} config")
        return imageconfig.chain_id(imageconfig.diff_ids(config))

    # --- snapshots ---------------------------------------------------------------------------------

    def snapshot_mounts(self, snapshotter: str, key: str) -> list[Mount]:
        r = self._call(
            self._snapshots.Mounts,
            snapshots_pb2.MountsRequest(snapshotter=snapshotter, key=key),
            f"mounts of snapshot {key!r} ({snapshotter})",
        )
        return [_mount_from_proto(m) for m in r.mounts]

    def prepare_snapshot(
        self, snapshotter: str, key: str, parent: str, labels: Mapping[str, str] | None = None
    ) -> list[Mount]:
        """An active (writable) snapshot `key` on top of the committed `parent`; its mounts."""
        r = self._call(
            self._snapshots.Prepare,
            snapshots_pb2.PrepareSnapshotRequest(
                snapshotter=snapshotter, key=key, parent=parent, labels=dict(labels or {})
            ),
            f"prepare snapshot {key!r} from {parent} ({snapshotter})",
            hint="is the image unpacked for this snapshotter? (`ctr images import` unpacks it)",
        )
        return [_mount_from_proto(m) for m in r.mounts]

    def remove_snapshot(self, snapshotter: str, key: str) -> None:
        self._call(
            self._snapshots.Remove,
            snapshots_pb2.RemoveSnapshotRequest(snapshotter=snapshotter, key=key),
            f"remove snapshot {key!r} ({snapshotter})",
        )

    # --- composite operations (what ctr does) -----------------------------------------------------

    def run_container(
        self,
        cid: str,
        *,
        image: str,
        args: list[str],
        env: list[str] | None = None,
        mounts: list[dict[str, Any]] | None = None,
        log_path: str | None = None,
        runc_options: RuncOptions | None = None,
        host_network: bool = False,
        netns_path: str | None = None,
        snapshotter: str = "overlayfs",
        labels: Mapping[str, str] | None = None,
    ) -> int:
        """Create and start a container from an unpacked image, like ``ctr run -d``; returns the pid.

        The rootfs is a snapshot keyed `cid` on the image's chain id; stdout and stderr go to
        `log_path` (appended) through the shim's pipes. On failure, what was created is removed.
        """
        spec = default_spec(
            cid,
            namespace=self.namespace,
            args=args,
            env=env or (),
            mounts=mounts or (),
            host_network=host_network,
            netns_path=netns_path,
        )
        uri = _file_uri(log_path) if log_path else ""
        with self.lease():
            parent = self.image_chain_id(image)
            rootfs = self.prepare_snapshot(snapshotter, cid, parent)
            try:
                self.create_container(
                    cid,
                    image=image,
                    spec=spec,
                    snapshotter=snapshotter,
                    snapshot_key=cid,
                    runc_options=runc_options,
                    labels=labels,
                )
            except SnapshotError:
                with contextlib.suppress(SnapshotError):
                    self.remove_snapshot(snapshotter, cid)
                raise
        try:
            self.create_task(cid, rootfs=rootfs, stdout=uri, stderr=uri)
            return self.start_task(cid)
        except SnapshotError:
            with contextlib.suppress(SnapshotError):
                self.remove_container(cid)
            raise

    def remove_container(self, cid: str) -> None:
        """Kill (SIGKILL) and delete the task, the container and its snapshot; missing pieces are fine."""
        task = self.get_task(cid)
        if task is not None:
            if task.status == "paused":
                with contextlib.suppress(SnapshotError):
                    self.resume_task(cid)  # a frozen process cannot die
            if task.status not in ("stopped", "created"):
                with contextlib.suppress(NotFound, FailedPrecondition):
                    self.kill_task(cid, SIGKILL, all=True)
                with contextlib.suppress(NotFound):
                    self.wait_task(cid, timeout=30.0)
            self.delete_task(cid)
        try:
            info = self.get_container(cid)
        except NotFound:
            return
        if info.snapshotter and info.snapshot_key:
            with contextlib.suppress(NotFound):
                self.remove_snapshot(info.snapshotter, info.snapshot_key)
        with contextlib.suppress(NotFound):
            self.delete_container(cid)

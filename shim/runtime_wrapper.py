"""kubectl-snapshot-runc: a runc-compatible runtime that restores containers when they are created.

containerd's runc shim runs it (runtime option ``BinaryName``, selected per container or by a
RuntimeClass) exactly like runc. For a container with staged snapshot data in the agent's state dir it:

- ``create``: applies the writable-layer diff to the bundle's rootfs and runs
  ``runc restore --detach --image-path <staged>/checkpoint --work-path <staged> ...`` instead;
- ``start``: does nothing (the restored process is already running);

and passes every other call to the real runc (``exec``, so signals and exit codes are runc's own).
Its ``runc restore`` runs with the node's RCU grace periods expedited (shim/host/rcu.py).
Every runc it runs is handed the node's installed CRIU (``--criu $KUBECTL_SNAPSHOT_CRIU``, set by the
launcher that install-node writes), so a CRIU of the host, present or not, is never used.
Staged data is found only by a key derived here: the container id, or the pod uid + container name
that containerd's CRI plugin writes into the bundle's config.json annotations. A node-level restore
creates its containers while their data still downloads: the ``create`` of a container whose id the
agent gated (shim/engine/staging.py, "the staging gate") waits until the agent says the staged data is
complete, and refuses to run anything if staging failed or the agent let go; once the agent says that
all but the page files is staged it starts ``runc restore``, whose CRIU waits for the page files after the
namespaces and mounts (early_restore_env: the node bundle's launcher relays runc's RPC socket to CRIU and
holds the restore there; staging.py "two phases"). A restored pod's containers
wait the same way at their pod gates (pod uid + container name); a resuming pod's (its resume annotation,
which containerd passes for the handler's ``pod_annotations``) also wait for the agent to take them up.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import time

from kubectl_snapshot.console import leave
from kubectl_snapshot.core import constants as C
from kubectl_snapshot.core import kubenames as K
from kubectl_snapshot.core.errors import InvalidArgument, SnapshotError, criu_first_error, log_tail
from shim.engine.staging import PendingPages, StatePaths, lazy_used_dir, wait_pod_staged, wait_staged_images
from shim.host import private

# The hook runs on every container create and its start-up is on a restore's critical path: at start
# it imports what json needs anyway (re, enum, functools, collections) and this project's few modules,
# never typing, dataclasses, subprocess or shutil; what only a restore needs is imported when it is
# needed (shutil then comes with tarfile where a rootfs diff is applied). tests/integration/
# test_wrapper_pyz.py pins the restore path's imports; bench/run.py's restore breakdown shows the start-up.
TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Callable, Iterator, Sequence
    from typing import Any

    from shim.net.podrestore import PodRestore

_GLOBAL_WITH_VALUE = {"--log", "--log-format", "--root", "--criu", "--rootless"}
_CREATE_WITH_VALUE = {"--bundle", "-b", "--console-socket", "--pid-file", "--preserve-fds"}
_CREATE_FLAGS = {"--no-pivot", "--no-new-keyring"}
_RUNC_CANDIDATES = ("/usr/sbin/runc", "/usr/bin/runc", "/usr/local/sbin/runc", "/usr/local/bin/runc")

ANN_SANDBOX_UID = "io.kubernetes.cri.sandbox-uid"
ANN_CONTAINER_NAME = "io.kubernetes.cri.container-name"
ANN_CONTAINER_TYPE = "io.kubernetes.cri.container-type"


TRACE_ENV = "KUBECTL_SNAPSHOT_HOOK_TRACE"
LAUNCHER_ENV = "KUBECTL_SNAPSHOT_LAUNCHER"  # set by the node bundle's launcher: its own path (launcher)
PAGES_GATE_ENV = "KUBECTL_SNAPSHOT_PAGES_GATE"  # read by the launcher as runc's CRIU relay (pagesgate.go)
PAGES_DEADLINE_ENV = "KUBECTL_SNAPSHOT_PAGES_DEADLINE"
RELAY_CRIU_ENV = "KUBECTL_SNAPSHOT_RELAY_CRIU"  # the CRIU the launcher relays runc's socket to (criurelay.go)
FAILURE_ANSWER_WAIT_S = 2.0  # an early restore that failed: how long to wait for the agent to say why
CRIU_RESTORE_OUTPUTS = (C.RESTORE_LOG_FILE, "stats-restore")  # what CRIU writes into its --work-path


def trace(phase: str, **facts: int) -> None:
    """With $KUBECTL_SNAPSHOT_HOOK_TRACE set (bench/run.py), append when this call reached `phase`:
    one JSON line (wall time, pid); the launcher's record of the same pid says when the call began."""
    path = os.environ.get(TRACE_ENV)
    if path:
        with contextlib.suppress(OSError), open(path, "a") as f:
            f.write(json.dumps({"t": time.time(), "pid": os.getpid(), "phase": phase, **facts}) + "\n")


def trace_copy(path: str) -> None:
    """With $KUBECTL_SNAPSHOT_HOOK_TRACE set: keep a copy of `path` (CRIU's restore.log, removed with the
    staging dir) beside the trace file, for the bench's split of `runc restore` (bench/run.py)."""
    trace_path = os.environ.get(TRACE_ENV)
    if trace_path:
        import shutil

        with contextlib.suppress(OSError):
            shutil.copyfile(path, f"{trace_path}.{os.path.basename(path)}")


class Invocation:
    """runc's command line: global options, the subcommand, its arguments."""

    __slots__ = ("args", "command", "global_args")

    def __init__(self, global_args: list[str], command: str, args: list[str]) -> None:
        self.global_args, self.command, self.args = global_args, command, args


def parse_invocation(argv: Sequence[str]) -> Invocation:
    """Split runc's argv into global options, the subcommand and its arguments."""
    i = 0
    global_args: list[str] = []
    while i < len(argv):
        a = argv[i]
        if not a.startswith("-"):
            return Invocation(global_args, a, list(argv[i + 1 :]))
        global_args.append(a)
        if a in _GLOBAL_WITH_VALUE and i + 1 < len(argv):
            global_args.append(argv[i + 1])
            i += 1
        i += 1
    return Invocation(global_args, "", [])


class CreateArgs:
    """`runc create`'s arguments, as the restore needs them."""

    __slots__ = ("bundle", "console_socket", "container_id", "passthrough_flags", "pid_file")

    def __init__(
        self,
        container_id: str,
        bundle: str,
        pid_file: str | None,
        console_socket: str | None,
        passthrough_flags: list[str],
    ) -> None:
        self.container_id, self.bundle, self.pid_file = container_id, bundle, pid_file
        self.console_socket, self.passthrough_flags = console_socket, passthrough_flags


def parse_create(args: Sequence[str]) -> CreateArgs:
    values: dict[str, str] = {}
    flags: list[str] = []
    positional: list[str] = []
    i = 0
    while i < len(args):
        a = args[i]
        name, eq, inline = a.partition("=")
        if name in _CREATE_WITH_VALUE:
            if eq:
                values[name] = inline
            else:
                if i + 1 >= len(args):
                    raise InvalidArgument(f"runc create: {name} needs a value")
                values[name] = args[i + 1]
                i += 1
        elif a in _CREATE_FLAGS:
            flags.append(a)
        elif a.startswith("-"):
            raise InvalidArgument(f"runc create: unsupported option {a} for a restore")
        else:
            positional.append(a)
        i += 1
    if len(positional) != 1:
        raise InvalidArgument("runc create: expected exactly one container id")
    bundle = values.get("--bundle") or values.get("-b") or os.getcwd()
    return CreateArgs(positional[0], bundle, values.get("--pid-file"), values.get("--console-socket"), flags)


def with_criu(global_args: Sequence[str], criu: str | None = None) -> list[str]:
    """runc's global options with ``--criu`` set to `criu`, or else to the installed CRIU (when the
    launcher names one)."""
    criu = criu or os.environ.get("KUBECTL_SNAPSHOT_CRIU")
    out = list(global_args)
    if not criu:
        return out
    i = 0
    while i < len(out):
        if out[i] == "--criu":
            del out[i : i + 2]
        elif out[i].startswith("--criu="):
            del out[i]
        else:
            i += 1
    return ["--criu", criu, *out]


def real_runc() -> str:
    env = os.environ.get("KUBECTL_SNAPSHOT_RUNC")
    if env:
        return env
    for c in _RUNC_CANDIDATES:
        if os.access(c, os.X_OK):
            return c
    raise SystemExit("kubectl-snapshot-runc: runc not found (set KUBECTL_SNAPSHOT_RUNC)")


def bundle_spec(bundle: str) -> dict[str, Any]:
    """The OCI spec the shim wrote into the bundle ({} if unreadable): read once per `create`."""
    try:
        with open(os.path.join(bundle, "config.json")) as f:
            spec = json.load(f)
    except (OSError, ValueError):
        return {}
    return spec if isinstance(spec, dict) else {}


def pod_key(spec: dict[str, Any]) -> tuple[str, str] | None:
    """(pod uid, container name) of a Kubernetes pod's container, from containerd's CRI annotations."""
    annotations = spec.get("annotations") or {}
    uid, name = annotations.get(ANN_SANDBOX_UID), annotations.get(ANN_CONTAINER_NAME)
    if annotations.get(ANN_CONTAINER_TYPE, "container") != "container" or not uid or not name:
        return None
    return str(uid), str(name)


def resuming(spec: dict[str, Any], container_name: str) -> bool:
    """A container of a resuming pod (the resume-policy annotation, passed by containerd for the runtime
    handler's pod_annotations): the agent takes its staging gate when it sees the pod. A resuming pod's
    gate init container (pods never restarted get one: deploy/resume.py) is not gated: it waits for the
    agent itself, as long as the staging takes. (An app container of that name is not waited for to
    appear either, but is held by the gate the agent takes for it.)"""
    annotations = spec.get("annotations") or {}
    return K.ANN_RESUME_POLICY in annotations and container_name != K.GATE_CONTAINER


def held(spec: dict[str, Any], container_name: str) -> bool:
    """A container whose create waits for the agent's gate to appear: a resuming pod's, or a restore
    pod's (the restore-from annotation, passed the same way; a restore pod goes without the gate
    init container where the node passes it: core/podspec.gate_needed). The gate init container of
    either waits for the agent itself."""
    annotations = spec.get("annotations") or {}
    return (K.ANN_RESUME_POLICY in annotations or K.ANN_RESTORE_FROM in annotations) and (
        container_name != K.GATE_CONTAINER
    )


def find_staged(paths: StatePaths, container_id: str, spec: dict[str, Any]) -> str | None:
    """The staged snapshot directory for this container, if the agent prepared one."""
    with contextlib.suppress(SnapshotError):
        d = paths.staged_by_id(container_id)
        if os.path.isdir(os.path.join(d, C.CHECKPOINT_DIRECTORY)):
            return d
    key = pod_key(spec)
    if key is None:
        return None
    with contextlib.suppress(SnapshotError):
        d = paths.staged_by_pod(*key)
        if os.path.isdir(os.path.join(d, C.CHECKPOINT_DIRECTORY)):
            return d
    return None


def runc_criu(global_args: Sequence[str]) -> str | None:
    """The CRIU runc would run (the installed one, runc's own ``--criu``, or ``criu`` in PATH) as an
    absolute path; None when there is none."""
    args = with_criu(global_args)
    name = "criu"
    for i, arg in enumerate(args):
        if arg == "--criu" and i + 1 < len(args):
            name = args[i + 1]
            break
        if arg.startswith("--criu="):
            name = arg[len("--criu=") :]
            break
    dirs = [""] if "/" in name else os.environ.get("PATH", "").split(os.pathsep)
    for d in dirs:
        path = os.path.join(d, name)
        if os.path.isabs(path) and os.path.isfile(path) and os.access(path, os.X_OK):
            return path
    return None


def restore_command(runc: str, inv: Invocation, create: CreateArgs, staged: str, criu: str | None = None) -> list[str]:
    """`runc restore` for `create`; `criu`: runc's CRIU, if not the installed one (the relay of an early
    restore)."""
    options: dict[str, bool] = {}
    with contextlib.suppress(OSError, ValueError), open(os.path.join(staged, C.DUMP_OPTIONS_FILE)) as f:
        options = json.load(f)
    cmd = [runc, *with_criu(inv.global_args, criu), "restore", "--detach"]
    cmd += ["--image-path", os.path.join(staged, C.CHECKPOINT_DIRECTORY), "--work-path", staged]
    cmd += ["--bundle", create.bundle]
    if create.pid_file:
        cmd += ["--pid-file", create.pid_file]
    if create.console_socket:
        cmd += ["--console-socket", create.console_socket]
    if "--no-pivot" in create.passthrough_flags:
        cmd.append("--no-pivot")
    if options.get("tcpEstablished", True):
        cmd.append("--tcp-established")
    if options.get("fileLocks", True):
        cmd.append("--file-locks")
    if lazy_restore(staged):
        cmd.append("--lazy-pages")
    cmd.append(create.container_id)
    return cmd


def lazy_restore(staged: str) -> bool:
    """The agent staged this container for a lazy restore: CRIU's lazy-pages daemon listens in its work dir
    (a socket, which nothing extracted from a layer is). The daemon reads the images and logs there after
    `runc restore` returns, so this hook moves the staged dir aside (lazy_used_dir) and the agent removes it
    (shim/engine/lazyrestore.py)."""
    import stat

    try:
        return stat.S_ISSOCK(os.lstat(os.path.join(staged, C.LAZY_PAGES_SOCKET)).st_mode)
    except OSError:
        return False


def bundle_rootfs(bundle: str, spec: dict[str, Any]) -> str:
    root = (spec.get("root") or {}).get("path") or "rootfs"
    return root if os.path.isabs(root) else os.path.join(bundle, root)


@contextlib.contextmanager
def pivot_dir(bundle: str, spec: dict[str, Any]) -> Iterator[None]:
    """CRIU pivots into the container's root through a directory in it: its `tmp`, or one it makes with
    mkdtemp, which a read-only root refuses ("Can't create a temporary directory"). An image without /tmp
    (a static binary alone, FROM scratch) run with readOnlyRootFilesystem gets an empty `tmp` from the host
    side of the rootfs for the restore, taken away again after: the container sees nothing of it."""
    made = None
    if (spec.get("root") or {}).get("readonly"):
        tmp = os.path.join(bundle_rootfs(bundle, spec), "tmp")
        if not os.path.lexists(tmp):
            with contextlib.suppress(OSError):  # CRIU then says what failed
                os.mkdir(tmp, 0o700)
                made = tmp
    try:
        yield
    finally:
        if made is not None:
            with contextlib.suppress(OSError):  # not empty: something of the container's, left alone
                os.rmdir(made)


def _apply_diff(bundle: str, spec: dict[str, Any], staged: str) -> None:
    rootfs = bundle_rootfs(bundle, spec)
    diff = os.path.join(staged, C.ROOTFS_DIFF_TAR)
    deleted: list[str] = []
    with contextlib.suppress(OSError, ValueError), open(os.path.join(staged, C.DELETED_FILES_FILE)) as f:
        deleted = [str(x) for x in json.load(f)]
    if os.path.exists(diff):
        from shim.files.rootfs_diff import apply_rootfs_diff  # imported only when restoring: keep pass-through fast

        with open(diff, "rb") as f:
            apply_rootfs_diff(rootfs, f, deleted)


def _loopback_up(create: CreateArgs, spec: dict[str, Any]) -> None:
    """Bring `lo` up in a restored private network namespace.

    runc always dumps and restores the network namespace as empty (it does not manage network
    devices), so a container that owned its netns comes back with `lo` down, as runc's `create` would
    have set it up. Containers that join a namespace (Kubernetes pods) are not touched.
    """
    namespaces = (spec.get("linux") or {}).get("namespaces") or []
    if not any(ns.get("type") == "network" and not ns.get("path") for ns in namespaces):
        return
    try:
        with open(create.pid_file or "") as f:
            pid = int(f.read().strip())
    except (OSError, ValueError):
        return
    from shim.net import loopback, netns  # in-process (ioctl from a thread in the namespace): no host `ip`

    try:
        netns.run_in(f"/proc/{pid}/ns/net", loopback.loopback_up)
    except OSError as e:
        print(f"kubectl-snapshot-runc: bringing lo up in the restored container failed: {e}", file=sys.stderr)


def _log_size(inv: Invocation) -> int:
    args = inv.global_args
    if "--log" not in args:
        return 0
    try:
        return os.path.getsize(args[args.index("--log") + 1])
    except OSError:
        return 0


def _runc_errors_since(inv: Invocation, offset: int) -> str:
    """runc's own error messages written to the --log file after `offset` (when it failed before CRIU ran)."""
    args = inv.global_args
    if "--log" not in args:
        return ""
    msgs = []
    with contextlib.suppress(OSError), open(args[args.index("--log") + 1], errors="replace") as f:
        f.seek(offset)
        for line in f.read().splitlines():
            with contextlib.suppress(ValueError, AttributeError):
                entry = json.loads(line)
                if entry.get("level") in ("error", "fatal"):
                    msgs.append(str(entry.get("msg", "")))
    return "; ".join(msgs[-3:])


def _log_error(inv: Invocation, message: str) -> None:
    """Write an error where the shim looks for runc's errors (the --log file, JSON) and to stderr."""
    print(f"kubectl-snapshot-runc: {message}", file=sys.stderr)
    args = inv.global_args
    if "--log" in args:
        path = args[args.index("--log") + 1]
        line = {"level": "error", "msg": message, "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
        with contextlib.suppress(OSError), open(path, "a") as f:
            f.write(json.dumps(line) + "\n")


def _restore(
    inv: Invocation,
    runc: str,
    paths: StatePaths,
    create: CreateArgs,
    spec: dict[str, Any],
    staged: str,
    prepare: Callable[[], None] | None = None,
    pages: PendingPages | None = None,
) -> tuple[int, str]:
    """`runc restore` in place of `create`; returns (exit status, the error written to runc's log).
    `pages`: the page files are still to come (a two-phase gate): CRIU waits for them (early_restore_env),
    or this waits before `runc restore`."""
    trace("image-check")
    decoded = 0
    try:
        # Issue 10: CRIU takes credentials, capabilities, seccomp, LSM labels, namespaces and
        # mounts from the images, not from this bundle; refuse images that ask for more.
        from shim.criu.guard import ImageReader, check_images

        reader = ImageReader(paths.image_cache())  # the images the agent decoded when staging are not decoded here
        # the image's rootfs, before the snapshot's diff: where runc puts the bundle's mounts is decided
        # by the image the pod spec names, never by a file the snapshot adds
        rootfs = bundle_rootfs(create.bundle, spec)
        check_images(os.path.join(staged, C.CHECKPOINT_DIRECTORY), spec, reader=reader, rootfs=rootfs)
        decoded = reader.decoded_here
    except SnapshotError as e:
        why = e.message if e.message.startswith("refusing to restore") else f"refusing to restore: {e.message}"
        msg = f"{why} (hint: {e.hint})" if e.hint else why
        _log_error(inv, msg)
        return 1, msg
    except Exception as e:  # fail closed: an image the check cannot read is never restored
        msg = f"refusing to restore: checking the CRIU images failed: {type(e).__name__}: {e}"
        _log_error(inv, msg)
        return 1, msg
    trace("rootfs-diff", images_decoded=decoded)
    try:
        _apply_diff(create.bundle, spec, staged)
    except SnapshotError as e:
        msg = f"applying the snapshot's rootfs diff failed: {e}"
        _log_error(inv, msg)
        return 1, msg
    if prepare is not None:
        try:
            prepare()
        except OSError as e:
            msg = f"preparing the pod's network for the restore failed: {e}"
            _log_error(inv, msg)
            return 1, msg
    # CRIU writes its log and stats into its work dir, the staged dir, which came from the snapshot's
    # layer: a file of those names planted there (a symlink to one of the checked images, say) must not
    # receive CRIU's writes
    for name in CRIU_RESTORE_OUTPUTS:
        try:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(os.path.join(staged, name))
        except OSError as e:  # a directory of that name: refused, CRIU could not write there
            msg = f"refusing to restore: the snapshot's layer holds {name} ({e.strerror})"
            _log_error(inv, msg)
            return 1, msg
    env, late = restore_env(staged, pages, inv.global_args)
    if late is not None:
        msg = f"refusing to restore: {late}"
        _log_error(inv, msg)
        return 1, msg
    log_offset = _log_size(inv)
    trace("runc-restore")
    from shim.host import rcu  # CRIU's mount namespaces wait for RCU grace periods: expedited meanwhile

    with rcu.expedited(paths.root), pivot_dir(create.bundle, spec):
        relay = env.get(LAUNCHER_ENV) if env is not None else None  # an early restore: runc's CRIU is the relay
        returncode = run_waited(restore_command(runc, inv, create, staged, relay), env)
    trace("after-restore")
    if returncode != 0:
        failed = pages.failure(wait_s=FAILURE_ANSWER_WAIT_S) if pages is not None else None
        if failed is not None:  # the relay aborted the restore at the gate: staging failed meanwhile
            msg = f"refusing to restore: {failed}"
            _log_error(inv, msg)
            return returncode, msg
        tail = first = ""
        with (
            contextlib.suppress(OSError),
            open(os.path.join(staged, C.RESTORE_LOG_FILE), errors="replace") as f,
        ):
            text = f.read()
            tail, first = log_tail(text, 10), criu_first_error(text)
        if tail:
            # the tail ends with what follows any failure (cgroupd's "recv req error"): name the cause
            cause = f"; first error: {first}" if first and first not in tail.splitlines()[-1:] else ""
            msg = f"criu restore failed (exit {returncode}){cause}; restore.log tail:\n{tail}"
        else:  # runc failed before CRIU started (a bind mount's source is gone, say)
            why = _runc_errors_since(inv, log_offset) or "no error message in runc's log"
            msg = f"runc restore failed before CRIU ran (exit {returncode}): {why}"
        _log_error(inv, msg)
        return returncode, msg
    _loopback_up(create, spec)
    marker = paths.restored_marker(create.container_id)
    private.makedirs(os.path.dirname(marker))
    with private.create(marker) as f:
        f.write(staged)
    trace_copy(os.path.join(staged, C.RESTORE_LOG_FILE))
    # Used once: a later re-create of this container (a restart) starts it afresh.
    if lazy_restore(staged):
        try:
            os.rename(staged, lazy_used_dir(staged))
        except OSError as e:  # a restart of the container would restore it again: refused at its create
            print(f"kubectl-snapshot-runc: could not move the lazily restored {staged} aside: {e}", file=sys.stderr)
    else:
        remove_detached(staged)
    trace("done")
    return 0, ""


def run_waited(cmd: list[str], env: dict[str, str] | None) -> int:
    """Run `cmd` (an absolute path first) and wait: its exit status, -N for signal N (subprocess.run's
    returncode, without importing subprocess). The child keeps stdin, stdout and stderr, which are the
    shim's; every other descriptor is closed, and SIGPIPE and SIGXFSZ are the defaults again, as
    subprocess's close_fds and restore_signals do."""
    import signal  # before the fork: the child only resets two signals, closes descriptors and execs

    pid = os.fork()
    if pid == 0:
        try:
            for sig in (signal.SIGPIPE, signal.SIGXFSZ):  # Python ignores both; runc gets the defaults
                signal.signal(sig, signal.SIG_DFL)
            os.closerange(3, os.sysconf("SC_OPEN_MAX"))
            if env is None:
                os.execv(cmd[0], cmd)
            else:
                os.execve(cmd[0], cmd, env)
        except BaseException as e:
            with contextlib.suppress(BaseException):
                os.write(2, f"kubectl-snapshot-runc: cannot run {cmd[0]}: {e}\n".encode())
        finally:
            os._exit(127)
    _, status = os.waitpid(pid, 0)  # retried on EINTR by Python itself
    return os.waitstatus_to_exitcode(status)


def restore_env(
    staged: str, pages: PendingPages | None, global_args: Sequence[str] = ()
) -> tuple[dict[str, str] | None, str | None]:
    """(the environment for `runc restore`, None: the hook's own; why not to restore, or None). With the
    page files still to come, CRIU waits for them at the launcher's relay where it can (early_restore_env);
    where it cannot, or where the agent has answered already, the hook waits here first."""
    if pages is None:
        return None, None
    env = None if pages.settled() else early_restore_env(staged, pages, global_args)
    if env is None:  # no relay: the page files first, then `runc restore`
        return None, pages.wait()
    return env, None


def early_restore_env(staged: str, pages: PendingPages, global_args: Sequence[str] = ()) -> dict[str, str] | None:
    """The environment for a `runc restore` started before the page files are in place, whose CRIU is the
    node bundle's launcher (LAUNCHER_ENV, given to runc as ``--criu``): it starts the real CRIU
    (RELAY_CRIU_ENV) and relays runc's RPC socket to it, holding the restore at "post-setup-namespaces",
    after the namespaces and mounts and before any page file is opened, until the agent answers on the
    pages gate (launcher/criurelay.go). None (wait here first) without the launcher, without a CRIU
    to relay to, or where CRIU would read page files earlier: the SysV shared memory of an IPC
    namespace is filled while it is restored."""
    launcher = os.environ.get(LAUNCHER_ENV, "")
    if not os.path.isabs(launcher) or not os.access(launcher, os.X_OK):
        return None
    criu = runc_criu(global_args)
    if criu is None:
        return None
    try:
        names = os.listdir(os.path.join(staged, C.CHECKPOINT_DIRECTORY))
    except OSError:
        return None
    if any(n.startswith("ipcns-shm-") for n in names):
        return None
    return {
        **os.environ,
        RELAY_CRIU_ENV: criu,
        PAGES_GATE_ENV: pages.gate,
        PAGES_DEADLINE_ENV: f"{pages.deadline:.3f}",
    }


def remove_detached(path: str) -> None:
    """Take `path` (a used staged dir) away at once and delete it in a detached process.

    Freeing the page files is the file system's work, which grows with the snapshot, and containerd's
    create waits for this process: the dir is renamed to a dot name beside it (atomic; no
    staged dir has a leading dot, so nothing finds it again) and removed by a grandchild that holds none
    of this process's descriptors (containerd reads this process's output to its end). Whatever stops
    that grandchild leaves the dot dir to the agent's garbage collection; any failure before it: removed
    here, as before."""
    trash = os.path.join(os.path.dirname(path), f".removing-{os.path.basename(path)}-{os.getpid()}")
    import shutil  # the grandchild's, or a failure's: not on the way to containerd's start

    try:
        os.rename(path, trash)
    except OSError:
        shutil.rmtree(path, ignore_errors=True)
        return
    try:
        child = os.fork()
    except OSError:
        shutil.rmtree(trash, ignore_errors=True)
        return
    if child == 0:  # the child: a new session, then a grandchild that outlives this process
        try:
            os.setsid()
            if os.fork() == 0:
                null = os.open(os.devnull, os.O_RDWR)
                for fd in (0, 1, 2):
                    os.dup2(null, fd)
                os.closerange(3, 1 << 16)
                shutil.rmtree(trash, ignore_errors=True)
        finally:
            os._exit(0)
    os.waitpid(child, 0)


def _old_sources(staged: str, paths: StatePaths) -> list[str]:
    """The old pod addresses this container's connections were made from ([] if the images say none).

    An image that cannot be read is left to the image check in _restore, which refuses it."""
    from shim.criu.oldaddrs import old_sources

    try:
        from shim.criu.guard import ImageReader

        return old_sources(os.path.join(staged, C.CHECKPOINT_DIRECTORY), ImageReader(paths.image_cache()))
    except SnapshotError:
        return []


def _restored_pod(paths: StatePaths, spec: dict[str, Any]) -> tuple[PodRestore, str, str] | None:
    """(the pod's restore state, pod uid, container name) when this container belongs to a restored pod."""
    key = pod_key(spec)
    if key is None:
        return None
    uid, name = key
    try:
        directory = paths.pod_dir(uid)
    except SnapshotError:
        return None
    if not os.path.isdir(directory):
        return None
    from shim.net.podrestore import PodRestore  # a restored pod's container: its state dir exists

    pod = PodRestore(directory)
    if pod.containers() is None:
        return None
    return pod, uid, name


LAZY_CUT = (
    "container {name!r} was restored lazily and its memory did not all come: the node's agent restores it "
    "again, eagerly, from the same save; not started from its image"
)


def _lazy_phase_cut(paths: StatePaths, uid: str, name: str) -> bool:
    """The container's lazily restored dir is still there (lazy_used_dir: its session removes it when every
    page is in, or when it ends the container): its lazy phase did not finish."""
    try:
        return os.path.isdir(lazy_used_dir(paths.staged_by_pod(uid, name)))
    except SnapshotError:
        return False


def _create_in_restored_pod(
    inv: Invocation,
    runc: str,
    paths: StatePaths,
    create: CreateArgs,
    spec: dict[str, Any],
    staged: str | None,
    pod: PodRestore,
    uid: str,
    name: str,
) -> int | None:
    """All or nothing, one network lock for the whole pod (shim/net/podrestore.py)."""
    from shim.net.podrestore import netns_of

    resume = resuming(spec, name)
    with pod.mutex():
        if staged is None and pod.fresh() is None and _lazy_phase_cut(paths, uid, name):
            # its memory never all came (the agent serving it stopped, or the process died on it): the
            # agent stops it and restores it again, eagerly; until then no create, and no failure of the pod
            _log_error(inv, LAZY_CUT.format(name=name))
            return 1
        why = pod.refusal(name, staged is not None)
        if why is not None:
            _log_error(inv, why)
            return 1
        if pod.fresh() is not None:  # a resume given up: from the image, its staged data unused
            if staged is not None:
                remove_detached(staged)
            return None
        if staged is None:
            return None  # not restored: an ordinary create
        netns = netns_of(spec)
        try:
            if netns:
                pod.lock(netns)
        except OSError as e:
            if resume:
                _start_fresh(pod, staged, f"{e}")
                return None
            pod.fail(str(e))
            _log_error(inv, f"{e}; the pod's containers are not restored")
            return 1

        def borrow() -> None:  # after the image check: only checked images name addresses
            if netns:
                pod.borrow(netns, _old_sources(staged, paths))

        rc, msg = _restore(inv, runc, paths, create, spec, staged, borrow)
        if rc != 0:
            if resume:
                _start_fresh(pod, staged, f"container {name!r} could not be restored: {msg}")
                return None
            pod.fail(f"container {name!r} could not be restored: {msg}")
            return rc
        pod.mark_restored(name)

        def pending(n: str) -> bool:
            with contextlib.suppress(SnapshotError):
                return os.path.isdir(os.path.join(paths.staged_by_pod(uid, n), C.CHECKPOINT_DIRECTORY))
            return False

        if not pod.remaining(pending):
            warning = pod.release()
            if warning:
                print(f"kubectl-snapshot-runc: {warning}", file=sys.stderr)
        return 0


def _start_fresh(pod: PodRestore, staged: str, reason: str) -> None:
    """A resume that cannot be restored does not hold the workload down: this container is created from
    its image (the caller goes on to runc's create), and so is every later one; the agent stops the ones
    already restored and says why (shim/net/podrestore.py, ``.fresh``)."""
    pod.start_fresh(reason)
    remove_detached(staged)
    warning = pod.release()  # the network lock and any borrowed address: a fresh pod needs neither
    print(f"kubectl-snapshot-runc: the resume is skipped, the pod starts fresh: {reason}", file=sys.stderr)
    if warning:
        print(f"kubectl-snapshot-runc: {warning}", file=sys.stderr)


def _load_restore_code() -> None:
    """Import what a restore needs after the gate opens: the image check."""
    import shim.criu.guard  # noqa: F401


def _load_pod_restore_code() -> None:
    """Import what a restored pod's container needs after its gate opens: the image check, the pod's
    state and its old addresses."""
    import shim.criu.guard
    import shim.criu.oldaddrs
    import shim.net.podrestore  # noqa: F401


def run(argv: Sequence[str]) -> int:  # returns only for create/start of a restore
    trace("started")
    inv = parse_invocation(argv)
    runc = real_runc()
    paths = StatePaths.from_env()
    if inv.command == "create":
        create = parse_create(inv.args)
        spec = bundle_spec(create.bundle)
        # created while its data downloads: a node-level restore's gate, or a restored pod's; while it
        # waits, the image check's code is loaded (only where there is a gate: an ordinary create does not)
        why, pages = wait_staged_images(paths, create.container_id, meanwhile=_load_restore_code)
        key = pod_key(spec)
        if why is None and key is not None:
            why = wait_pod_staged(paths, *key, expected=held(spec, key[1]), meanwhile=_load_pod_restore_code)
        trace("staged")
        if why is not None:
            msg = f"refusing to restore: {why}"
            _log_error(inv, msg)
            return 1
        staged = find_staged(paths, create.container_id, spec)
        pod = _restored_pod(paths, spec)
        if pages is not None and (pod is not None or staged is None):  # only a plain restore starts early
            why = pages.wait()
            if why is not None:
                _log_error(inv, f"refusing to restore: {why}")
                return 1
            pages = None
        if pod is not None:
            rc = _create_in_restored_pod(inv, runc, paths, create, spec, staged, *pod)
            if rc is not None:
                return rc
        elif staged is not None:
            return _restore(inv, runc, paths, create, spec, staged, pages=pages)[0]
    elif inv.command in ("start", "delete") and inv.args:
        cid = inv.args[-1]
        with contextlib.suppress(SnapshotError):
            marker = paths.restored_marker(cid)
            if os.path.exists(marker):
                os.unlink(marker)
                if inv.command == "start":
                    return 0  # the restored process is already running
    os.execv(runc, [runc, *with_criu(inv.global_args), *argv[len(inv.global_args) :]])


def main() -> None:
    """containerd's shim waits for this process to end before the container is created: it ends without
    the interpreter's teardown (console/leave.py)."""
    try:
        code = run(sys.argv[1:])
    except InvalidArgument as e:
        print(f"kubectl-snapshot-runc: {e}", file=sys.stderr)
        code = 2
    leave.leave(code)


if __name__ == "__main__":
    main()

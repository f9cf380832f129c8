"""The containerd drop-in that registers the runtime handler, in the format of the node's containerd.

containerd 2.x (config version 3) merges an imported file into its configuration table by table: the
drop-in holds the handler alone, under ``io.containerd.cri.v1.runtime``.

containerd 1.7 (config version 2) differs twice (services/server/config/config.go in v1.7.x):
- it refuses to start with any file of version 3 ("unsupported config version `3`"), so the 2.x
  drop-in would take the node down at its next restart;
- an imported file's plugin table replaces the whole table of that plugin (``mergeConfig``), so a
  drop-in with the handler alone would drop the node's own CRI settings (its sandbox image, runc's
  ``SystemdCgroup``, registry mirrors, ...).
For 1.x the drop-in therefore carries the CRI table (``io.containerd.grpc.v1.cri``) as containerd
loads it from the node's other files, with the handler added. install-node rewrites it from those
files on every start of the agent, and says so in the file.
"""

from __future__ import annotations

import copy
import datetime as dt
import fnmatch
import glob
import json
import os
import re
import tomllib
from typing import Any

from kubectl_snapshot.core import kubenames as K
from kubectl_snapshot.core.errors import FailedPrecondition
from shim.service import nodecheck

CRI_V1 = "io.containerd.grpc.v1.cri"  # containerd 1.x (config version 2)
CRI_RUNTIME_V2 = "io.containerd.cri.v1.runtime"  # containerd 2.x (config version 3)
HEADER = "# written by ks-agent install-node; removed by uninstall-node\n"
# what containerd passes to the runtime wrapper (the handler's pod_annotations): a container of a pod
# carrying one of these waits at its create until the node's agent takes the pod up (runtime_wrapper.py)
POD_ANNOTATIONS = (K.ANN_RESUME_POLICY, K.ANN_RESTORE_FROM)


def major_version(version: str) -> int:
    """containerd's major version from its Version API answer ("v1.7.35", Debian's "1.7.24~ds1-6")."""
    m = re.match(r"v?(\d+)\.", version.strip())
    if not m:
        raise FailedPrecondition(
            f"containerd reports version {version!r}, which is not a release version",
            hint="kubectl-snapshot supports containerd 1.7 and 2.x (docs/deploy.md, Supported containerd versions)",
        )
    return int(m.group(1))


def handler(launcher: str) -> dict[str, Any]:
    """The runtime handler's table (the same keys in 1.7 and 2.x)."""
    return {
        "runtime_type": "io.containerd.runc.v2",
        # a resuming or restoring pod's containers wait at their create for the agent (shim/engine/staging.py)
        "pod_annotations": list(POD_ANNOTATIONS),
        "options": {"BinaryName": launcher, "SystemdCgroup": False},
    }


def render(containerd_version: str, launcher: str, node_cri: dict[str, Any] | None = None) -> str:
    """The drop-in for this containerd release; `node_cri`: for 1.x, the CRI table the node's other
    files give (``node_cri_table``)."""
    major = major_version(containerd_version)
    if major >= 2:
        table = f"plugins.'{CRI_RUNTIME_V2}'.containerd.runtimes.{K.RUNTIME_CLASS}"
        return (
            HEADER + "version = 3\n"
            f"[{table}]\n"
            "  runtime_type = 'io.containerd.runc.v2'\n"
            "  # a resuming or restoring pod's containers wait at their create for the agent (shim/engine/staging.py)\n"
            f"  pod_annotations = [{', '.join(repr(a) for a in POD_ANNOTATIONS)}]\n"
            f"[{table}.options]\n"
            f"  BinaryName = '{launcher}'\n"
            "  SystemdCgroup = false\n"
        )
    if major != 1:
        raise FailedPrecondition(
            f"containerd {containerd_version} is not supported",
            hint="kubectl-snapshot supports containerd 1.7 and 2.x (docs/deploy.md, Supported containerd versions)",
        )
    cri = copy.deepcopy(node_cri or {})
    runtimes = cri.setdefault("containerd", {}).setdefault("runtimes", {})
    runtimes[K.RUNTIME_CLASS] = handler(launcher)
    return (
        HEADER + "# containerd 1.x replaces a plugin's whole table with an imported file's: this is the node's\n"
        f"# {CRI_V1} table (from its other configuration files, read at install-node) plus the\n"
        f"# {K.RUNTIME_CLASS} handler. Change the node's files, not this one; the agent's next start copies them.\n"
        + dumps({"version": 2, "plugins": {CRI_V1: cri}})
    )


# --- containerd 1.7's view of the node's configuration --------------------------------------------


def _load(root: str, path: str) -> dict[str, Any]:
    try:
        with open(root + path, "rb") as f:
            return tomllib.load(f)
    except FileNotFoundError:
        return {}
    except (OSError, tomllib.TOMLDecodeError) as e:
        raise FailedPrecondition(
            f"containerd configuration {path}: {e}", hint="containerd would not start with it either; fix the file"
        ) from None


def _imports(root: str, parent: str, patterns: list[str], dropin_file: str) -> list[str]:
    """containerd 1.7's resolveImports: relative to the importing file, globs expanded (sorted); the
    drop-in counts as there when its pattern covers it (it may not be written yet)."""
    out: list[str] = []
    for p in patterns:
        p = p if os.path.isabs(p) else os.path.join(os.path.dirname(parent), p)
        if glob.has_magic(p):
            found = {m.removeprefix(root) for m in glob.glob(root + p)}
            if fnmatch.fnmatch(dropin_file, p):
                found.add(dropin_file)
            out += sorted(found)
        else:
            out.append(p)
    return out


def node_cri_table(config_path: str, dropin_file: str, *, root: str = "") -> dict[str, Any]:
    """The CRI table containerd 1.7 loads from `config_path` and its imports, leaving out `dropin_file`.

    Files load in containerd's order (breadth first, each file's imports after it), and each file's
    CRI table replaces the one before. `root`: where the node's filesystem is (/proc/PID/root).
    A file after the drop-in that has a CRI table would replace the handler's: that is refused.
    """
    main = _load(root, config_path)
    if main.get("plugins") and main.get("version", 1) < 2:
        raise FailedPrecondition(
            f"containerd configuration {config_path} is of version 1 (plugin tables by short name)",
            hint="migrate it to version 2: containerd config migrate",
        )
    cri: dict[str, Any] = {}
    seen: set[str] = set()
    pending = [config_path]
    after_dropin: list[str] = []
    while pending:
        path, pending = pending[0], pending[1:]
        if path in seen:
            continue
        seen.add(path)
        if path == dropin_file:
            after_dropin = []
            continue
        data = _load(root, path)
        table = (data.get("plugins") or {}).get(CRI_V1)
        if table is not None:
            cri = table
            after_dropin.append(path)
        pending += _imports(root, path, list(data.get("imports") or []), dropin_file)
    if dropin_file in seen and after_dropin:
        raise FailedPrecondition(
            f"containerd 1.x loads {', '.join(after_dropin)} after {dropin_file}, and its {CRI_V1} table "
            f"would replace the one that registers the {K.RUNTIME_CLASS} runtime handler",
            hint="give the drop-in directory a name that sorts last, or move those settings into config.toml",
        )
    return cri


def node_cri_table_of(socket: str, dropin_file: str) -> dict[str, Any]:
    """``node_cri_table`` of the containerd serving `socket`, its files read through its /proc/PID/root."""
    c = nodecheck.find_containerd(socket)
    if c is None:
        raise FailedPrecondition(
            f"no containerd process serves {socket}",
            hint="the agent needs hostPID and the node's containerd socket (--containerd-socket)",
        )
    return node_cri_table(c.config_path, dropin_file, root=f"/proc/{c.pid}/root")


# --- a small TOML writer (tomllib reads only) ------------------------------------------------------

_BARE_KEY = re.compile(r"[A-Za-z0-9_-]+")


def _key(k: str) -> str:
    return k if _BARE_KEY.fullmatch(k) else json.dumps(k)


def _value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int | float):
        return repr(v)  # also inf, -inf and nan, as TOML spells them
    if isinstance(v, str):
        return json.dumps(v)  # JSON's escapes are TOML basic-string escapes
    if isinstance(v, dt.datetime | dt.date | dt.time):
        return v.isoformat()
    if isinstance(v, list):
        return "[" + ", ".join(_value(x) for x in v) + "]"
    if isinstance(v, dict):
        return "{" + ", ".join(f"{_key(k)} = {_value(x)}" for k, x in v.items()) + "}"
    raise TypeError(f"cannot write {type(v).__name__} to TOML")


def dumps(doc: dict[str, Any], _prefix: str = "") -> str:
    """`doc` as TOML that tomllib reads back equal (tables as [headers], arrays inline)."""
    lines = [f"{_key(k)} = {_value(v)}" for k, v in doc.items() if not isinstance(v, dict)]
    out = "\n".join(lines) + ("\n" if lines else "")
    for k, v in doc.items():
        if isinstance(v, dict):
            name = f"{_prefix}.{_key(k)}" if _prefix else _key(k)
            out += f"[{name}]\n" + dumps(v, name)
    return out

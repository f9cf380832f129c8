"""Where the agent keeps its node-local state: work dirs for dumps and staged data for restores.

The runtime wrapper finds staged data only here, by a key it derives itself (the container id, or the
pod uid + container name that containerd's CRI plugin writes into the spec annotations); it never
follows a path named by the container or the snapshot.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

from kubectl_snapshot.core import constants as C
from kubectl_snapshot.core.errors import InvalidArgument

_KEY_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}$")


def check_key(value: str, what: str) -> str:
    if not _KEY_RE.match(value) or value in (".", ".."):
        raise InvalidArgument(
            f"invalid {what} {value!r}",
            hint="use letters, digits, '.', '_' and '-' (at most 128 characters, not starting with a symbol)",
        )
    return value


@dataclass(frozen=True)
class StatePaths:
    root: str = C.DEFAULT_STATE_DIR

    @classmethod
    def from_env(cls) -> StatePaths:
        return cls(os.environ.get(C.ENV_STATE_DIR) or C.DEFAULT_STATE_DIR)

    def work_dir(self, snapshot_id: str) -> str:
        return os.path.join(self.root, "work", check_key(snapshot_id, "snapshot id"))

    def staged_by_id(self, container_id: str) -> str:
        return os.path.join(self.root, C.STAGING_SUBDIR, "by-id", check_key(container_id, "container id"))

    def staged_by_pod(self, pod_uid: str, container_name: str) -> str:
        return os.path.join(
            self.root,
            C.STAGING_SUBDIR,
            "by-pod",
            check_key(pod_uid, "pod uid"),
            check_key(container_name, "container name"),
        )

    def pod_dir(self, pod_uid: str) -> str:
        """A restored pod's own state (shim.podrestore), beside its containers' staged dirs."""
        return os.path.join(self.root, C.STAGING_SUBDIR, "by-pod", check_key(pod_uid, "pod uid"))

    def restored_marker(self, container_id: str) -> str:
        return os.path.join(self.root, "restored", check_key(container_id, "container id"))

    def page_index(self) -> str:
        """The bases of page deltas, one file per repository + container (shim/engine/pageindex.py)."""
        return os.path.join(self.root, "page-index")

    def image_cache(self) -> str:
        """Decoded CRIU images by the SHA-256 of their bytes, written by the agent when it stages a
        restore, read by the wrapper's image check (shim/criu_guard.py, "the decode cache")."""
        return os.path.join(self.root, "image-cache")

    def downloads(self) -> str:
        return os.path.join(self.root, "downloads")

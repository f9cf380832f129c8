"""Progress of a remote operation (a PodSnapshot's status, a restore Pod's state) on stderr.

Unlike `console.progress.Progress` (which counts bytes moved here), the numbers come from the agent as
absolute values: bytesDone/bytesTotal and a stage name. Silent when stderr is not a terminal.
"""

from __future__ import annotations

import sys
from types import TracebackType

from tqdm import tqdm

from kubectl_snapshot.core.podspec import RestoreState
from kubectl_snapshot.core.status import SnapshotStatus


class RemoteProgress:
    def __init__(self, description: str, *, enabled: bool | None = None) -> None:
        self.enabled = sys.stderr.isatty() if enabled is None else enabled
        self.description = description
        self._bar: tqdm | None = None

    def __enter__(self) -> RemoteProgress:
        if self.enabled:
            self._bar = tqdm(
                desc=self.description,
                unit="B",
                unit_scale=True,
                unit_divisor=1024,
                file=sys.stderr,
                leave=False,
                total=None,
            )
        return self

    def snapshot(self, st: SnapshotStatus) -> None:
        if self._bar is None:
            return
        where = f" on {st.node}" if st.node else ""
        label = st.stage or (st.phase.lower() if st.phase else "waiting for an agent")
        self._bar.set_description(f"{self.description}{where}: {label}", refresh=False)
        if st.bytes_total and self._bar.total != st.bytes_total:
            self._bar.total = st.bytes_total
        self._bar.n = st.bytes_done
        self._bar.refresh()

    def restore(self, st: RestoreState) -> None:
        if self._bar is not None:
            self._bar.set_description(f"{self.description}: {st.reason or st.state}"[:100])

    def step(self, text: str) -> None:
        if self._bar is not None:
            self._bar.set_description(f"{self.description}: {text}")

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self._bar is not None:
            self._bar.close()

"""Progress of a remote operation (a PodSnapshot's status, a restore Pod's state) on stderr.

The same bar as `console.progress.Progress` (which counts bytes moved here), but the numbers come
from the agent as absolute values: bytesDone/bytesTotal and a stage name. Silent when stderr is not a
terminal.
"""

from __future__ import annotations

from kubectl_snapshot.console.progress import Progress
from kubectl_snapshot.core.podspec import RestoreState
from kubectl_snapshot.core.status import SnapshotStatus


class RemoteProgress(Progress):
    def __enter__(self) -> RemoteProgress:
        super().__enter__()
        return self

    def snapshot(self, st: SnapshotStatus) -> None:
        if self._bar is None:
            return
        where = f" on {st.node}" if st.node else ""
        label = st.stage or (st.phase.lower() if st.phase else "waiting for an agent")
        self._bar.set_description(f"{self._description}{where}: {label}", refresh=False)
        if st.bytes_total and self._bar.total != st.bytes_total:
            self._bar.total = st.bytes_total
        self._bar.n = st.bytes_done
        self._bar.refresh()

    def restore(self, st: RestoreState) -> None:
        if self._bar is not None:
            self._bar.set_description(f"{self._description}: {st.reason or st.state}"[:100])

    def step(self, text: str) -> None:
        self.phase(text)

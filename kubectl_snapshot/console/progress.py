"""Progress on stderr with tqdm: bytes moved, and the current phase; silent when not a terminal.

tqdm is imported only when a bar is shown: its import (with importlib.metadata for its version) is a
visible part of a short command's start-up, and scripts and the agent's own work run without a terminal.
"""

from __future__ import annotations

import sys
from types import TracebackType

TYPE_CHECKING = False  # typing is not imported at run time: the client's start-up (ks-agent)

if TYPE_CHECKING:
    from tqdm import tqdm


class Progress:
    def __init__(self, description: str, *, enabled: bool | None = None) -> None:
        self.enabled = sys.stderr.isatty() if enabled is None else enabled
        self._bar: tqdm | None = None
        self._description = description

    def __enter__(self) -> Progress:
        if self.enabled:
            from tqdm import tqdm

            self._bar = tqdm(
                desc=self._description,
                unit="B",
                unit_scale=True,
                unit_divisor=1024,
                file=sys.stderr,
                leave=False,
            )
        return self

    def phase(self, name: str) -> None:
        if self._bar is not None:
            self._bar.set_description(f"{self._description}: {name}")

    def advance(self, n: int, total: int) -> None:
        if self._bar is not None:
            if total and self._bar.total != total:
                if self._bar.total and self._bar.n >= self._bar.total:  # the last count is done: a new one
                    self._bar.reset(total=total)
                else:
                    self._bar.total = total
            self._bar.update(n)

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self._bar is not None:
            self._bar.close()

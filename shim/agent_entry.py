"""The `ks-agent` program: `checkpoint` and `restore` through the node's warm agent when one listens
(shim/service/localapi.py), everything else, and those when no agent serves them, by `shim.agent_cli`.

Only the standard library, the node-local API client and the console's output are imported before the
request is answered: the point is not to pay the standalone command's start-up.
"""

from __future__ import annotations

import os
import sys

from kubectl_snapshot.console import leave
from kubectl_snapshot.core import constants as C
from shim.service import localapi
from shim.service.text import rendered

TYPE_CHECKING = False  # typing is not imported at run time: the client's start-up (ks-agent)
if TYPE_CHECKING:
    from typing import Any


def forwarded(argv: list[str]) -> int | None:
    """Run `argv` through the node's agent: its exit status, or None when no agent serves it."""
    if not argv or argv[0] not in localapi.COMMANDS or {"-h", "--help"} & set(argv):
        return None
    path = localapi.socket_path(os.environ, os.environ.get(C.ENV_STATE_DIR) or C.DEFAULT_STATE_DIR)
    if path is None or not os.path.exists(path):
        return None
    from kubectl_snapshot.console.progress import Progress

    command = argv[0]
    with Progress(command) as bar:

        def progress(msg: dict[str, Any]) -> None:
            if "phase" in msg:
                bar.phase(str(msg["phase"]))
            elif isinstance(msg.get("bytes"), list) and len(msg["bytes"]) == 2:
                bar.advance(int(msg["bytes"][0]), int(msg["bytes"][1]))

        answer = localapi.forward(path, command, argv[1:], progress)
    if answer is None or "declined" in answer:
        return None
    if "result" in answer:
        text = answer.get("rendered")
        if not isinstance(text, str):  # the agent could not apply the format (or predates rendering)
            text = rendered(command, answer["result"], str(answer.get("output") or "text"))
        sys.stdout.write(text)
        return 0
    print(str(answer.get("error") or "error: the node's agent gave no answer"), file=sys.stderr)
    code = answer.get("exit")
    return code if isinstance(code, int) and 0 < code < 256 else 1


def main() -> None:
    try:
        code = forwarded(sys.argv[1:])
    except KeyboardInterrupt:
        print("error: interrupted; if the node's agent had the request, it carries it through (its log says "
              "how it ended)", file=sys.stderr)  # fmt: skip
        leave.leave(130)
    if code is not None:
        leave.leave(code)
    from shim.agent_cli import main as standalone

    standalone()

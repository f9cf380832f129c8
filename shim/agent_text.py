"""What `ks-agent checkpoint` and `restore` print as text: the same lines whether the command ran here
or the node's agent ran it for this client (shim/agent_entry.py)."""

from __future__ import annotations

TYPE_CHECKING = False  # typing is not imported at run time: the client's start-up (ks-agent)
if TYPE_CHECKING:
    from typing import Any


def checkpoint_text(d: dict[str, Any]) -> str:
    return str(d["reference"])


def restore_text(d: dict[str, Any]) -> str:
    return "\n".join(f"{c['name']}\trunning (pid {c['pid']})" for c in d["containers"])

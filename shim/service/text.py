"""What `ks-agent checkpoint` and `restore` print as text: the same lines whether the command ran here
or the node's agent ran it for this client (shim/agent_entry.py)."""

from __future__ import annotations

TYPE_CHECKING = False  # typing is not imported at run time: the client's start-up (ks-agent)
if TYPE_CHECKING:
    from typing import Any


def checkpoint_text(d: dict[str, Any]) -> str:
    return str(d["reference"])


def restore_text(d: dict[str, Any]) -> str:
    lazy = {x["name"]: x for x in d.get("lazy") or []}

    def line(c: dict[str, Any]) -> str:
        x = lazy.get(c["name"])
        if x is None:
            return f"{c['name']}\trunning (pid {c['pid']})"
        mib = x["pages"] * 4096 / (1 << 20)
        return f"{c['name']}\trunning (pid {c['pid']}), restored lazily: {mib:.0f} MiB fetched in {x['seconds']:.1f} s"

    lines = [line(c) for c in d["containers"]]
    if d.get("eagerBecause"):
        lines.append(f"restored eagerly: {d['eagerBecause']}")
    return "\n".join(lines)


TEXT = {"checkpoint": checkpoint_text, "restore": restore_text}


def rendered(command: str, data: Any, output: str) -> str:
    """What `ks-agent COMMAND -o OUTPUT` prints on stdout for `data`: the node's agent renders its answer
    with this, so that a client need not know the formats (launcher/agentclient.go)."""
    from kubectl_snapshot.console.formats import formatted

    return formatted(data, output, TEXT[command])

"""`kubectl snapshot doctor`: the installation, each node's agent and its facts."""

from __future__ import annotations

import sys
from typing import Any

import click

from kubectl_snapshot.app import doctor as doctor_app
from kubectl_snapshot.cli import wiring
from kubectl_snapshot.cli.params import common_options
from kubectl_snapshot.console.errors import handle_errors
from kubectl_snapshot.console.output import emit, output_option


@click.command("doctor")
@common_options
@output_option
@handle_errors
def doctor_cmd(output: str) -> None:
    """Check the installation and each node's agent and facts."""
    report = doctor_app.doctor(kube=wiring.kube_client())
    emit(report, output, doctor_text)
    if not report["ok"]:
        sys.exit(1)


def doctor_text(d: dict[str, Any]) -> str:
    lines = [f"{'ok ' if c['ok'] else 'BAD'} {c['check']}: {c['detail']}" for c in d["checks"]]
    if d.get("error"):
        lines.append(f"BAD {d['error']}")
    head = ["NODE", "AGENT", "READY", "CRIU", "CONTAINERD", "RUNC", "KERNEL", "HANDLER"]
    rows = [head] + [
        [
            n["node"],
            n["agentPod"] or "-",
            str(n["agentReady"]).lower(),
            str(n["criuVersion"]),
            str(n["containerdVersion"]),
            str(n["runcVersion"]),
            str(n["kernel"]),
            str(n["runtimeHandler"]).lower(),
        ]
        for n in d["nodes"]
    ]
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    lines += ["", *("   ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows)]
    for n in d["nodes"]:
        criu, hook = n.get("criu") or {}, n.get("hook") or {}
        if not criu and not hook:
            continue
        lines += [
            "",
            f"{n['node']}:",
            f"  CRIU          {criu.get('path', '?')} ({criu.get('version', '?')}; {criu.get('from', '?')})",
            f"  runtime wrapper  {hook.get('path', '?')} (python {hook.get('python', '?')}; {hook.get('from', '?')})",
            *(
                f"  {name}: {t.get('path', '?')}"
                + (f" {t['version']}" if t.get("version") else "")
                + f" ({t.get('from', '?')}"
                + (f"; instead of {t['replaces']}" if t.get("replaces") else "")
                + (f"; {t.get('detail')}" if "ok" in t else "")
                + ")"
                for name, t in (n.get("tools") or {}).items()
            ),
            f"  criu check    {str(n.get('criuCheck', '?')).splitlines()[-1] if n.get('criuCheck') else '?'}",
            f"  cgroup        {n.get('cgroup', '?')}",
            f"  containerd    config {n.get('containerdConfig', '?')}; imports the drop-in: "
            f"{str(n.get('importsDropin', '?')).lower()}; restart pending: {str(n.get('restartPending', '?')).lower()}",
            *(f"  BLOCKED       {b}" for b in n.get("blockers") or []),
        ]
    return "\n".join(lines)

"""Output formats as text, without click: what `-o text|wide|name|json|yaml|jsonpath=TEMPLATE` prints
(console/output.py defines the option and prints through this)."""

from __future__ import annotations

import json
from collections.abc import Callable

TYPE_CHECKING = False  # typing is not imported at run time: the client's start-up (ks-agent)
if TYPE_CHECKING:
    from typing import Any

FORMATS = ("text", "wide", "name", "json", "yaml", "jsonpath=TEMPLATE")


def formatted(
    data: Any,
    fmt: str,
    text: Callable[[Any], str],
    *,
    wide: Callable[[Any], str] | None = None,
    name: Callable[[Any], str] | None = None,
) -> str:
    """`data` in `fmt`, as printed (with its final newline, none after a jsonpath= template, as kubectl);
    `text` makes the human form, `wide` the wider one, `name` the `-o name` one (kind.group/name lines).
    Commands without a name form print their text for `-o name`."""
    if fmt == "json":
        return json.dumps(data, indent=2, sort_keys=False) + "\n"
    if fmt == "yaml":
        import yaml  # only here: a command's start-up is part of every snapshot's time (docs/performance.md)

        return yaml.safe_dump(data, sort_keys=False).rstrip() + "\n"
    if fmt.startswith("jsonpath="):
        # only here: `ks-agent`'s node-local client formats its answer with nothing else imported
        from kubectl_snapshot.core import jsonpath

        return jsonpath.render(fmt[len("jsonpath=") :], data)
    if fmt.startswith("jsonpath-as-json="):
        from kubectl_snapshot.core import jsonpath

        results = jsonpath.values(fmt[len("jsonpath-as-json=") :], data)
        return json.dumps(results, indent=4) + "\n"
    if fmt == "wide":
        return (wide or text)(data) + "\n"
    if fmt == "name":
        return (name or text)(data) + "\n"
    return text(data) + "\n"

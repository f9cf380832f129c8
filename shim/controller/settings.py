"""The agent's settings for its node: the flags (declared once, in kubectl_snapshot/core/nodesettings.py)
and, for several nodes on one machine, this node's entry of the node map."""

from __future__ import annotations

import json
import os
from dataclasses import replace
from typing import Any

import yaml

from kubectl_snapshot.core.errors import InvalidArgument
from kubectl_snapshot.core.nodesettings import NodeSettings, check_value, per_node_key

__all__ = ["NodeSettings", "apply_node_map"]


def apply_node_map(settings: NodeSettings, path: str | None) -> NodeSettings:
    """Override this node's settings with its entry of a node map file ({node: {key: value}}), if any:
    only the settings declared per-node, each validated as the install validated it."""
    if not path or not os.path.exists(path):
        return settings
    with open(path) as f:
        text = f.read()
    try:
        data: Any = json.loads(text) if text.lstrip().startswith("{") else yaml.safe_load(text)
    except (ValueError, yaml.YAMLError) as e:
        raise InvalidArgument(f"node map {path} is not valid JSON/YAML: {e}") from e
    entry = (data or {}).get(settings.node) or {}
    changes: dict[str, Any] = {}
    for key, value in entry.items():
        name = per_node_key(key)
        if name is not None and isinstance(value, str):
            changes[name] = check_value(name, value, f"node map {path}: {settings.node}.{key}")
    return replace(settings, **changes)

"""Moved to `kubectl_snapshot.app.artifact` (the plugin needs it and must not import shim)."""

from kubectl_snapshot.app.artifact import MAX_CONFIG_BYTES, Artifact, load_artifact

__all__ = ["MAX_CONFIG_BYTES", "Artifact", "load_artifact"]

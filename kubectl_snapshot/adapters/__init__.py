"""Adapters both programs use: the registry (HTTP), the Kubernetes API, encryption keys, signatures and trust.

The node's own adapters (archives, CRIU images, safe file access, the freezer, ...) live in ``shim``."""

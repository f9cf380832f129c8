"""kubectl-snapshot: save games for Kubernetes pods."""

__version__ = "0.1.0"

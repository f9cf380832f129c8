"""kubectl-snapshot's node side: the node agent, the runtime wrapper and the freeze guard.

Not a containerd shim (the name is older than the package's shape): containerd's own runc shim runs the
runtime wrapper. Everything here runs on a node, next to containerd, and does I/O; the pure model lives
in ``kubectl_snapshot.core``. Only programs lie at this root (hack/check-house.py); the rest is in the
packages that are the rows of the "node layers" contract (docs/architecture.md).
"""

"""kubectl-snapshot's node side: the agent, its containerd client and the runc restore wrapper.

Everything here runs on a node, next to containerd, and does I/O; the pure model lives in
``kubectl_snapshot.core``.
"""

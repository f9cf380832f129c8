"""The agent's surfaces on its node: the local socket, metrics, the node check, its signing key, its text."""

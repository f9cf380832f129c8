"""CRIU on this node: its configuration, its kernel-feature cache, reading and checking its images."""

"""The host itself: its facts, mounts, cgroup freezer, files reached without following links, memory and disk."""

"""Node-level use cases: checkpoint a group of containers, restore it, inspect a snapshot."""

"""The agent as a Kubernetes controller: PodSnapshot objects in, snapshots out; restore pods staged."""

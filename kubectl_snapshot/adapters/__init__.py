"""Adapters: the only modules that touch grpc, HTTP, kubernetes, the filesystem in bulk or subprocesses."""

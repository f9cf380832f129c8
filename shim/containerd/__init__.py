"""The node agent's view of containerd: a gRPC client over the project's own protos.

``client`` is the only module that talks gRPC to containerd; ``spec`` builds the default OCI runtime
spec for containers the project creates itself; ``api`` is generated code (hack/gen-protos.sh) from
the .proto files under ``protos/``.
"""

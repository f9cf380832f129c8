"""The pure core: model, OCI layout, archive names, states and errors. No I/O library imports."""

#!/usr/bin/env bash
# gofmt, go vet and go test for the project's own Go (the node bundle's static launcher).
set -euo pipefail
cd "$(dirname "$0")/../launcher"
export PATH="/usr/local/go/bin:$PATH" CGO_ENABLED=0 GOTOOLCHAIN=local GOFLAGS=-mod=mod
unformatted=$(gofmt -l .)
if [ -n "$unformatted" ]; then
    echo "error: not gofmt-formatted: $unformatted" >&2
    echo "hint: run gofmt -w launcher" >&2
    exit 1
fi
go vet .
go test -count=1 .

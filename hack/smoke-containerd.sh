#!/usr/bin/env bash
# The local cluster's smoke on every other supported containerd release (docs/deploy.md, "Supported
# containerd versions"): for each release, bring the two-node cluster up with it, run the smoke
# (snapshot and restore on the other node; a Debian pod with the token and restricted settings; a
# StatefulSet pod resumed and migrated by its policy), and take the cluster down again.
#
# It brings clusters up and down, so it runs only when no cluster is up: a cluster someone else
# started (`make demo`'s, one for the tests) is left as it is and the smoke is skipped with the reason.
# `make test` runs it after the test suite; KS_SMOKE_CONTAINERD=0 skips it, KS_SMOKE_VERSIONS picks
# the releases (default: tests/support/containerd_versions.py's OTHER_VERSIONS).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=.venv/bin/python
if [ "${KS_SMOKE_CONTAINERD:-1}" = 0 ]; then
  echo "[smoke-containerd] skipped: KS_SMOKE_CONTAINERD=0"
  exit 0
fi
# shellcheck source=hack/cluster/lib.sh
. hack/cluster/lib.sh
if [ -e "$KS_DIR/cluster.env" ] || ip netns list 2>/dev/null | grep -qw "$KS_NETNS"; then
  echo "[smoke-containerd] skipped: a local cluster is up ($KS_DIR), which this smoke would have to take down;"
  echo "[smoke-containerd] run it with no cluster up (hack/cluster/down.sh first, if the cluster is yours)"
  exit 0
fi
versions="${KS_SMOKE_VERSIONS:-$($PY -c 'from tests.support.containerd_versions import OTHER_VERSIONS as v; print(" ".join(v))')}"
SMOKE=(
  "tests/e2e/test_snapshot_flows.py::test_snapshot_then_restore_on_the_other_node"
  "tests/e2e/test_real_workloads.py::test_a_debian_pod_with_the_token_and_restricted_settings_restores"
  "tests/e2e/test_autosave_resume.py::test_statefulset_pod_resumes_by_name_and_migrates_without_a_duplicate"
)
trap 'hack/cluster/down.sh >/dev/null 2>&1 || true' EXIT
failed=()
for v in $versions; do
  echo "[smoke-containerd] containerd $v: cluster up"
  if ! KS_CONTAINERD_VERSION="$v" hack/cluster/up.sh >/dev/null; then
    failed+=("$v (cluster up)")
    hack/cluster/down.sh >/dev/null 2>&1 || true
    continue
  fi
  if ! .venv/bin/pytest -p no:cacheprovider -q "${SMOKE[@]}"; then
    failed+=("$v")
  fi
  hack/cluster/down.sh >/dev/null
done
if [ "${#failed[@]}" -gt 0 ]; then
  echo "error: the cluster smoke failed on containerd ${failed[*]}" >&2
  echo "hint: KS_CONTAINERD_VERSION=VERSION hack/cluster/up.sh, then run the smoke tests above by hand" >&2
  exit 1
fi
echo "[smoke-containerd] passed on containerd $versions"

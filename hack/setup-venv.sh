#!/usr/bin/env bash
# Create (or refresh) the project's virtualenv in .venv with the package and its dev tools, and make
# Debian's python3-pycriu importable in it (pycriu is not on PyPI; only that one package is linked,
# not all of dist-packages).
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
stamp=.venv/.installed-$( (sha256sum pyproject.toml; echo compat) | sha256sum | cut -c1-16)
if [ ! -f "$stamp" ]; then
  .venv/bin/pip install -q --upgrade pip
  # The checkout goes on sys.path by a .pth path entry ("compat"), as an installed package costs a
  # process nothing: setuptools' default editable finder is imported by every process at start-up (with
  # pathlib, fnmatch, re), which bench/ would count in every `ks-agent` it times. Where a
  # setuptools no longer offers compat mode, the default one.
  .venv/bin/pip install -q -e '.[dev]' --config-settings editable_mode=compat 2>/dev/null \
    || .venv/bin/pip install -q -e '.[dev]'
  rm -f .venv/.installed-* && touch "$stamp"
fi
site=$(.venv/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
if [ -d /usr/lib/python3/dist-packages/pycriu ]; then
  ln -sfn /usr/lib/python3/dist-packages/pycriu "$site/pycriu"
else
  echo "warning: python3-pycriu is not installed (run hack/install-node-deps.sh); 'inspect' needs it" >&2
fi

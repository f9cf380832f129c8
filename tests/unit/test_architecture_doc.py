"""docs/architecture.md names every import-linter contract, so its picture of the layers cannot drift."""

from __future__ import annotations

import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_every_import_contract_is_named_in_the_architecture_doc() -> None:
    config = tomllib.loads((REPO / "pyproject.toml").read_text())
    names = [c["name"] for c in config["tool"]["importlinter"]["contracts"]]
    assert len(names) >= 8  # the plugin's, the shared library's and the node side's
    doc = " ".join((REPO / "docs" / "architecture.md").read_text().split())
    missing = [n for n in names if f'"{n}"' not in doc]
    assert not missing, f"docs/architecture.md does not name these contracts: {missing}"

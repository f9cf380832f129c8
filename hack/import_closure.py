"""The modules of this repository a program imports, directly or not: what its zipapp must carry.

Read from the sources (every import statement counts, lazy ones inside functions included), with the
standard library only: hack/build-wrapper-pyz.py runs it with the host's bare python3. Used for the
runtime wrapper's zipapp and the krew zipapp of the plugin (krew/package.py); the import-linter
contracts in pyproject.toml say what these closures may and may not reach.
"""

from __future__ import annotations

import ast
from collections.abc import Iterable
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("kubectl_snapshot", "shim")  # imports of anything else are third-party or the stdlib's


def module_file(name: str, repo: Path = REPO) -> Path | None:
    """The file of module `name` in the repository, or None (`from pkg import Name` names no module)."""
    base = repo.joinpath(*name.split("."))
    for path in (base / "__init__.py", base.with_suffix(".py")):
        if path.is_file():
            return path
    return None


def imported(path: Path) -> set[str]:
    """The names this module's import statements could load from PACKAGES (absolute imports only)."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_bytes(), filename=str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return {n for n in names if n.split(".", 1)[0] in PACKAGES}


def closure(entries: Iterable[str], repo: Path = REPO) -> list[Path]:
    """The files of `entries` and of everything they import from PACKAGES, with their packages'
    ``__init__.py``; relative to the repository, sorted."""
    entries = list(entries)
    found: set[Path] = set()
    seen: set[str] = set()
    todo = list(entries)
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        parts = name.split(".")
        todo.extend(".".join(parts[:i]) for i in range(1, len(parts)))
        path = module_file(name, repo)
        if path is None:
            continue
        found.add(path.relative_to(repo))
        todo.extend(imported(path))
    for entry in entries:
        if module_file(entry, repo) is None:
            raise SystemExit(f"error: module {entry} not found under {repo}")
    return sorted(found)

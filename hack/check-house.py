#!/usr/bin/env python3
"""The house rules of the source tree that import-linter's contracts cannot say (run by `make lint`).

- no import cycle between modules anywhere in the product packages (pyproject's import-linter
  ``root_packages``), lazy imports inside functions and ``TYPE_CHECKING`` imports included;
- the node side's root package (``shim``) holds only programs: a module there is a program when
  ``[project.scripts]`` names it or it runs as ``__main__`` (``if __name__ == "__main__":``);
  everything else belongs in one of its packages, the rows of the "node layers" contract;
- every module of the product packages is in an import-linter contract: a contract names it or a package
  above it (a root package alone does not count), and a module of a package whose own layers a contract
  declares (``containers``) is in one of those layers;
- no product code under hack/. Product code is what ships in the agent image or the plugin: the
  packages pip installs (``[tool.setuptools.packages.find]``) and all they import, and every source the
  agent image build takes from the tree (Containerfile ``COPY``, hack/agent_image.py ``SOURCES``). From
  hack/ the image build may take only build scripts (a ``.py`` or ``.sh`` file it runs or imports at build
  time); a directory or a compiled source taken from hack/ is shipped code, and so is a module of hack/
  that a product module imports.

Usage: hack/check-house.py [REPO]. Prints ``error:`` lines and a ``hint:``; exit status 1 if any.
"""

from __future__ import annotations

import ast
import fnmatch
import shlex
import sys
import tomllib
from collections.abc import Iterable, Mapping
from pathlib import Path

BUILD_SCRIPT_SUFFIXES = (".py", ".sh")


def contracts_of(pyproject: Mapping[str, object]) -> list[dict[str, object]]:
    tool = pyproject.get("tool", {})
    assert isinstance(tool, dict)
    return list(tool.get("importlinter", {}).get("contracts", []))


def roots_of(pyproject: Mapping[str, object]) -> list[str]:
    tool = pyproject.get("tool", {})
    assert isinstance(tool, dict)
    return list(tool.get("importlinter", {}).get("root_packages", []))


def _layer_names(layer: str) -> list[str]:
    """The modules one layer names: ``a | b`` independent, ``a : b`` not; ``(a)`` optional."""
    names = []
    for part in layer.replace(":", "|").split("|"):
        part = part.strip().strip("()").strip()
        if part:
            names.append(part)
    return names


def named_by_contracts(contracts: Iterable[Mapping[str, object]]) -> tuple[set[str], dict[str, tuple[str, set[str]]]]:
    """(every module a contract constrains by name, {container: (contract, the modules its layers name)})."""
    named: set[str] = set()
    containers: dict[str, tuple[str, set[str]]] = {}
    for c in contracts:
        kind, title = c.get("type"), str(c.get("name", "?"))
        if kind == "layers":
            layers = [n for layer in c.get("layers", []) for n in _layer_names(str(layer))]  # type: ignore[attr-defined]
            boxes = list(c.get("containers", []) or [])  # type: ignore[call-overload]
            if boxes:
                for box in boxes:
                    inside = {f"{box}.{n}" for n in layers}
                    named |= inside
                    containers[box] = (title, inside)
            else:
                named |= set(layers)
        elif kind in ("forbidden", "acyclic_siblings"):
            named |= {str(m) for m in c.get("source_modules", [])}  # type: ignore[attr-defined]
        elif kind == "independence":
            named |= {str(m) for m in c.get("modules", [])}  # type: ignore[attr-defined]
    return named, containers


def uncontracted(modules: Iterable[str], contracts: Iterable[Mapping[str, object]], roots: Iterable[str]) -> list[str]:
    """What is wrong, one line per module that no contract constrains."""
    named, containers = named_by_contracts(contracts)
    named -= set(roots)
    problems = []
    for m in sorted(modules):
        if m in roots:
            continue
        parts = m.split(".")
        ancestors = {".".join(parts[:i]) for i in range(2, len(parts) + 1)}
        if not ancestors & named:
            problems.append(f"{m} is in no import-linter contract")
            continue
        parent = ".".join(parts[:-1])
        if parent in containers:
            title, inside = containers[parent]
            if m not in inside:
                problems.append(f'{m} is in no layer of "{title}", which declares the layers of {parent}')
    return problems


def cycles(graph: Mapping[str, Iterable[str]]) -> list[list[str]]:
    """The import cycles between modules: each strongly connected component of more than one module."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    found: list[list[str]] = []
    counter = 0
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph.get(start, ()))))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            v, children = work[-1]
            for w in children:
                if w not in graph:
                    continue
                if w not in index:
                    index[w] = low[w] = counter
                    counter += 1
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(graph.get(w, ())))))
                    break
                if w in on_stack:
                    low[v] = min(low[v], index[w])
            else:
                work.pop()
                if work:
                    parent = work[-1][0]
                    low[parent] = min(low[parent], low[v])
                if low[v] == index[v]:
                    component = []
                    while True:
                        w = stack.pop()
                        on_stack.discard(w)
                        component.append(w)
                        if w == v:
                            break
                    if len(component) > 1:
                        found.append(sorted(component))
    return sorted(found)


def runs_as_main(source: str) -> bool:
    """Whether the module has a top-level ``if __name__ == "__main__":``."""
    for node in ast.parse(source).body:
        if isinstance(node, ast.If) and isinstance(node.test, ast.Compare):
            t = node.test
            sides = [t.left, *t.comparators]
            if any(isinstance(s, ast.Name) and s.id == "__name__" for s in sides) and any(
                isinstance(s, ast.Constant) and s.value == "__main__" for s in sides
            ):
                return True
    return False


def non_programs_at_root(repo: Path, node_root: str, scripts: Mapping[str, str]) -> list[str]:
    """The modules at the node side's root that are no program."""
    entry_modules = {str(v).split(":", 1)[0] for v in scripts.values()}
    problems = []
    for path in sorted((repo / node_root).glob("*.py")):
        if path.name == "__init__.py":
            continue
        name = f"{node_root}.{path.stem}"
        if name in entry_modules or runs_as_main(path.read_text()):
            continue
        problems.append(f"{name} is no program, yet lies at {node_root}'s root: move it into the package of its layer")
    return problems


def _containerfile_sources(text: str) -> list[str]:
    """The build-context paths a Containerfile COPYs or ADDs (not ``--from=`` another stage)."""
    sources = []
    logical = text.replace("\\\n", " ")
    for line in logical.splitlines():
        words = shlex.split(line, comments=True) if line.strip() else []
        if not words or words[0].upper() not in ("COPY", "ADD"):
            continue
        args = [w for w in words[1:] if not w.startswith("--")]
        if any(w.startswith("--from") for w in words[1:]):
            continue
        sources.extend(args[:-1])
    return sources


def _agent_image_sources(text: str) -> list[str]:
    """hack/agent_image.py's ``SOURCES``: what it copies into the image's build."""
    for node in ast.parse(text).body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "SOURCES" for t in node.targets):
            value = ast.literal_eval(node.value)
            return [str(v) for v in value]
    return []


def product_code_under_hack(repo: Path, pyproject: Mapping[str, object], imports_of_hack: Iterable[str]) -> list[str]:
    """What ships in the agent image or the plugin but lies under hack/."""
    problems = []
    project_tool = pyproject.get("tool", {})
    assert isinstance(project_tool, dict)
    find = project_tool.get("setuptools", {}).get("packages", {}).get("find", {})
    for pattern in find.get("include", []) if isinstance(find, dict) else []:
        if fnmatch.fnmatch("hack", pattern) or str(pattern).startswith("hack"):
            problems.append(f"pip installs hack/ ([tool.setuptools.packages.find] include {pattern!r})")
    for importer in sorted(set(imports_of_hack)):
        problems.append(f"{importer} imports from hack/: that code ships with it")
    taken: list[tuple[str, str]] = []
    containerfile = repo / "Containerfile"
    if containerfile.is_file():
        taken += [("Containerfile", s) for s in _containerfile_sources(containerfile.read_text())]
    agent_image = repo / "hack" / "agent_image.py"
    if agent_image.is_file():
        taken += [("hack/agent_image.py", s) for s in _agent_image_sources(agent_image.read_text())]
    for where, source in taken:
        rel = Path(source.lstrip("./"))
        if not rel.parts or rel.parts[0] != "hack":
            continue
        path = repo / rel
        if path.is_dir() or path.suffix not in BUILD_SCRIPT_SUFFIXES:
            problems.append(f"{rel} is product code under hack/: the agent image build takes it ({where})")
    return problems


def import_graph(roots: list[str], repo: Path) -> tuple[dict[str, set[str]], list[str]]:
    """({module: the modules of the roots it imports}, [product modules importing hack]) read by grimp."""
    import grimp

    sys.path.insert(0, str(repo))
    try:
        graph = grimp.build_graph(*roots, cache_dir=None, include_external_packages=True)
    finally:
        sys.path.remove(str(repo))
    ours = {m for m in graph.modules if m.split(".", 1)[0] in roots}
    edges = {m: {i for i in graph.find_modules_directly_imported_by(m) if i in ours} for m in ours}
    hack_importers = [
        m for m in ours if any(i == "hack" or i.startswith("hack.") for i in graph.find_modules_directly_imported_by(m))
    ]
    return edges, hack_importers


def _modules_on_disk(repo: Path, roots: Iterable[str]) -> set[str]:
    found = set()
    for root in roots:
        for path in (repo / root).rglob("*.py"):
            rel = path.relative_to(repo).with_suffix("")
            parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
            found.add(".".join(parts))
    return found


def check(repo: Path, node_root: str = "shim") -> list[str]:
    pyproject = tomllib.loads((repo / "pyproject.toml").read_text())
    roots = roots_of(pyproject)
    edges, hack_importers = import_graph(roots, repo)
    problems = [f"import cycle: {' <-> '.join(c)}" for c in cycles(edges)]
    scripts = pyproject.get("project", {}).get("scripts", {})
    problems += non_programs_at_root(repo, node_root, scripts)
    problems += uncontracted(_modules_on_disk(repo, roots) | set(edges), contracts_of(pyproject), roots)
    problems += product_code_under_hack(repo, pyproject, hack_importers)
    return problems


def main(argv: list[str]) -> int:
    repo = Path(argv[1] if len(argv) > 1 else Path(__file__).resolve().parents[1]).resolve()
    problems = check(repo)
    for p in problems:
        print(f"error: {p}", file=sys.stderr)
    if problems:
        print(
            "hint: the rules and why: hack/check-house.py's docstring and docs/architecture.md "
            '("Packages and layers")',
            file=sys.stderr,
        )
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))

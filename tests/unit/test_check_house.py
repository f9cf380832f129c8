"""hack/check-house.py on small trees written here: the legitimate tree passes, each defect is named."""

from __future__ import annotations

import importlib.util
import uuid
from pathlib import Path
from types import ModuleType

REPO = Path(__file__).resolve().parents[2]


def _house() -> ModuleType:
    spec = importlib.util.spec_from_file_location("check_house", REPO / "hack" / "check-house.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


house = _house()

PYPROJECT = """
[project.scripts]
tool = "{N}.entry:main"

[tool.setuptools.packages.find]
include = ["{P}*", "{N}*"]

[tool.importlinter]
root_packages = ["{P}", "{N}"]

[[tool.importlinter.contracts]]
name = "plugin layers"
type = "layers"
layers = ["{P}.cli", "{P}.core"]

[[tool.importlinter.contracts]]
name = "node layers"
type = "layers"
layers = ["{N}.entry", "{N}.guard", "{N}.host"]

[[tool.importlinter.contracts]]
name = "the host"
type = "layers"
containers = ["{N}.host"]
layers = ["mem", "facts | (optional)"]
"""


def legitimate_tree() -> dict[str, str]:
    """Two roots: a plugin (cli over core) and a node side whose root holds two programs (one a console
    script, one run as __main__) over a package with its own layers; the image build takes a build script
    from hack/ and compiles a product folder."""
    return {
        "pyproject.toml": PYPROJECT,
        "{P}/__init__.py": "",
        "{P}/cli/__init__.py": "",
        "{P}/cli/main.py": "from {P}.core import model\n",
        "{P}/core/__init__.py": "",
        "{P}/core/model.py": "X = 1\n",
        "{N}/__init__.py": "",
        "{N}/entry.py": "from {N} import guard\nfrom {N}.host import mem\n\ndef main() -> None: ...\n",
        "{N}/guard.py": (
            "def main() -> None:\n    from {N}.host import facts\n\n\nif __name__ == '__main__':\n    main()\n"
        ),
        "{N}/host/__init__.py": "",
        "{N}/host/mem.py": "from {N}.host.facts import X\n",
        "{N}/host/facts.py": "X = 1\n",
        "hack/build.py": "print('built')\n",
        "hack/agent_image.py": 'SOURCES = ("{P}", "{N}", "hack/build.py", "launcher")\n',
        "launcher/main.go": "package main\n",
        "Containerfile": (
            "FROM golang AS launcher\nCOPY launcher /src/launcher\nRUN go build\n"
            "FROM debian\nCOPY hack/build.py \\\n  /src/hack/\nCOPY --from=launcher /launcher /launcher\n"
            "RUN python3 /src/hack/build.py\n"
        ),
    }


def check(tmp_path: Path, files: dict[str, str]) -> list[str]:
    """Write the tree with fresh package names (each test its own: the import system remembers) and check it."""
    names = {"{P}": f"plug_{uuid.uuid4().hex[:8]}", "{N}": f"node_{uuid.uuid4().hex[:8]}"}

    def fill(text: str) -> str:
        for k, v in names.items():
            text = text.replace(k, v)
        return text

    for rel, text in files.items():
        path = tmp_path / fill(rel)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(fill(text))
    problems = house.check(tmp_path, node_root=names["{N}"])
    out = []
    for p in problems:  # back to the placeholders, for the assertions
        for k, v in names.items():
            p = p.replace(v, k)
        out.append(p)
    return out


def test_the_legitimate_tree_passes(tmp_path: Path) -> None:
    assert check(tmp_path, legitimate_tree()) == []


def test_an_import_cycle_is_reported_with_its_modules_even_through_a_lazy_import(tmp_path: Path) -> None:
    files = legitimate_tree()
    files["{N}/host/facts.py"] = "X = 1\n\ndef f() -> None:\n    from {N}.host import mem\n"
    assert check(tmp_path, files) == ["import cycle: {N}.host.facts <-> {N}.host.mem"]


def test_a_module_at_the_node_root_that_is_no_program_is_reported(tmp_path: Path) -> None:
    files = legitimate_tree()
    files["{N}/helpers.py"] = "Y = 2\n"
    files["pyproject.toml"] = PYPROJECT.replace('"{N}.guard",', '"{N}.guard | {N}.helpers",')
    assert check(tmp_path, files) == [
        "{N}.helpers is no program, yet lies at {N}'s root: move it into the package of its layer"
    ]


def test_a_module_in_no_contract_is_reported(tmp_path: Path) -> None:
    files = legitimate_tree()
    files["{N}/net/__init__.py"] = ""
    files["{N}/net/lock.py"] = "Z = 3\n"
    assert check(tmp_path, files) == [
        "{N}.net is in no import-linter contract",
        "{N}.net.lock is in no import-linter contract",
    ]


def test_a_module_outside_its_packages_declared_layers_is_reported(tmp_path: Path) -> None:
    files = legitimate_tree()
    files["{N}/host/disk.py"] = "Z = 3\n"  # {N}.host is a row of "node layers", but "the host" omits it
    assert check(tmp_path, files) == [
        '{N}.host.disk is in no layer of "the host", which declares the layers of {N}.host'
    ]


def test_a_source_tree_under_hack_that_the_image_build_takes_is_reported(tmp_path: Path) -> None:
    files = legitimate_tree()
    del files["launcher/main.go"]
    files["hack/launcher/main.go"] = "package main\n"
    files["Containerfile"] = files["Containerfile"].replace("COPY launcher /src/launcher", "COPY hack/launcher /src/l")
    files["hack/agent_image.py"] = 'SOURCES = ("{P}", "{N}", "hack/build.py", "hack/launcher", "hack/tool.go")\n'
    files["hack/tool.go"] = "package main\n"
    assert check(tmp_path, files) == [
        "hack/launcher is product code under hack/: the agent image build takes it (Containerfile)",
        "hack/launcher is product code under hack/: the agent image build takes it (hack/agent_image.py)",
        "hack/tool.go is product code under hack/: the agent image build takes it (hack/agent_image.py)",
    ]


def test_hack_imported_by_the_product_or_installed_by_pip_is_reported(tmp_path: Path) -> None:
    files = legitimate_tree()
    files["hack/__init__.py"] = ""
    files["{P}/core/model.py"] = "from hack import build\n"
    files["pyproject.toml"] = PYPROJECT.replace('include = ["{P}*", "{N}*"]', 'include = ["{P}*", "{N}*", "hack*"]')
    assert check(tmp_path, files) == [
        "pip installs hack/ ([tool.setuptools.packages.find] include 'hack*')",
        "{P}.core.model imports from hack/: that code ships with it",
    ]


def test_cycles_are_strongly_connected_components_of_more_than_one_module() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"d", "a"}, "e": {"f"}, "f": set()}
    assert house.cycles(graph) == [["a", "b", "c"]]  # d's self-import is no cycle between modules
    assert house.cycles({"e": {"f"}, "f": set()}) == []


def test_the_repository_passes() -> None:
    """This tree: every rule holds, the CLI included."""
    assert house.check(REPO) == []

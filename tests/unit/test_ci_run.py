"""CI runs the README's commands in the README's order (`make demo`, then the Test section's `make check`
and `make test` on the demo's cluster), then checks the demo's cluster still works, then the containerd
smoke with no cluster up."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def commands(script: str) -> list[str]:
    """The script's top-level command lines, without comments, settings and the guard lines."""
    out = []
    for raw in script.splitlines():
        line = raw.split(" #", 1)[0].strip()
        if not line or line.startswith(("#", "set ", "cd ", "export ", "for ", "done", "[ ", "command ", "trap ")):
            continue
        out.append(line)
    return out


def fresh_machine_block(readme: str) -> list[str]:
    section = readme.split("## On a fresh machine", 1)[1].split("\n## ", 1)[0]
    block = section.split("```sh\n", 1)[1].split("```", 1)[0]
    return [m.group(1) for m in re.finditer(r"^(make \w+)", block, re.M)]


def readme_test_commands(readme: str) -> list[str]:
    """The make commands of the README's Test section's code blocks, in order."""
    section = readme.split("## Test\n", 1)[1].split("\n## ", 1)[0]
    blocks = [b.split("```", 1)[0] for b in section.split("```sh\n")[1:]]
    return [m.group(1) for b in blocks for m in re.finditer(r"^(make \w+)", b, re.M)]


def test_ci_runs_the_readme_commands_in_order_then_checks_the_demo_then_the_smoke() -> None:
    text = (REPO / "README.md").read_text()
    fresh = fresh_machine_block(text)
    assert fresh == ["make demo", "make test"]
    tests = readme_test_commands(text)
    assert tests == ["make check", "make test"]  # the fast lane, then the full suite
    ci = commands((REPO / ".ci" / "run").read_text())
    after = ["hack/demo.sh --check", "hack/cluster/down.sh", "hack/smoke-containerd.sh"]
    assert ci[-6:] == ["make demo", *tests, *after], ci


def test_the_order_check_reads_a_script_as_ci_runs_it() -> None:
    script = "set -e\n# make test first\nexport A=1\nmake demo  # the demo\nmake test\n"
    assert commands(script) == ["make demo", "make test"]
    assert commands("make test\nmake demo\n") != ["make demo", "make test"]

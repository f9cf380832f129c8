"""docs/performance.md stays a document a newcomer can read: at most 40 KiB, every benchmark it names
exists in the tree, and every section other files point to by name ("docs/performance.md, "X"") is
one of its headings."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
DOC = REPO / "docs" / "performance.md"
MAX_BYTES = 40 * 1024
SELF = Path(__file__).resolve().relative_to(REPO).as_posix()  # its own examples are not citations

# `bench/x.py` or `-m bench.x` in a command line
_BENCH = re.compile(r"(?:\bbench/(\w+)\.py\b|-m bench\.(\w+)\b)")
# docs/performance.md, "Section" / performance.md "Section" / (performance.md, "Section
_SECTION_REF = re.compile(r'performance\.md[,]?\s*\n?\s*(?:#\s*)?"([^"]+)"?', re.M)


def headings(text: str) -> set[str]:
    return {m.group(1).strip() for m in re.finditer(r"^#{2,4} (.+)$", text, re.M)}


def benches_named(text: str) -> set[str]:
    return {a or b for a, b in _BENCH.findall(text)}


def section_refs(text: str) -> list[str]:
    """The section names a file cites; a name cut by a line break (a comment's wrap) is its first part."""
    return [m.group(1).split("\n")[0].rstrip() for m in _SECTION_REF.finditer(text)]


def resolves(ref: str, names: set[str]) -> bool:
    return any(h == ref or h.startswith(ref) for h in names)


def test_the_document_is_at_most_40_kib() -> None:
    size = len(DOC.read_bytes())
    assert size <= MAX_BYTES, f"docs/performance.md is {size} bytes (at most {MAX_BYTES}): state the current figures"


def test_every_benchmark_it_names_exists() -> None:
    named = benches_named(DOC.read_text())
    assert {"run", "autosave_cost", "freeze_breakdown", "encryption"} <= named
    missing = sorted(n for n in named if not (REPO / "bench" / f"{n}.py").exists())
    assert not missing, f"docs/performance.md names benchmarks that are not in bench/: {missing}"


def test_sections_cited_elsewhere_are_its_headings() -> None:
    names = headings(DOC.read_text())
    tracked = subprocess.run(
        ["git", "ls-files", "*.md", "*.py", "*.go", "*.sh"], cwd=REPO, capture_output=True, text=True, check=True
    ).stdout.split()
    cited = {
        (path, ref)
        for path in tracked
        if path not in ("docs/performance.md", SELF) and (REPO / path).exists()
        for ref in section_refs((REPO / path).read_text(errors="replace"))
    }
    assert cited, "no file cites a section of docs/performance.md by name: the check reads nothing"
    broken = sorted((path, ref) for path, ref in cited if not resolves(ref, names))
    assert not broken, f"sections cited but not in docs/performance.md: {broken}"


def test_the_checks_tell_a_cited_section_from_a_missing_one() -> None:
    names = headings("# Performance\n\n## Where the freeze goes\n\n### Keyed page hashes\n")
    cited = section_refs('see docs/performance.md, "Keyed page hashes"; (performance.md, "Where the freeze\n')
    assert cited == ["Keyed page hashes", "Where the freeze"]
    assert all(resolves(r, names) for r in cited)
    assert not resolves("Page hashes without SHA-256", names)
    assert benches_named("sudo python bench/run.py --quick; python -m bench.autosave_cost") == {"run", "autosave_cost"}

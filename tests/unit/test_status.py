"""The PodSnapshot status contract (kubectl_snapshot/core/status.py): what the agent writes is what the
CRD schema allows and what the plugin reads back."""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Any

import pytest

from kubectl_snapshot.core import kubenames as K
from kubectl_snapshot.core import status as S
from kubectl_snapshot.deploy.crd import podsnapshot_crd

ROOT = Path(__file__).resolve().parents[2]


def _schema() -> dict[str, Any]:
    crd = podsnapshot_crd({})
    return crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["status"]  # type: ignore[no-any-return]


def _stages_written_by_the_engine() -> set[str]:
    """Every string literal the snapshot engine hands to its phase callback (`phase("dump")`); the
    controller forwards them to status.stage."""
    found: set[str] = set()
    for path in (ROOT / "shim/engine/checkpoint.py", ROOT / "shim/controller/snapshots.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Name)
                and node.func.id in ("phase", "on_phase")
                and node.args
                and isinstance(node.args[0], ast.Constant)
            ):
                found.add(str(node.args[0].value))
    return found


def test_every_stage_the_engine_writes_is_in_the_schema() -> None:
    written = _stages_written_by_the_engine()
    assert written, "the AST scan found no phase(...) calls: the scan is out of date"
    schema_stages = set(_schema()["properties"]["stage"]["enum"])
    assert written <= schema_stages
    assert schema_stages == set(S.STAGES)


def _check_against_schema(patch: dict[str, Any]) -> None:
    """Each key the agent writes is declared in the schema (the API server would prune it silently)."""
    props = _schema()["properties"]
    for key, value in patch.items():
        assert key in props, f"status.{key} is not in the CRD schema"
        if key == "conditions":
            cprops = props["conditions"]["items"]["properties"]
            for c in value:
                assert set(c) <= set(cprops)
                assert c["status"] in cprops["status"]["enum"]
        if key == "timings":
            assert set(value) <= set(props["timings"]["properties"])
        if key == "stage":
            assert value in props["stage"]["enum"]
        if key == "phase":
            assert value in props["phase"]["enum"]


def test_every_patch_builder_stays_inside_the_schema() -> None:
    now = "2026-11-30T18:00:00Z"
    out = S.Outcome("r/x@sha256:" + "a" * 64, "r/x:t", 1536, "cgroup", {"freeze_ms": 1.234, "total_ms": 9})
    patches = [
        S.claimed(node="n1", now=now, generation=1),
        S.progress(stage="dump", done=1, total=2),
        S.succeeded(out, node="n1", now=now, generation=1),
        S.failed(node="n1", now=now, generation=1, reason="CriuFailed", message="m", hint="h", details="log"),
    ]
    for p in patches:
        _check_against_schema(p)


def test_conditions_follow_the_phase() -> None:
    now = "2026-11-30T18:00:00Z"

    def conds(p: dict[str, Any]) -> dict[str, tuple[str, str]]:
        return {c["type"]: (c["status"], c["reason"]) for c in p["conditions"]}

    assert conds(S.claimed(node="n1", now=now, generation=3)) == {
        "Succeeded": ("Unknown", "Running"),
        "Failed": ("False", "Running"),
    }
    out = S.Outcome("r@d", "r:t", 10, "cgroup", {})
    ok = S.succeeded(out, node="n1", now=now, generation=3)
    assert conds(ok) == {"Succeeded": ("True", "Pushed"), "Failed": ("False", "Pushed")}
    assert all(c["observedGeneration"] == 3 and c["lastTransitionTime"] == now for c in ok["conditions"])
    bad = S.failed(node="n1", now=now, generation=3, reason="NotFound", message="pod gone", hint=None)
    assert conds(bad) == {"Succeeded": ("False", "NotFound"), "Failed": ("True", "NotFound")}
    assert bad["phase"] == K.PHASE_FAILED and bad["message"] == "pod gone"


def test_the_plugin_reads_what_the_agent_writes() -> None:
    now = "2026-11-30T18:00:00Z"
    bad = S.failed(
        node="n1", now=now, generation=1, reason="CriuFailed", message="dump failed", hint="see log", details="x"
    )
    st = S.read({"status": bad})
    assert (st.phase, st.node, st.message, st.hint, st.reason, st.details) == (
        K.PHASE_FAILED,
        "n1",
        "dump failed",
        "see log",
        "CriuFailed",
        "x",
    )
    assert st.done and st.claimed
    out = S.Outcome("r@d", "r:t", 3 << 20, "cgroup", {"dump_ms": 5.55})
    ok = S.succeeded(out, node="n1", now=now, generation=1)
    st = S.read({"status": ok})
    assert st.reference == "r@d" and st.bytes_done == st.bytes_total == 3 << 20 and st.hint is None
    assert ok["sizeHuman"] == "3.0 MiB" and ok["timings"]["dumpMs"] == 5.5


def test_read_tolerates_missing_and_bad_fields_and_old_agents() -> None:
    st = S.read({})
    assert not st.claimed and not st.done and st.bytes_done == 0
    st = S.read({"status": {"phase": "Succeeded", "bytesDone": "x", "bytesTotal": 10, "node": "n1"}})
    assert st.done and st.bytes_done == 0 and st.bytes_total == 10 and st.node == "n1"
    # An agent from before the contract wrote the CLI's text into message.
    st = S.read({"status": {"phase": "Failed", "message": "error: x failed\nhint: do y"}})
    assert (st.message, st.hint) == ("x failed", "do y")
    assert S.read({"status": {"message": "plain"}}).hint is None


def test_a_stage_outside_the_contract_is_a_bug() -> None:
    with pytest.raises(ValueError):
        S.progress(stage="package")


@pytest.mark.parametrize(("n", "text"), [(0, "0 B"), (1023, "1023 B"), (1536, "1.5 KiB"), (5 << 30, "5.0 GiB")])
def test_human_bytes(n: int, text: str) -> None:
    assert S.human_bytes(n) == text

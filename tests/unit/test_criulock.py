"""CRIU's network lock left by a killed CRIU (threat A2): which tables the agent lifts, and when.

The real kernel case is tests/integration/test_criu_faults.py::test_criu_killed_mid_dump_leaves_no_network_lock."""

from __future__ import annotations

import os

import pytest

from kubectl_snapshot.core.criulock import is_criu_table, left_by_dump
from shim.net.criulock import lifted_after_failure


def test_only_new_tables_of_criu_s_name_are_left_by_the_dump() -> None:
    before = ["kube-proxy", "CRIU-old"]
    after = ["kube-proxy", "CRIU-old", "CRIU-8f3a", "kubectl-snapshot-dump-lock", "CRIU-8f3a"]
    assert left_by_dump(before, after) == ["CRIU-8f3a"]


def test_what_was_there_before_and_other_names_are_never_taken() -> None:
    assert left_by_dump(["CRIU-1"], ["CRIU-1"]) == []
    assert left_by_dump([], ["criu-1", "CRIU", "my-CRIU-1", "kubectl-snapshot-dump-lock"]) == []
    assert is_criu_table("CRIU-7") and not is_criu_table("CRIU-") and not is_criu_table("CRIUX-1")


class FakeTables:
    """One namespace's tables: `appear` are added while the block runs (what CRIU creates)."""

    def __init__(self, before: list[str]) -> None:
        self.tables = list(before)
        self.deleted: list[str] = []

    def names(self, netns_path: str) -> list[str]:
        assert netns_path.startswith("/proc/self/fd/")
        return list(self.tables)

    def delete(self, netns_path: str, table: str) -> bool:
        self.tables.remove(table)
        self.deleted.append(table)
        return True


def test_a_failed_dump_lifts_the_lock_criu_left_and_keeps_the_rest() -> None:
    tables = FakeTables(["CRIU-other", "cni"])
    with pytest.raises(RuntimeError), lifted_after_failure([os.getpid()], tables) as lifted:
        tables.tables.append("CRIU-killed")
        raise RuntimeError("CRIU dump failed")
    assert tables.deleted == ["CRIU-killed"] and lifted == ["inet CRIU-killed"]
    assert tables.tables == ["CRIU-other", "cni"]


def test_a_dump_that_succeeds_lifts_nothing() -> None:
    tables = FakeTables([])
    with lifted_after_failure([os.getpid()], tables):
        tables.tables.append("CRIU-concurrent")  # not this dump's to judge: CRIU lifts its own on success
    assert tables.deleted == []


def test_one_namespace_is_listed_once_and_a_gone_task_is_skipped() -> None:
    calls: list[str] = []

    class Counting(FakeTables):
        def names(self, netns_path: str) -> list[str]:
            calls.append(netns_path)
            return super().names(netns_path)

    with lifted_after_failure([os.getpid(), os.getpid(), 2**22 + 12345], Counting([])):
        pass
    assert len(calls) == 1

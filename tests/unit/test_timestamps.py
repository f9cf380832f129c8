"""API timestamps (core/timestamps.py): the one parser and writer the plugin and the agents use."""

from __future__ import annotations

import datetime

import pytest

from kubectl_snapshot.core import timestamps as T


def test_written_as_the_api_server_writes_them_and_read_back() -> None:
    t = datetime.datetime(2026, 1, 2, 3, 4, 5, tzinfo=datetime.UTC).timestamp()
    assert T.rfc3339(t) == "2026-01-02T03:04:05Z"
    assert T.rfc3339(t + 0.9) == "2026-01-02T03:04:05Z"  # to the second, as metadata timestamps are
    assert T.seconds(T.rfc3339(t)) == t


@pytest.mark.parametrize(
    "text",
    ["2026-01-02T03:04:05Z", "2026-01-02T04:04:05+01:00", "2026-01-02T03:04:05.000000Z"],
)
def test_zulu_offsets_and_fractions_are_the_same_instant(text: str) -> None:
    assert T.parse(text) == datetime.datetime(2026, 1, 2, 3, 4, 5, tzinfo=datetime.UTC)


@pytest.mark.parametrize("text", [None, "", "yesterday", "2026-13-01T00:00:00Z"])
def test_absent_or_malformed_is_none_not_an_error(text: str | None) -> None:
    assert T.parse(text) is None and T.seconds(text) is None


def test_now_is_aware_utc() -> None:
    now = T.now()
    assert now.tzinfo is datetime.UTC
    assert abs(now.timestamp() - datetime.datetime.now(datetime.UTC).timestamp()) < 5

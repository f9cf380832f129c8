"""Shared pytest configuration. Fixtures live in tests/support/ and are registered here."""

pytest_plugins = [
    "tests.support.registry",
    "tests.support.containerd",
]

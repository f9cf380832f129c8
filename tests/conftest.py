"""Shared pytest configuration. Fixtures live in tests/support/ and are registered here."""

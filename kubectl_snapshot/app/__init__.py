"""app layer."""

"""Corpus preparation tools (orthros-data)."""

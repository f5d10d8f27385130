"""CCVR (being written)."""

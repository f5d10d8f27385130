"""Ratio Loss (being written)."""

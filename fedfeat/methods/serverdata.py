"""server-side data (being written)."""

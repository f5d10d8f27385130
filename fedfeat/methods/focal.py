"""Fed-Focal Loss (being written)."""

"""FedOPT (being written)."""

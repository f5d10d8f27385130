"""FedBE (being written)."""

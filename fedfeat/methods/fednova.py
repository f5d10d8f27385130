"""FedNova (being written)."""

"""FedDF (being written)."""

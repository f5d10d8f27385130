"""FedAvg + tau-norm (being written)."""

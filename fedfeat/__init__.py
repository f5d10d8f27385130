"""fedfeat: federated learning on cached frozen-CLIP features."""

__version__ = "0.1.0"

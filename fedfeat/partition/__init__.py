"""Who holds which sample: partitions of a store's split among clients.

Owns the schemes (``iid``, ``shard``, ``dirichlet``, ``dirichlet-equal``, ``dirichlet-joint``, ``longtail``,
``disjoint-classes``; bit-identical to FedNTD's and CLIP2FL's code), local test splits, the open-vocabulary
base/novel split, and exports (JSON).

May import: ``fedfeat.store`` (a partition is read from and saved to a store) and below, and ``fedfeat.errors``.
"""

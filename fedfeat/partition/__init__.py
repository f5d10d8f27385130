"""Who holds which sample: partitions of a store's split among clients.

Owns the schemes (``iid``, ``shard``, ``dirichlet``, ``dirichlet-equal``, ``dirichlet-joint``, ``longtail``,
``disjoint-classes``; bit-identical to FedNTD's and CLIP2FL's code), local test splits, the open-vocabulary
base/novel split, and exports (JSON).

May import: ``fedfeat.store`` (a partition is read from and saved to a store) and below, and ``fedfeat.errors``.
"""

from fedfeat.partition.core import Partition, from_json, partition_key, to_json
from fedfeat.partition.make import LOCAL_TEST, default_seed, local_test_split, make_partition
from fedfeat.partition.schemes import (
    CLIP2FL_SEED,
    FEDCOPL_SEED,
    FEDMP_SEED,
    FEDNTD_SEED,
    SCHEMES,
    dirichlet,
    dirichlet_equal,
    dirichlet_joint,
    disjoint_classes,
    iid,
    longtail,
    longtail_counts,
    shard,
)

__all__ = [
    "CLIP2FL_SEED",
    "FEDCOPL_SEED",
    "FEDMP_SEED",
    "FEDNTD_SEED",
    "LOCAL_TEST",
    "SCHEMES",
    "Partition",
    "default_seed",
    "dirichlet",
    "dirichlet_equal",
    "dirichlet_joint",
    "disjoint_classes",
    "from_json",
    "iid",
    "local_test_split",
    "longtail",
    "longtail_counts",
    "make_partition",
    "partition_key",
    "shard",
    "to_json",
]

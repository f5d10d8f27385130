"""Who holds which sample: partitions of a store's split among clients.

Owns the schemes (``SCHEMES``: one class per scheme in ``fedfeat.partition.kinds``, registered in
``fedfeat.partition.registry``; each bit-identical to its reference code, ``Scheme.source``), the
long tail any scheme may run on (``longtail``), local test splits, the open-vocabulary base/novel split, and exports
(JSON).

May import: ``fedfeat.store`` (a partition is read from and saved to a store) and below, and ``fedfeat.errors``.
"""

from fedfeat.partition.core import Partition, from_json, partition_key, to_json
from fedfeat.partition.make import LOCAL_TEST, default_seed, local_test_split, make_partition
from fedfeat.partition.registry import (
    SCHEMES,
    Scheme,
    discover,
    fill_defaults,
    get_scheme,
    register_scheme,
    scheme_fields,
    schemes_using,
)
from fedfeat.partition.schemes import (
    CLIP2FL_SEED,
    FEDCOPL_SEED,
    FEDMP_SEED,
    FEDNTD_SEED,
    dirichlet,
    dirichlet_equal,
    dirichlet_joint,
    disjoint_classes,
    iid,
    longtail,
    longtail_counts,
    shard,
)

discover()  # every module of fedfeat.partition.kinds registers its scheme (SCHEMES is filled from here on)

__all__ = [
    "CLIP2FL_SEED",
    "FEDCOPL_SEED",
    "FEDMP_SEED",
    "FEDNTD_SEED",
    "LOCAL_TEST",
    "SCHEMES",
    "Partition",
    "Scheme",
    "default_seed",
    "dirichlet",
    "dirichlet_equal",
    "dirichlet_joint",
    "disjoint_classes",
    "fill_defaults",
    "from_json",
    "get_scheme",
    "iid",
    "local_test_split",
    "longtail",
    "longtail_counts",
    "make_partition",
    "partition_key",
    "register_scheme",
    "scheme_fields",
    "schemes_using",
    "shard",
    "to_json",
]

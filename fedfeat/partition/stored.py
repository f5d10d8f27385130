"""Partitions kept in a store: computed here, written and read through the store's plain arrays.

The store (``fedfeat.store``) sits below this package and knows a partition only as arrays: the client-major
``order`` of split rows, client ``offsets``, the scheme and its parameters. ``write`` / ``read`` turn a
``Partition`` into those and back; ``store_partition`` makes a store's partition once and reuses it after.
"""

from __future__ import annotations

import numpy as np

import fedfeat.partition as P
from fedfeat.errors import FedfeatError
from fedfeat.store.featurestore import FeatureStore


def write(st: FeatureStore, partition: P.Partition, split: str = "train", key: str | None = None) -> str:
    """Store ``partition`` of ``split`` under ``partitions/<key>`` (default key: ``partition_key``); returns the key."""
    order, offsets = partition.order_and_offsets()
    key = key or P.partition_key(partition)
    st.save_partition_arrays(key, partition.scheme, partition.params, order, offsets, split=split)
    return key


def read(st: FeatureStore, key: str) -> P.Partition:
    """The stored partition ``key`` (a one-line error listing the stored keys when absent)."""
    scheme, params, order, offsets = st.partition_arrays(key)
    return P.Partition.from_order_and_offsets(scheme, params, order, offsets)


def _test_labels(st: FeatureStore) -> np.ndarray:
    """The valid rows' labels of the store's test split (dirichlet-joint partitions it with the train split)."""
    if "test" not in st.splits:
        raise FedfeatError(
            f"store {st.path} has no test split; dirichlet-joint partitions train and test together"
        )
    lab = st.labels("test")
    return lab[lab >= 0]


def store_partition(
    st: FeatureStore,
    *,
    scheme: str,
    clients: int,
    alpha: float | None = None,
    shards: int | None = None,
    imbalance_factor: float | None = None,
    shots: int | None = None,
    seed: int | None = None,
    split: str = "train",
    save: bool = True,
    class_order=None,
    class_order_name: str | None = None,
    min_size: int | None = None,
):
    """Make (or load, when already stored) a partition of a store's split. Returns ``(key, Partition)``.

    Rows with label -1 (images skipped as unreadable at encode time) are never given to a client.
    ``class_order`` / ``class_order_name``: disjoint-classes' class list (``make_partition``).
    """
    if scheme not in P.SCHEMES:
        raise FedfeatError(f"unknown partition scheme '{scheme}'; choose one of: {', '.join(P.SCHEMES)}")
    if scheme in ("dirichlet", "dirichlet-equal", "dirichlet-joint") and alpha is None:
        alpha = 0.5 if scheme == "dirichlet-equal" else 0.1
    if scheme == "shard" and shards is None:
        shards = 2
    if scheme == "disjoint-classes" and shots is None:
        shots = 10
    labels = st.labels(split)
    valid = np.flatnonzero(labels >= 0)
    part = P.make_partition(
        labels[valid],
        scheme,
        clients=clients,
        alpha=alpha,
        shards=shards,
        imbalance_factor=imbalance_factor,
        seed=seed,
        shots=shots,
        n_classes=st.n_classes,
        test_labels=_test_labels(st) if scheme == "dirichlet-joint" else None,
        class_order=class_order,
        class_order_name=class_order_name,
        min_size=min_size,
    )
    if len(valid) != len(labels):  # map positions among valid rows back to split rows
        part = P.Partition(part.scheme, part.params, [valid[c] for c in part.clients])
    key = P.partition_key(part)
    if save:
        if key in st.partition_keys():
            try:
                o1, f1 = read(st, key).order_and_offsets()
            except FedfeatError:  # damaged or lying: replaced by the recomputed one, as its message advises
                o1, f1 = None, None
            o2, f2 = part.order_and_offsets()
            if o1 is None or not (np.array_equal(o1, o2) and np.array_equal(f1, f2)):
                write(st, part, split=split, key=key)
        else:
            write(st, part, split=split, key=key)
    return key, part

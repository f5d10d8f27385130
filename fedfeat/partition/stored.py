"""Partitions kept in a store: computed here, written and read through the store's plain arrays.

The store (``fedfeat.store``) sits below this package and knows a partition only as arrays: the client-major
``order`` of split rows, client ``offsets``, the scheme and its parameters. ``write`` / ``read`` turn a
``Partition`` into those and back; ``store_partition`` makes a store's partition once and reuses it after.
"""

from __future__ import annotations

import numpy as np

import fedfeat.partition as P
from fedfeat.errors import FedfeatError
from fedfeat.partition.registry import fill_defaults, get_scheme
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


def _test_labels(st: FeatureStore, scheme: str) -> np.ndarray:
    """The valid rows' labels of the store's test split (for schemes that partition it with the train split)."""
    if "test" not in st.splits:
        raise FedfeatError(f"store {st.path} has no test split; {scheme} partitions train and test together")
    lab = st.labels("test")
    return lab[lab >= 0]


def _domain_args(st, cls, split: str, valid, with_test: bool) -> dict:
    """A domain scheme's rows' domains (``<split>/domains`` of the valid rows, and the test split's) and names;
    nothing for the other schemes. A store without domains is a one-line error naming where domains come from."""
    if not cls.uses_domains:
        return {}
    d = st.domains(split)
    if d is None and not cls.needs_domains:  # a scheme that may draw by domain, on a store without domains
        return {}
    if d is None:
        raise FedfeatError(
            f"scheme {cls.name!r} draws clients by domain, and store {st.path} records no domains; encode a domain "
            "dataset (--dataset domainnet / domainfolder / pacs / officehome / vlcs / office-caltech10) or build "
            "a stand-in with `fedfeat synth --domains N`"
        )
    td = None
    if with_test:  # the valid test rows, as _test_labels gives them
        td = st.domains("test")
        td = None if td is None else td[st.labels("test") >= 0]
    return {"domains": d[valid], "test_domains": td, "domain_names": tuple(st.domain_names or ())}


def store_partition(
    st: FeatureStore,
    *,
    scheme: str,
    clients: int,
    seed: int | None = None,
    imbalance_factor: float | None = None,
    split: str = "train",
    save: bool = True,
    class_order=None,
    class_order_name: str | None = None,
    base_novel: bool = False,
    **scheme_params,
):
    """Make (or load, when already stored) a partition of a store's split. Returns ``(key, Partition)``.

    ``scheme_params``: the scheme's own parameters (``make_partition``); those not given (None) take the scheme's
    ``store_defaults`` (``fill_defaults``: e.g. alpha 0.1 for dirichlet, 0.5 for dirichlet-equal).
    Rows with label -1 (images skipped as unreadable at encode time) are never given to a client.
    ``class_order`` / ``class_order_name``: disjoint-classes' class list (``make_partition``). A scheme that
    draws the test split too gets the store's test labels (required: ``needs_test_labels``; when the store has a
    test split: ``uses_test_labels``).
    """
    cls = get_scheme(scheme)
    scheme_params = fill_defaults(scheme, scheme_params)
    labels = st.labels(split)
    valid = np.flatnonzero(labels >= 0)
    with_test = cls.needs_test_labels or (cls.uses_test_labels and split == "train" and "test" in st.splits)
    part = P.make_partition(
        labels[valid],
        scheme,
        clients=clients,
        imbalance_factor=imbalance_factor,
        seed=seed,
        n_classes=st.n_classes,
        test_labels=_test_labels(st, scheme) if with_test else None,
        class_order=class_order,
        class_order_name=class_order_name,
        **_domain_args(st, cls, split, valid, with_test),
        **({"class_groups": st.attrs.get("domain_classes")} if base_novel or cls.uses_domains else {}),
        base_novel=base_novel,
        **scheme_params,
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

"""``make_partition``: one entry point for every scheme (with an optional long tail first), each scheme's default
seed, and local test splits that follow a training partition's class proportions (FedCoPL).
"""

from __future__ import annotations

import numbers

import numpy as np

from fedfeat.errors import FedfeatError
from fedfeat.partition.core import Partition, _plain
from fedfeat.partition.schemes import (
    CLIP2FL_SEED,
    FEDCOPL_SEED,
    FEDMP_SEED,
    FEDNTD_SEED,
    SCHEMES,
    _int,
    _labels,
    _n_classes,
    dirichlet,
    dirichlet_equal,
    dirichlet_joint,
    disjoint_classes,
    iid,
    longtail,
    shard,
)

# ----------------------------------------------------------------------------------------- composition


def default_seed(scheme: str, imbalance_factor: float | None = None) -> int:
    """The seed a scheme's reference code uses: CLIP2FL's 7 whenever the long tail is involved."""
    if imbalance_factor is not None or scheme == "dirichlet-equal":
        return CLIP2FL_SEED
    if scheme == "disjoint-classes":
        return FEDMP_SEED
    if scheme == "dirichlet-joint":
        return FEDCOPL_SEED
    return FEDNTD_SEED


_INTS = {"clients": "e.g. clients=10", "shards": "e.g. shards=2", "seed": "e.g. seed=0",
         "shots": "e.g. shots=10", "n_classes": "the split's number of classes",
         "min_size": "e.g. min_size=10"}  # fmt: skip
_DIRICHLET_MIN = 10  # FedNTD lda_partition's `while min_size < 10` (schemes.dirichlet)
_REALS = {"alpha": "e.g. alpha=0.5", "imbalance_factor": "e.g. imbalance_factor=100"}


def _check_types(scheme, **args) -> None:
    """``make_partition``'s arguments have their types (numpy numbers count; bools and strings do not): one
    ``FedfeatError`` line naming the argument, as the CLI's flags are typed. Ranges are the schemes' checks."""
    if not isinstance(scheme, str):
        raise FedfeatError(
            f"scheme must be a string, got {type(scheme).__name__} {scheme!r:.60}; choose one of: {', '.join(SCHEMES)}"
        )
    for name, v in args.items():
        if v is None:
            continue
        is_bool = isinstance(v, (bool, np.bool_))
        if name in _INTS and (is_bool or not isinstance(v, numbers.Integral)):
            raise FedfeatError(f"{name} must be an integer (got {v!r:.60}); {_INTS[name]}")
        if name in _REALS and (is_bool or not isinstance(v, numbers.Real)):
            raise FedfeatError(f"{name} must be a number (got {v!r:.60}); {_REALS[name]}")


_USES = {  # which optional parameters each scheme takes
    "iid": (),
    "shard": ("shards",),
    "dirichlet": ("alpha",),
    "dirichlet-equal": ("alpha",),
    "disjoint-classes": ("shots",),
    "dirichlet-joint": ("alpha",),
}


def make_partition(
    labels,
    scheme: str,
    *,
    clients: int,
    alpha: float | None = None,
    shards: int | None = None,
    imbalance_factor: float | None = None,
    seed: int | None = None,
    shots: int | None = None,
    n_classes: int | None = None,
    test_labels=None,
    class_order=None,
    class_order_name: str | None = None,
    min_size: int | None = None,
) -> Partition:
    """Partition a split by name; the one entry point the CLI and the store use.

    ``dirichlet-joint`` (FedCoPL) partitions the test split with the same draws: pass its labels as
    ``test_labels``; the clients' test positions are ``params["test_clients"]``.

    With ``imbalance_factor``, the split is first cut to CLIP2FL's long tail (``longtail``) and the scheme
    runs on the kept samples, in ``longtail``'s order (class-major, shuffled within a class: what CLIP2FL feeds
    its partitioner), and the clients are mapped back to split positions. One ``seed`` drives both steps,
    each from a fresh generator (as in CLIP2FL: ``np.random.seed(7)`` for the tail, ``RandomState(7)`` for the
    Dirichlet). Default seed: ``default_seed(scheme, imbalance_factor)`` (FedNTD's 19940817 for iid / shard /
    dirichlet, CLIP2FL's 7 for dirichlet-equal and for anything with a long tail, 0 for disjoint-classes).
    ``shards`` defaults to 2 (FedNTD). ``n_classes`` defaults to ``labels.max() + 1``.
    ``class_order`` (disjoint-classes only): the class list the draws index, a permutation of the class ids
    (``disjoint_classes``' ``order``), recorded under ``class_order_name`` (its partition key says ``-o<name>``).
    ``min_size`` (dirichlet only): every client must hold ``>= min_size`` samples or the whole partition is
    redrawn (``schemes.dirichlet``); default None = FedNTD's 10. A value other than 10 is recorded in the params
    and the partition key (``-m<N>``), so two readings never share a stored partition.

    >>> p = make_partition(np.repeat(np.arange(10), 100), "shard", clients=10)
    >>> partition_key(p), p.sizes().tolist()[:3]
    ('shard-sh2-c10-s19940817', [100, 100, 100])
    """
    _check_types(
        scheme,
        clients=clients,
        alpha=alpha,
        shards=shards,
        imbalance_factor=imbalance_factor,
        seed=seed,
        shots=shots,
        n_classes=n_classes,
        min_size=min_size,
    )
    labels = _labels(labels)
    if scheme not in SCHEMES:
        hint = (
            " (the long tail is not a scheme: pass imbalance_factor with any scheme)"
            if scheme == "longtail"
            else ""
        )
        raise FedfeatError(f"unknown partition scheme {scheme!r}{hint}; choose one of: {', '.join(SCHEMES)}")
    given = {"alpha": alpha, "shards": shards, "shots": shots}
    for name, value in given.items():
        if value is not None and name not in _USES[scheme]:
            raise FedfeatError(
                f"{name} does not apply to scheme {scheme!r}; drop {name} or pick a scheme that uses it"
            )
    if min_size is not None and scheme != "dirichlet":
        raise FedfeatError(
            f"min_size applies to scheme 'dirichlet' only (got scheme {scheme!r}); drop --min-size"
        )
    if min_size is not None:
        min_size = _int("min_size", min_size, 0, "use --min-size 0 or more (FedNTD: 10)")
    if scheme in ("dirichlet", "dirichlet-equal", "dirichlet-joint") and alpha is None:
        raise FedfeatError(f"scheme {scheme!r} needs alpha; pass e.g. alpha=0.5 (smaller = more skewed)")
    if scheme == "dirichlet-joint" and (test_labels is None or imbalance_factor is not None):
        raise FedfeatError(
            "scheme 'dirichlet-joint' partitions the train and test splits together: it needs the test labels "
            "(a store with a test split) and no imbalance factor"
        )
    if scheme == "disjoint-classes" and shots is None:
        raise FedfeatError("scheme 'disjoint-classes' needs shots; pass the samples per class, e.g. shots=10")
    if class_order is not None and (scheme != "disjoint-classes" or not class_order_name):
        raise FedfeatError(
            "a class order applies to scheme 'disjoint-classes' only and needs a name for the partition key; "
            "drop it or pass class_order_name"
        )
    n_cls = _n_classes(labels, n_classes)
    if seed is None:
        seed = default_seed(scheme, imbalance_factor)
    if scheme == "shard" and shards is None:
        shards = 2

    if imbalance_factor is not None:
        kept = longtail(labels, imbalance_factor, seed, n_classes=n_cls)
    else:
        kept = np.arange(len(labels), dtype=np.int64)
    sub = labels[kept]
    extra: dict = {}
    if scheme == "iid":
        parts = iid(sub, clients, seed)
    elif scheme == "shard":
        parts = shard(sub, clients, shards, seed)
    elif scheme == "dirichlet":
        minimum = _DIRICHLET_MIN if min_size is None else min_size
        parts = dirichlet(sub, clients, alpha, seed, min_size=minimum)
        if min_size is not None and min_size != _DIRICHLET_MIN:
            extra["min_size"] = min_size
    elif scheme == "dirichlet-equal":
        parts = dirichlet_equal(sub, clients, alpha, seed, n_classes=n_cls)
    elif scheme == "dirichlet-joint":
        parts, tparts = dirichlet_joint(sub, _labels(test_labels), clients, alpha, seed, n_classes=n_cls)
        extra["test_clients"] = [t.tolist() for t in tparts]
    else:
        parts, novel = disjoint_classes(sub, clients, shots, seed, n_classes=n_cls, order=class_order)
        extra["novel_classes"] = novel.tolist()
        if class_order is not None:
            extra["class_order"] = str(class_order_name)
            extra["class_order_ids"] = np.asarray(class_order).tolist()
    parts = [kept[p] for p in parts]
    empty = [i for i, p in enumerate(parts) if len(p) == 0]
    if empty:
        raise FedfeatError(
            f"{scheme}: {len(empty)} of {len(parts)} clients got no samples (first: client {empty[0]}); "
            "use fewer clients"
        )
    params = {
        "scheme": scheme,
        "clients": int(clients),
        "alpha": None if alpha is None else float(alpha),
        "shards": None if shards is None else int(shards),
        "imbalance_factor": None if imbalance_factor is None else _plain(imbalance_factor),
        "seed": int(seed),
        "shots": None if shots is None else int(shots),
        "n_classes": n_cls,
        "n_samples": len(labels),
        **extra,
    }
    return Partition(scheme, params, parts)


LOCAL_TEST = ("none", "proportional", "joint")


def local_test_split(partition: Partition, train_labels, test_labels, n_classes: int, seed: int = 0) -> list:
    """Each client's local test set (FedCoPL's evaluation: per-client accuracy on a test split drawn like the
    client's training data): for every class ``c``, the test positions of ``c`` (shuffled by a
    ``RandomState(seed)``) are cut among the clients in proportion to their training counts ``n_{k,c} / N_c``, with
    FedML's cut rule ``(cumsum(p) * len(idx)).astype(int)`` (the one FedCoPL's ``prepare_dataset_UL_fed`` applies
    to its test split). A client without training samples of ``c`` gets no test samples of ``c``.

    FedCoPL draws one Dirichlet ``p`` per class and cuts both splits with it (each split with its own cap of
    clients already holding ``N / n``): its test proportions are its train proportions wherever the two caps
    agree, which is what this reads it as; it applies to every partition scheme. Returns int64 positions into
    ``test_labels`` per client, each client's sorted."""
    train_labels = np.asarray(train_labels)
    test_labels = np.asarray(test_labels)
    counts = partition.counts(train_labels, n_classes)  # [clients, classes]
    rs = np.random.RandomState(seed)
    out: list[list[np.ndarray]] = [[] for _ in range(partition.n_clients)]
    for c in range(n_classes):
        idx = np.flatnonzero(test_labels == c)
        rs.shuffle(idx)
        total = counts[:, c].sum()
        if total == 0 or len(idx) == 0:
            continue
        p = counts[:, c] / total
        cuts = (np.cumsum(p) * len(idx)).astype(int)[:-1]
        for k, piece in enumerate(np.split(idx, cuts)):
            out[k].append(piece)
    return [np.sort(np.concatenate(o)).astype(np.int64) if o else np.zeros(0, np.int64) for o in out]

"""``make_partition``: one entry point for every scheme (with an optional long tail first), each scheme's default
seed, and local test splits that follow a training partition's class proportions (FedCoPL).

The schemes are classes (``fedfeat.partition.registry``, one module each in ``fedfeat.partition.kinds``): this
module knows none by name.
"""

from __future__ import annotations

import math
import numbers

import numpy as np

from fedfeat.errors import FedfeatError
from fedfeat.partition.core import Partition, _plain
from fedfeat.partition.registry import SCHEMES, Draw, field_kind, get_scheme, scheme_fields, schemes_using
from fedfeat.partition.schemes import _labels, _n_classes, longtail

# ----------------------------------------------------------------------------------------- composition


def default_seed(scheme: str, imbalance_factor: float | None = None) -> int:
    """The seed a scheme's reference code uses: CLIP2FL's 7 whenever the long tail is involved
    (``Scheme.default_seed``)."""
    return get_scheme(scheme).default_seed(imbalance_factor)


# the arguments every scheme takes; the schemes' own come with their Params fields (help, example)
_COMMON = {"clients": (int, "e.g. clients=10"), "seed": (int, "e.g. seed=0"),
           "n_classes": (int, "the split's number of classes"),
           "imbalance_factor": (float, "e.g. imbalance_factor=100")}  # fmt: skip


def _check_types(scheme, given: dict) -> None:
    """``make_partition``'s arguments have their types (numpy numbers count; bools and strings do not): one
    ``FedfeatError`` line naming the argument, as the CLI's flags are typed. Ranges are the schemes' checks."""
    if not isinstance(scheme, str):
        get_scheme(scheme)  # "scheme must be a string ..."
    fields = scheme_fields()
    unknown = [k for k in given if k not in _COMMON and k not in fields]
    if unknown:
        raise FedfeatError(
            f"unknown partition parameter {unknown[0]!r}; the scheme parameters are: {', '.join(fields)}"
        )
    for name, v in given.items():
        if v is None:
            continue
        if name in _COMMON:
            kind, fix = _COMMON[name]
        else:
            kind, fix = field_kind(fields[name]), f"e.g. {name}={fields[name].metadata['example']}"
        is_bool = isinstance(v, (bool, np.bool_))
        if kind is int and (is_bool or not isinstance(v, numbers.Integral)):
            raise FedfeatError(f"{name} must be an integer (got {v!r:.60}); {fix}")
        if kind is float and (is_bool or not isinstance(v, numbers.Real)):
            raise FedfeatError(f"{name} must be a number (got {v!r:.60}); {fix}")
        if kind is str and not isinstance(v, str):
            raise FedfeatError(f"{name} must be a string (got {v!r:.60}); {fix}")


def _not_applicable(name: str, scheme: str) -> FedfeatError:
    users = schemes_using(name)
    which = f"scheme {users[0]!r}" if len(users) == 1 else "schemes " + ", ".join(map(repr, users))
    return FedfeatError(
        f"{name} does not apply to scheme {scheme!r} ({name} applies to {which} only); drop {name} or pick "
        "a scheme that uses it"
    )


def make_partition(
    labels,
    scheme: str,
    *,
    clients: int,
    seed: int | None = None,
    imbalance_factor: float | None = None,
    n_classes: int | None = None,
    test_labels=None,
    class_order=None,
    class_order_name: str | None = None,
    domains=None,
    test_domains=None,
    domain_names=(),
    base_novel: bool = False,
    client_shots: int | None = None,
    class_groups=None,
    **scheme_params,
) -> Partition:
    """Partition a split by name; the one entry point the CLI and the store use.

    ``scheme_params``: the scheme's own parameters (``fedfeat.partition.registry.scheme_fields()``: ``shards``,
    ``alpha``, ``min_size``, ``shots``, ...; each scheme's ``Params`` says which it takes, their defaults and
    their meaning). A parameter of another scheme is refused in one line, None counts as not given.

    A scheme that draws the test split too (``dirichlet-joint``, FedCoPL: ``needs_test_labels``) gets its labels
    as ``test_labels``; the clients' test positions are ``params["test_clients"]``.

    With ``imbalance_factor``, the split is first cut to CLIP2FL's long tail (``longtail``) and the scheme
    runs on the kept samples, in ``longtail``'s order (class-major, shuffled within a class: what CLIP2FL feeds
    its partitioner), and the clients are mapped back to split positions. One ``seed`` drives both steps,
    each from a fresh generator (as in CLIP2FL: ``np.random.seed(7)`` for the tail, ``RandomState(7)`` for the
    Dirichlet). Default seed: ``default_seed(scheme, imbalance_factor)`` (FedNTD's 19940817 for iid / shard /
    dirichlet, CLIP2FL's 7 for dirichlet-equal and for anything with a long tail, 0 for disjoint-classes).
    ``n_classes`` defaults to ``labels.max() + 1``.
    ``class_order`` (schemes with ``takes_class_order``: disjoint-classes): the class list the draws index, a
    permutation of the class ids (``disjoint_classes``' ``order``), recorded under ``class_order_name`` (its
    partition key says ``-o<name>``).
    ``base_novel`` (CoOp's base-to-novel protocol, ``subsample_classes``): the scheme draws from the rows of the
    first ``ceil(K / 2)`` classes only (label order), with ``n_classes`` = that; the rest are ``params["novel_classes"]``
    (the key starts ``b2n+``; ``class_groups``, a combined store's ``domain_classes``: the first half of each
    dataset's classes, FedTPG's per-dataset base classes). ``client_shots`` k (few-shot): after the draw each client keeps the first k of its
    positions of every class it holds (the key starts ``shots<k>+``); the schemes' draws are random orders, so these
    are k random samples of the class.
    ``domains`` / ``test_domains`` / ``domain_names`` (schemes with ``needs_domains``: ``domain``): each row's
    domain id in the split and the test split, and the domains' names (a store's ``domains(split)`` and
    ``domain_names``).

    >>> p = make_partition(np.repeat(np.arange(10), 100), "shard", clients=10)
    >>> partition_key(p), p.sizes().tolist()[:3]
    ('shard-sh2-c10-s19940817', [100, 100, 100])
    """
    _check_types(
        scheme,
        {"clients": clients, "imbalance_factor": imbalance_factor, "seed": seed, "n_classes": n_classes,
         **scheme_params},
    )  # fmt: skip
    labels = _labels(labels)
    cls = get_scheme(scheme)
    own = {f.name for f in cls.fields()}
    for name, value in scheme_params.items():
        if value is not None and name not in own:
            raise _not_applicable(name, scheme)
    params = cls.params({k: v for k, v in scheme_params.items() if k in own})
    cls.check_inputs(imbalance_factor=imbalance_factor, test_labels=test_labels)
    if class_order is not None and (not cls.takes_class_order or not class_order_name):
        users = " / ".join(repr(n) for n, c in SCHEMES.items() if c.takes_class_order)
        raise FedfeatError(
            f"a class order applies to scheme {users} only and needs a name for the partition key; "
            "drop it or pass class_order_name"
        )
    if cls.needs_domains:
        if domains is None:
            raise FedfeatError(
                f"scheme {scheme!r} draws by domain: it needs each row's domain (a store encoded from a domain "
                "dataset: --dataset domainnet / domainfolder / pacs / officehome / vlcs / office-caltech10, or "
                "`fedfeat synth --domains N`)"
            )
        domains = np.asarray(domains, dtype=np.int64)
        if domains.shape != labels.shape:
            raise FedfeatError(
                f"domains has {len(domains)} entries for {len(labels)} labels; give one per row"
            )
        if imbalance_factor is not None:
            raise FedfeatError(f"scheme {scheme!r} takes no imbalance factor; drop imbalance_factor")
    elif cls.uses_domains and domains is not None:
        domains = np.asarray(domains, dtype=np.int64)
        if domains.shape != labels.shape:
            raise FedfeatError(
                f"domains has {len(domains)} entries for {len(labels)} labels; give one per row"
            )
    elif domains is not None or test_domains is not None:
        raise FedfeatError(f"scheme {scheme!r} does not draw by domain; drop domains")
    n_cls = _n_classes(labels, n_classes)
    if seed is None:
        seed = cls.default_seed(imbalance_factor)

    if imbalance_factor is not None:
        kept = longtail(labels, imbalance_factor, seed, n_classes=n_cls)
    else:
        kept = np.arange(len(labels), dtype=np.int64)
    draw_classes = n_cls
    if base_novel:
        if cls.needs_test_labels:
            raise FedfeatError(
                f"base_novel: scheme {scheme!r} draws the test split too; use another scheme for base-to-novel runs"
            )
        if class_groups:  # each dataset's first half (FedTPG server.py:108-112, dm_federated.py:188-193)
            base = np.concatenate(
                [np.asarray(g, dtype=np.int64)[: math.ceil(len(g) / 2)] for g in class_groups]
            )
        else:  # CoOp subsample_classes: m = math.ceil(n / 2) base labels
            base = np.arange(math.ceil(n_cls / 2))
        is_base = np.zeros(n_cls, dtype=bool)
        is_base[base] = True
        kept = kept[is_base[labels[kept]]]
        draw_classes = n_cls if class_groups else len(base)
        test_labels = None  # the test split is the protocol's: base / novel rows, no client test draw
    if client_shots is not None and (isinstance(client_shots, bool) or int(client_shots) < 1):
        raise FedfeatError(f"client_shots must be >= 1, got {client_shots} (e.g. 8)")
    draw = Draw(
        labels=labels[kept], clients=clients, seed=seed, n_classes=draw_classes,
        test_labels=None if test_labels is None or not cls.uses_test_labels else _labels(test_labels),
        class_order=class_order, class_order_name=class_order_name,
        domains=None if domains is None else domains[kept],
        test_domains=None if test_domains is None or test_labels is None or not cls.uses_test_labels
        else np.asarray(test_domains, dtype=np.int64),
        domain_names=tuple(domain_names or ()),
        class_groups=None if not class_groups else tuple(
            tuple(int(c) for c in (g[: math.ceil(len(g) / 2)] if base_novel else g)) for g in class_groups),
    )  # fmt: skip
    parts, extra = cls.draw(draw, params)
    parts = [kept[p] for p in parts]
    if client_shots is not None:
        parts = [_first_shots(p, labels, int(client_shots)) for p in parts]
    empty = [i for i, p in enumerate(parts) if len(p) == 0]
    if empty:
        raise FedfeatError(
            f"{scheme}: {len(empty)} of {len(parts)} clients got no samples (first: client {empty[0]}); "
            "use fewer clients"
        )
    record = {  # alpha, shards and shots are in every record (None where the scheme has none), as they always were
        "scheme": scheme,
        "clients": int(clients),
        "alpha": None,
        "shards": None,
        "imbalance_factor": None if imbalance_factor is None else _plain(imbalance_factor),
        "seed": int(seed),
        "shots": None,
        "n_classes": n_cls,
        "n_samples": len(labels),
    }
    # the scheme's own parameters (in place where listed above, after the rest otherwise), then its extras
    record.update(cls.record(params))
    record.update(extra)
    if base_novel:  # recorded only when set: the records of before are as they were
        record["base_novel"] = True
        record["novel_classes"] = np.flatnonzero(~is_base).tolist()
    if client_shots is not None:
        record["client_shots"] = int(client_shots)
    return Partition(scheme, record, parts)


def _first_shots(pos: np.ndarray, labels: np.ndarray, k: int) -> np.ndarray:
    """The first ``k`` positions of each class among ``pos`` (their order kept)."""
    y = labels[pos]
    order = np.argsort(y, kind="stable")  # class-major, each class in its draw order
    ys = y[order]
    starts = np.searchsorted(ys, ys, side="left")  # each entry's class's first index in the sorted order
    rank = np.empty(len(pos), dtype=np.int64)
    rank[order] = np.arange(len(pos)) - starts
    return pos[rank < k]


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

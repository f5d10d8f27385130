"""Client partitions of one split: which sample positions each client holds.

Every scheme reproduces a published code's partition bit for bit: same algorithm, same random calls in the
same order, on generators seeded the way that code seeds them. The reference codes draw from numpy's
legacy global generator (a ``RandomState``) and python's ``random``; fedfeat draws from a private
``np.random.RandomState(seed)`` / ``random.Random(seed)`` instead (identical streams, so identical results,
checked against transcriptions of the reference functions in ``tests/reference_partitions.py``) and never
touches the global generators.

The functions below are the algorithms; each scheme is a class in ``fedfeat.partition.kinds`` (one module each,
``fedfeat.partition.registry.SCHEMES``, re-exported here as ``SCHEMES``) that owns its parameters, defaults and
default seed and calls its function: ``iid`` and ``shard`` (FedNTD ``iid_partition`` / ``sharding_partition``),
``dirichlet`` (FedNTD ``lda_partition``, the FedML rule), ``dirichlet-equal`` (CLIP2FL/CReFF ``clients_indices``),
``disjoint-classes`` (Fed-MP ``caltech_split_clients``), ``dirichlet-joint`` (FedCoPL). Any scheme may first
cut CLIP2FL's long tail (``longtail``, ``train_long_tail``; seed ``CLIP2FL_SEED``).

FedNTD: ``Lee-Gihun/FedNTD``, ``train_tools/preprocessing/datasetter.py`` (HEAD be00ee5), seeded in
``main.py`` with ``np.random.seed(19940817); random.seed(19940817)``. CLIP2FL: ``shijiangming1/CLIP2FL``
@ 9db63f3, ``Dataset/long_tailed_cifar10.py`` and ``Dataset/sample_dirichlet.py`` (the same code as CReFF,
``shangxinyi/CReFF-FL``); ``main.py`` seeds ``np.random.seed(7)`` and passes ``--seed`` (7) to
``clients_indices``. Fed-MP: ``huiminzeng/Fed-MP``, ``dataset/utils.py``.

Positions are always positions in the labels array given (the split); ``make_partition`` maps the
positions of a long-tailed subset back to split positions. A scheme's "each sample to exactly one client"
holds for the samples it keeps; each function says which samples it drops.

Example::

    >>> labels = np.repeat(np.arange(10), 50)
    >>> p = make_partition(labels, "dirichlet", clients=5, alpha=0.5)
    >>> partition_key(p)
    'dirichlet-a0.5-c5-s19940817'
    >>> int(p.sizes().sum())
    500
"""

from __future__ import annotations

import itertools
import math
import operator
import random

import numpy as np

from fedfeat.errors import FedfeatError
from fedfeat.partition.registry import LONGTAIL_SEED, SCHEMES

__all__ = [
    "CLIP2FL_SEED",
    "FEDCOPL_SEED",
    "FEDMP_SEED",
    "FEDNTD_SEED",
    "SCHEMES",
    "dirichlet",
    "dirichlet_equal",
    "dirichlet_joint",
    "disjoint_classes",
    "iid",
    "longtail",
    "longtail_counts",
    "shard",
]

FEDNTD_SEED = 19940817  # FedNTD main.py: np.random.seed(19940817); random.seed(19940817)
CLIP2FL_SEED = LONGTAIL_SEED  # 7, CLIP2FL main.py: np.random.seed(7); options.py --seed 7
FEDCOPL_SEED = 2  # FedCoPL run-textPT_ALL.sh: OPTIM_SEED 2 seeds the global np.random before the split
FEDMP_SEED = 0  # Fed-MP: np.random.seed(i + 1) for client i (Caltech, Food, Flowers) = FEDMP_SEED + i + 1

_MAX_DRAWS = 10_000  # the references loop forever when no draw succeeds; fedfeat gives up with an error
_AUX_WORKERS = 10  # CLIP2FL's n_auxi_workers: Dirichlet workers per chunk
_SEED_MAX = 2**32 - 1  # np.random.RandomState accepts 0 .. 2**32 - 1


# ----------------------------------------------------------------------------------------- checks


def _labels(labels) -> np.ndarray:
    arr = np.asarray(labels)
    if arr.ndim != 1 or arr.size == 0 or not np.issubdtype(arr.dtype, np.integer):
        raise FedfeatError(
            f"labels must be a non-empty 1-D array of integer class ids (got shape {arr.shape}, "
            f"dtype {arr.dtype}); pass the split's label array"
        )
    arr = arr.astype(np.int64, copy=False)
    if arr.min() < 0:
        raise FedfeatError(f"labels must be class ids >= 0 (found {arr.min()}); remap the labels to 0..C-1")
    return arr


def _int(name: str, value, minimum: int, fix: str) -> int:
    try:
        out = operator.index(value)
    except TypeError:
        raise FedfeatError(f"{name} must be an integer (got {value!r}); {fix}") from None
    if out < minimum:
        raise FedfeatError(f"{name} must be >= {minimum} (got {out}); {fix}")
    return out


def _seed(seed, lowest: int = 0, highest: int = _SEED_MAX) -> int:
    seed = _int("seed", seed, lowest, f"pick a seed in {lowest}..{highest}")
    if seed > highest:
        raise FedfeatError(f"seed must be <= {highest} (got {seed}); pick a seed in {lowest}..{highest}")
    return seed


def _alpha(alpha) -> float:
    try:
        out = float(alpha)
    except (TypeError, ValueError):
        out = float("nan")
    if not (out > 0 and math.isfinite(out)):
        raise FedfeatError(
            f"alpha must be a positive finite Dirichlet concentration (got {alpha!r}); "
            "pass e.g. alpha=0.5 (smaller = more skewed)"
        )
    return out


def _n_classes(labels: np.ndarray, n_classes) -> int:
    if n_classes is None:
        return int(labels.max()) + 1
    n_classes = _int("n_classes", n_classes, 1, "pass the split's number of classes")
    if labels.max() >= n_classes:
        raise FedfeatError(
            f"label {labels.max()} is out of range for n_classes={n_classes}; pass the split's number of classes"
        )
    return n_classes


def _clients(n_clients, n_samples: int) -> int:
    n_clients = _int("clients", n_clients, 1, "use at least one client")
    if n_clients > n_samples:
        raise FedfeatError(
            f"{n_clients} clients but only {n_samples} samples; use at most {n_samples} clients"
        )
    return n_clients


# ----------------------------------------------------------------------------------------- shared pieces


def _by_class(labels: np.ndarray, n_classes: int) -> list[np.ndarray]:
    """Positions of each class id ``0..n_classes-1`` in dataset order (CLIP2FL's ``classify_label``)."""
    order = np.argsort(labels, kind="stable")
    return np.split(order, np.cumsum(np.bincount(labels, minlength=n_classes))[:-1])


def _piece_sizes(cuts: np.ndarray, length: int) -> np.ndarray:
    """Sizes of the pieces ``np.split(a, cuts)`` makes of an ``a`` of this length (python slice rules).

    Only needed when the cuts are NaN cast to int (``p / p.sum()`` is 0 / 0 because every client with
    p > 0 is capped, or the Dirichlet draw itself underflowed to NaN at tiny alpha): the cast gives one
    platform-defined value for all cuts and the pieces follow from the slice rules, as in the reference
    (on x86 the last client takes the whole class).
    """
    bounds = np.concatenate(([0], cuts, [length])).astype(np.int64)
    bounds = np.clip(np.where(bounds < 0, bounds + length, bounds), 0, length)
    return np.maximum(np.diff(bounds), 0)


def _dirichlet_cut(rs: np.random.RandomState, alphas: np.ndarray, held: np.ndarray, cap: float, n: int):
    """FedML's per-class rule: p ~ Dir(alphas), zero for clients holding >= cap, cut n items at cumsum(p).

    The same float operations as the reference (``p * (len < cap)``, ``p / p.sum()``,
    ``(cumsum(p) * n).astype(int)[:-1]``), vectorised over clients. Returns the piece sizes ``[clients]``;
    the pieces lie in client order, so client j takes items ``[sum(sizes[:j]), sum(sizes[:j + 1]))``.
    """
    return _cut(rs.dirichlet(alphas), held, cap, n)


def _cut(p: np.ndarray, held: np.ndarray, cap: float, n: int):
    """``_dirichlet_cut`` after its draw ``p``: zero the capped clients, cut ``n`` items at ``cumsum(p)``."""
    p = p * (held < cap)
    total = p.sum()
    if not total > 0:
        with np.errstate(divide="ignore", invalid="ignore"):
            return _piece_sizes((np.cumsum(p / total) * n).astype(int)[:-1], n)
    cuts = (np.cumsum(p / total) * n).astype(int)  # monotone, within [0, n]
    cuts[-1] = n  # np.split's last piece ends at len(a)
    sizes = cuts.copy()
    sizes[1:] -= cuts[:-1]
    return sizes


def _gather_by_owner(items: list[np.ndarray], pieces: list[np.ndarray], n_owners: int) -> list[np.ndarray]:
    """Owner j's list = piece j of items[0], then piece j of items[1], ... (the references' list appends)."""
    flat = np.concatenate(items)
    owner = np.concatenate([np.repeat(np.arange(n_owners), sizes) for sizes in pieces])
    by_owner = flat[np.argsort(owner, kind="stable")]
    return np.split(by_owner, np.cumsum(np.sum(pieces, axis=0))[:-1])


# ----------------------------------------------------------------------------------------- schemes


def iid(labels, n_clients: int, seed: int = FEDNTD_SEED) -> list[np.ndarray]:
    """Uniform random clients of ``int(N / clients)`` samples each (FedNTD ``iid_partition``).

    Source: ``Lee-Gihun/FedNTD`` ``train_tools/preprocessing/datasetter.py``. For each client in turn, the
    remaining positions are shuffled in place and the client takes the first ``int(N / clients)``.
    Drops: the ``N mod clients`` positions left at the end (random ones).
    """
    labels = _labels(labels)
    n = len(labels)
    n_clients = _clients(n_clients, n)
    rs = np.random.RandomState(_seed(seed))
    length = int(n / n_clients)
    remaining = np.arange(n, dtype=np.int64)
    clients = []
    for _ in range(n_clients):
        rs.shuffle(remaining)
        clients.append(remaining[:length].copy())
        remaining = remaining[length:]
    return clients


def shard(labels, n_clients: int, shards_per_client: int = 2, seed: int = FEDNTD_SEED) -> list[np.ndarray]:
    """Label-sorted shards, ``shards_per_client`` per client (FedNTD ``sharding_partition``).

    Source: ``Lee-Gihun/FedNTD`` ``train_tools/preprocessing/datasetter.py``. Each class's positions, in
    dataset order (not shuffled), are cut into ``s * clients / C`` equal shards; the ``len % (shards per class)`` leftover
    positions go one each to the first shards. The class list ``[0..C-1] * shards_per_class`` is shuffled
    with python ``random`` and cut into rows of ``s`` labels (a row may repeat a label); each client then
    pops a random remaining shard of each of its labels (``np.random.choice(n, replace=False)``).
    Drops: nothing. fedfeat requires ``s * clients`` to be a multiple of C, so every client gets exactly ``s``
    shards (FedNTD silently gives fewer otherwise, or fails in a reshape). Classes are the ids that occur,
    in increasing order (FedNTD uses ``range(#classes)``: the same when all ids 0..C-1 occur).
    """
    labels = _labels(labels)
    n_clients = _clients(n_clients, len(labels))
    s = _int("shards", shards_per_client, 1, "give each client at least one shard")
    classes = np.unique(labels)
    n_cls = len(classes)
    if (s * n_clients) % n_cls:
        raise FedfeatError(
            f"shard: shards x clients = {s} x {n_clients} = {s * n_clients} is not a multiple of the {n_cls} "
            f"classes; choose clients and shards so that their product is a multiple of {n_cls}"
        )
    rs = np.random.RandomState(_seed(seed))
    py = random.Random(seed)
    per_class = s * n_clients // n_cls

    by_class = _by_class(labels, int(classes[-1]) + 1)
    shards: dict[int, list[np.ndarray]] = {}
    for c in classes.tolist():
        idx = by_class[c]
        n_left = len(idx) % per_class
        body = idx[: len(idx) - n_left]
        parts = list(body.reshape((per_class, -1)))
        for i in range(n_left):
            parts[i] = np.append(parts[i], idx[len(idx) - n_left + i])
        shards[c] = parts

    row_labels = classes.tolist() * per_class
    py.shuffle(row_labels)
    rows = np.array(row_labels).reshape((n_clients, -1))
    clients = []
    for row in rows.tolist():
        picked = [shards[c].pop(rs.choice(len(shards[c]), replace=False)) for c in row]
        clients.append(np.concatenate(picked).astype(np.int64))
    return clients


def dirichlet(
    labels, n_clients: int, alpha: float, seed: int = FEDNTD_SEED, min_size: int = 10
) -> list[np.ndarray]:
    """Per-class Dirichlet label skew (FedNTD ``lda_partition``, the FedML rule).

    Source: ``Lee-Gihun/FedNTD`` ``train_tools/preprocessing/datasetter.py``. For each class in turn: its
    positions (dataset order) are shuffled, ``p ~ Dir(alpha * 1)``, clients already holding ``>= N / clients``
    get ``p = 0``, and the class is cut at ``cumsum(p)``. The whole partition is drawn again until every client
    holds ``>= min_size`` samples; finally each client's list is shuffled.
    Drops: nothing. Classes are the ids that occur, in increasing order (FedNTD iterates ``range(#classes)``:
    the same when all ids 0..C-1 occur). Gives up with an error after 10,000 draws (FedNTD loops forever).

    ``min_size`` (``--min-size N``) is the resampling condition, a named reading for settings whose minimum
    cannot be met (e.g. 100 clients at alpha 0.05 on CIFAR-10). What public FL code does:

    - FedNTD ``lda_partition``: ``while min_size < 10`` redraws the whole partition (no limit): N = 10, the
      default here (the same partitions bit for bit as before the switch existed);
    - FedML (``non_iid_partition_with_dirichlet_distribution``, the rule FedNTD copies): the same
      ``while min_size < 10`` loop;
    - CLIP2FL / CReFF ``clients_indices``: a min-size loop per chunk of 10 workers,
      ``min_size < int(0.5 * chunk_size / 10)`` (50 % of the chunk average; ``dirichlet-equal`` here);
    - Flower Datasets ``DirichletPartitioner`` (``adap/flower@e6fb35f``
      ``datasets/flwr_datasets/partitioner/dirichlet_partitioner.py``,
      ``_determine_partition_id_to_indices_if_needed``): ``min_partition_size=10`` by default, the same redraw of
      all classes, a warning per failed draw and ``ValueError("The max number of attempts (10) was reached")``
      after 11 draws; ``self_balancing`` (default False) is the cap above (zero p for partitions holding more
      than N / partitions; FedNTD's rule always caps, at ``>=``).

    ``min_size=0`` accepts the first draw (clients may then be empty, which ``make_partition`` rejects);
    ``min_size=1`` is the weakest minimum under which every client can train.
    """
    labels = _labels(labels)
    n = len(labels)
    n_clients = _clients(n_clients, n)
    alpha = _alpha(alpha)
    min_size = _int("min_size", min_size, 0, "use min_size >= 0")
    if n < min_size * n_clients:
        raise FedfeatError(
            f"dirichlet: {n} samples cannot give {n_clients} clients >= {min_size} samples each; "
            f"use at most {n // max(min_size, 1)} clients or a smaller --min-size"
        )
    rs = np.random.RandomState(_seed(seed))
    by_class = [idx for idx in _by_class(labels, int(labels.max()) + 1) if len(idx)]  # the ids that occur
    cap = n / n_clients
    alphas = np.repeat(alpha, n_clients)
    for _ in range(_MAX_DRAWS):
        held = np.zeros(n_clients, dtype=np.int64)
        shuffled, pieces = [], []
        for idx in by_class:
            idx = idx.copy()
            rs.shuffle(idx)
            sizes = _dirichlet_cut(rs, alphas, held, cap, len(idx))
            held += sizes
            shuffled.append(idx)
            pieces.append(sizes)
        if held.min() >= min_size:
            break
    else:
        raise FedfeatError(
            f"dirichlet: no draw in {_MAX_DRAWS} gave all {n_clients} clients >= {min_size} samples at "
            f"alpha={alpha}; use fewer clients or a larger alpha, or lower --min-size (e.g. --min-size 1)"
        )
    clients = _gather_by_owner(shuffled, pieces, n_clients)
    for c in clients:
        rs.shuffle(c)
    return clients


def dirichlet_joint(
    labels,
    test_labels,
    n_clients: int,
    beta: float,
    seed: int = FEDCOPL_SEED,
    n_classes: int | None = None,
    min_size: int = 10,
) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """FedCoPL's split of the train **and** test sets (``krumpguo/FedCoPL`` ``methods/main_UL.py``
    ``prepare_dataset_UL_fed``, ``partition == "noniid"``, lines 218-250): for each class ``k`` in turn, its train and
    test positions (dataset order) are shuffled (train first), one ``p ~ Dir(beta * 1)`` is drawn, and each split is
    cut at ``cumsum(p')`` where ``p'`` zeroes the clients already holding ``>= N / clients`` of *that* split (its
    own cap) and is renormalised; the whole draw repeats until every client holds ``>= min_size`` (10) train
    samples; finally each client's train list, then its test list, is shuffled (client by client). The reference
    draws from the global ``np.random`` seeded with ``OPTIM_SEED``; here a private ``RandomState(seed)`` (the same
    stream). Returns ``(train clients, test clients)``; no minimum on the test side, as the reference."""
    labels, test_labels = _labels(labels), _labels(test_labels)
    n, nt = len(labels), len(test_labels)
    n_clients = _clients(n_clients, n)
    beta = _alpha(beta)
    K = _n_classes(labels, n_classes)
    rs = np.random.RandomState(_seed(seed))
    by_class = [np.flatnonzero(labels == k) for k in range(K)]
    by_class_t = [np.flatnonzero(test_labels == k) for k in range(K)]
    for _ in range(_MAX_DRAWS):
        batch: list[list[int]] = [[] for _ in range(n_clients)]
        batch_t: list[list[int]] = [[] for _ in range(n_clients)]
        for k in range(K):
            idx_k, idx_t = by_class[k].copy(), by_class_t[k].copy()
            rs.shuffle(idx_k)
            rs.shuffle(idx_t)
            p = rs.dirichlet(np.repeat(beta, n_clients))
            held = np.array([len(b) for b in batch])
            held_t = np.array([len(b) for b in batch_t])
            with np.errstate(divide="ignore", invalid="ignore"):
                pt = p * (held < n / n_clients)
                pt = pt / pt.sum()
                ps = p * (held_t < nt / n_clients)
                ps = ps / ps.sum()
            cut = (np.cumsum(pt) * len(idx_k)).astype(int)[:-1]
            cut_t = (np.cumsum(ps) * len(idx_t)).astype(int)[:-1]
            batch = [b + piece.tolist() for b, piece in zip(batch, np.split(idx_k, cut))]
            batch_t = [b + piece.tolist() for b, piece in zip(batch_t, np.split(idx_t, cut_t))]
        if min(len(b) for b in batch) >= min_size:
            break
    else:
        raise FedfeatError(
            f"dirichlet-joint: no draw in {_MAX_DRAWS} gave all {n_clients} clients >= {min_size} train samples at "
            f"alpha={beta}; use fewer clients or a larger alpha"
        )
    train, test = [], []
    for j in range(n_clients):
        a, b = np.asarray(batch[j], dtype=np.int64), np.asarray(batch_t[j], dtype=np.int64)
        rs.shuffle(a)
        rs.shuffle(b)
        train.append(a)
        test.append(b)
    return train, test


def _chunks(n: int, n_clients: int) -> list[tuple[int, int, int]]:
    """CLIP2FL's chunks of the shuffled list: (start, stop, workers); 10 workers each, the rest in the last."""
    n_chunks = math.ceil(n_clients / _AUX_WORKERS)
    step = int(_AUX_WORKERS / n_clients * n)
    return [
        (
            k * step,
            n if k == n_chunks - 1 else (k + 1) * step,
            min(_AUX_WORKERS, n_clients - k * _AUX_WORKERS),
        )
        for k in range(n_chunks)
    ]


def _chunks_fit(n: int, n_clients: int) -> bool:
    """Whether every chunk asks its workers for >= 1 sample (CLIP2FL skips a chunk that asks for 0)."""
    return all(int(0.50 * (hi - lo) / n_w) > 0 for lo, hi, n_w in _chunks(n, n_clients))


def dirichlet_equal(
    labels, n_clients: int, alpha: float, seed: int = CLIP2FL_SEED, n_classes: int | None = None
) -> list[np.ndarray]:
    """Chunked Dirichlet re-cut into equal-size clients (CLIP2FL/CReFF ``clients_indices``).

    Source: ``shijiangming1/CLIP2FL`` ``Dataset/sample_dirichlet.py`` (``clients_indices``,
    ``build_non_iid_by_dirichlet``, ``partition_balance``). The positions are listed class-major (class 0
    first; within a class in the order they occur in ``labels``: dataset order, or the long-tail order when
    ``labels`` is the output of ``longtail``) and shuffled with ``RandomState(seed)``, which makes every later
    draw too. The list is cut into ``ceil(clients / 10)`` chunks of ``int(10 / clients * N)`` (the last takes
    the rest); each chunk is dealt to 10 workers (fewer in the last chunk) by the FedML rule without
    further shuffling (classes ``0..n_classes-1``, cap ``chunk / workers``), redrawn until every worker has
    ``>= int(0.5 * chunk / workers)``. The workers' lists, concatenated in order, are re-cut into ``clients``
    consecutive pieces of equal size (the first ``N mod clients`` one larger).
    Drops: nothing (CLIP2FL drops a chunk of fewer than 2 samples per worker; fedfeat refuses such input).
    Needs >= 10 clients, like the reference.
    """
    labels = _labels(labels)
    n = len(labels)
    n_cls = _n_classes(labels, n_classes)
    n_clients = _clients(n_clients, n)
    if n_clients < _AUX_WORKERS:
        raise FedfeatError(
            f"dirichlet-equal needs >= {_AUX_WORKERS} clients (CLIP2FL deals each chunk to "
            f"{_AUX_WORKERS} workers), got {n_clients}; use clients >= {_AUX_WORKERS} or scheme 'dirichlet'"
        )
    if not _chunks_fit(n, n_clients):
        fits = [c for c in range(_AUX_WORKERS, n_clients) if _chunks_fit(n, c)]
        fix = f"use at most {fits[-1]} clients" if fits else "use scheme 'dirichlet' or more samples"
        raise FedfeatError(
            f"dirichlet-equal: {n} samples leave a chunk with under 2 samples per client for {n_clients} "
            f"clients (CLIP2FL would silently drop it); {fix}"
        )
    alpha = _alpha(alpha)
    rs = np.random.RandomState(_seed(seed))

    items = np.argsort(labels, kind="stable")  # class-major (position, label) list
    perm = np.arange(n)
    rs.shuffle(perm)  # the same swaps as shuffling the list of (position, label) tuples
    items = items[perm]
    item_labels = labels[items]

    # Every chunk's class lists at once (``chunk[chunk_labels == c]``: a stable sort by (chunk, class)), and its
    # workers' lists gathered for all chunks by one stable sort at the end (worker j of chunk k: piece j of class
    # 0, then of class 1, ...): the same lists as the reference's per-chunk loops, in O(N) numpy calls, not
    # O(chunks x classes) -- 100,000 clients are 10,000 chunks.
    chunks = _chunks(n, n_clients)
    chunk_of = np.repeat(np.arange(len(chunks)), [hi - lo for lo, hi, _ in chunks])
    by_chunk_class = items[np.argsort(chunk_of * n_cls + item_labels, kind="stable")]
    class_counts = np.bincount(chunk_of * n_cls + item_labels, minlength=len(chunks) * n_cls)
    owner_parts = []  # per chunk: the global worker of each item of by_chunk_class, in that order
    first_worker = 0
    for k, (lo, hi, n_w) in enumerate(chunks):
        size = hi - lo
        need = int(0.50 * size / n_w)
        counts = class_counts[k * n_cls : (k + 1) * n_cls]
        cap = size / n_w
        alphas = np.repeat(alpha, n_w)
        for _ in range(_MAX_DRAWS):
            held = np.zeros(n_w, dtype=np.int64)
            pieces = []
            # one Dirichlet draw per class, as the reference's loop: drawn together (legacy ``dirichlet`` with a
            # size draws its rows one after another from the same stream: the same numbers)
            draws = rs.dirichlet(alphas, size=n_cls)
            for c in range(n_cls):
                sizes = _cut(draws[c], held, cap, int(counts[c]))
                held += sizes
                pieces.append(sizes)
            if held.min() >= need:
                break
        else:
            raise FedfeatError(
                f"dirichlet-equal: no draw in {_MAX_DRAWS} gave all {n_w} workers of a chunk >= {need} "
                f"samples at alpha={alpha}; use a larger alpha or fewer clients"
            )
        owner_parts.append(first_worker + np.repeat(np.tile(np.arange(n_w), n_cls), np.concatenate(pieces)))
        first_worker += n_w
    flat = by_chunk_class[np.argsort(np.concatenate(owner_parts), kind="stable")]
    per, extra = divmod(n, n_clients)
    bounds = np.concatenate(([0], np.cumsum([per + 1] * extra + [per] * (n_clients - extra))))
    return [flat[a:b].astype(np.int64) for a, b in itertools.pairwise(bounds)]


def longtail_counts(n_samples: int, n_classes: int, imbalance_factor: float) -> list[int]:
    """Samples kept per class: ``int(N / C * (1 / IF) ** (c / (C - 1)))`` (CLIP2FL ``_get_img_num_per_cls``).

    >>> longtail_counts(50000, 10, 100)
    [5000, 2997, 1796, 1077, 645, 387, 232, 139, 83, 50]
    """
    code_factor = 1.0 / imbalance_factor  # CLIP2FL's imb_factor: 0.01 for "IF 100" (1 / 100 == 0.01 exactly)
    img_max = n_samples / n_classes
    return [int(img_max * (code_factor ** (c / (n_classes - 1.0)))) for c in range(n_classes)]


def longtail(
    labels, imbalance_factor: float, seed: int = CLIP2FL_SEED, n_classes: int | None = None
) -> np.ndarray:
    """Positions kept by the exponential long-tail profile, class 0 the head (CLIP2FL ``train_long_tail``).

    Source: ``shijiangming1/CLIP2FL`` ``Dataset/long_tailed_cifar10.py`` (imb_type 'exp'), run after
    ``np.random.seed(seed)``. ``imbalance_factor`` is the usual ``>= 1`` ratio head / tail (100 here is
    CLIP2FL's ``--imb_factor 0.01``). Class c keeps ``longtail_counts(N, C, IF)[c]`` samples: its positions
    (dataset order) are shuffled and the first ones kept. Returns the kept positions int64, class-major and
    in that shuffled order (CLIP2FL's per-class lists, concatenated): the order ``dirichlet_equal`` needs.
    Drops: all but the kept ones. ``n_classes`` defaults to ``labels.max() + 1``.
    """
    labels = _labels(labels)
    n_cls = _n_classes(labels, n_classes)
    try:
        factor = float(imbalance_factor)
    except (TypeError, ValueError):
        factor = float("nan")
    if not (factor >= 1 and math.isfinite(factor)):
        raise FedfeatError(
            f"imbalance factor must be a finite number >= 1 (head / tail ratio; got {imbalance_factor!r}); "
            "pass e.g. imbalance_factor=100 (CLIP2FL's 0.01 is 100 here)"
        )
    if n_cls < 2:
        raise FedfeatError("longtail needs at least 2 classes; drop the imbalance factor for this split")
    rs = np.random.RandomState(_seed(seed))
    counts = longtail_counts(len(labels), n_cls, factor)
    kept = []
    for idx, n_c in zip(_by_class(labels, n_cls), counts):
        idx = idx.copy()
        rs.shuffle(idx)
        kept.append(idx[:n_c])
    return np.concatenate(kept).astype(np.int64)


def disjoint_classes(
    labels,
    n_clients: int,
    shots: int,
    seed: int = FEDMP_SEED,
    n_classes: int | None = None,
    order=None,
) -> tuple[list[np.ndarray], np.ndarray]:
    """Fed-MP's base/novel split: disjoint classes per client, ``shots`` samples of each.

    Source: ``huiminzeng/Fed-MP`` ``dataset/utils.py`` (``caltech_split_clients``). ``C // (clients + 1)``
    classes per client. Client i draws from ``RandomState(seed + i + 1)`` (Fed-MP calls
    ``np.random.seed(i + 1)`` for Caltech101, Food101 and Flowers102, so the default ``seed=0`` matches those;
    ``seed=-1`` gives its FGVC/UCF convention ``i``, ``seed=1`` its Cars convention ``i + 2``): first its
    classes from the remaining ones (sorted), without replacement, then for each drawn class, in draw order,
    ``shots`` of its positions (dataset order) without replacement; a class with fewer than ``shots`` samples
    gives all of them (Fed-MP's UCF fallback). Returns (clients, novel class ids): the classes no client drew,
    sorted; they are the unseen test classes.

    The draws pick *positions* in a class list: the code's own list (sorted folder names, Flowers' 1..102, ...).
    ``order`` (a permutation of the class ids, default ``0 .. C-1``) is that list: position j is class
    ``order[j]`` (``fedfeat.partition.openvocab.preset_class_order`` makes it from a preset's class names), so
    that the same classes are drawn whatever order a store's labels are in.
    Drops: every sample of a novel class and all but ``shots`` of each client class.
    """
    labels = _labels(labels)
    n_cls = _n_classes(labels, n_classes)
    n_clients = _int("clients", n_clients, 1, "use at least one client")
    shots = _int("shots", shots, 1, "pass the samples per class, e.g. shots=10")
    seed = _seed(seed, lowest=-1, highest=_SEED_MAX - n_clients)
    if order is None:
        order = np.arange(n_cls, dtype=np.int64)
    order = np.asarray(order)
    if order.shape != (n_cls,) or not np.array_equal(np.sort(order), np.arange(n_cls)):
        raise FedfeatError(
            f"disjoint-classes: the class order must be a permutation of the {n_cls} class ids (got shape "
            f"{order.shape}); pass each class id once"
        )
    per_client = n_cls // (n_clients + 1)
    if per_client < 1:
        raise FedfeatError(
            f"disjoint-classes: {n_cls} classes cannot give {n_clients} clients a class each and keep novel "
            f"classes; use at most {n_cls - 1} clients"
        )
    per_class = _by_class(labels, n_cls)
    remaining = list(range(n_cls))  # positions in the class list
    clients = []
    for i in range(n_clients):
        rs = np.random.RandomState(seed + i + 1)
        drawn = rs.choice(remaining, per_client, replace=False).tolist()
        remaining = sorted(set(remaining) - set(drawn))
        picked = []
        for j in drawn:
            pool = per_class[int(order[j])]
            picked.append(rs.choice(pool, shots, replace=False) if len(pool) >= shots else pool)
        clients.append(np.concatenate(picked).astype(np.int64))
    return clients, np.sort(order[remaining]).astype(np.int64)

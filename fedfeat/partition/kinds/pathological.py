"""``pathological``: k classes per client, each class's samples cut among its clients in uniform(0.4, 0.6)
proportions (FedOTP's and FedPGP's pathological non-IID split of CIFAR-10 / CIFAR-100, ``noniid-labeluni``).

Source, read in the stored copies of the public repositories:

- FedOTP, ``HongxiaLee/FedOTP`` @ 9948611 (``utils/datasplit.py`` of the code release 506d68c),
  ``partition_data``, branch ``partition == "noniid-labeluni"``; called from ``datasets/cifar10.py`` /
  ``datasets/cifar100.py`` with ``cfg.DATASET.USERS`` clients. ``federated_main.py`` seeds ``random``,
  ``np.random`` and torch with ``--seed`` (default 1; Dassl ``set_random_seed``) before ``build_trainer`` builds
  the dataset, and nothing draws from ``random`` / ``np.random`` in between: default seed ``FEDOTP_SEED = 1``.
- FedPGP, ``TianyuCuiOvO/FedPGP`` @ d43045b, ``datasplit.py`` and ``datasets/datasplit.py`` (ba16025): the same
  branch, line for line. Its ``--seed`` defaults to 0, which leaves the generators unseeded (``if args.seed:``).

The reference, per dataset ``num`` = 2 classes per client on CIFAR-10 and 10 on CIFAR-100 (hard-coded; here
``classes_per_client``, default 2), ``K`` classes, asserts ``num x clients % K == 0`` and then:

1. for each class ``0..K-1``: ``p = np.random.uniform(0.4, 0.6, size=num x clients / K)``, normalised;
2. for each client in turn, ``num`` times: ``np.random.choice`` among the classes with the most unassigned
   client slots, which loses one slot; the client takes its classes' proportions with ``list.pop()`` (last first);
3. each class's positions (dataset order, ``np.where``) are shuffled with python ``random.shuffle``: every train
   class, then every test class;
4. client by client, class by class: the client takes the first ``int(N_c x p)`` of what is left of class ``c``.

The draws here are the same calls in the same order on a private ``np.random.RandomState(seed)`` and
``random.Random(seed)``: checked bit for bit against a transcription of the branch
(``tests/test_partition_pathological.py``). Not checked: the paper's text (FedOTP, CVPR 2024; FedPGP, ICML 2024)
was not in the stored sources beyond FedOTP's abstract, so that "pathological non-IID" in their tables is this
branch is read from the code (its ``--partition`` help lists ``homo``, ``noniid-labeluni``, ``noniid-labeldir``,
``noniid-labeldir100``, and this is its one k-classes-per-client split), not from the paper. Their Dassl
``generate_federated_dataset`` (the CLIP datasets: disjoint ``round(C / clients)`` classes per client after
``random.seed(2023)``) is another split, not this one.

Drops: the ``N_c - sum_j int(N_c x p_j)`` samples of each class left after the cuts (a few per class), and every
sample of a class no client drew. Each client holds exactly ``k`` distinct classes when ``k`` divides the number of
classes (the draws deal the classes round by round); otherwise a client whose ``k`` draws straddle two rounds may
draw a class twice (then it takes two pieces of it and holds fewer classes), as in the reference.
With the test labels (``make_partition(test_labels=...)``; a store's test split), the test split is cut with the
same classes and proportions (the reference's ``net_dataidx_map_test``): ``params["test_clients"]``.
"""

import random
from dataclasses import dataclass, field

import numpy as np

from fedfeat.errors import FedfeatError
from fedfeat.partition.registry import Draw, KeyPart, Scheme, register_scheme
from fedfeat.partition.schemes import _clients, _int, _labels, _n_classes, _seed

FEDOTP_SEED = 1  # FedOTP federated_main.py: --seed default 1 -> set_random_seed(1) (random, np.random, torch)


def _at_least_one(v) -> str | None:
    return None if v >= 1 else f"must be >= 1, got {v} (FedOTP: 2 on CIFAR-10, 10 on CIFAR-100)"


CLASSES_PER_CLIENT = {
    "help": "k classes per client (FedOTP/FedPGP pathological non-IID)",
    "example": "2",
    "check": _at_least_one,
}


def pathological(
    labels,
    n_clients: int,
    classes_per_client: int = 2,
    seed: int = FEDOTP_SEED,
    n_classes=None,
    test_labels=None,
) -> tuple[list[np.ndarray], list[np.ndarray] | None]:
    """FedOTP / FedPGP ``noniid-labeluni`` (module docstring): ``(train clients, test clients or None)``, each
    client's int64 positions in the order the reference appends them (class by class)."""
    labels = _labels(labels)
    n_clients = _clients(n_clients, len(labels))
    k = _int("classes_per_client", classes_per_client, 1, "give each client at least one class, e.g. 2")
    K = _n_classes(labels, n_classes)
    if k > K:
        raise FedfeatError(f"pathological: {k} classes per client but the split has {K}; use at most {K}")
    if (k * n_clients) % K:
        raise FedfeatError(
            f"pathological: classes_per_client x clients = {k} x {n_clients} = {k * n_clients} is not a multiple "
            f"of the {K} classes; choose clients and classes_per_client so that their product is a multiple of {K}"
        )
    rs = np.random.RandomState(_seed(seed))
    py = random.Random(seed)
    slots = k * n_clients // K  # count_per_class
    probs = []
    for _ in range(K):
        p = rs.uniform(0.4, 0.6, size=slots)
        probs.append((p / p.sum()).tolist())
    left = [slots] * K
    drawn, shares = [], []
    for _ in range(n_clients):
        mine = []
        for _ in range(k):
            most = np.where(np.array(left) == max(left))[0]
            mine.append(int(rs.choice(most)))
            left[mine[-1]] -= 1
        drawn.append(mine)
        shares.append([probs[c].pop() for c in mine])

    def cut(split_labels) -> list[np.ndarray]:
        by_class = [np.where(split_labels == c)[0] for c in range(K)]
        sizes = [len(idx) for idx in by_class]
        for idx in by_class:
            order = list(range(len(idx)))  # the swaps python's shuffle makes, whatever is being shuffled
            py.shuffle(order)
            idx[:] = idx[order]
        out = []
        for mine, ps in zip(drawn, shares):
            got = []
            for c, p in zip(mine, ps):
                end = int(sizes[c] * p)
                got.append(by_class[c][:end])
                by_class[c] = by_class[c][end:]
            out.append(np.concatenate(got).astype(np.int64))
        return out

    train = cut(labels)
    return train, None if test_labels is None else cut(_labels(test_labels))


@register_scheme
class Pathological(Scheme):
    name = "pathological"
    summary = "k classes per client, uniform(0.4, 0.6) shares of each class (FedOTP / FedPGP)"
    source = "FedOTP / FedPGP partition_data 'noniid-labeluni' (HongxiaLee/FedOTP utils/datasplit.py)"
    order = 70
    seed = FEDOTP_SEED
    uses_test_labels = True

    @dataclass(frozen=True)
    class Params:
        # the reference's num: 2 on CIFAR-10 (our default), 10 on CIFAR-100 (reference code)
        classes_per_client: int = field(default=2, metadata=CLASSES_PER_CLIENT)

    key_parts = (KeyPart("classes_per_client", "k", "{} classes per client"),)
    words = "pathological, {classes_per_client} classes per client"

    @classmethod
    def draw(cls, d: Draw, params):
        train, test = pathological(
            d.labels,
            d.clients,
            params.classes_per_client,
            d.seed,
            n_classes=d.n_classes,
            test_labels=d.test_labels,
        )
        return train, {} if test is None else {"test_clients": [t.tolist() for t in test]}

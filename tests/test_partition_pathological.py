"""``pathological`` (FedOTP / FedPGP ``noniid-labeluni``): bit for bit against a transcription of the reference branch,
and hand-countable cases."""

from __future__ import annotations

import random
from collections import defaultdict

import numpy as np
import pytest

from fedfeat.errors import FedfeatError
from fedfeat.partition import make_partition, partition_key
from fedfeat.partition.kinds.pathological import FEDOTP_SEED, pathological
from fedfeat.report.plots import readable_partition


def reference_labeluni(y_train, y_test, n_parties, num, K):
    """``HongxiaLee/FedOTP`` ``utils/datasplit.py`` ``partition_data``, ``partition == "noniid-labeluni"`` (the same
    lines in ``TianyuCuiOvO/FedPGP`` ``datasplit.py``), with ``num`` and ``K`` as parameters instead of the
    per-dataset constants (cifar10: 2 and 10; cifar100: 10 and 100). Global ``np.random`` and ``random``, seeded by
    the caller as Dassl's ``set_random_seed`` does. Returns (train map, test map)."""
    assert (num * n_parties) % K == 0, "equal classes appearance is needed"
    count_per_class = (num * n_parties) // K
    class_dict = {}
    for i in range(K):
        # sampling alpha_i_c
        probs = np.random.uniform(0.4, 0.6, size=count_per_class)
        # normalizing
        probs_norm = (probs / probs.sum()).tolist()
        class_dict[i] = {"count": count_per_class, "prob": probs_norm}

    class_partitions = defaultdict(list)
    for i in range(n_parties):  # noqa: B007 (as in the reference)
        c = []
        for _ in range(num):
            class_counts = [class_dict[i]["count"] for i in range(K)]
            max_class_counts = np.where(np.array(class_counts) == max(class_counts))[0]
            c.append(np.random.choice(max_class_counts))
            class_dict[c[-1]]["count"] -= 1
        class_partitions["class"].append(c)
        class_partitions["prob"].append([class_dict[i]["prob"].pop() for i in c])

    data_class_idx_train = {i: np.where(y_train == i)[0] for i in range(K)}
    data_class_idx_test = {i: np.where(y_test == i)[0] for i in range(K)}
    num_samples_train = {i: len(data_class_idx_train[i]) for i in range(K)}
    num_samples_test = {i: len(data_class_idx_test[i]) for i in range(K)}
    for data_idx in data_class_idx_train.values():
        random.shuffle(data_idx)
    for data_idx in data_class_idx_test.values():
        random.shuffle(data_idx)

    net_dataidx_map_train = {i: np.ndarray(0, dtype=np.int64) for i in range(n_parties)}
    net_dataidx_map_test = {i: np.ndarray(0, dtype=np.int64) for i in range(n_parties)}
    for usr_i in range(n_parties):
        for c, p in zip(class_partitions["class"][usr_i], class_partitions["prob"][usr_i]):
            end_idx_train = int(num_samples_train[c] * p)
            end_idx_test = int(num_samples_test[c] * p)
            net_dataidx_map_train[usr_i] = np.append(
                net_dataidx_map_train[usr_i], data_class_idx_train[c][:end_idx_train]
            )
            net_dataidx_map_test[usr_i] = np.append(
                net_dataidx_map_test[usr_i], data_class_idx_test[c][:end_idx_test]
            )
            data_class_idx_train[c] = data_class_idx_train[c][end_idx_train:]
            data_class_idx_test[c] = data_class_idx_test[c][end_idx_test:]
    return net_dataidx_map_train, net_dataidx_map_test


def _reference(y_train, y_test, n_parties, num, K, seed):
    random.seed(seed)  # Dassl set_random_seed
    np.random.seed(seed)
    return reference_labeluni(y_train, y_test, n_parties, num, K)


def _shuffled(counts, seed):
    return np.random.RandomState(seed).permutation(np.repeat(np.arange(len(counts)), counts))


CASES = [  # (train class counts, test class counts, clients, k, seed)
    ([50] * 10, [10] * 10, 10, 2, FEDOTP_SEED),  # CIFAR-10's setting, scaled down
    ([30] * 10, [7] * 10, 20, 2, 0),
    ([40, 35, 30, 25, 20, 15], [9, 8, 7, 6, 5, 4], 4, 3, 123),  # uneven classes; 3 x 4 = 2 x 6
    ([20] * 20, [5] * 20, 10, 10, 7),  # CIFAR-100's k = 10 (C / 10 of the classes), scaled down
    (
        [25] * 10,
        [6] * 10,
        10,
        3,
        2024,
    ),  # k does not divide C: a client may draw a class twice (as the reference)
]


@pytest.mark.parametrize(("train", "test", "clients", "k", "seed"), CASES)
def test_bit_identical_to_the_reference(train, test, clients, k, seed):
    y, yt = _shuffled(train, 1), _shuffled(test, 2)
    ref_train, ref_test = _reference(y, yt, clients, k, len(train), seed)
    ours, ours_test = pathological(y, clients, k, seed, test_labels=yt)
    assert [o.tolist() for o in ours] == [ref_train[i].astype(np.int64).tolist() for i in range(clients)]
    assert [o.tolist() for o in ours_test] == [ref_test[i].astype(np.int64).tolist() for i in range(clients)]
    # through make_partition: the same train clients, test clients in the params, the default seed FedOTP's 1
    p = make_partition(y, "pathological", clients=clients, classes_per_client=k, seed=seed, test_labels=yt)
    assert [c.tolist() for c in p.clients] == [o.tolist() for o in ours]
    assert p.params["test_clients"] == [o.tolist() for o in ours_test]


def test_default_seed_and_k_are_fedotp_cifar10():
    y = _shuffled([50] * 10, 3)
    p = make_partition(y, "pathological", clients=10)
    ref, _ = _reference(y, y[:0], 10, 2, 10, 1)
    assert p.params["seed"] == 1 and p.params["classes_per_client"] == 2
    assert [c.tolist() for c in p.clients] == [ref[i].astype(np.int64).tolist() for i in range(10)]
    assert partition_key(p) == "pathological-k2-c10-s1"
    assert readable_partition(partition_key(p)) == "pathological, 2 classes per client, 10 clients"
    assert "test_clients" not in p.params  # no test labels given: the train split only


def test_hand_countable_every_client_holds_k_classes():
    """4 classes x 100 samples, 4 clients, k = 2: 2 x 4 / 4 = 2 slots per class, so every class goes to exactly 2
    clients, and (k = 2 divides C = 4: each client's two picks lie in one round of 4 distinct classes) every client
    holds 2 distinct classes. A class's two shares are u / (u + v) and v / (u + v) with u, v in [0.4, 0.6]: each in
    [0.4, 0.6], so a piece holds int(100 x share) in [40, 60] samples and the two pieces 99 or 100."""
    y = np.repeat(np.arange(4), 100)
    p = make_partition(y, "pathological", clients=4, classes_per_client=2, seed=0)
    counts = p.counts(y, 4)  # [clients, classes]
    assert ((counts > 0).sum(axis=1) == 2).all()  # every client: 2 classes
    assert ((counts > 0).sum(axis=0) == 2).all()  # every class: 2 clients
    assert set(counts.sum(axis=0).tolist()) <= {99, 100}  # int() drops less than 1 per piece
    held = counts[counts > 0]
    assert held.min() >= 40 and held.max() <= 60
    flat = np.concatenate(p.clients)
    assert len(np.unique(flat)) == len(flat) == int(p.sizes().sum())  # each sample at most once


def test_k_dividing_c_gives_exactly_k_distinct_classes():
    """C = 10, k = 2, 20 clients: the classes are dealt in rounds of 10 distinct picks and each client's 2 picks lie
    in one round, so every client holds exactly 2 classes, every class 4 clients; sizes int(60 x p)."""
    y = np.repeat(np.arange(10), 60)
    for seed in (0, 1, 5):
        p = make_partition(y, "pathological", clients=20, classes_per_client=2, seed=seed)
        counts = p.counts(y, 10)
        assert ((counts > 0).sum(axis=1) == 2).all()
        assert ((counts > 0).sum(axis=0) == 4).all()
        # a class's 4 shares are u_i / sum(u), u in [0.4, 0.6]: each in [0.4 / 2.2, 0.6 / 1.8] of 60 = [10.9, 20]
        assert counts[counts > 0].min() >= 10 and counts.max() <= 20


def test_bad_settings_are_one_line():
    y = np.repeat(np.arange(10), 20)
    for kw, fix in (
        ({"clients": 3, "classes_per_client": 2}, "multiple of the 10 classes"),
        ({"clients": 5, "classes_per_client": 11}, "use at most 10"),
        ({"clients": 5, "classes_per_client": 0}, "at least one class"),
        ({"clients": 5, "alpha": 0.5}, "alpha does not apply to scheme 'pathological'"),
    ):
        with pytest.raises(FedfeatError, match=fix) as e:
            make_partition(y, "pathological", **kw)
        assert "\n" not in str(e.value)

"""Test oracle: the reference partition algorithms, re-expressed step by step. Not part of fedfeat.

Each function below makes the same random calls, on the same *global* generators (``np.random`` and
``random``), in the same order, on the same data structures (python lists where the reference uses lists)
as the function it stands for, so that ``fedfeat.partition.schemes`` can be checked against it bit for bit. They
are written plainly, without any of fedfeat's vectorisation, and do nothing but what the reference does
(no input checks; printing left out).

Sources (read through the stored copies of the public repositories):

- FedNTD, ``Lee-Gihun/FedNTD``, ``train_tools/preprocessing/datasetter.py`` (commits fd7e20c and 0d00e65;
  same partition code; repository HEAD be00ee5): ``iid_partition``, ``sharding_partition``,
  ``lda_partition`` + ``partition_class_samples_with_dirichlet_distribution``. FedNTD's ``main.py`` calls
  ``np.random.seed(19940817); random.seed(19940817)`` before partitioning.
- CLIP2FL, ``shijiangming1/CLIP2FL`` @ 9db63f3, ``Dataset/long_tailed_cifar10.py`` (``train_long_tail``,
  ``_get_img_num_per_cls``, imb_type 'exp'), ``Dataset/sample_dirichlet.py`` (``clients_indices``,
  ``build_non_iid_by_dirichlet``, ``partition_balance``), ``Dataset/dataset.py`` (``classify_label``).
  ``main.py`` seeds ``np.random.seed(7)`` before ``train_long_tail``; ``clients_indices`` makes its own
  ``np.random.RandomState(seed)``. The same code is in CReFF (``shangxinyi/CReFF-FL``).
- Fed-MP, ``huiminzeng/Fed-MP`` @ 92c9d66, ``dataset/utils.py`` (``caltech_split_clients``: per client
  ``np.random.seed(i + 1)``, classes then shots drawn with ``np.random.choice(..., replace=False)``), here on
  class ids and positions instead of folder names and file paths.
"""

import functools
import math
import random

import numpy as np

# --------------------------------------------------------------------------------------------- FedNTD


def iid_partition(all_targets, n_clients):
    """FedNTD ``iid_partition``: shuffle what is left, give the next client the first N // n of it."""
    length = int(len(all_targets) / n_clients)
    remaining = np.arange(len(all_targets))
    out = {}
    for client in range(n_clients):
        np.random.shuffle(remaining)
        out[client] = np.array(remaining[:length])
        remaining = remaining[length:]
    return out


def sharding_partition(all_targets, n_clients, shard_per_user):
    """FedNTD ``sharding_partition`` (train split: ``rand_set_all`` drawn here). Returns (map, rand_set_all)."""
    by_label = {}  # label -> list of positions, labels in order of first appearance
    for pos in range(len(all_targets)):
        by_label.setdefault(int(all_targets[pos]), []).append(pos)
    num_classes = len(np.unique(all_targets))
    shard_per_class = int(shard_per_user * n_clients / num_classes)

    for label, x in by_label.items():
        n_left = len(x) % shard_per_class
        leftover = x[-n_left:] if n_left > 0 else []
        body = np.array(x[:-n_left]) if n_left > 0 else np.array(x)
        shards = list(body.reshape((shard_per_class, -1)))
        for i, pos in enumerate(leftover):
            shards[i] = np.concatenate([shards[i], [pos]])
        by_label[label] = shards

    rand_set_all = list(range(num_classes)) * shard_per_class
    random.shuffle(rand_set_all)
    rand_set_all = np.array(rand_set_all).reshape((n_clients, -1))

    out = {}
    for client in range(n_clients):
        picked = []
        for label in rand_set_all[client]:
            k = np.random.choice(len(by_label[label]), replace=False)
            picked.append(by_label[label].pop(k))
        out[client] = np.concatenate(picked).astype("int")
    return out, rand_set_all


def _fedml_class_split(N, alpha, client_num, idx_batch, idx_k):
    """FedNTD ``partition_class_samples_with_dirichlet_distribution``."""
    np.random.shuffle(idx_k)
    proportions = np.random.dirichlet(np.repeat(alpha, client_num))
    proportions = np.array([p * (len(idx_j) < N / client_num) for p, idx_j in zip(proportions, idx_batch)])
    proportions = proportions / proportions.sum()
    proportions = (np.cumsum(proportions) * len(idx_k)).astype(int)[:-1]
    idx_batch = [idx_j + idx.tolist() for idx_j, idx in zip(idx_batch, np.split(idx_k, proportions))]
    return idx_batch, min(len(idx_j) for idx_j in idx_batch)


def lda_partition(all_targets, n_clients, alpha):
    """FedNTD ``lda_partition``: per-class Dirichlet with the N/n cap, redrawn until every client has >= 10."""
    all_targets = np.asarray(all_targets)
    min_size = 0
    while min_size < 10:
        idx_batch = [[] for _ in range(n_clients)]
        N, K = len(all_targets), len(np.unique(all_targets))
        for k in range(K):
            idx_k = np.where(all_targets == k)[0]
            idx_batch, min_size = _fedml_class_split(N, alpha, n_clients, idx_batch, idx_k)
    out = {}
    for client in range(n_clients):
        np.random.shuffle(idx_batch[client])
        out[client] = idx_batch[client]
    return out


# --------------------------------------------------------------------------------------------- CLIP2FL


def classify_label(labels, num_classes):
    """CLIP2FL ``classify_label``: per-class position lists in dataset order."""
    lists = [[] for _ in range(num_classes)]
    for pos, label in enumerate(labels):
        lists[int(label)].append(pos)
    return lists


def train_long_tail(list_label2indices_train, num_classes, imb_factor):
    """CLIP2FL ``train_long_tail`` (imb_type 'exp'; ``imb_factor`` is the code's <= 1 form, 0.01 = 'IF 100').

    Shuffles each class list in place with the global ``np.random`` (the caller passes a deep copy, as
    CLIP2FL does). Returns (img_num_list, per-class kept lists).
    """
    img_max = sum(len(x) for x in list_label2indices_train) / num_classes
    img_num_list = [int(img_max * (imb_factor ** (c / (num_classes - 1.0)))) for c in range(num_classes)]
    kept = []
    for c, n_c in zip(range(num_classes), img_num_list):
        indices = list_label2indices_train[c]
        np.random.shuffle(indices)
        kept.append(indices[:n_c])
    return img_num_list, kept


def partition_balance(idxs, num_split):
    """CLIP2FL ``partition_balance``: consecutive pieces, the first ``len % num_split`` one longer."""
    per_part, r = len(idxs) // num_split, len(idxs) % num_split
    parts = []
    i, r_used = 0, 0
    while i < len(idxs):
        if r_used < r:
            parts.append(idxs[i : i + per_part + 1])
            i += per_part + 1
            r_used += 1
        else:
            parts.append(idxs[i : i + per_part])
            i += per_part
    return parts


def build_non_iid_by_dirichlet(seed, indices2targets, non_iid_alpha, num_classes, num_indices, n_workers):
    """CLIP2FL ``build_non_iid_by_dirichlet``: 10 auxiliary workers per chunk of the shuffled list."""
    random_state = np.random.RandomState(seed)
    n_auxi_workers = 10
    assert n_auxi_workers <= n_workers
    random_state.shuffle(indices2targets)

    num_splits = math.ceil(n_workers / n_auxi_workers)
    from_index = 0
    splitted = []
    for idx in range(num_splits):
        to_index = from_index + int(n_auxi_workers / n_workers * num_indices)
        splitted.append(indices2targets[from_index : (num_indices if idx == num_splits - 1 else to_index)])
        from_index = to_index

    idx_batch = []
    for targets in splitted:
        targets = np.array(targets)
        size = len(targets)
        n_w = min(n_auxi_workers, n_workers)
        n_workers = n_workers - n_auxi_workers
        min_size = 0
        batch = None
        while min_size < int(0.50 * size / n_w):
            batch = [[] for _ in range(n_w)]
            for c in range(num_classes):
                idx_class = targets[np.where(targets[:, 1] == c)[0], 0]
                try:  # kept as in the reference: numpy division never raises ZeroDivisionError
                    proportions = random_state.dirichlet(np.repeat(non_iid_alpha, n_w))
                    proportions = np.array(
                        [p * (len(idx_j) < size / n_w) for p, idx_j in zip(proportions, batch)]
                    )
                    proportions = proportions / proportions.sum()
                    proportions = (np.cumsum(proportions) * len(idx_class)).astype(int)[:-1]
                    batch = [
                        idx_j + idx.tolist() for idx_j, idx in zip(batch, np.split(idx_class, proportions))
                    ]
                    min_size = min(len(idx_j) for idx_j in batch)
                except ZeroDivisionError:
                    pass
        if batch is not None:
            idx_batch += batch
    return idx_batch


def clients_indices(list_label2indices, num_classes, num_clients, non_iid_alpha, seed=None):
    """CLIP2FL ``clients_indices``: class-major (index, label) list -> chunked Dirichlet -> equal re-cut."""
    indices2targets = []
    for label, indices in enumerate(list_label2indices):
        for idx in indices:
            indices2targets.append((idx, label))
    batch_indices = build_non_iid_by_dirichlet(
        seed=seed,
        indices2targets=indices2targets,
        non_iid_alpha=non_iid_alpha,
        num_classes=num_classes,
        num_indices=len(indices2targets),
        n_workers=num_clients,
    )
    flat = functools.reduce(lambda x, y: x + y, batch_indices)
    return partition_balance(flat, num_clients)


# --------------------------------------------------------------------------------------------- Fed-MP


def fedmp_split_clients(labels, n_classes, num_samples, num_users, seed_offset=1):
    """Fed-MP ``caltech_split_clients`` on class ids: ``np.random.seed(i + seed_offset)`` per client.

    Where a class has fewer than ``num_samples`` samples, all of them are taken (the UCF variant's fallback).
    Returns ({client: (classes, positions)}, novel classes).
    """
    labels = np.asarray(labels)
    all_categories = list(range(n_classes))
    classes_per_client = len(all_categories) // (num_users + 1)
    out = {}
    for i in range(num_users):
        np.random.seed(i + seed_offset)
        selected = np.random.choice(all_categories, classes_per_client, replace=False)
        all_categories = sorted(set(all_categories) - set(selected))
        samples_all = []
        for c in selected:
            pool = np.where(labels == c)[0]
            try:
                samples = np.random.choice(pool, num_samples, replace=False)
            except ValueError:
                samples = pool
            samples_all.extend(int(s) for s in samples)
        out[i] = ([int(c) for c in selected], samples_all)
    return out, all_categories

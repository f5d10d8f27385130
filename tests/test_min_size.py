"""``--min-size N``: the named reading of FedNTD's Dirichlet rule for settings whose minimum cannot be met (issue 30).

The hand-checked case: 8 samples (positions 0-3 class 0, 4-7 class 1), 4 clients, alpha 0.05, seed 0. The draws'
client sizes, in order, are [3, 0, 1, 4], [3, 0, 1, 4], [0, 3, 3, 2], [1, 2, 4, 1], ... (a port of FedNTD's
``lda_partition`` below, the loop's ``10`` made a parameter and run as "draw, then test"): min_size 0 takes the
first draw (client 1 empty), min_size 1 the fourth; each client's list is then shuffled.
"""

from __future__ import annotations

import numpy as np
import pytest

from fedfeat.errors import FedfeatError
from fedfeat.partition import make_partition, partition_key
from fedfeat.partition import schemes as S
from fedfeat.runs.config import RunConfig, validate_config
from tests.helpers_clip import cli_error_text, run_cli

TINY = np.array([0, 0, 0, 0, 1, 1, 1, 1])


def _port(labels, n_clients, alpha, seed, min_size, max_draws=10_000):
    """FedNTD ``lda_partition`` + ``partition_class_samples_with_dirichlet_distribution`` (Lee-Gihun/FedNTD
    ``train_tools/preprocessing/datasetter.py``) on a private RandomState, ``while min_size < 10`` made a
    do-while with the minimum as a parameter. Returns (clients, number of draws)."""
    rs = np.random.RandomState(seed)
    labels = np.asarray(labels)
    N = len(labels)
    for draw in range(1, max_draws + 1):  # noqa: B007 (the count is returned)
        idx_batch = [[] for _ in range(n_clients)]
        for k in range(len(np.unique(labels))):
            idx_k = np.where(labels == k)[0]
            rs.shuffle(idx_k)
            p = rs.dirichlet(np.repeat(alpha, n_clients))
            p = np.array([q * (len(b) < N / n_clients) for q, b in zip(p, idx_batch)])
            p = p / p.sum()
            cuts = (np.cumsum(p) * len(idx_k)).astype(int)[:-1]
            idx_batch = [b + i.tolist() for b, i in zip(idx_batch, np.split(idx_k, cuts))]
        if min(len(b) for b in idx_batch) >= min_size:
            break
    for b in idx_batch:
        rs.shuffle(b)
    return idx_batch, draw


def _lists(parts):
    return [np.asarray(p).tolist() for p in parts]


def test_hand_checked_tiny_case():
    first = _lists(S.dirichlet(TINY, 4, 0.05, seed=0, min_size=0))
    assert first == [[7, 4, 5], [], [6], [2, 1, 3, 0]]  # the first draw: sizes [3, 0, 1, 4]
    fourth = _lists(S.dirichlet(TINY, 4, 0.05, seed=0, min_size=1))
    assert fourth == [[5], [7, 6], [3, 1, 2, 0], [4]]  # draws 1-3 leave a client empty; draw 4: [1, 2, 4, 1]
    for m, want in ((0, first), (1, fourth)):
        assert _port(TINY, 4, 0.05, 0, m)[0] == want
    # make_partition refuses the empty client of min_size 0 and records the reading in key and params
    with pytest.raises(FedfeatError, match="clients got no samples"):
        make_partition(TINY, "dirichlet", clients=4, alpha=0.05, seed=0, min_size=0)
    p = make_partition(TINY, "dirichlet", clients=4, alpha=0.05, seed=0, min_size=1)
    assert _lists(p.clients) == fourth and p.params["min_size"] == 1
    assert partition_key(p) == "dirichlet-a0.05-c4-s0-m1"


def test_default_is_fedntd_bit_for_bit():
    """No min_size, and min_size=10 given, are FedNTD's rule: the same clients, params and key as before."""
    labels = np.repeat(np.arange(5), 60)
    ref, _ = _port(labels, 6, 0.3, S.FEDNTD_SEED, 10)
    a = make_partition(labels, "dirichlet", clients=6, alpha=0.3)
    b = make_partition(labels, "dirichlet", clients=6, alpha=0.3, min_size=10)
    assert _lists(a.clients) == _lists(b.clients) == ref
    assert a.params == b.params and "min_size" not in a.params
    assert partition_key(a) == partition_key(b) == "dirichlet-a0.3-c6-s19940817"
    c = make_partition(labels, "dirichlet", clients=6, alpha=0.3, min_size=1)
    assert partition_key(c) == "dirichlet-a0.3-c6-s19940817-m1"  # another reading never shares the key


def test_cifar10_alpha_005_column_reading():
    """The fst-cbdg-table2 column's setting (10 x 5,000 labels, 100 clients, alpha 0.05): min_size 1 is draw 21
    (sizes depend only on the class counts), every client non-empty; FedNTD's >= 10 is not met in 50 draws."""
    labels = np.repeat(np.arange(10), 5000)
    p = make_partition(labels, "dirichlet", clients=100, alpha=0.05, min_size=1)
    ref, draws = _port(labels, 100, 0.05, S.FEDNTD_SEED, 1)
    assert draws == 21 and _lists(p.clients) == ref
    sizes = p.sizes()
    assert sizes.min() >= 1 and sizes.sum() == 50_000
    assert np.array_equal(np.sort(np.concatenate(p.clients)), np.arange(50_000))


def test_unmeetable_minimum_is_one_line_naming_the_switch(monkeypatch):
    monkeypatch.setattr(S, "_MAX_DRAWS", 5)
    with pytest.raises(FedfeatError, match=r"no draw in 5 gave all 4 clients >= 2 samples.*--min-size") as e:
        S.dirichlet(TINY, 4, 0.05, seed=0, min_size=2)  # only [2, 2, 2, 2] meets it
    assert "\n" not in str(e.value)


def test_bad_settings():
    with pytest.raises(FedfeatError, match="min_size applies to scheme 'dirichlet' only"):
        make_partition(TINY, "iid", clients=2, min_size=1)
    with pytest.raises(FedfeatError, match="min_size must be >= 0"):
        make_partition(TINY, "dirichlet", clients=2, alpha=0.5, min_size=-1)
    with pytest.raises(FedfeatError, match="min_size must be an integer"):
        make_partition(TINY, "dirichlet", clients=2, alpha=0.5, min_size=1.5)
    with pytest.raises(FedfeatError, match="--min-size must be >= 0"):
        validate_config(RunConfig(partition="dirichlet", min_size=-1))
    with pytest.raises(FedfeatError, match="--min-size applies to --partition dirichlet only"):
        validate_config(RunConfig(partition="shard", min_size=1))


def test_cli_flag(tmp_path):
    r = run_cli(["train", "--partition", "shard", "--min-size", "1", "--out", str(tmp_path)])
    assert "--min-size applies to --partition dirichlet only" in cli_error_text(r)

"""fedfeat.partition.schemes: bit-for-bit agreement with the reference codes, and the numbers they are known for.

The oracle (``reference_partitions``) runs the reference algorithms on the *global* numpy / python
generators, seeded the way the reference codes seed them; fedfeat uses private generators. Equal
outputs therefore also show that the private streams are the reference's streams.
"""

import copy
import json
import math
import random
from unittest import mock

import numpy as np
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

import fedfeat.partition as P
import fedfeat.partition.core as C
import fedfeat.partition.schemes as S
from fedfeat.errors import FedfeatError

try:
    from tests import reference_partitions as ref
except ImportError:  # tests/ itself is on sys.path (pytest's rootdir-relative import)
    import reference_partitions as ref

# The references divide 0 by 0 when every client is capped or a Dirichlet draw underflows; so do we.
pytestmark = pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")

# CIFAR-10 / CIFAR-100 shaped training labels, in a shuffled "dataset order" as in the real files.
CIFAR10 = np.random.RandomState(0).permutation(np.repeat(np.arange(10), 5000))
CIFAR100 = np.random.RandomState(1).permutation(np.repeat(np.arange(100), 500))
# Small, uneven: class sizes 37, 12, 50, 3, 28 (none divisible by the shard counts used below).
UNEVEN = np.random.RandomState(2).permutation(np.repeat(np.arange(5), [37, 12, 50, 3, 28]))


def seeded(seed):
    """Seed the global generators the way FedNTD's main.py does (CLIP2FL seeds numpy only; same thing)."""
    np.random.seed(seed)
    random.seed(seed)


def assert_same_clients(ours, theirs):
    theirs = list(theirs.values()) if isinstance(theirs, dict) else list(theirs)
    assert len(ours) == len(theirs)
    for i, (a, b) in enumerate(zip(ours, theirs)):
        assert a.dtype == np.int64
        np.testing.assert_array_equal(a, np.asarray(b, dtype=np.int64), err_msg=f"client {i}")


def assert_exactly_once(clients, expected_kept):
    """No position twice, and together the clients hold exactly ``expected_kept``."""
    flat = np.concatenate(clients) if clients else np.zeros(0, np.int64)
    assert len(np.unique(flat)) == len(flat), "a sample is held twice"
    np.testing.assert_array_equal(np.sort(flat), np.sort(np.asarray(expected_kept)))


def clip2fl_longtail(labels, n_classes, imbalance_factor, seed=P.CLIP2FL_SEED):
    """CLIP2FL main.py: np.random.seed(7); train_long_tail(deepcopy(classify_label(...)), ..., 1/IF)."""
    np.random.seed(seed)
    _, kept = ref.train_long_tail(
        copy.deepcopy(ref.classify_label(labels, n_classes)), n_classes, 1 / imbalance_factor
    )
    return kept


# ----------------------------------------------------------------------------- equality with the references


@pytest.mark.parametrize(
    ("labels", "n_clients", "seed"),
    [(CIFAR10, 100, P.FEDNTD_SEED), (CIFAR10, 7, 3), (UNEVEN, 6, P.FEDNTD_SEED), (UNEVEN, 130, 0)],
)
def test_iid_equals_fedntd(labels, n_clients, seed):
    seeded(seed)
    theirs = ref.iid_partition(labels, n_clients)
    assert_same_clients(P.iid(labels, n_clients, seed), theirs)


@pytest.mark.parametrize(
    ("labels", "n_clients", "shards", "seed"),
    [
        (CIFAR10, 100, 2, P.FEDNTD_SEED),
        (CIFAR10, 100, 5, 11),
        (CIFAR100, 100, 10, P.FEDNTD_SEED),
        (UNEVEN, 10, 3, P.FEDNTD_SEED),  # 6 shards per class: leftovers appended, class 3 has empty shards
        (UNEVEN, 5, 1, 5),
    ],
)
def test_shard_equals_fedntd(labels, n_clients, shards, seed):
    seeded(seed)
    theirs, _ = ref.sharding_partition(labels, n_clients, shards)
    assert_same_clients(P.shard(labels, n_clients, shards, seed), theirs)


@pytest.mark.parametrize(
    ("labels", "n_clients", "alpha", "seed"),
    [
        (CIFAR10, 100, 0.1, P.FEDNTD_SEED),
        (CIFAR10, 100, 0.5, 2),  # seed 2 needs 4 draws at alpha 0.1 (checked: resampling is exercised)
        (CIFAR10, 100, 0.1, 2),
        (CIFAR100, 50, 0.3, P.FEDNTD_SEED),
        (UNEVEN, 6, 1.0, 4),
    ],
)
def test_dirichlet_equals_fedntd(labels, n_clients, alpha, seed):
    seeded(seed)
    theirs = ref.lda_partition(labels, n_clients, alpha)
    assert_same_clients(P.dirichlet(labels, n_clients, alpha, seed), theirs)


@pytest.mark.parametrize(
    ("labels", "n_classes", "factor", "seed"),
    [(CIFAR10, 10, 100, 7), (CIFAR10, 10, 10, 123), (CIFAR100, 100, 50, 7), (UNEVEN, 5, 3.5, 7)],
)
def test_longtail_equals_clip2fl(labels, n_classes, factor, seed):
    theirs = clip2fl_longtail(labels, n_classes, factor, seed)
    np.testing.assert_array_equal(P.longtail(labels, factor, seed), np.concatenate(theirs))


@pytest.mark.parametrize(
    ("n_clients", "alpha", "seed"), [(20, 0.5, 7), (10, 0.1, 7), (25, 0.5, 3), (37, 1.0, 7)]
)
def test_longtail_then_dirichlet_equal_equals_clip2fl(n_clients, alpha, seed):
    """CLIP2FL's whole data pipeline: long tail (IF 100), then clients_indices; 25 and 37 clients -> 3/4 chunks."""
    lt = clip2fl_longtail(CIFAR10, 10, 100, seed)
    theirs = ref.clients_indices(copy.deepcopy(lt), 10, n_clients, alpha, seed=seed)
    ours = P.make_partition(
        CIFAR10, "dirichlet-equal", clients=n_clients, alpha=alpha, imbalance_factor=100, seed=seed
    )
    assert_same_clients(ours.clients, theirs)


def test_dirichlet_equal_without_longtail_equals_clip2fl():
    theirs = ref.clients_indices(ref.classify_label(CIFAR100, 100), 100, 20, 0.5, seed=7)
    assert_same_clients(P.dirichlet_equal(CIFAR100, 20, 0.5), theirs)


@pytest.mark.parametrize("seed", [-1, 0, 1])
def test_disjoint_classes_equals_fedmp(seed):
    labels = np.random.RandomState(3).permutation(np.repeat(np.arange(30), 12))
    labels = labels[labels != 7][:-4]  # class 7 empty, some classes short of 12
    theirs, novel = ref.fedmp_split_clients(labels, 30, 10, 4, seed_offset=seed + 1)
    ours, ours_novel = P.disjoint_classes(labels, 4, 10, seed=seed, n_classes=30)
    assert_same_clients(ours, [v[1] for v in theirs.values()])
    np.testing.assert_array_equal(ours_novel, novel)


def test_degenerate_draws_follow_the_reference(monkeypatch):
    """alpha = 0.001: Dirichlet draws underflow to all-zero / NaN proportions; the reference then cuts at
    NaN cast to int and np.split decides who gets the class. Both schemes must follow it there too."""
    hits = []
    real = S._piece_sizes
    monkeypatch.setattr(S, "_piece_sizes", lambda cuts, n: hits.append(n) or real(cuts, n))
    ours = P.dirichlet(UNEVEN, 3, 0.001, seed=1)
    seeded(1)
    assert_same_clients(ours, ref.lda_partition(UNEVEN, 3, 0.001))
    labels = CIFAR10[:2000]
    ours = P.dirichlet_equal(labels, 10, 0.001, seed=0)
    assert_same_clients(ours, ref.clients_indices(ref.classify_label(labels, 10), 10, 10, 0.001, seed=0))
    assert sum(n > 0 for n in hits) >= 10  # the NaN path ran on non-empty classes


def test_global_generators_untouched():
    np.random.seed(5)
    random.seed(5)
    np_state, py_state = np.random.get_state(), random.getstate()
    P.make_partition(UNEVEN, "shard", clients=5, shards=2)
    P.make_partition(UNEVEN, "dirichlet-equal", clients=10, alpha=1.0, imbalance_factor=2)
    P.disjoint_classes(UNEVEN, 1, 3)
    assert random.getstate() == py_state
    after = np.random.get_state()
    assert after[2:] == np_state[2:] and np.array_equal(after[1], np_state[1])


# ----------------------------------------------------------------------------- the published numbers


def test_shard_cifar10_two_shards_per_client():
    p = P.make_partition(CIFAR10, "shard", clients=100, shards=2)
    assert p.sizes().tolist() == [500] * 100
    classes_per_client = (p.counts(CIFAR10, 10) > 0).sum(axis=1)
    assert classes_per_client.max() == 2 and classes_per_client.min() >= 1
    assert_exactly_once(p.clients, np.arange(50000))


def test_dirichlet_cifar10_alpha01_min_size():
    p = P.make_partition(CIFAR10, "dirichlet", clients=100, alpha=0.1)
    assert p.params["seed"] == P.FEDNTD_SEED
    assert p.sizes().min() >= 10 and p.sizes().sum() == 50000
    # strong label skew: at alpha 0.1 most clients are dominated by one class
    counts = p.counts(CIFAR10, 10)
    assert np.median(counts.max(axis=1) / counts.sum(axis=1)) > 0.5


@pytest.mark.parametrize(
    ("labels", "n_classes", "factor", "total"),
    [
        (CIFAR10, 10, 100, 12406),
        (CIFAR10, 10, 50, 13996),
        (CIFAR10, 10, 10, 20431),
        (CIFAR100, 100, 100, 10847),
    ],
)
def test_longtail_totals(labels, n_classes, factor, total):
    kept = P.longtail(labels, factor)
    assert len(kept) == total == len(np.unique(kept))
    per_class = np.bincount(labels[kept], minlength=n_classes)
    assert per_class.tolist() == P.longtail_counts(len(labels), n_classes, factor)
    if n_classes == 10 and factor == 100:
        assert per_class.tolist() == [5000, 2997, 1796, 1077, 645, 387, 232, 139, 83, 50]
    if n_classes == 100:
        assert per_class[0] == 500 and per_class[-1] == 5


def test_dirichlet_equal_sizes_equal():
    p = P.make_partition(CIFAR10, "dirichlet-equal", clients=20, alpha=0.5, imbalance_factor=100)
    assert p.params["seed"] == P.CLIP2FL_SEED
    assert p.sizes().tolist() == [621] * 6 + [620] * 14  # 12,406 = 20 x 620 + 6
    assert_exactly_once(p.clients, P.longtail(CIFAR10, 100))
    assert len(p.unassigned(50000)) == 50000 - 12406


def test_disjoint_classes_hundred_classes():
    labels = np.random.RandomState(4).permutation(np.repeat(np.arange(100), 20))
    p = P.make_partition(labels, "disjoint-classes", clients=10, shots=5)
    client_classes = [set(labels[c].tolist()) for c in p.clients]
    assert [len(s) for s in client_classes] == [9] * 10
    assert len(set().union(*client_classes)) == 90  # disjoint
    assert (p.counts(labels, 100)[:, sorted(set().union(*client_classes))].sum(axis=0) == 5).all()
    novel = p.params["novel_classes"]
    assert len(novel) == 10 and set(novel) == set(range(100)) - set().union(*client_classes)
    assert p.sizes().tolist() == [45] * 10


# ----------------------------------------------------------------------------- seeds, helpers, storage

CASES = [
    ("iid", {}),
    ("shard", {"shards": 2}),
    ("dirichlet", {"alpha": 0.5}),
    ("dirichlet-equal", {"alpha": 0.5}),
    ("disjoint-classes", {"shots": 3}),
]


@pytest.mark.parametrize(("scheme", "kw"), CASES)
def test_seed_determines_partition(scheme, kw):
    labels = np.random.RandomState(5).permutation(np.repeat(np.arange(20), 24))
    a = P.make_partition(labels, scheme, clients=10, seed=1, **kw)
    b = P.make_partition(labels, scheme, clients=10, seed=1, **kw)
    c = P.make_partition(labels, scheme, clients=10, seed=2, **kw)
    assert all(np.array_equal(x, y) for x, y in zip(a.clients, b.clients))
    assert not all(np.array_equal(x, y) for x, y in zip(a.clients, c.clients))


def test_default_seeds():
    assert P.make_partition(UNEVEN, "iid", clients=3).params["seed"] == 19940817
    assert P.make_partition(UNEVEN, "iid", clients=3, imbalance_factor=2).params["seed"] == 7
    assert P.make_partition(CIFAR10[:200], "dirichlet-equal", clients=10, alpha=1).params["seed"] == 7
    assert P.make_partition(UNEVEN, "disjoint-classes", clients=1, shots=2).params["seed"] == 0


def test_iid_remainder_and_helpers(tmp_path):
    p = P.make_partition(UNEVEN, "iid", clients=7, seed=9)  # 130 = 7 x 18 + 4
    assert p.sizes().tolist() == [18] * 7
    dropped = p.unassigned(len(UNEVEN))
    assert len(dropped) == 4
    assert_exactly_once([*p.clients, dropped], np.arange(130))

    order, offsets = p.order_and_offsets()
    assert order.dtype == offsets.dtype == np.int64
    assert offsets.tolist() == list(range(0, 127, 18))
    q = P.Partition.from_order_and_offsets(p.scheme, p.params, order, offsets)
    assert_same_clients(q.clients, p.clients)
    counts = p.counts(UNEVEN, 5)
    assert counts.shape == (7, 5) and counts.sum(axis=1).tolist() == [18] * 7
    assert counts[2].tolist() == np.bincount(UNEVEN[p.clients[2]], minlength=5).tolist()

    path = tmp_path / "part.json"
    P.to_json(p, path)
    assert [f.name for f in tmp_path.iterdir()] == ["part.json"]  # no temporary file left behind
    doc = json.loads(path.read_text())
    assert doc["scheme"] == "iid" and doc["params"] == p.params and doc["clients"][0] == p.clients[0].tolist()
    assert_same_clients(P.from_json(path).clients, p.clients)


def test_partition_keys():
    assert P.partition_key(P.make_partition(CIFAR10, "dirichlet", clients=100, alpha=0.1)) == (
        "dirichlet-a0.1-c100-s19940817"
    )
    p = P.make_partition(CIFAR10, "dirichlet-equal", clients=20, alpha=0.5, imbalance_factor=100)
    assert P.partition_key(p) == "lt100+dirichlet-equal-a0.5-c20-s7"
    assert P.partition_key(p.params) == P.partition_key(p)
    p = P.make_partition(UNEVEN, "shard", clients=10, imbalance_factor=2.5)
    assert P.partition_key(p) == "lt2.5+shard-sh2-c10-s7"
    assert P.partition_key({"scheme": "disjoint-classes", "clients": 10, "shots": 10, "seed": 0}) == (
        "disjoint-classes-shot10-c10-s0"
    )


def test_bad_offsets_rejected():
    with pytest.raises(FedfeatError, match="rebuild it"):
        P.Partition.from_order_and_offsets("iid", {}, np.arange(5), [0, 3, 2, 5])


@pytest.mark.parametrize(
    ("call", "fix"),
    [
        (lambda: P.make_partition(UNEVEN, "dirichlet", clients=2, alpha=0), "e.g. alpha=0.5"),
        (lambda: P.make_partition(UNEVEN, "dirichlet", clients=2, alpha=-1.0), "e.g. alpha=0.5"),
        (lambda: P.make_partition(UNEVEN, "dirichlet", clients=2), "needs alpha"),
        (lambda: P.make_partition(UNEVEN, "iid", clients=131), "use at most 130 clients"),
        (lambda: P.make_partition(UNEVEN, "iid", clients=0), "at least one client"),
        (lambda: P.make_partition(UNEVEN, "dirichlet", clients=14, alpha=1), "use at most 13 clients"),
        (lambda: P.make_partition(UNEVEN, "shard", clients=3, shards=2), "multiple of 5"),
        (lambda: P.make_partition(UNEVEN, "fedavg", clients=3), "choose one of: iid, shard, dirichlet"),
        (lambda: P.make_partition(UNEVEN, "longtail", clients=3), "pass imbalance_factor with any scheme"),
        (lambda: P.make_partition(UNEVEN, "iid", clients=3, imbalance_factor=0.01), "imbalance_factor=100"),
        (lambda: P.make_partition(UNEVEN, "iid", clients=3, alpha=0.5), "drop alpha"),
        (lambda: P.make_partition(UNEVEN, "dirichlet-equal", clients=5, alpha=0.5), "use clients >= 10"),
        (lambda: P.make_partition(UNEVEN, "dirichlet-equal", clients=100, alpha=0.5), "at most 65 clients"),
        (lambda: P.make_partition(UNEVEN, "disjoint-classes", clients=2), "e.g. shots=10"),
        (lambda: P.make_partition(UNEVEN, "disjoint-classes", clients=5, shots=2), "at most 4 clients"),
        (lambda: P.make_partition(UNEVEN, "iid", clients=3, seed=2**32), "pick a seed in 0..4294967295"),
        (lambda: P.make_partition(UNEVEN, "iid", clients=3, n_classes=3), "number of classes"),
        (lambda: P.make_partition(np.array([0.5, 1.5]), "iid", clients=1), "integer class ids"),
        (lambda: P.make_partition(np.array([1, -1]), "iid", clients=1), "remap the labels"),
        (
            lambda: P.make_partition(np.zeros(10, int), "disjoint-classes", clients=2, shots=1, n_classes=30),
            "no samples",
        ),
    ],
)
def test_user_errors_name_the_fix(call, fix):
    with pytest.raises(FedfeatError) as err:
        call()
    message = str(err.value)
    assert fix in message and "\n" not in message


def test_dirichlet_gives_up_instead_of_looping_forever(monkeypatch):
    monkeypatch.setattr(S, "_MAX_DRAWS", 50)
    labels = np.repeat(np.arange(2), [99, 1])  # 10 clients x 10: one client must take the lone sample
    with pytest.raises(FedfeatError, match="use fewer clients or a larger alpha"):
        P.dirichlet(labels, 10, 0.05, seed=0)


# ----------------------------------------------------------------------------- properties over random inputs


@st.composite
def label_arrays(draw, min_per_class=1):
    n_classes = draw(st.integers(2, 8))
    sizes = draw(st.lists(st.integers(min_per_class, 60), min_size=n_classes, max_size=n_classes))
    order_seed = draw(st.integers(0, 2**32 - 1))
    return np.random.RandomState(order_seed).permutation(np.repeat(np.arange(n_classes), sizes))


SEEDS = st.integers(0, 2**32 - 1)
PROPERTY = settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.filter_too_much])
# Our draws are the reference's, so whatever succeeds within this many redraws succeeds in the reference too;
# a tighter cap than the library's only keeps rejected examples fast.
FEW_DRAWS = mock.patch.object(S, "_MAX_DRAWS", 300)


@PROPERTY
@given(labels=label_arrays(), seed=SEEDS, data=st.data())
def test_property_iid(labels, seed, data):
    n_clients = data.draw(st.integers(1, len(labels)))
    ours = P.iid(labels, n_clients, seed)
    seeded(seed)
    assert_same_clients(ours, ref.iid_partition(labels, n_clients))
    length = len(labels) // n_clients
    assert [len(c) for c in ours] == [length] * n_clients
    flat = np.concatenate(ours)
    assert len(np.unique(flat)) == len(flat) == len(labels) - len(labels) % n_clients


@PROPERTY
@given(labels=label_arrays(), seed=SEEDS, shards=st.integers(1, 4), k=st.integers(1, 4))
def test_property_shard(labels, seed, shards, k):
    n_cls = labels.max() + 1
    n_clients = k * n_cls // math.gcd(shards, n_cls)  # makes shards x clients a multiple of the classes
    assume(n_clients <= len(labels))
    ours = P.shard(labels, n_clients, shards, seed)
    seeded(seed)
    theirs, _ = ref.sharding_partition(labels, n_clients, shards)
    assert_same_clients(ours, theirs)
    assert_exactly_once(ours, np.arange(len(labels)))
    assert max(len(np.unique(labels[c])) for c in ours) <= shards


@PROPERTY
@given(labels=label_arrays(), seed=SEEDS, alpha=st.floats(0.05, 10), data=st.data())
def test_property_dirichlet(labels, seed, alpha, data):
    n_clients = data.draw(st.integers(1, max(1, len(labels) // 20)))
    try:
        with FEW_DRAWS:
            ours = P.dirichlet(labels, n_clients, alpha, seed)
    except FedfeatError:
        assume(False)  # no draw succeeded; the reference would loop forever
    seeded(seed)
    assert_same_clients(ours, ref.lda_partition(labels, n_clients, alpha))
    assert_exactly_once(ours, np.arange(len(labels)))
    assert min(len(c) for c in ours) >= 10


@PROPERTY
@given(
    labels=label_arrays(min_per_class=3), seed=SEEDS, alpha=st.sampled_from([0.3, 1.0, 5.0]), data=st.data()
)
def test_property_longtail_dirichlet_equal(labels, seed, alpha, data):
    n_cls = int(labels.max()) + 1
    factor = data.draw(st.sampled_from([1, 2, 10, 100]))
    kept = P.longtail(labels, factor, seed)
    np.testing.assert_array_equal(kept, np.concatenate(clip2fl_longtail(labels, n_cls, factor, seed)))
    n_clients = data.draw(st.integers(10, max(10, len(kept) // 4)))
    try:
        with FEW_DRAWS:
            p = P.make_partition(
                labels, "dirichlet-equal", clients=n_clients, alpha=alpha, imbalance_factor=factor, seed=seed
            )
    except FedfeatError:
        assume(False)
    lt = clip2fl_longtail(labels, n_cls, factor, seed)
    assert_same_clients(p.clients, ref.clients_indices(lt, n_cls, n_clients, alpha, seed=seed))
    assert_exactly_once(p.clients, kept)
    assert p.sizes().max() - p.sizes().min() <= 1


# the schemes whose draws this property knows how to size and count; every registered scheme (a new one too) is
# enumerated by tests/test_partition_registry.py, and each has its own test file
EXACTLY_ONCE = ("iid", "shard", "dirichlet", "dirichlet-equal", "disjoint-classes", "dirichlet-joint")


@PROPERTY
@given(labels=label_arrays(), seed=SEEDS, scheme=st.sampled_from(EXACTLY_ONCE), data=st.data())
def test_property_every_scheme_exactly_once(labels, seed, scheme, data):
    """Through make_partition, also on long-tailed subsets and with class ids missing from the split."""
    if data.draw(st.booleans()):  # leave a class id with no samples
        labels = labels[labels != data.draw(st.integers(0, int(labels.max()) - 1))]
    n_cls = int(labels.max()) + 1
    factor = None if scheme == "dirichlet-joint" else data.draw(st.sampled_from([None, 1.5, 20]))
    kept = P.longtail(labels, factor, seed) if factor else np.arange(len(labels))
    n_kept, present = len(kept), len(np.unique(labels[kept]))
    if scheme == "shard":
        shards = data.draw(st.integers(1, 3))
        kw = {"shards": shards}
        clients = data.draw(st.integers(1, 3)) * present // math.gcd(shards, present)
    elif scheme == "disjoint-classes":
        kw = {"shots": data.draw(st.integers(1, 10))}
        clients = data.draw(st.integers(1, n_cls - 1))
    else:
        kw = {} if scheme == "iid" else {"alpha": data.draw(st.floats(0.05, 5))}
        if scheme == "dirichlet-joint":  # FedCoPL: the test split is cut with the same draws
            kw["test_labels"] = labels[::-1].copy()
        low, high = {
            "iid": (1, n_kept),
            "dirichlet": (1, n_kept // 20),
            "dirichlet-equal": (10, n_kept // 3),
            "dirichlet-joint": (1, n_kept // 20),
        }[scheme]
        clients = data.draw(st.integers(low, max(low, high)))
    try:
        with FEW_DRAWS:
            p = P.make_partition(labels, scheme, clients=clients, imbalance_factor=factor, seed=seed, **kw)
    except FedfeatError:
        assume(False)
    held = np.concatenate(p.clients)
    assert len(np.unique(held)) == len(held)
    if scheme == "dirichlet-joint":  # every test sample of a class some client holds, once
        t = np.concatenate([np.asarray(c, dtype=np.int64) for c in p.params["test_clients"]])
        assert len(np.unique(t)) == len(t) == len(labels)
    assert set(held.tolist()) <= set(kept.tolist())
    if scheme == "iid":
        assert len(held) == len(kept) - len(kept) % clients
    elif scheme == "disjoint-classes":
        base = sorted(set(range(int(labels.max()) + 1)) - set(p.params["novel_classes"]))
        per_class = np.bincount(labels[kept], minlength=int(labels.max()) + 1)
        assert np.bincount(labels[held], minlength=len(per_class)).tolist() == [
            min(per_class[c], kw["shots"]) if c in base else 0 for c in range(len(per_class))
        ]
    else:
        assert len(held) == len(kept)
    assert len(p.unassigned(len(labels))) == len(labels) - len(held)


def test_local_test_split_follows_train_proportions_by_hand():
    """2 clients, 3 classes. Train: client 0 holds 3 of class 0 and 1 of class 1, client 1 holds 1 of class 0 and
    2 of class 2. Test: 8 of class 0, 4 of class 1, 2 of class 2, 3 of class 3 (no client trains on it).
    FedML's cuts: class 0 -> p = (3/4, 1/4): 6 and 2; class 1 -> (1, 0): 4 and 0; class 2 -> (0, 1): 0 and 2;
    class 3 -> nobody."""
    train = np.array([0, 0, 0, 1, 0, 2, 2])
    part = P.Partition("custom", {}, [np.array([0, 1, 2, 3]), np.array([4, 5, 6])])
    test = np.array([0] * 8 + [1] * 4 + [2] * 2 + [3] * 3)
    got = P.local_test_split(part, train, test, 4, seed=0)
    per = [np.bincount(test[g], minlength=4).tolist() for g in got]
    assert per == [[6, 4, 0, 0], [2, 0, 2, 0]]
    assert len(np.intersect1d(got[0], got[1])) == 0  # disjoint
    assert all(np.all(np.diff(g) > 0) for g in got)
    again = P.local_test_split(part, train, test, 4, seed=0)
    assert all(np.array_equal(a, b) for a, b in zip(got, again))  # seeded
    other = P.local_test_split(part, train, test, 4, seed=1)
    assert any(not np.array_equal(a, b) for a, b in zip(got, other))  # the seed picks which test samples


def _fedcopl_reference(train_lbs, test_lbs, n_parties, beta, seed):
    """FedCoPL methods/main_UL.py prepare_dataset_UL_fed, partition == "noniid", transcribed (global np.random)."""
    np.random.seed(seed)
    K = int(max(train_lbs)) + 1
    N, N_test = len(train_lbs), len(test_lbs)
    min_size, min_require_size = 0, 10
    while min_size < min_require_size:
        idx_batch = [[] for _ in range(n_parties)]
        idx_batch_test = [[] for _ in range(n_parties)]
        for k in range(K):
            idx_k = [idx for idx, value in enumerate(train_lbs) if value == k]
            idx_k_test = [idx for idx, value in enumerate(test_lbs) if value == k]
            np.random.shuffle(idx_k)
            np.random.shuffle(idx_k_test)
            proportions = np.random.dirichlet(np.repeat(beta, n_parties))
            proportions_train = np.array(
                [p * (len(idx_j) < N / n_parties) for p, idx_j in zip(proportions, idx_batch)]
            )
            proportions_test = np.array(
                [p * (len(idx_j) < N_test / n_parties) for p, idx_j in zip(proportions, idx_batch_test)]
            )
            proportions_train = proportions_train / proportions_train.sum()
            proportions_test = proportions_test / proportions_test.sum()
            proportions_train = (np.cumsum(proportions_train) * len(idx_k)).astype(int)[:-1]
            proportions_test = (np.cumsum(proportions_test) * len(idx_k_test)).astype(int)[:-1]
            idx_batch = [
                idx_j + idx.tolist() for idx_j, idx in zip(idx_batch, np.split(idx_k, proportions_train))
            ]
            idx_batch_test = [
                idx_j + idx.tolist()
                for idx_j, idx in zip(idx_batch_test, np.split(idx_k_test, proportions_test))
            ]
            min_size = min([len(idx_j) for idx_j in idx_batch])
    out, out_t = [], []
    for j in range(n_parties):
        np.random.shuffle(idx_batch[j])
        np.random.shuffle(idx_batch_test[j])
        out.append(list(idx_batch[j]))
        out_t.append(list(idx_batch_test[j]))
    return out, out_t


@pytest.mark.parametrize("seed, beta, parties", [(2, 0.1, 10), (1, 0.5, 5), (3, 0.1, 5)])
def test_dirichlet_joint_is_fedcopls_split_bit_for_bit(seed, beta, parties):
    rs = np.random.RandomState(100 + seed)
    train = rs.randint(0, 10, 3000)
    test = rs.randint(0, 10, 700)
    state = np.random.get_state()
    try:
        want, want_t = _fedcopl_reference(train.tolist(), test.tolist(), parties, beta, seed)
    finally:
        np.random.set_state(state)
    p = P.make_partition(train, "dirichlet-joint", clients=parties, alpha=beta, seed=seed, test_labels=test)
    assert [c.tolist() for c in p.clients] == want
    assert p.params["test_clients"] == want_t
    assert P.partition_key(p) == f"dirichlet-joint-a{C._plain(beta)}-c{parties}-s{seed}"
    # the test split follows the train proportions: same draw per class
    tr = p.counts(train, 10) / np.maximum(p.counts(train, 10).sum(0), 1)
    tc = np.array([np.bincount(test[t], minlength=10) for t in want_t])
    assert np.corrcoef(tr.ravel(), (tc / np.maximum(tc.sum(0), 1)).ravel())[0, 1] > 0.9


def test_dirichlet_joint_needs_test_labels():
    with pytest.raises(FedfeatError, match="needs the test labels"):
        P.make_partition(np.arange(100) % 10, "dirichlet-joint", clients=2, alpha=0.1)

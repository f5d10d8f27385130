"""The training-free family (issue 39): FedNCM and Fed3R against transcriptions of the authors' code, the accumulated
statistics against the centralized computation (any order, any partition), checkpoints, and `fedfeat train`."""

import dataclasses
import json

import numpy as np
import pytest
import torch

from fedfeat.engine import checkpoint
from fedfeat.engine.data import load_run_data
from fedfeat.engine.rounds import run_federated
from fedfeat.methods import REGISTRY, get_method
from fedfeat.methods.closedform import class_sums, ncm_head, ridge_head, ridge_stats, rows_of_clients
from fedfeat.partition.make import make_partition
from fedfeat.store.synth import SynthParams, write_synthetic_store
from tests.helpers_clip import run_cli, synth_store


# --------------------------------------------------------------------------- the authors' code, transcribed
# GwenLegate/GuidingLastLayerFLPretrain@54b5d1ee24601281a080128ec390afa7aaca1d06 src/federated_main.py:102-120 (the
# features of a batch are the pooled backbone output, here the batch itself; `.to(device)` and the squeezenet
# branch left out; dtype: the batches')
def ref_fedncm(batches, num_classes, dim):
    class_sums = torch.zeros((num_classes, dim), dtype=batches[0][0].dtype)
    class_count = torch.zeros(num_classes, dtype=batches[0][0].dtype)
    for batch_idx, (data, target) in enumerate(batches):  # noqa: B007 (as in the reference)
        features = data
        for i, t in enumerate(target):
            class_sums[t] += features[i].data.squeeze()
            class_count[t] += 1
    class_means = torch.div(class_sums, torch.reshape(class_count, (-1, 1)))
    return torch.nn.functional.normalize(class_means)  # global_model.model.fc.weight.data = ...


# Erosinho13/Fed3R@c2a8e5de59e4b86efaa351c241a4a3357bcdab34 src/fed3r.py:23-62 and 402-418 (`model` is the identity on
# the features; torch.float32 of lines 50 and 402-403 made the batches' dtype so that the comparison is at 1e-6)
def calc_ridge_params(A, b):
    W = torch.linalg.solve(A, b)
    bias = W[-1, :]
    W = W[:-1, :]
    return W, bias


def normalize_W(W, bias, warnings=True):
    norm = torch.norm(W, dim=0, keepdim=True)
    if torch.any(norm == 0.0):
        norm[norm == 0.0] = 1e-6
    W = W / norm
    bias = bias / norm[0, :]
    return W, bias


def fed3r_step(A, b, dataloader, num_classes):
    for batch_idx, (data, target) in enumerate(dataloader):  # noqa: B007 (as in the reference)
        features = data
        feats_with_bias = torch.cat(
            (features, torch.ones((features.shape[0], 1), dtype=features.dtype)), dim=1
        )
        one_hot_encoded = torch.nn.functional.one_hot(target, num_classes=num_classes)
        one_hot_encoded = one_hot_encoded.to(features.dtype)
        Ak = feats_with_bias.T @ feats_with_bias
        bk = feats_with_bias.T @ one_hot_encoded
        A += Ak
        b += bk
    return A, b


def ref_fed3r(loaders, num_classes, dim, lambda_):
    A = lambda_ * torch.eye(dim + 1, dtype=loaders[0][0][0].dtype)
    b = torch.zeros((dim + 1, num_classes), dtype=loaders[0][0][0].dtype)
    for loader in loaders:  # src/fed3r.py:405-411: one client after another
        A, b = fed3r_step(A, b, loader, num_classes)
    W, bias = normalize_W(*calc_ridge_params(A, b))  # src/fed3r.py:418
    return W.T, bias  # model.classifier.weight = W.T (src/fed3r.py:420)


def _random(seed, n=300, D=12, K=5, scale=3.0):
    g = torch.Generator().manual_seed(seed)
    y = torch.randint(0, K, (n,), generator=g)
    y[:K] = torch.arange(K)  # every class held
    centres = torch.randn(K, D, generator=g, dtype=torch.float64) * scale
    x = centres[y] + torch.randn(n, D, generator=g, dtype=torch.float64)
    return x, y


def _batches(x, y, B=32):
    return [(x[i : i + B], y[i : i + B]) for i in range(0, len(y), B)]


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_fedncm_pure_pieces_equal_the_reference(seed):
    x, y = _random(seed)
    K, D = 5, x.shape[1]
    W = ncm_head(*class_sums(x, y, K))
    torch.testing.assert_close(W, ref_fedncm(_batches(x, y), K, D), atol=1e-6, rtol=0)


@pytest.mark.parametrize("seed, lam", [(0, 0.01), (1, 0.01), (2, 1.0)])
def test_fed3r_pure_pieces_equal_the_reference(seed, lam):
    x, y = _random(seed)
    K, D = 5, x.shape[1]
    clients = [(x[:100], y[:100]), (x[100:170], y[100:170]), (x[170:], y[170:])]
    G = sum(ridge_stats(cx, cy, K)[0] for cx, cy in clients)
    B = sum(ridge_stats(cx, cy, K)[1] for cx, cy in clients)
    W, b = ridge_head(G, B, lam)
    W_ref, b_ref = ref_fed3r([_batches(cx, cy) for cx, cy in clients], K, D, lam)
    torch.testing.assert_close(W, W_ref, atol=1e-6, rtol=0)
    torch.testing.assert_close(b, b_ref, atol=1e-6, rtol=0)


# --------------------------------------------------------------------------- the methods in the engine
@pytest.fixture(scope="module")
def small(tmp_path_factory):
    """6 classes x 40 train, D = 16, 8 clients (Dirichlet 0.3, ragged)."""
    p = SynthParams(classes=6, dim=16, train_per_class=40, test_per_class=10, templates=1)
    return write_synthetic_store(
        tmp_path_factory.mktemp("cf") / "s.zarr", p, stats=False, log=lambda *_: None
    )


def _data(st, partition="dirichlet", clients=8, seed=1):
    kw = {"alpha": 0.3} if partition == "dirichlet" else {}
    part = make_partition(st.labels("train"), partition, clients=clients, seed=seed, **kw)
    return load_run_data(st, part, dtype=torch.float64)


def _loaders(data):
    """Every client's (features, labels) in client-major order, as batches (the reference's data loaders)."""
    o = data.offsets
    x, y = data.train_x.to(torch.float64), data.train_y
    return [_batches(x[o[i] : o[i + 1]], y[o[i] : o[i + 1]]) for i in range(len(o) - 1) if o[i + 1] > o[i]]


@pytest.mark.parametrize("name", ["fedncm", "fed3r"])
def test_one_round_of_every_client_equals_the_reference_head_and_logits(small, name):
    data = _data(small)
    m = get_method(name)
    glob, rows = run_federated(m, data, rounds=1, participation=1.0, seed=0)
    K, D = len(data.class_names), data.train_x.shape[1]
    loaders = _loaders(data)
    if name == "fedncm":
        W_ref, b_ref = (
            ref_fedncm([b for lo in loaders for b in lo], K, D),
            torch.zeros(K, dtype=torch.float64),
        )
    else:
        W_ref, b_ref = ref_fed3r(loaders, K, D, 0.01)
    torch.testing.assert_close(glob["W"], W_ref, atol=1e-6, rtol=0)
    torch.testing.assert_close(glob["b"], b_ref, atol=1e-6, rtol=0)
    # the logits: the reference's nn.Linear with those weights, on the raw (unnormalised) test features
    tx = data.test_x.to(torch.float64)
    torch.testing.assert_close(m.predict(None, glob, tx), tx @ W_ref.T + b_ref, atol=1e-6, rtol=0)
    # one round, every client new: every client's statistics are the round's upload; nothing is sent down
    n_up = K * D + K if name == "fedncm" else (D + 1) ** 2 + (D + 1) * K
    assert rows[1]["bytes_up"] == (len(data.offsets) - 1) * n_up * 8  # float64 run
    assert rows[1]["bytes_down"] == 0 and rows[1]["images"] == 0 and rows[1]["train_loss"] == 0.0


def _centralized(name, x, y, K, lam=0.01):
    """The centralized head computed independently (numpy): pooled class means / the ridge solution on all data."""
    x, y = x.numpy().astype(np.float64), y.numpy()
    if name == "fedncm":
        M = np.stack([x[y == c].mean(0) for c in range(K)])
        return M / np.linalg.norm(M, axis=1, keepdims=True), np.zeros(K)
    X = np.hstack([x, np.ones((len(x), 1))])
    W = np.linalg.solve(X.T @ X + lam * np.eye(X.shape[1]), X.T @ np.eye(K)[y])
    n = np.linalg.norm(W[:-1], axis=0)
    return (W[:-1] / n).T, W[-1] / n


@pytest.mark.parametrize("name", ["fedncm", "fed3r"])
@pytest.mark.parametrize(
    "partition, clients, seed, participation",
    [("dirichlet", 8, 0, 0.25), ("dirichlet", 8, 3, 0.5), ("iid", 5, 1, 0.4), ("shard", 6, 2, 0.34)],
)
def test_partial_participation_accumulates_to_the_centralized_head(
    small, name, partition, clients, seed, participation
):
    """Metamorphic: whatever the partition and the order in which clients are sampled (seed), once every client has
    uploaded the head is the centralized one; each client uploads once (bytes_up adds up to one upload per client)."""
    kw = {"alpha": 0.3} if partition == "dirichlet" else {"shards": 2} if partition == "shard" else {}
    part = make_partition(small.labels("train"), partition, clients=clients, seed=seed, **kw)
    data = load_run_data(small, part, dtype=torch.float64)
    m = get_method(name)
    glob, rows = run_federated(m, data, rounds=30, participation=participation, seed=seed)
    seen = set().union(*(r["clients"] for r in rows[1:]))
    assert seen == set(range(clients))
    assert len({tuple(r["clients"]) for r in rows[1:]}) > 1  # clients came over several rounds
    K, D = len(data.class_names), data.train_x.shape[1]
    W_c, b_c = _centralized(name, data.train_x.to(torch.float64), data.train_y, K)
    np.testing.assert_allclose(glob["W"].numpy(), W_c, atol=1e-6)
    np.testing.assert_allclose(glob["b"].numpy(), b_c, atol=1e-6)
    n_up = K * D + K if name == "fedncm" else (D + 1) ** 2 + (D + 1) * K
    assert sum(r["bytes_up"] for r in rows[1:]) == clients * n_up * 8
    # a round whose clients had all uploaded before sends nothing and leaves the head as it was
    first = {}
    for r in rows[1:]:
        for c in r["clients"]:
            first.setdefault(c, r["round"])
    for r in rows[1:]:
        new = sum(first[c] == r["round"] for c in r["clients"])
        assert r["bytes_up"] == new * n_up * 8


@pytest.mark.parametrize("name", ["fedncm", "fed3r"])
def test_uploads_in_any_order_or_grouping_sum_to_the_pooled_statistics(name):
    """The pure pieces: the statistics of any partition of the samples into clients, added in any order, are the
    pooled samples' (to rounding), so the head is the centralized one."""
    x, y = _random(7, n=240)
    K = 5
    gen = np.random.default_rng(0)
    heads = []
    for _ in range(4):
        cuts = np.sort(gen.choice(np.arange(1, 240), size=gen.integers(1, 8), replace=False))
        parts = np.split(gen.permutation(240), cuts)
        gen.shuffle(parts)
        fn = class_sums if name == "fedncm" else ridge_stats
        s1 = sum(fn(x[p], y[p], K)[0] for p in parts)
        s2 = sum(fn(x[p], y[p], K)[1] for p in parts)
        heads.append(ncm_head(s1, s2) if name == "fedncm" else ridge_head(s1, s2, 0.01)[0])
    W_c = torch.from_numpy(_centralized(name, x, y, K)[0])
    for W in heads:
        torch.testing.assert_close(W, W_c, atol=1e-9, rtol=0)


def test_rows_of_clients_are_their_client_major_rows():
    offsets = torch.tensor([0, 3, 3, 7, 9])
    assert rows_of_clients(offsets, torch.tensor([3, 0, 1, 2])).tolist() == [7, 8, 0, 1, 2, 3, 4, 5, 6]
    assert rows_of_clients(offsets, torch.tensor([], dtype=torch.int64)).tolist() == []


def test_engine_facts(small):
    """Training-free: no hyperparameter of local training, no stacking, every state key declared."""
    for name in ("fedncm", "fed3r"):
        cls = REGISTRY[name]
        assert cls.Params.local_epochs == 0 and not cls.stacks and cls.uses_labels
        keys = {f.name for f in dataclasses.fields(cls.Params)}
        assert not keys & {"lr", "local_epochs", "batch_size", "momentum"}
    from fedfeat.errors import FedfeatError

    with pytest.raises(FedfeatError, match="no hyperparameter 'local_epochs'"):
        get_method("fed3r", {"local_epochs": "1"})
    with pytest.raises(FedfeatError, match="lam"):
        get_method("fed3r", {"lam": "0"})


@pytest.mark.parametrize("name", ["fedncm", "fed3r"])
def test_resume_from_a_checkpoint_equals_the_uninterrupted_run(small, name, tmp_path):
    data = _data(small)
    full_glob, full_rows = run_federated(get_method(name), data, rounds=4, participation=0.25, seed=5)
    saved = {}

    def on_checkpoint(rnd, glob, state):
        checkpoint.save(tmp_path / "ck.safetensors", rnd, glob, state)
        saved["rnd"] = rnd

    run_federated(
        get_method(name),
        data,
        rounds=4,
        participation=0.25,
        seed=5,
        on_checkpoint=on_checkpoint,
        checkpoint_every=2,
    )
    assert saved["rnd"] == 2
    resume = checkpoint.load(tmp_path / "ck.safetensors", "cpu")
    glob, rows = run_federated(get_method(name), data, rounds=4, participation=0.25, seed=5, resume=resume)
    for k in full_glob:
        torch.testing.assert_close(glob[k], full_glob[k], atol=0, rtol=0)
    assert [r["bytes_up"] for r in rows] == [r["bytes_up"] for r in full_rows[3:]]
    assert [r["test_acc"] for r in rows] == [r["test_acc"] for r in full_rows[3:]]


@pytest.mark.parametrize("name", ["fedncm", "fed3r"])
@pytest.mark.parametrize("normalize", ["false", "true"])
def test_training_free_heads_beat_the_zero_head(small, name, normalize):
    """Sane heads: well above chance (1/6) after one round of all clients, features raw or unit."""
    m = get_method(name, {"normalize": normalize})
    _, rows = run_federated(m, _data(small), rounds=1, participation=1.0, seed=0)
    assert rows[0]["test_acc"] == pytest.approx(100 / 6)  # round 0: no statistics, a zero head
    assert rows[1]["test_acc"] > 50


# --------------------------------------------------------------------------- the CLI
@pytest.fixture(scope="module")
def cli_store(tmp_path_factory):
    return synth_store(tmp_path_factory.mktemp("cfcli") / "s.zarr")


@pytest.mark.parametrize("name", ["fedncm", "fed3r"])
def test_fedfeat_train_runs_and_is_sane(cli_store, name, tmp_path):
    r = run_cli(["train", "--store", cli_store, "--method", name, "--rounds", "2", "--clients", "10",
                 "--participation", "0.5", "--out", tmp_path, "--name", "x", "--quiet"])  # fmt: skip
    assert r.exit_code == 0, r.output
    run = tmp_path / "x"
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [row["round"] for row in rows] == [0, 1, 2]
    summary = json.loads((run / "summary.json").read_text())
    K, D = 10, 32  # the synthetic store's classes; synth_store's dim
    n_up = K * D + K if name == "fedncm" else (D + 1) ** 2 + (D + 1) * K
    assert rows[1]["bytes_up"] == len(rows[1]["clients"]) * n_up * 4  # float32: every round-1 client is new
    assert all(row["bytes_down"] == 0 for row in rows)
    assert summary["final_acc"] > 3 * 100 / K  # chance is 10 %; measured 66.5 % for both
    assert (run / "weights.safetensors").is_file()

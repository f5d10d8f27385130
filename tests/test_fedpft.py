"""FedPFT (fedfeat/methods/fedpft.py) against transcriptions of its reference functions.

Sources transcribed below (numpy, one group at a time, as the references run):
- adap/flower@fdef7afb1dca3030553be302366cfd285ed6632c baselines/fedpft/fedpft/utils.py:39-97 ``learn_gmm``
  (a class is fitted when it has more than ``n_mixtures`` samples; parameters sent as float16),
  strategy.py:96-115 (``gmm.sample(num_samples)`` per received mixture), models.py:174-226 ``train``.
- scikit-learn@dc2c37aa7826b8238334768f9b80f7cf8d59bb12 sklearn/mixture/_gaussian_mixture.py
  ``_estimate_gaussian_parameters`` / ``_estimate_gaussian_covariances_{full,diag,spherical}``,
  ``_compute_precision_cholesky``, ``_compute_log_det_cholesky``, ``_estimate_log_gaussian_prob``,
  ``GaussianMixture._initialize`` / ``_m_step``; sklearn/mixture/_base.py ``BaseMixture.fit_predict`` (the EM loop
  and its ``abs(change) < tol`` stop), ``_e_step``, ``_estimate_log_prob_resp`` and ``sample`` (numpy
  ``multivariate_normal``'s SVD factor for full covariances). sklearn is not installed here: these are the
  references.
"""

import json
import math

import numpy as np
import pytest
import torch

from fedfeat.methods import get_method
from fedfeat.methods.fedpft import (
    fit_gmm,
    fit_groups,
    init_resp,
    linear_init,
    mixture_factor,
    sample_mixtures,
    train_head,
    transform_noise,
)
from tests.helpers_clip import run_cli, synth_store

F64 = torch.float64


# ------------------------------------------------------------------------------- sklearn, transcribed (numpy)
def sk_params(X, resp, reg, cov_type):
    nk = resp.sum(axis=0) + 10 * np.finfo(resp.dtype).eps
    means = np.dot(resp.T, X) / nk[:, np.newaxis]
    if cov_type == "full":
        n_components, n_features = means.shape
        cov = np.empty((n_components, n_features, n_features))
        for k in range(n_components):
            diff = X - means[k]
            cov[k] = np.dot(resp[:, k] * diff.T, diff) / nk[k]
            cov[k].flat[:: n_features + 1] += reg
    else:
        cov = np.dot(resp.T, X * X) / nk[:, np.newaxis] - means**2 + reg
        if cov_type == "spherical":
            cov = cov.mean(1)
    return nk, means, cov


def sk_pchol(cov, cov_type):
    if cov_type == "full":
        d = cov.shape[-1]
        # scipy's solve_triangular(cholesky(c, lower=True), eye, lower=True).T (scipy is not installed here)
        return np.stack([np.linalg.solve(np.linalg.cholesky(c), np.eye(d)).T for c in cov])
    return 1.0 / np.sqrt(cov)


def sk_log_prob(X, means, pc, cov_type):
    n, d = X.shape
    if cov_type == "full":
        log_det = np.sum(np.log(pc.reshape(len(pc), -1)[:, :: d + 1]), axis=1)
        lp = np.empty((n, len(means)))
        for k, (mu, p) in enumerate(zip(means, pc)):
            y = np.dot(X, p) - np.dot(mu, p)
            lp[:, k] = np.sum(np.square(y), axis=1)
    elif cov_type == "diag":
        log_det = np.sum(np.log(pc), axis=1)
        prec = pc**2
        lp = np.sum(means**2 * prec, 1) - 2.0 * np.dot(X, (means * prec).T) + np.dot(X**2, prec.T)
    else:
        log_det = d * np.log(pc)
        prec = pc**2
        lp = np.sum(means**2, 1) * prec - 2 * np.dot(X, means.T * prec) + np.outer((X * X).sum(1), prec)
    return -0.5 * (d * np.log(2 * np.pi) + lp) + log_det


def sk_fit(X, resp, cov_type, reg, tol, max_iter):
    """GaussianMixture.fit from the responsibilities ``resp`` (``_initialize``, then ``fit_predict``'s loop)."""
    w, mu, cov = sk_params(X, resp, reg, cov_type)
    w = w / X.shape[0]
    pc = sk_pchol(cov, cov_type)
    lower = -np.inf
    n_iter = 0
    while n_iter < max_iter:
        n_iter += 1
        prev = lower
        wlp = sk_log_prob(X, mu, pc, cov_type) + np.log(w)  # _e_step
        top = wlp.max(1, keepdims=True)  # scipy.special.logsumexp
        lpn = (top + np.log(np.exp(wlp - top).sum(1, keepdims=True)))[:, 0]
        log_resp = wlp - lpn[:, np.newaxis]
        w, mu, cov = sk_params(X, np.exp(log_resp), reg, cov_type)  # _m_step
        w = w / w.sum()
        pc = sk_pchol(cov, cov_type)
        lower = np.mean(lpn)
        if abs(lower - prev) < tol:
            break
    return w, mu, cov, n_iter


# ----------------------------------------------------------------------------------------------- the EM
@pytest.mark.parametrize("cov_type", ["spherical", "diag", "full"])
@pytest.mark.parametrize("k, how", [(1, "kmeans"), (3, "kmeans"), (2, "random")])
def test_batched_em_equals_sklearn_per_group(cov_type, k, how):
    g = torch.Generator().manual_seed(0)
    sizes = [25, 12, 40]  # ragged groups: padded rows must not count
    G, n, D = len(sizes), max(sizes), 4
    X = torch.randn(G, n, D, generator=g, dtype=F64) + torch.arange(G, dtype=F64).view(G, 1, 1)
    mask = torch.arange(n).unsqueeze(0) < torch.tensor(sizes).unsqueeze(1)
    X = X * mask.unsqueeze(-1)
    rows = torch.arange(G * n).view(G, n)
    resp0 = init_resp(X, mask, k, how, torch.arange(G), rows, key=7)
    assert torch.allclose(resp0.sum(-1), mask.to(F64))  # one unit of responsibility per real row
    w, mu, cov, it = fit_gmm(X, mask, resp0, cov_type, 1e-6, 1e-10, 500)
    for i, s in enumerate(sizes):
        rw, rmu, rcov, rit = sk_fit(X[i, :s].numpy(), resp0[i, :s].numpy(), cov_type, 1e-6, 1e-10, 500)
        assert int(it[i]) == rit
        np.testing.assert_allclose(w[i].numpy(), rw, rtol=1e-9, atol=1e-12)
        np.testing.assert_allclose(mu[i].numpy(), rmu, rtol=1e-9, atol=1e-12)
        np.testing.assert_allclose(cov[i].numpy(), rcov, rtol=1e-9, atol=1e-12)


def test_one_component_is_the_class_mean_and_variance_in_two_iterations():
    """The reference's default (n_mixtures 1, spherical): the mean, the mean per-dimension (biased) variance +
    reg_covar, converged at the second iteration (the lower bound no longer changes)."""
    X = torch.randn(1, 30, 5, generator=torch.Generator().manual_seed(1), dtype=F64)
    mask = torch.ones(1, 30, dtype=torch.bool)
    w, mu, cov, it = fit_gmm(X, mask, mask.to(F64).unsqueeze(-1), "spherical", 1e-6, 1e-12, 10000)
    torch.testing.assert_close(mu[0, 0], X[0].mean(0))
    torch.testing.assert_close(cov[0, 0], X[0].var(0, unbiased=False).mean() + 1e-6)
    assert w.item() == 1.0 and it.item() == 2


def test_fit_groups_is_learn_gmm_per_client_and_class():
    """Rows of two clients, classes interleaved: each (client, class) with more than n_mixtures rows is fitted on
    exactly its rows (utils.py:75-87), whatever the chunking."""
    p = get_method("fedpft", {"n_mixtures": 2, "cov_type": "diag", "init": "random", "max_iter": 200}).p
    gen = torch.Generator().manual_seed(2)
    feats = torch.randn(90, 3, generator=gen)
    group = torch.randint(0, 5, (90,), generator=gen)
    order = torch.argsort(group, stable=True)
    rows, grp = order, group[order]
    out = fit_groups(feats, rows, grp, p, key=11)
    ids = torch.unique_consecutive(grp)
    for j, gid in enumerate(ids.tolist()):
        r = rows[grp == gid]
        X = feats[r].to(F64).unsqueeze(0)
        m = torch.ones(1, len(r), dtype=torch.bool)
        r0 = init_resp(X, m, 2, "random", torch.tensor([gid]), r.unsqueeze(0), 11)
        rw, rmu, rcov, _ = sk_fit(X[0].numpy(), r0[0].numpy(), "diag", 1e-6, p.tol, 200)
        np.testing.assert_allclose(out["means"][j].numpy(), rmu, rtol=1e-8, atol=1e-10)
        np.testing.assert_allclose(out["cov"][j].numpy(), rcov, rtol=1e-8, atol=1e-10)
        np.testing.assert_allclose(out["weights"][j].numpy(), rw, rtol=1e-8, atol=1e-10)


# ----------------------------------------------------------------------------------------------- the server
def sk_sample_given(z, mean, cov, cov_type):
    """sklearn ``sample``'s draw of one component, its standard normals ``z`` given."""
    if cov_type == "full":  # numpy RandomState.multivariate_normal: (u, s, v) = svd(cov)
        _, s, v = np.linalg.svd(cov)
        return mean + np.dot(z, np.sqrt(s)[:, None] * v)
    return mean + z * np.sqrt(cov)


@pytest.mark.parametrize("cov_type", ["spherical", "diag", "full"])
def test_noise_to_features_is_sklearns_sample(cov_type):
    rs = np.random.RandomState(0)
    D = 4
    A = rs.randn(D, D)
    cov = {"spherical": np.array(0.3), "diag": rs.rand(D) + 0.1, "full": A @ A.T + 0.1 * np.eye(D)}[cov_type]
    mean = rs.randn(D)
    z = rs.standard_normal(size=(6, D))
    ref = sk_sample_given(z, mean, cov, cov_type)
    fac = mixture_factor(torch.as_tensor(cov).unsqueeze(0), cov_type)  # one component
    m = torch.as_tensor(mean).expand(6, D)
    comp = torch.zeros(6, dtype=torch.int64)
    f = (lambda r: fac[comp[r]]) if cov_type == "full" else fac[comp]
    out = transform_noise(torch.as_tensor(z), m, f, cov_type)
    np.testing.assert_allclose(out.numpy(), ref, rtol=1e-10, atol=1e-12)


def test_sampling_counts_labels_and_moments():
    """num_samples draws per mixture with its label (strategy.py:110-115); components by the weights."""
    mix = {
        "label": torch.tensor([3, 1]),
        "count": torch.tensor([4000, 7]),
        "weights": torch.tensor([[0.25, 0.75], [1.0, 0.0]], dtype=torch.float16),
        "means": torch.tensor([[[-5.0, 0.0], [5.0, 1.0]], [[0.0, 0.0], [9.0, 9.0]]], dtype=torch.float16),
        "cov": torch.tensor([[0.5, 2.0], [1.0, 1.0]], dtype=torch.float16),
    }
    x, y = sample_mixtures(mix, "spherical", torch.Generator().manual_seed(0))
    assert x.shape == (4007, 2) and (y == 3).sum() == 4000 and (y == 1).sum() == 7
    a = x[y == 3]
    right = a[:, 0] > 0
    assert abs(right.double().mean().item() - 0.75) < 0.03
    assert abs(a[right, 1].mean().item() - 1.0) < 0.1 and abs(a[right, 0].var().item() - 2.0) < 0.2
    assert abs(a[~right, 0].var().item() - 0.5) < 0.1


def ref_train(head, loader, opt, num_epochs):
    """models.py:203-224 ``train`` (no feature extractor)."""
    for _ in range(num_epochs):
        for batch in loader:
            head.zero_grad()
            output = head(batch["img"])
            running_loss = torch.nn.CrossEntropyLoss()(output, batch["label"])
            running_loss.backward()
            opt.step()


def test_server_head_training_is_the_reference_train():
    from torch.utils.data import DataLoader

    g = torch.Generator().manual_seed(3)
    x = torch.randn(70, 5, generator=g)
    y = torch.randint(0, 3, (70,), generator=g)
    W0, b0 = linear_init(3, 5, torch.Generator().manual_seed(4))
    assert W0.abs().max() <= 1 / math.sqrt(5) and b0.abs().max() <= 1 / math.sqrt(5)
    head = torch.nn.Linear(5, 3)
    with torch.no_grad():
        head.weight.copy_(W0)
        head.bias.copy_(b0)
    data = [{"img": a, "label": c} for a, c in zip(x, y)]  # strategy.py:120-127
    loader = DataLoader(data, batch_size=32, shuffle=True, generator=torch.Generator().manual_seed(5))
    ref_train(head, loader, torch.optim.AdamW(head.parameters(), lr=1e-2), 3)
    W, b, _ = train_head(W0, b0, x, y, 3, 32, 1e-2, 0.01, torch.Generator().manual_seed(5))
    torch.testing.assert_close(W, head.weight.detach(), rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(b, head.bias.detach(), rtol=1e-6, atol=1e-7)


# ----------------------------------------------------------------------------------------------- end to end
def test_cli_two_rounds_one_shot_upload(tmp_path):
    store = synth_store(tmp_path / "s.zarr", dim=16, train_per_class=40, test_per_class=10)
    out = tmp_path / "runs"
    r = run_cli(["train", "--store", store, "--method", "fedpft", "--clients", "6", "--rounds", "2",
                 "--participation", "0.5", "--out", out, "--name", "p", "--quiet",
                 "--set", "server_epochs=20", "--set", "server_lr=1e-2"])  # fmt: skip
    assert r.exit_code == 0, r.output
    rows = [json.loads(line) for line in (out / "p" / "metrics.jsonl").read_text().splitlines()]
    assert [row["round"] for row in rows] == [0, 1, 2]
    assert rows[1]["bytes_up"] > 0 and rows[1]["mixtures_received"] > 0
    # a mixture (k = 1, spherical, D = 16): 16 + 1 + 1 float16 numbers, the label and count as int64
    assert rows[1]["bytes_up"] == rows[1]["mixtures_received"] * ((16 + 2) * 2 + 16)
    # round 2: the new clients' mixtures join round 1's (one-shot: the head is re-trained on all received)
    assert rows[2]["synthetic"] > rows[1]["synthetic"]
    # this store's classes overlap (FedAvg: 33% here after 2 rounds, all clients); chance 10, round 0 a random head.
    # The code's lr 1e-4 needs more steps than 20 epochs of a few hundred features: 1e-2 here
    assert rows[-1]["test_acc"] >= 30 and rows[0]["test_acc"] <= 15


def test_resampled_client_uploads_nothing_and_head_kept(tmp_path):
    store = synth_store(tmp_path / "s.zarr", dim=8, train_per_class=20, test_per_class=5)
    out = tmp_path / "runs"
    r = run_cli(["train", "--store", store, "--method", "fedpft", "--clients", "3", "--rounds", "2",
                 "--participation", "1", "--out", out, "--name", "q", "--quiet", "--set", "server_epochs=2"])  # fmt: skip
    assert r.exit_code == 0, r.output
    rows = [json.loads(line) for line in (out / "q" / "metrics.jsonl").read_text().splitlines()]
    assert rows[1]["bytes_up"] > 0 and rows[2]["bytes_up"] == 0
    assert rows[2]["test_acc"] == rows[1]["test_acc"]  # retrain="new": no new mixtures, the same head

"""CLIP2FL Table 1's baselines with server-side data or statistics: FedDF, FedBE, CCVR, Ratio Loss, and the server
data they share (``fedfeat.methods.serverdata``). Hand-computed cases of each paper's equation, ports of the
reference codes' functions run on the same inputs, and the batched engine against the loop engine."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from fedfeat.engine.context import Context
from fedfeat.engine.data import build_context, load_run_data
from fedfeat.engine.optim import BatchedSGD
from fedfeat.engine.rounds import run_federated
from fedfeat.errors import FedfeatError
from fedfeat.methods import get_method
from fedfeat.methods.ccvr import class_stats, merge_stats, sample_virtual
from fedfeat.methods.fedbe import fit_gaussian, sample_code, sharpen
from fedfeat.methods.feddf import teacher_targets
from fedfeat.methods.ratio_loss import ratio_from_updates, ratio_weights, train_class_copies
from fedfeat.methods.serverdata import DistillConfig, distill_head, draw_balanced, draw_set
from fedfeat.partition.make import make_partition
from fedfeat.store.synth import SynthParams, write_synthetic_store

F64 = torch.float64


@pytest.fixture(scope="module")
def lt(tmp_path_factory):
    """10 classes x 60 train, D = 16; CLIP2FL's long tail (IF 10) over 10 clients leaves most rows unassigned."""
    p = SynthParams(classes=10, dim=16, train_per_class=60, test_per_class=10, templates=2)
    st = write_synthetic_store(tmp_path_factory.mktemp("b") / "s.zarr", p, stats=False, log=lambda *_: None)
    part = make_partition(st.labels("train"), "dirichlet-equal", clients=10, alpha=0.5, imbalance_factor=10)
    return st, part


def _ctx(st, part, method, seed=0) -> Context:
    return build_context(load_run_data(st, part, dtype=F64), method, seed, torch.device("cpu"))


# ---------------------------------------------------------------------------------------------- server data
def test_unassigned_rows_are_the_ones_no_client_holds_seeded_and_normalised(lt):
    st, part = lt
    ctx = _ctx(st, part, get_method("feddf"))
    held = set(ctx.train_rows.tolist())
    s = draw_set(ctx, "unassigned", 40, True, tag=1, field="server_data")
    assert len(s) == 40 and s.y is None and not held & set(s.rows.tolist())
    torch.testing.assert_close(s.x.norm(dim=1), torch.ones(40, dtype=F64))
    raw = torch.from_numpy(st.features("train")[s.rows]).to(F64)
    torch.testing.assert_close(s.x, F.normalize(raw, dim=1))
    again = draw_set(ctx, "unassigned", 40, True, tag=1, field="server_data")
    other = draw_set(ctx, "unassigned", 40, True, tag=2, field="server_data")
    assert (again.rows == s.rows).all() and not (other.rows == s.rows).all()
    every = draw_set(ctx, "unassigned", 0, False, tag=1, field="server_data")
    assert len(every) == 600 - len(held)
    rest = draw_set(ctx, "unassigned", 0, False, tag=3, field="server_data", exclude=s.rows)
    assert len(rest) == len(every) - 40 and not set(rest.rows) & set(s.rows)


def test_balanced_set_has_per_class_rows_and_their_labels(lt):
    st, part = lt
    ctx = _ctx(st, part, get_method("ratio-loss"))
    s = draw_balanced(ctx, "train", 5, False, tag=1, field="aux_data", size_field="aux_per_class")
    assert s.y.tolist() == np.repeat(np.arange(10), 5).tolist()
    assert (st.labels("train")[s.rows] == s.y.numpy()).all()
    with pytest.raises(FedfeatError, match="aux_per_class"):  # the head class has no unassigned row left
        draw_balanced(ctx, "unassigned", 5, False, tag=1, field="aux_data", size_field="aux_per_class")


def test_empty_server_set_and_bad_sources_are_one_line_errors(lt):
    st, _ = lt
    full = make_partition(st.labels("train"), "dirichlet", clients=6, alpha=0.5, seed=1)  # every row assigned
    ctx = _ctx(st, full, get_method("feddf"))
    with pytest.raises(FedfeatError, match="imbalance-factor") as e:
        draw_set(ctx, "unassigned", 0, True, tag=1, field="server_data")
    assert "\n" not in str(e.value)
    with pytest.raises(FedfeatError, match="server_data"):
        get_method("feddf", {"server_data": "elsewhere"})
    with pytest.raises(FedfeatError, match="16-d"):
        other = write_synthetic_store(
            st.path.parent / "o.zarr", SynthParams(classes=10, dim=8, train_per_class=5, test_per_class=2,
            templates=1), stats=False, log=lambda *_: None,
        )  # fmt: skip
        draw_set(ctx, f"store:{other.path}", 0, True, tag=1, field="server_data")


def test_store_source_reads_another_stores_train_split(lt, tmp_path):
    st, part = lt
    ctx = _ctx(st, part, get_method("feddf"))
    p = SynthParams(classes=10, dim=16, train_per_class=7, test_per_class=2, templates=1, seed=5)
    other = write_synthetic_store(tmp_path / "c100.zarr", p, stats=False, log=lambda *_: None)
    s = draw_set(ctx, f"store:{other.path}", 0, False, tag=1, field="server_data")
    assert len(s) == 70
    torch.testing.assert_close(s.x, torch.from_numpy(other.features("train")[s.rows]).to(F64))


# ---------------------------------------------------------------------------------------------- FedDF
def test_feddf_teacher_two_samples_two_heads_hand_case():
    """K = 2, D = 2, logit scale 1, T = 1. Heads W1 = [[1, 0], [0, 0]], W2 = [[0, 0], [0, 1]], b = 0.
    x1 = (2, 0): logits (2, 0) and (0, 0); mean (1, 0) -> avg_logits softmax = (e/(e+1), 1/(e+1));
    avg_losses = ((e^2/(e^2+1) + 1/2) / 2, ...). x2 = (0, 2): mean logits (0, 1)."""
    W = torch.tensor([[[1.0, 0.0], [0.0, 0.0]], [[0.0, 0.0], [0.0, 1.0]]], dtype=F64)
    b = torch.zeros(2, 2, dtype=F64)
    x = torch.tensor([[2.0, 0.0], [0.0, 2.0]], dtype=F64)
    e = np.e
    t = teacher_targets(x, W, b, 1.0, 1.0, "avg_logits")
    np.testing.assert_allclose(
        t.numpy(), [[e / (e + 1), 1 / (e + 1)], [1 / (e + 1), e / (e + 1)]], rtol=1e-12
    )
    a = (e**2 / (e**2 + 1) + 0.5) / 2
    t = teacher_targets(x, W, b, 1.0, 1.0, "avg_losses")
    np.testing.assert_allclose(t.numpy(), [[a, 1 - a], [1 - a, a]], rtol=1e-12)
    t = teacher_targets(x, W, b, 1.0, 2.0, "avg_logits")  # T = 2: softmax((1, 0) / 2)
    s = np.exp(0.5) / (np.exp(0.5) + 1)
    np.testing.assert_allclose(t.numpy(), [[s, 1 - s], [1 - s, s]], rtol=1e-12)


def _feddf_reference(W0, b0, x, teachers, scale, T, steps, batch, lr, val, every, patience, seed, clip):
    """A port of FedDF's ``NoiseKTSolver.distillation`` (epfml/federated-learning-public-code@44dd555
    noise_knowledge_transfer.py) for a linear student: avg_logits, KL batchmean, Adam, CosineAnnealingLR,
    clip_grad_norm_ (5 there), validation every ``every`` batches, early stopping, best model returned."""
    lin = torch.nn.Linear(W0.shape[1], W0.shape[0], dtype=F64)
    with torch.no_grad():
        lin.weight.copy_(W0)
        lin.bias.copy_(b0)
    opt = torch.optim.Adam(lin.parameters(), lr=lr)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, steps, last_epoch=-1)
    g = torch.Generator().manual_seed(seed)
    order, pos, n = torch.empty(0, dtype=torch.int64), 0, 0
    best_perf, best_locs, best = None, [], None
    while n < steps:
        if pos >= len(order):
            order, pos = torch.randperm(len(x), generator=g), 0
        idx = order[pos : pos + batch]
        pos += batch
        teacher = sum(t[idx] / len(teachers) for t in teachers)  # avg_logits with weights 1 / n
        student = scale * lin(x[idx])
        loss = F.kl_div(F.log_softmax(student / T, 1), F.softmax(teacher / T, 1), reduction="batchmean")
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(lin.parameters(), clip)
        opt.step()
        sched.step()
        if (n + 1) % every == 0:
            with torch.no_grad():
                perf = float((lin(val[0]).argmax(1) == val[1]).double().mean())
            if best_perf is None or perf > best_perf:
                best_perf, best = perf, copy.deepcopy(lin)
                best_locs.append(n + 1)
            if n + 1 - (best_locs[-1] if best_locs else 0) >= patience:
                break
        n += 1
    return best.weight.detach(), best.bias.detach(), n + 1


@pytest.mark.parametrize("clip", [5.0, 0.01])  # 0.01: every step is clipped
def test_feddf_distillation_equals_a_port_of_the_reference_solver(clip):
    torch.manual_seed(0)
    K, D, S, m = 4, 6, 50, 3
    x = F.normalize(torch.randn(S, D, dtype=F64), dim=1)
    Wc, bc = torch.randn(m, K, D, dtype=F64), 0.1 * torch.randn(m, K, dtype=F64)
    W0, b0 = Wc.mean(0) + 0.3 * torch.randn(K, D, dtype=F64), bc.mean(0)
    val = (F.normalize(torch.randn(30, D, dtype=F64), dim=1), torch.randint(0, K, (30,)))
    scale, T = 3.0, 2.0
    teachers = [scale * (x @ Wc[i].T + bc[i]) for i in range(m)]
    Wr, br, n_ref = _feddf_reference(
        W0, b0, x, teachers, scale, T, 60, 16, 0.05, val, 4, 12, seed=3, clip=clip
    )
    cfg = DistillConfig(
        steps=60, batch=16, lr=0.05, loss="kl", temperature=T, optimizer="adam", schedule="cosine",
        clip_norm=clip, eval_every=4, patience=12,
    )  # fmt: skip
    target = teacher_targets(x, Wc, bc, scale, T, "avg_logits")
    W, b, info = distill_head(W0, b0, x, target, scale, cfg, torch.Generator().manual_seed(3), val=val)
    torch.testing.assert_close(W, Wr, atol=1e-9, rtol=1e-9)
    torch.testing.assert_close(b, br, atol=1e-9, rtol=1e-9)
    assert info["distill_steps"] == n_ref
    if clip == 5.0:  # early-stopped: the best (step 12) is 12 steps old at step 24, and is what comes back
        assert (n_ref, info["distill_best_step"]) == (24, 12)


def test_feddf_on_equal_clients_with_avg_logits_teaches_the_student_its_own_output():
    """Linear heads: the mean of the clients' logits is the logit of their mean head; with equal client sizes that
    is the FedAvg head, so FedDF's target is the student's own prediction and the first step's gradient is 0
    (rounding aside: Adam then amplifies rounding-level gradients to lr-sized steps, as it would in FedDF's code)."""
    torch.manual_seed(1)
    Wc, bc = torch.randn(4, 3, 5, dtype=F64), torch.randn(4, 3, dtype=F64)
    x = torch.randn(20, 5, dtype=F64)
    target = teacher_targets(x, Wc, bc, 1.0, 1.0, "avg_logits")
    torch.testing.assert_close(target, torch.softmax(x @ Wc.mean(0).T + bc.mean(0), -1), atol=1e-15, rtol=0)
    cfg = DistillConfig(steps=1, batch=8, lr=1e-3, optimizer="adam", clip_norm=5.0)
    W, b, info = distill_head(Wc.mean(0), bc.mean(0), x, target, 1.0, cfg, torch.Generator().manual_seed(0))
    assert info["distill_loss"] < 1e-14 and (W - Wc.mean(0)).abs().max() < 1e-10
    W, _, _ = distill_head(Wc[0], bc[0], x, target, 1.0, cfg, torch.Generator().manual_seed(0))
    assert (W - Wc[0]).abs().max() > 0.5e-3  # a real gradient: an lr-sized first Adam step


# ---------------------------------------------------------------------------------------------- FedBE
def test_fedbe_gaussian_fit_hand_case():
    """Two clients, sizes 1 and 3 (weights 1/4, 3/4); W entries 0 and 4 -> mu = 3, var = 1/4 9 + 3/4 1 = 3;
    b entries 2 and 2 -> mu = 2, var = 0."""
    params = {"W": torch.tensor([[[0.0]], [[4.0]]], dtype=F64), "b": torch.tensor([[2.0], [2.0]], dtype=F64)}
    mu, var = fit_gaussian(params, torch.tensor([1, 3]))
    assert mu["W"].item() == 3.0 and var["W"].item() == 3.0
    assert mu["b"].item() == 2.0 and var["b"].item() == 0.0


def _swag_server_reference(teachers, base, eps, var_scale, stepsize):
    """FedBE's ``SWAG_server`` (hongyouc/FedBE@7eeb965 swag.py: compute_mean_sq, compute_var, construct_models
    with mode="gaussian", concentrate_num=1), with the normal draw ``eps`` given."""
    out = {}
    for k in base:
        w_avg = torch.zeros_like(base[k])
        w_sq = torch.zeros_like(base[k])
        w_norm = 0.0
        for t in teachers:
            grad = t[k] - base[k]
            norm = torch.norm(grad, p=2)
            grad = grad / norm
            w_avg += grad
            w_sq += grad**2
            w_norm += norm
        w_avg, w_sq, w_norm = w_avg / len(teachers), w_sq / len(teachers), w_norm / len(teachers)
        var = torch.clamp(torch.clamp(w_sq - w_avg**2, 1e-5), 1e-6)
        sample = w_avg + torch.sqrt(var) * eps[k] * var_scale
        out[k] = sample * stepsize * w_norm + base[k]
    return out


def test_fedbe_code_gaussian_equals_the_reference_swag_server():
    torch.manual_seed(2)
    base = {"W": torch.randn(3, 4, dtype=F64), "b": torch.randn(3, dtype=F64)}
    cp = {k: v.unsqueeze(0) + 0.1 * torch.randn(5, *v.shape, dtype=F64) for k, v in base.items()}
    got = sample_code(cp, base, 2, torch.Generator().manual_seed(9), 0.1, 1.0)
    g = torch.Generator().manual_seed(9)
    eps = {k: torch.randn((2, *v.shape), generator=g, dtype=F64) for k, v in base.items()}  # same draws
    for i in range(2):
        ref = _swag_server_reference([{k: cp[k][j] for k in cp} for j in range(5)], base,
                                     {k: eps[k][i] for k in eps}, 0.1, 1.0)  # fmt: skip
        for k in base:
            torch.testing.assert_close(got[k][i], ref[k], atol=1e-12, rtol=1e-12)


def test_fedbe_sharpen_hand_case():
    """(3/4, 1/4) at t = 1/2: squares (9/16, 1/16), normalised (0.9, 0.1)."""
    np.testing.assert_allclose(sharpen(torch.tensor([[0.75, 0.25]], dtype=F64), 0.5).numpy(), [[0.9, 0.1]])


def test_fedbe_distillation_equals_sgd_with_torchcontrib_swa():
    """FedBE's ServerUpdate.train for a linear student: (P (log P - log Q)).mean(), SGD(1e-3 -> 0.2 here, momentum
    0.9, wd 1e-5), SWA averaging the iterate after steps c > swa_start with c % swa_freq == 0."""
    torch.manual_seed(4)
    K, D, S = 3, 5, 40
    x = torch.randn(S, D, dtype=F64)
    P = sharpen(torch.softmax(torch.randn(S, K, dtype=F64), 1), 0.5)
    W0, b0 = torch.randn(K, D, dtype=F64), torch.randn(K, dtype=F64)
    cfg = DistillConfig(steps=30, batch=8, lr=0.2, loss="kl_mean", optimizer="sgd", momentum=0.9,
                        weight_decay=1e-5, swa_start=10, swa_freq=4)  # fmt: skip
    W, b, info = distill_head(W0, b0, x, P, 2.0, cfg, torch.Generator().manual_seed(5))
    lin = torch.nn.Linear(D, K, dtype=F64)
    with torch.no_grad():
        lin.weight.copy_(W0)
        lin.bias.copy_(b0)
    opt = torch.optim.SGD(lin.parameters(), lr=0.2, momentum=0.9, weight_decay=1e-5)
    g = torch.Generator().manual_seed(5)
    bufs, n_avg, order, pos = None, 0, torch.empty(0, dtype=torch.int64), 0
    for c in range(1, 31):
        if pos >= len(order):
            order, pos = torch.randperm(S, generator=g), 0
        idx = order[pos : pos + 8]
        pos += 8
        q = torch.softmax(2.0 * lin(x[idx]), -1)
        loss = (P[idx] * (P[idx].log() - q.log())).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        if c > 10 and c % 4 == 0:
            cur = [lin.weight.detach().clone(), lin.bias.detach().clone()]
            bufs = cur if bufs is None else [bf + (p - bf) / (n_avg + 1) for bf, p in zip(bufs, cur)]
            n_avg += 1
    assert info["swa_snapshots"] == n_avg == 5  # steps 12, 16, 20, 24, 28
    torch.testing.assert_close(W, bufs[0], atol=1e-10, rtol=1e-10)
    torch.testing.assert_close(b, bufs[1], atol=1e-10, rtol=1e-10)


# ---------------------------------------------------------------------------------------------- CCVR
def test_ccvr_global_gaussian_from_two_clients_equals_the_pooled_data():
    """Eq. 3-4 from two clients' (N, mean, unbiased covariance) per class give the pooled data's mean and unbiased
    covariance; class 2 is held once by each client (each has no covariance: N - 1 = 0), class 1 by one client."""
    torch.manual_seed(5)
    D = 3
    x1, y1 = torch.randn(7, D, dtype=F64), torch.tensor([0, 0, 0, 1, 1, 1, 2])
    x2, y2 = torch.randn(5, D, dtype=F64) + 1, torch.tensor([0, 0, 0, 0, 2])
    N, mu, Sigma = merge_stats([class_stats(x1, y1, 4), class_stats(x2, y2, 4)])
    x, y = torch.cat([x1, x2]), torch.cat([y1, y2])
    assert N.tolist() == [7, 3, 2, 0]
    for c in range(3):
        torch.testing.assert_close(mu[c], x[y == c].mean(0), atol=1e-12, rtol=0)
        torch.testing.assert_close(Sigma[c], torch.cov(x[y == c].T), atol=1e-12, rtol=0)
    assert (Sigma[3] == 0).all() and (mu[3] == 0).all()


def test_ccvr_virtual_features_follow_the_class_gaussians():
    """20,000 draws: sample mean / covariance within 0.05 of (mu, Sigma); a rank-1 covariance (a class of two
    points) keeps every draw on the line through them; an unheld class gets none."""
    torch.manual_seed(6)
    A = torch.randn(3, 3, dtype=F64)
    S0 = A @ A.T + 0.1 * torch.eye(3, dtype=F64)
    v = torch.tensor([1.0, 2.0, 0.0], dtype=F64)
    S1 = torch.outer(v, v) / 2
    N, mu = torch.tensor([10, 2, 0]), torch.tensor([[1.0, 0, 0], [0, 1, 0], [0, 0, 0]], dtype=F64)
    x, y = sample_virtual(N, mu, torch.stack([S0, S1, torch.zeros(3, 3, dtype=F64)]), 20000,
                          torch.Generator().manual_seed(0))  # fmt: skip
    assert y.tolist() == [0] * 20000 + [1] * 20000
    torch.testing.assert_close(x[y == 0].mean(0), mu[0], atol=0.05, rtol=0)
    torch.testing.assert_close(torch.cov(x[y == 0].T), S0, atol=0.05, rtol=0.03)
    d = x[y == 1] - mu[1]
    assert torch.linalg.matrix_rank(d.T @ d).item() == 1
    torch.testing.assert_close(torch.cov(x[y == 1].T), S1, atol=0.05, rtol=0.03)


# ---------------------------------------------------------------------------------------------- Ratio Loss
def test_ratio_hand_case():
    """K = 2 classes, D = 2; updates Delta_p[r, d] of the aux copies:
    Delta_0 = [[2, 0.1], [-1, 0.5]], Delta_1 = [[-1, 0.09], [3, 1]].
    (0,0): max 2 (class 0), |-1|/2 = 0.5 -> class 0's. (0,1): 0.09/0.1 = 0.9 > 0.8 -> nobody's.
    (1,0): max 3 (class 1), 1/3 -> class 1's. (1,1): max 1 (class 1), 0.5 -> class 1's.
    Ra_0 = |2| / |-1| = 2; Ra_1 = |3 + 1| / |-1 + 0.5| = 8; weights 1 + 0.1 Ra = (1.2, 1.8)."""
    delta = torch.tensor([[[2.0, 0.1], [-1.0, 0.5]], [[-1.0, 0.09], [3.0, 1.0]]], dtype=F64)
    ra = ratio_from_updates(delta)
    np.testing.assert_allclose(ra.numpy(), [2.0, 8.0])
    np.testing.assert_allclose(ratio_weights(ra, 1.0, 0.1, 5000.0).numpy(), [1.2, 1.8])
    np.testing.assert_allclose(ratio_weights(torch.tensor([9000.0]), 1.0, 0.1, 5000.0).numpy(), [501.0])
    # class 1 owns (1, 0) only, where class 0 did not move: denominator 0 -> the code's 10
    z = torch.tensor([[[1.0]], [[0.0]]], dtype=F64).expand(2, 2, 1).clone()
    z[1, 1, 0], z[0, 1, 0] = 2.0, 0.0
    np.testing.assert_allclose(ratio_from_updates(z).numpy()[1], 10.0)


def _ratio_reference(w_glob, cc):
    """balanced-fl/Addressing-Class-Imbalance-FL@cd0e996 FEMNIST-4-Losses/models/Fed.py: outlier_detect ->
    search_neuron_new, then whole_determination (numpy, loops; 26 classes and 512 inputs made general)."""
    w = np.array([(c - w_glob) * 100 for c in cc])
    P, R, Dd = w.shape
    pos = np.zeros((P, R, Dd))
    for i in range(R):
        for j in range(Dd):
            temp = [w[p, i, j] for p in range(P)]
            mi = temp.index(max(temp))
            if w[mi, i, j] == 0:
                outlier = np.where(np.array(temp) == w[mi, i, j])
            else:
                outlier = np.where(np.abs(temp) / abs(w[mi, i, j]) > 0.80)
            if len(outlier[0]) < 2:
                pos[mi, i, j] = 1
    res_all = []
    for it in range(P):
        aux_sum = aux_other = 0
        for i in range(R):
            for j in range(Dd):
                if pos[it, i, j] == 1:
                    temp = np.delete(np.array([cc[p][i, j] - w_glob[i, j] for p in range(P)]), it)
                    aux_sum += cc[it][i, j] - w_glob[i, j]
                    aux_other += np.sum(temp) / (P - 1)
        res = abs(aux_sum) / abs(aux_other) if aux_other != 0 else 10
        res_all.append(1.0 + 0.1 * min(res, 5000))
    return np.array(res_all)


def test_ratio_weights_equal_a_port_of_the_reference_monitor():
    rs = np.random.default_rng(0)
    K, D = 5, 7
    w_glob = rs.normal(size=(K, D))
    cc = [w_glob + rs.normal(size=(K, D)) * 0.1 for _ in range(K)]
    for p in range(K):  # each copy pushes its own class's row up, as training on that class alone does
        cc[p][p] += np.abs(rs.normal(size=D))
    delta = torch.from_numpy(np.stack(cc) - w_glob[None])
    got = ratio_weights(ratio_from_updates(delta), 1.0, 0.1, 5000.0)
    np.testing.assert_allclose(got.numpy(), _ratio_reference(w_glob, cc), rtol=1e-9)


def test_monitor_copies_equal_torch_sgd_per_class():
    """Copy p of the head trained on class p's auxiliary features (CE, label p) = torch.optim.SGD on an nn.Linear,
    the same shuffles (one argsort of uniforms per copy and epoch)."""
    torch.manual_seed(7)
    K, A, D = 3, 5, 4
    x = torch.randn(K, A, D, dtype=F64)
    W0, b0 = torch.randn(K, D, dtype=F64), torch.randn(K, dtype=F64)
    opt = BatchedSGD(lr=0.3, momentum=0.5, weight_decay=0.01)
    got = train_class_copies(W0, b0, x, 2.0, 2, 2, opt, torch.Generator().manual_seed(1))
    g = torch.Generator().manual_seed(1)
    orders = [torch.argsort(torch.rand(K, A, generator=g), dim=1) for _ in range(2)]
    for p in range(K):
        lin = torch.nn.Linear(D, K, dtype=F64)
        with torch.no_grad():
            lin.weight.copy_(W0)
            lin.bias.copy_(b0)
        sgd = torch.optim.SGD(lin.parameters(), lr=0.3, momentum=0.5, weight_decay=0.01)
        for e in range(2):
            for s in range(0, A, 2):
                xb = x[p, orders[e][p, s : s + 2]]
                loss = F.cross_entropy(2.0 * lin(xb), torch.full((len(xb),), p))
                sgd.zero_grad()
                loss.backward()
                sgd.step()
        torch.testing.assert_close(got[p], lin.weight.detach(), atol=1e-12, rtol=1e-12)


# ---------------------------------------------------------------------------------------------- whole methods
SMALL = {"local_epochs": "2", "batch_size": "8"}
CASES = [
    ("feddf", {**SMALL, "ensemble": "avg_losses", "distill_steps": "40", "distill_batch": "16", "val_size": "30",
               "eval_every": "5", "patience": "15", "temperature": "2"}),
    # avg_probs here: with avg_logits the target is ~the student's own output on these near-equal clients, and
    # Adam turns the engines' rounding differences (1e-15) into lr-sized steps (the test above)
    ("feddf", {**SMALL, "early_stopping": "none", "distill_steps": "20", "server_size": "64",
               "ensemble": "avg_probs"}),
    ("fedbe", {**SMALL, "server_size": "100", "distill_epochs": "3", "distill_batch": "16", "swa_start": "5",
               "swa_freq": "3", "samples": "4"}),
    ("fedbe", {**SMALL, "server_size": "100", "distill_epochs": "2", "gaussian": "code", "samples": "3"}),
    ("ccvr", {**SMALL, "virtual_per_class": "20", "calib_epochs": "2", "calibrate": "every"}),
    ("ratio-loss", {**SMALL, "aux_per_class": "6"}),
]  # fmt: skip


def _run(lt, name, sets, engine, kernel="auto", rounds=3):
    st, part = lt
    m = get_method(name, sets)
    return run_federated(
        m, load_run_data(st, part, dtype=F64), rounds=rounds, participation=0.5, seed=0, engine=engine,
        kernel=kernel,
    )  # fmt: skip


@pytest.mark.parametrize("name, sets", CASES, ids=[f"{n}-{i}" for i, (n, _) in enumerate(CASES)])
def test_batched_equals_loop(lt, name, sets):
    gl, ml = _run(lt, name, sets, "loop")
    kernels = ["torch", "fused"] if get_method(name, sets).has_fused() else ["torch"]
    for kernel in kernels:
        gb, mb = _run(lt, name, sets, "batched", kernel)
        assert [r["clients"] for r in mb] == [r["clients"] for r in ml]
        np.testing.assert_allclose([r["test_acc"] for r in mb], [r["test_acc"] for r in ml], atol=1e-9)
        np.testing.assert_allclose(
            [r["train_loss"] for r in mb[1:]], [r["train_loss"] for r in ml[1:]], rtol=1e-9
        )
        assert set(gb) == set(gl)
        for k in gb:
            torch.testing.assert_close(gb[k], gl[k], atol=1e-9, rtol=1e-9)
        for key in ("distill_loss", "fedavg_head_acc", "calib_loss", "ratio_weights"):
            if key in mb[-1]:
                np.testing.assert_allclose(mb[-1][key], ml[-1][key], rtol=1e-9, atol=1e-9)


def test_feddf_and_fedbe_change_the_fedavg_head(lt):
    for name, sets in CASES[:3]:
        g, met = _run(lt, name, sets, "batched", rounds=1)
        assert met[1]["distill_steps"] > 0 and met[1]["server_rows"] > 0
    _, met = _run(lt, "fedbe", CASES[2][1], "batched", rounds=1)
    assert met[1]["ensemble_size"] == 1 + 4 + 5 and met[1]["swa_snapshots"] > 0  # mean + M + 5 clients


def test_ratio_loss_round_one_is_fedavg_and_later_weights_differ(lt):
    """Round 1 trains with weights 1 (plain CE): the same global head as fedavg with the same local protocol."""
    sets = {**SMALL, "lr": "0.1", "momentum": "0", "weight_decay": "0"}
    gf, _ = _run(lt, "fedavg", sets, "batched", kernel="torch", rounds=1)
    gr, mr = _run(lt, "ratio-loss", {**sets, "aux_per_class": "6"}, "batched", rounds=1)
    torch.testing.assert_close(gr["W"], gf["W"], atol=1e-12, rtol=0)
    w = np.array(mr[1]["ratio_weights"])
    assert (w >= 1).all() and w.std() > 0


def test_ccvr_final_equals_every_at_the_last_round_and_clients_train_fedavg(lt):
    sets = {**SMALL, "virtual_per_class": "20", "calib_epochs": "2"}
    gf, mf = _run(lt, "ccvr", {**sets, "calibrate": "final"}, "batched")
    ge, me = _run(lt, "ccvr", {**sets, "calibrate": "every"}, "batched")
    ga, ma = _run(lt, "fedavg", {**SMALL, "lr": "0.1", "momentum": "0", "weight_decay": "0"}, "batched")
    assert mf[-1]["test_acc"] == me[-1]["test_acc"] and mf[-1]["fedavg_head_acc"] == ma[-1]["test_acc"]
    assert (gf["W_cal"] - gf["W"]).abs().max() > 1e-3  # the calibrated head is another head
    assert [r["test_acc"] for r in mf[:-1]] == [r["test_acc"] for r in ma[:-1]]  # final: FedAvg until the end
    torch.testing.assert_close(gf["W"], ga["W"], atol=1e-9, rtol=0)  # the calibration is never sent back
    torch.testing.assert_close(gf["W_cal"], ge["W_cal"], atol=1e-12, rtol=0)
    assert mf[-1]["bytes_up"] > ma[-1]["bytes_up"] and me[1]["bytes_up"] > ma[1]["bytes_up"]
    assert me[2]["bytes_up"] == ma[2]["bytes_up"]  # the statistics go up once


def test_registry_defaults_and_validation():
    for name in ("feddf", "fedbe", "ccvr", "ratio-loss"):
        p = get_method(name).p
        assert (p.local_epochs, p.batch_size, p.lr, p.momentum, p.weight_decay) == (10, 32, 0.1, 0.0, 0.0)
    assert get_method("fedbe").p.samples == 10 and get_method("ccvr").p.virtual_per_class == 2000
    for name, bad in [("feddf", {"distill_steps": "0"}), ("fedbe", {"sharpen_temperature": "0"}),
                      ("ccvr", {"virtual_per_class": "0"}), ("ratio-loss", {"dominance": "1.5"}),
                      ("ratio-loss", {"aux_data": "somewhere"})]:  # fmt: skip
        with pytest.raises(FedfeatError):
            get_method(name, bad)

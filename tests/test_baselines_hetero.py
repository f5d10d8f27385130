"""CLIP2FL Table 1's FedNova, Fed-Focal Loss and FedAvg + tau-norm: hand-computed numbers and batched == loop."""

from __future__ import annotations

import math
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from fedfeat.engine.context import RoundPlan, make_plan
from fedfeat.engine.data import build_context, load_run_data
from fedfeat.engine.rounds import run_federated, run_local
from fedfeat.errors import FedfeatError
from fedfeat.methods import get_method
from fedfeat.methods.fednova import normalizing_vec
from fedfeat.partition.make import make_partition
from fedfeat.store.synth import SynthParams, write_synthetic_store


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    """10 classes x 60 train, D = 16; Dirichlet alpha 0.1 over 12 clients of ragged sizes (different local steps)."""
    p = SynthParams(classes=10, dim=16, train_per_class=60, test_per_class=10, templates=1)
    st = write_synthetic_store(tmp_path_factory.mktemp("h") / "s.zarr", p, stats=False, log=lambda *_: None)
    part = make_partition(st.labels("train"), "dirichlet", clients=12, alpha=0.1, seed=2)
    steps = -(-part.sizes() // 16)
    assert len(set(steps.tolist())) > 2  # clients take different numbers of local steps at batch 16
    return st, part


def _run(small, name, sets, engine, kernel="auto", rounds=2, participation=0.5, dtype=torch.float32):
    st, part = small
    data = load_run_data(st, part, dtype=dtype)
    return run_federated(
        get_method(name, sets),
        data,
        rounds=rounds,
        participation=participation,
        seed=0,
        engine=engine,
        kernel=kernel,
    )


CASES = [
    (
        "fednova",
        {"batch_size": "16", "local_epochs": "2"},
    ),  # LinearHead defaults: momentum 0.9 -> momentum a_i
    (
        "fednova",
        {"batch_size": "16", "momentum": "0", "weight_decay": "0", "lr": "0.1"},
    ),  # CLIP2FL's local SGD
    (
        "fednova",
        {"batch_size": "16", "mu": "0.5", "gmf": "0.5", "tau_eff": "steps", "weight_decay_in_a": "true"},
    ),
    ("fednova", {"batch_size": "16", "weights": "population"}),
    ("fed-focal", {"batch_size": "16", "local_epochs": "2"}),
    ("fed-focal", {"batch_size": "16", "gamma": "0.5", "logit_scale": "10"}),
    ("fedavg-tau-norm", {"batch_size": "16", "local_epochs": "2"}),
    ("fedavg-tau-norm", {"batch_size": "16", "tau": "0.5", "bias": "keep"}),
]


@pytest.mark.parametrize("name, sets", CASES, ids=[f"{n}-{i}" for i, (n, _) in enumerate(CASES)])
def test_batched_equals_loop(small, name, sets):
    gl, ml = _run(small, name, sets, "loop")
    kernels = ["torch", "fused"] if get_method(name, sets).has_fused() else ["torch"]
    for kernel in kernels:
        gb, mb = _run(small, name, sets, "batched", kernel=kernel)
        assert gb.keys() == gl.keys()
        for k in gb:
            torch.testing.assert_close(gb[k], gl[k], atol=1e-5, rtol=1e-5)
        np.testing.assert_allclose([r["test_acc"] for r in mb], [r["test_acc"] for r in ml], atol=1e-5)
        np.testing.assert_allclose(
            [r["train_loss"] for r in mb[1:]], [r["train_loss"] for r in ml[1:]], rtol=1e-5
        )


def test_kernels():
    """FedNova and tau-norm train as FedAvg (FedProx with mu) and so keep the fused kernel; the focal loss has none."""
    assert get_method("fednova").has_fused() and get_method("fednova", {"mu": "0.1"}).has_fused()
    assert get_method("fednova", {"mu": "0.1"}).fused_loss() == (0, 0.1, 1.0, 0.0)  # FedProx's kernel term
    assert get_method("fedavg-tau-norm").has_fused()
    assert not get_method("fed-focal").has_fused()


# ---------------------------------------------------------------------------------------------------------- FedNova
def _reference_a(tau: int, rho: float, etamu: float) -> float:
    """JYWa/FedNova distoptim/FedNova.py:151-162, run once per local step (``local_normalizing_vec``)."""
    vec, counter = 0, 0
    for _ in range(tau):
        if rho != 0:
            counter = counter * rho + 1
            vec += counter
        if etamu != 0:
            vec *= 1 - etamu
            vec += 1
        if rho == 0 and etamu == 0:
            vec += 1
    return vec


@pytest.mark.parametrize("rho", [0.0, 0.5, 0.9, 0.99])
@pytest.mark.parametrize("etamu", [0.0, 0.01, 0.3])
def test_normalizing_vec_equals_the_reference(rho, etamu):
    taus = [0, 1, 2, 3, 7, 40, 157]
    got = normalizing_vec(torch.tensor(taus), rho, etamu).tolist()
    np.testing.assert_allclose(got, [_reference_a(t, rho, etamu) for t in taus], rtol=1e-12, atol=1e-12)
    if (
        etamu == 0 and rho
    ):  # the paper's momentum case in closed form: [tau - rho (1 - rho^tau) / (1 - rho)] / (1 - rho)
        closed = [(t - rho * (1 - rho**t) / (1 - rho)) / (1 - rho) for t in taus]
        np.testing.assert_allclose(got, closed, rtol=1e-12, atol=1e-12)
    if rho == 0 and etamu:  # the paper's FedProx case: [1 - (1 - eta mu)^tau] / (eta mu)
        np.testing.assert_allclose(
            got, [(1 - (1 - etamu) ** t) / etamu for t in taus], rtol=1e-12, atol=1e-12
        )


def _plan(sizes, steps, epochs, rnd=1):
    m = len(sizes)
    return RoundPlan(rnd, torch.arange(m), torch.tensor(sizes), torch.tensor(steps), 10, epochs)


def _ctx(total):
    return SimpleNamespace(device=torch.device("cpu"), offsets=torch.tensor([0, total]), state={})


def test_fednova_aggregation_vanilla_sgd_by_hand():
    """Three clients, plain SGD: n = (10, 20, 30) -> p = (1/6, 1/3, 1/2); steps per epoch (1, 2, 3) x 2 epochs ->
    tau = a = (2, 4, 6); tau_eff = 2/6 + 4/3 + 6/2 = 14/3. Updates x - x_i = (2, 0), (0, 4), (6, 6), i.e. per step
    (1, 0), (0, 1), (1, 1): x_new = x - 14/3 [(1, 0)/6 + (0, 1)/3 + (1, 1)/2] = x - 14/3 (2/3, 5/6)
    = x - (28/9, 35/9). FedAvg would give x - (1/3 + 3, 4/3 + 3) = x - (10/3, 13/3)."""
    m = get_method("fednova", {"momentum": "0", "weight_decay": "0", "lr": "0.1"})
    glob = {
        "W": torch.tensor([[1.0, -1.0]], dtype=torch.float64),
        "b": torch.tensor([0.5], dtype=torch.float64),
    }
    delta = torch.tensor([[2.0, 0.0], [0.0, 4.0], [6.0, 6.0]], dtype=torch.float64)
    cp = {
        "W": glob["W"] - delta.unsqueeze(1),
        "b": glob["b"] - torch.tensor([[1.0], [2.0], [3.0]], dtype=torch.float64),
    }
    new = m.aggregate(_ctx(60), _plan([10, 20, 30], [1, 2, 3], 2), glob, cp)
    torch.testing.assert_close(new["W"], torch.tensor([[1 - 28 / 9, -1 - 35 / 9]], dtype=torch.float64))
    # b: per-step updates 1/2, 2/4, 3/6 = 1/2 each -> x - 14/3 * 1/2 = 0.5 - 7/3
    torch.testing.assert_close(new["b"], torch.tensor([0.5 - 7 / 3], dtype=torch.float64))


def test_fednova_aggregation_momentum_by_hand():
    """Momentum 0.5, two clients with tau = (2, 4): a = (1 + 1.5, 1 + 1.5 + 1.75 + 1.875) = (2.5, 6.125); n = (10, 30)
    -> p = (1/4, 3/4). Updates 2.5 and 12.25 (per unit of a: 1 and 2). tau_eff = a: 0.625 + 4.59375 = 5.21875,
    x_new = x - 5.21875 (1/4 + 3/2) = x - 9.1328125; tau_eff = steps: 1/2 + 3 = 3.5, x_new = x - 6.125;
    weights = population (40 of 80 samples in the round): p = (1/8, 3/8), tau_eff = 2.609375,
    x_new = x - 2.609375 * 0.875 = x - 2.283203125."""
    glob = {"W": torch.zeros(1, 1, dtype=torch.float64), "b": torch.zeros(1, dtype=torch.float64)}
    cp = {
        "W": -torch.tensor([2.5, 12.25], dtype=torch.float64).view(2, 1, 1),
        "b": torch.zeros(2, 1, dtype=torch.float64),
    }
    plan = _plan([10, 30], [1, 2], 2)
    for sets, want in [
        ({}, -9.1328125),
        ({"tau_eff": "steps"}, -6.125),
        ({"weights": "population"}, -2.283203125),
    ]:
        m = get_method("fednova", {"momentum": "0.5", "weight_decay": "0", **sets})
        assert float(m.aggregate(_ctx(80), plan, glob, cp)["W"]) == pytest.approx(want, abs=1e-12), sets


def test_fednova_proximal_and_weight_decay_a_by_hand():
    """lr 0.1, mu 1: a_i of proximal SGD after 2 steps is 1 + (1 - 0.1) = 1.9; with weight_decay_in_a and
    weight_decay 1, lr (mu + wd) = 0.2 and a = 1 + 0.8 = 1.8. One client: x_new = x - tau_eff (x - x_1) / a
    = x - (x - x_1) whatever a is (tau_eff = a); with tau_eff = steps: x - 2 (x - x_1) / 1.9."""
    glob = {"W": torch.zeros(1, 1, dtype=torch.float64), "b": torch.zeros(1, dtype=torch.float64)}
    cp = {"W": -torch.ones(1, 1, 1, dtype=torch.float64), "b": torch.zeros(1, 1, dtype=torch.float64)}
    plan = _plan([5], [1], 2)
    base = {"momentum": "0", "lr": "0.1", "mu": "1", "tau_eff": "steps"}
    m = get_method("fednova", {**base, "weight_decay": "0"})
    assert float(m.aggregate(_ctx(5), plan, glob, cp)["W"]) == pytest.approx(-2 / 1.9, abs=1e-12)
    m = get_method("fednova", {**base, "weight_decay": "1", "weight_decay_in_a": "true"})
    assert float(m.aggregate(_ctx(5), plan, glob, cp)["W"]) == pytest.approx(-2 / 1.8, abs=1e-12)
    m = get_method("fednova", {**base, "weight_decay": "1"})  # the reference: weight decay leaves a_i alone
    assert float(m.aggregate(_ctx(5), plan, glob, cp)["W"]) == pytest.approx(-2 / 1.9, abs=1e-12)
    m = get_method("fednova", {**base, "tau_eff": "a", "weight_decay": "0"})
    assert float(m.aggregate(_ctx(5), plan, glob, cp)["W"]) == pytest.approx(-1.0, abs=1e-12)


def test_fednova_server_momentum_by_hand():
    """gmf 0.9, lr 0.1 decaying by 0.5 a round (FedNova.py:194-203, buffer in units of update / lr).
    Round 1: d = 0 - (-1) = 1, buf = 1 / 0.1 = 10, x = 0 - 0.1 * 10 = -1.
    Round 2 (lr 0.05): d = -1 - (-1.5) = 0.5, buf = 0.9 * 10 + 0.5 / 0.05 = 19, x = -1 - 0.05 * 19 = -1.95."""
    m = get_method("fednova", {"gmf": "0.9", "lr": "0.1", "lr_decay": "0.5"})
    ctx = _ctx(1)
    m.setup(ctx)
    t = lambda v: {"W": torch.tensor([[v]], dtype=torch.float64)}  # noqa: E731
    x1 = m.server_update(ctx, _plan([1], [1], 1, rnd=1), t(0.0), t(-1.0))
    assert float(x1["W"]) == pytest.approx(-1.0, abs=1e-12)
    x2 = m.server_update(ctx, _plan([1], [1], 1, rnd=2), x1, t(-1.5))
    assert float(x2["W"]) == pytest.approx(-1.95, abs=1e-12)
    assert (
        get_method("fednova").server_update(ctx, None, t(0.0), t(-1.0))["W"] == -1.0
    )  # gmf 0: the update as is


def test_fednova_round_is_the_formula_on_the_local_models(small):
    """One round of every client through run_federated equals the paper's formula applied by hand (numpy, the
    closed-form momentum a_i) to the clients' local models from run_local, and differs from FedAvg's average."""
    st, part = small
    data = load_run_data(st, part, dtype=torch.float64)
    sets = {"batch_size": "16", "local_epochs": "2", "momentum": "0.5"}
    m = get_method("fednova", sets)
    glob_fed, _ = run_federated(m, data, rounds=1, participation=1.0, seed=0, kernel="torch")
    ctx = build_context(data, m, 0, torch.device("cpu"))
    glob0 = m.init_global(ctx)
    plan = make_plan(ctx, 1, np.arange(part.n_clients), 16, 2)
    cp, _ = run_local(m, ctx, plan, glob0)
    tau = (plan.steps * 2).numpy().astype(float)
    a = (tau - 0.5 * (1 - 0.5**tau) / 0.5) / 0.5
    p = plan.sizes.numpy() / plan.sizes.numpy().sum()
    coef = p * (p * a).sum() / a
    for k in ("W", "b"):
        x0, xi = glob0[k].numpy(), cp[k].numpy()
        want = x0 - np.tensordot(coef, x0[None] - xi, axes=1)
        np.testing.assert_allclose(glob_fed[k].numpy(), want, rtol=1e-10, atol=1e-12)
        fedavg = np.tensordot(p, xi, axes=1)
        assert np.abs(want - fedavg).max() > 1e-4  # ragged steps: the normalisation changes the average


def test_fednova_bad_values_are_one_line_errors():
    for sets in ({"gmf": "1"}, {"mu": "-1"}, {"mu": "20", "lr": "0.1"}):
        with pytest.raises(FedfeatError, match="--set"):
            get_method("fednova", sets)


# ------------------------------------------------------------------------------------------------------- Fed-Focal
def test_focal_loss_by_hand():
    """Logits (2, 0, -1) with label 0 and (0, 0, 0) with label 2, gamma 2:
    p_0 = e^2 / (e^2 + 1 + e^-1) -> loss (1 - p_0)^2 (-log p_0); uniform p = 1/3 -> (2/3)^2 log 3."""
    m = get_method("fed-focal")
    z = torch.tensor([[[2.0, 0.0, -1.0], [0.0, 0.0, 0.0]]], dtype=torch.float64)  # [n=1, B=2, K=3]
    y = torch.tensor([[0, 2]])
    p0 = math.exp(2) / (math.exp(2) + 1 + math.exp(-1))
    want = [(1 - p0) ** 2 * -math.log(p0), (2 / 3) ** 2 * math.log(3)]
    np.testing.assert_allclose(m.sample_loss(None, z, y, {})[0].numpy(), want, rtol=1e-12)
    m0 = get_method("fed-focal", {"gamma": "0"})  # gamma 0: cross-entropy
    np.testing.assert_allclose(
        m0.sample_loss(None, z, y, {})[0].numpy(), [-math.log(p0), math.log(3)], rtol=1e-12
    )
    m5 = get_method("fed-focal", {"gamma": "0.5"})
    np.testing.assert_allclose(
        m5.sample_loss(None, z, y, {})[0].numpy(),
        [(1 - p0) ** 0.5 * -math.log(p0), (2 / 3) ** 0.5 * math.log(3)],
    )


def test_focal_gradient_is_finite_when_a_sample_is_certain():
    z = torch.tensor([[[200.0, 0.0]]], requires_grad=True)  # p_t == 1 in float32
    loss = get_method("fed-focal", {"gamma": "0.5"}).sample_loss(None, z, torch.tensor([[0]]), {})
    (g,) = torch.autograd.grad(loss.sum(), z)
    assert float(loss.detach()) == 0.0 and torch.isfinite(g).all()


def test_focal_with_gamma_zero_trains_as_fedavg(small):
    gf, _ = _run(small, "fed-focal", {"batch_size": "16", "gamma": "0"}, "batched", dtype=torch.float64)
    ga, _ = _run(small, "fedavg", {"batch_size": "16"}, "batched", kernel="torch", dtype=torch.float64)
    gf2, _ = _run(small, "fed-focal", {"batch_size": "16"}, "batched", dtype=torch.float64)
    for k in ga:
        torch.testing.assert_close(gf[k], ga[k], atol=1e-12, rtol=0)
    assert not torch.allclose(gf2["W"], ga["W"], atol=1e-6)  # gamma 2 is not cross-entropy


# ------------------------------------------------------------------------------------------------------ tau-norm
def test_tau_norm_logits_by_hand():
    """W = ((6, 8), (0, 2)) (norms 10 and 2), b = (1, -1), x = (0, 1): the plain head gives (8 + 1, 2 - 1) and
    predicts class 0; tau = 1 drops the norms: (0.8, 1.0), class 1; tau = 0.5: (8 / sqrt 10, 2 / sqrt 2);
    bias kept at tau = 1: (1.8, 0.0)."""
    glob = {"W": torch.tensor([[6.0, 8.0], [0.0, 2.0]], dtype=torch.float64), "b": torch.tensor([1.0, -1.0])}
    glob["b"] = glob["b"].double()
    x = torch.tensor([[0.0, 1.0]], dtype=torch.float64)
    ctx = SimpleNamespace(test_x=x, test_xT=lambda: x.T.contiguous(), open_vocab=None)
    other = SimpleNamespace(test_x=None)
    cases = [
        ({}, [0.8, 1.0]),
        ({"tau": "0.5"}, [8 / math.sqrt(10), math.sqrt(2)]),
        ({"bias": "keep"}, [1.8, 0.0]),
    ]
    for sets, want in cases:
        m = get_method("fedavg-tau-norm", sets)
        for c in (ctx, other):  # the cached test-set path and a plain batch
            np.testing.assert_allclose(m.predict(c, glob, x).numpy(), [want], rtol=1e-12, atol=1e-12)
    m = get_method("fedavg-tau-norm", {"tau": "0"})  # tau 0 without bias: the plain head's x W^T
    np.testing.assert_allclose(m.predict(other, glob, x).numpy(), [[8.0, 2.0]], rtol=1e-12)
    w = get_method("fedavg-tau-norm").final_weights(ctx, glob)
    assert set(w) == {"W", "b", "W_tau", "b_tau"} and torch.equal(w["W"], glob["W"])
    torch.testing.assert_close(w["W_tau"], torch.tensor([[0.6, 0.8], [0.0, 1.0]], dtype=torch.float64))
    assert torch.equal(w["b_tau"], torch.zeros(2, dtype=torch.float64))


def test_tau_norm_trains_as_fedavg_and_reports_both_heads(small):
    gt, mt = _run(small, "fedavg-tau-norm", {"batch_size": "16"}, "batched")
    ga, ma = _run(small, "fedavg", {"batch_size": "16"}, "batched")
    torch.testing.assert_close(gt["W"], ga["W"], atol=0, rtol=0)
    torch.testing.assert_close(gt["b"], ga["b"], atol=0, rtol=0)
    assert [r["fedavg_head_acc"] for r in mt] == pytest.approx([r["test_acc"] for r in ma], abs=1e-9)
    norms = torch.linalg.vector_norm(gt["W_tau"], dim=1)
    torch.testing.assert_close(norms, torch.ones_like(norms))  # tau = 1: unit rows

"""Issue 16's fidelity switches: FST-CBDG's ``aggregation``, ``synthetic_loss``, ``synthetic_draw`` and
CLIP2FL / CReFF's ``feature_scale``, each against hand-computed values, and both engines / kernels per value."""

import math
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from fedfeat.engine.context import RoundPlan, make_plan
from fedfeat.engine.data import build_context, load_run_data
from fedfeat.engine.rounds import run_federated
from fedfeat.methods import get_method
from fedfeat.methods.fst_cbdg import balanced_counts
from fedfeat.partition.core import Partition
from fedfeat.partition.make import make_partition
from fedfeat.store.synth import SynthParams, write_synthetic_store


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    """10 classes x 60 train, D = 32, Dirichlet alpha 0.1 over 12 ragged clients."""
    p = SynthParams(classes=10, dim=32, train_per_class=60, test_per_class=20, templates=2)
    st = write_synthetic_store(tmp_path_factory.mktemp("f") / "s.zarr", p, stats=False, log=lambda *_: None)
    return st, make_partition(st.labels("train"), "dirichlet", clients=12, alpha=0.1, seed=1)


@pytest.fixture(scope="module")
def two_clients(tmp_path_factory):
    """3 classes x 2 train, D = 8; client 0 holds 1 sample, client 1 holds 3."""
    p = SynthParams(classes=3, dim=8, train_per_class=2, test_per_class=2, templates=1)
    st = write_synthetic_store(tmp_path_factory.mktemp("t") / "t.zarr", p, stats=False, log=lambda *_: None)
    part = Partition("manual", {"scheme": "manual", "clients": 2}, [np.array([0]), np.array([1, 2, 3])])
    return st, part


# ---------------------------------------------------------------------------------------------- aggregation
def test_aggregation_default_is_the_papers_simple_average():
    assert get_method("fst-cbdg").p.aggregation == "mean"
    assert get_method("fst-cbdg").p.synthetic_loss == "mean"
    assert get_method("fst-cbdg").p.synthetic_draw == "epoch"


def test_aggregation_hand_computed():
    """Client heads all 1 and all 5, sizes 1 and 3: mean (1 + 5) / 2 = 3; weighted (1 + 3 * 5) / 4 = 4."""
    ctx = SimpleNamespace(device=torch.device("cpu"))
    plan = RoundPlan(1, torch.tensor([0, 1]), torch.tensor([1, 3]), torch.tensor([1, 1]), 50, 1)
    cp = {"W": torch.stack([torch.ones(2, 3), 5 * torch.ones(2, 3)]), "b": torch.tensor([[1.0, 1], [5, 5]])}
    for agg, want in (("mean", 3.0), ("weighted", 4.0)):
        out = get_method("fst-cbdg", {"aggregation": agg}).aggregate(ctx, plan, {}, cp)
        torch.testing.assert_close(out["W"], torch.full((2, 3), want))
        torch.testing.assert_close(out["b"], torch.full((2,), want))
    # a sampled client without samples trains nothing: it is not averaged in
    plan0 = RoundPlan(1, torch.tensor([0, 1]), torch.tensor([0, 3]), torch.tensor([0, 1]), 50, 1)
    out = get_method("fst-cbdg").aggregate(ctx, plan0, {}, cp)
    torch.testing.assert_close(out["W"], torch.full((2, 3), 5.0))


@pytest.mark.parametrize("agg", ["mean", "weighted"])
def test_aggregation_in_a_run(two_clients, agg):
    """A real round of the two clients (sizes 1 and 3): the new global head is the plain average of the two
    uploaded heads (mean) or their 1:3 average (weighted), in both engines."""
    st, part = two_clients
    for engine in ("batched", "loop"):
        m = get_method("fst-cbdg", {"aggregation": agg, "batch_size": "2"})
        seen = {}
        orig = m.aggregate

        def aggregate(ctx, plan, glob, cparams, orig=orig, seen=seen):
            seen["sizes"] = plan.sizes.tolist()
            seen["clients"] = plan.clients.tolist()
            seen["cp"] = {k: v.clone() for k, v in cparams.items()}
            seen["out"] = orig(ctx, plan, glob, cparams)
            return seen["out"]

        m.aggregate = aggregate
        run_federated(m, load_run_data(st, part), rounds=1, participation=1.0, seed=0, engine=engine)
        i0, i1 = seen["clients"].index(0), seen["clients"].index(1)
        assert [seen["sizes"][i0], seen["sizes"][i1]] == [1, 3]
        for k in ("W", "b"):
            a, b = seen["cp"][k][i0], seen["cp"][k][i1]
            assert float((a - b).abs().max()) > 1e-4  # the two heads differ: the weights matter
            want = (a + b) / 2 if agg == "mean" else (a + 3 * b) / 4
            torch.testing.assert_close(seen["out"][k], want, atol=1e-7, rtol=1e-6)


# ---------------------------------------------------------------------------------------------- synthetic loss
def _first_steps(small, sets):
    """Round 1's first-step losses per client (self-training off, so the loss is the synthetic term alone), the
    synthetic-sample count of each client's first step, and what forms the samples."""
    st, part = small
    m = get_method("fst-cbdg", {"batch_size": "16", "self_training": "false", **sets})
    out = {}
    step_loss = m.step_loss

    def spy(ctx, params, batch, local):
        loss = step_loss(ctx, params, batch, local)
        if batch.step == 0 and batch.epoch == 0 and local["rnd"] == 1:
            cnt = local["syn"]["mask"][0, : batch.n].sum(1)
            out.update(
                loss=loss.detach().clone(), count=cnt.clone(), syn=local["syn"], ctx=ctx, W=params["W"]
            )
        return loss

    m.step_loss = spy
    run_federated(
        m, load_run_data(st, part), rounds=1, participation=0.5, seed=0, engine="batched", kernel="torch"
    )
    return m, out


def test_synthetic_loss_sum_is_mean_times_the_steps_count(small):
    """Same draws, same starting head: the sum form is the mean form times the step's synthetic count (Eq. 6's
    sum over the samples), and the mean form is the mean CE of the explicitly formed samples
    ``T_c + sigma / sqrt(D) * sign * eps`` under the initial head ``W = T, b = 0`` (logit scale 1)."""
    m, mean = _first_steps(small, {"synthetic_loss": "mean"})
    _, tot = _first_steps(small, {"synthetic_loss": "sum"})
    cnt = mean["count"].to(mean["loss"].dtype)
    assert int(cnt.max()) > 1 and bool((cnt > 0).all())
    torch.testing.assert_close(tot["loss"], mean["loss"] * cnt, rtol=1e-5, atol=1e-6)
    ctx, syn = mean["ctx"], mean["syn"]
    T, D = ctx.text, ctx.D
    for j in range(len(cnt)):
        P = int(cnt[j])
        cls = syn["cls"][0, j, :P]
        eps = m._noise(ctx, 1, 0, 0, P)
        x = T[cls] + (m.p.sigma / math.sqrt(D)) * syn["sign"][0, j, :P].unsqueeze(1) * eps
        ce = torch.nn.functional.cross_entropy(x @ T.T, cls)  # the round's first step: W = T, b = 0
        assert float(mean["loss"][j]) == pytest.approx(float(ce), rel=1e-5)
        assert float(tot["loss"][j]) == pytest.approx(float(ce) * P, rel=1e-5)


# ---------------------------------------------------------------------------------------------- draws
def _tables(small, draw):
    st, part = small
    m = get_method("fst-cbdg", {"batch_size": "16", "synthetic_draw": draw})
    data = load_run_data(st, part)
    ctx = build_context(data, m, 0, torch.device("cpu"))
    m.setup(ctx)
    plan = make_plan(ctx, 1, np.arange(part.n_clients), 16, 1)
    local = m.local_begin(ctx, plan, m.init_global(ctx))
    m.epoch_begin(ctx, plan, local, 0)
    return m, ctx, plan, local


def _formed(m, ctx, syn, step, j, P):
    eps = m._noise(ctx, 1, 0, step, P)
    return ctx.text[syn["cls"][step, j, :P]] + syn["sign"][step, j, :P].unsqueeze(1) * eps


def test_epoch_draw_is_shared_by_the_epoch_iteration_draw_is_fresh_each_step(small):
    K = 10
    for draw in ("epoch", "iteration"):
        m, ctx, plan, local = _tables(small, draw)
        syn, n_k = local["syn"], local["n_k"]
        j = int(torch.nonzero((plan.steps >= 2) & (n_k.sum(1) >= 2))[0])  # a client with >= 2 steps
        S, J = int(plan.steps[j]), int(n_k[j].sum())
        per_step = [torch.bincount(syn["cls"][s, j][syn["mask"][s, j]], minlength=K) for s in range(S)]
        if draw == "epoch":  # one draw of sum(n_k) samples, split over the steps: each sample used once
            torch.testing.assert_close(sum(per_step), n_k[j])
            # spread evenly: step s holds ranks ceil(s J / S) .. ceil((s + 1) J / S) - 1
            assert [int(c.sum()) for c in per_step] == [
                math.ceil((s + 1) * J / S) - math.ceil(s * J / S) for s in range(S)
            ]
        else:  # every step: the whole class-balanced set n_k, freshly drawn
            for c in per_step:
                torch.testing.assert_close(c, n_k[j])
            x0, x1 = _formed(m, ctx, syn, 0, j, J), _formed(m, ctx, syn, 1, j, J)
            assert float(torch.cdist(x0, x1).min()) > 1e-3  # no sample of step 1 repeats one of step 0
            assert int(syn["mask"][S:, j].sum()) == 0  # none past the client's own steps


# ---------------------------------------------------------------------------------------------- engines
SWITCHES = [
    {"aggregation": "mean"},
    {"aggregation": "weighted"},
    {"synthetic_loss": "sum"},
    {"synthetic_draw": "iteration", "local_epochs": "2"},
    {"synthetic_draw": "iteration", "synthetic_loss": "sum", "renormalize_synthetic": "true"},
]


@pytest.mark.parametrize("sets", SWITCHES, ids=["-".join(f"{k}={v}" for k, v in s.items()) for s in SWITCHES])
def test_engines_and_kernels_agree(small, sets):
    st, part = small
    sets = {"batch_size": "16", **sets}
    assert get_method("fst-cbdg", sets).has_fused()  # every value keeps the fused kernel

    def run(engine, kernel="auto"):
        m = get_method("fst-cbdg", sets)
        return run_federated(
            m, load_run_data(st, part), rounds=3, participation=0.5, seed=0, engine=engine, kernel=kernel
        )

    gl, ml = run("loop")
    for kernel in ("torch", "fused"):
        gb, mb = run("batched", kernel)
        for k in gb:
            torch.testing.assert_close(gb[k], gl[k], atol=1e-5, rtol=1e-5)
        np.testing.assert_allclose([r["test_acc"] for r in mb], [r["test_acc"] for r in ml], atol=1e-5)
        np.testing.assert_allclose(
            [r["train_loss"] for r in mb[1:]], [r["train_loss"] for r in ml[1:]], rtol=1e-5
        )


def test_n_k_floors():
    """Eq. 7 with (1 + gamma) max m_k not an integer: floor, not round (module docstring)."""
    assert balanced_counts(torch.tensor([[3, 1, 2]]), 0.5).tolist() == [[1, 3, 2]]  # 4.5 - m_k, floored


# ---------------------------------------------------------------------------------------------- CLIP2FL
@pytest.mark.parametrize("name", ["clip2fl", "creff"])
def test_feature_scale(small, name):
    st, part = small
    V = {}
    for scale in ("unit", "reference"):
        m = get_method(name, {"feature_scale": scale, "num_features": "50"})
        ctx = build_context(load_run_data(st, part), m, 0, torch.device("cpu"))
        m.setup(ctx)
        V[scale] = ctx.state["syn"]
    D = V["unit"].shape[1]
    assert get_method(name).p.feature_scale == "unit"
    norms = V["reference"].norm(dim=1)  # randn rows: norm ~ sqrt(D) (chi with D degrees of freedom)
    assert abs(float(norms.mean()) - math.sqrt(D)) < 0.05 * math.sqrt(D)
    assert abs(float(V["unit"].norm(dim=1).mean()) - 1) < 0.05
    torch.testing.assert_close(V["reference"], V["unit"] * math.sqrt(D), rtol=1e-5, atol=1e-6)

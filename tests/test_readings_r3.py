"""Issue 37, items 4, 5, 6, 8 and 9: the baselines' defaults where the authors' code (or, without code, the paper's
text) decides. Each new default is checked against a small transcription of the code's rule on a tiny case, each
switch restores fedfeat's earlier reading, and FST-CBDG's table rows resolve to the paper's readings."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from fedfeat.engine.context import RoundPlan
from fedfeat.engine.data import build_context, load_run_data
from fedfeat.methods import feddf as feddf_mod
from fedfeat.methods import get_method
from fedfeat.methods.fednova import normalizing_vec
from fedfeat.methods.ratio_loss import TAG_AUX_SET
from fedfeat.methods.serverdata import draw_balanced
from fedfeat.partition.make import make_partition
from fedfeat.store.synth import SynthParams, write_synthetic_store

F64 = torch.float64


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """3 classes x 70 train rows (>= 63 per class: Ratio Loss's default), D = 6, IID over 4 clients."""
    p = SynthParams(classes=3, dim=6, train_per_class=70, test_per_class=5, templates=2)
    st = write_synthetic_store(tmp_path_factory.mktemp("r3") / "s.zarr", p, stats=False, log=lambda *_: None)
    part = make_partition(st.labels("train"), "iid", clients=4, seed=0)
    return st, part


def _ctx(tiny, method):
    st, part = tiny
    return build_context(load_run_data(st, part, dtype=F64), method, 0, torch.device("cpu"))


def _plan(sizes, steps, epochs):
    return RoundPlan(1, torch.arange(len(sizes)), torch.tensor(sizes), torch.tensor(steps), 10, epochs)


def _heads(m, K=3, D=6, seed=0):
    g = torch.Generator().manual_seed(seed)
    glob = {"W": torch.randn(K, D, generator=g, dtype=F64), "b": torch.randn(K, generator=g, dtype=F64)}
    cp = {k: v.unsqueeze(0) + torch.randn(m, *v.shape, generator=g, dtype=F64) for k, v in glob.items()}
    return glob, cp


# ---------------------------------------------------------------------------------------------- FedDF (5, 6)
def _fedavg_reference(local_states):
    """epfml/federated-learning-public-code ``codes/FedDF-code/pcode/aggregation/fedavg.py:11-14, 33-36``
    (``_fedavg``): ``weights = [1.0 / n_selected_clients] * n``; ``state = local[0] * w[0]; state += local[i] * w[i]``."""
    n = len(local_states)
    weights = [1.0 / n for _ in range(n)]
    out = {k: v * weights[0] for k, v in local_states[0].items()}
    for idx in range(1, n):
        for k in out:
            out[k] = out[k] + local_states[idx][k] * weights[idx]
    return out


def _feddf_start(tiny, monkeypatch, sets):
    """Run FedDF's server step once at unequal client sizes; returns (the head distillation started from, its
    config, the client heads, the sizes)."""
    seen = {}

    def spy(W, b, x, target, scale, cfg, gen, val=None):
        seen.update(W=W.clone(), b=b.clone(), cfg=cfg)
        return W, b, {"distill_steps": 0}

    monkeypatch.setattr(feddf_mod, "distill_head", spy)
    m = get_method("feddf", {"server_data": "train", "early_stopping": "none", **sets})
    ctx = _ctx(tiny, m)
    m.setup(ctx)
    sizes = [5, 20, 45]
    glob, cp = _heads(3)
    m.aggregate(ctx, _plan(sizes, [1, 2, 3], 1), glob, cp)
    return seen, cp, sizes


def test_feddf_distillation_batch_is_the_codes_batch_size_64():
    """FedDF's server distils real data with the loader of ``--batch_size``, 64 (FedDF README.md:84;
    ``create_aggregator.py:224-231``); ``noise_knowledge_transfer.py:107``'s 128 sizes only noise batches."""
    assert get_method("feddf").p.distill_batch == 64
    assert get_method("feddf", {"distill_batch": "128"}).p.distill_batch == 128  # the old reading, a value


def test_feddf_student_starts_from_the_uniform_mean_of_the_client_heads(tiny, monkeypatch):
    """``use_fedavg_as_start``: the student is ``_fedavg`` (``pcode/aggregation/fedavg.py:11-14``), uniform weights
    ``1 / n_selected_clients`` whatever the clients' sizes (here 5, 20, 45); the batch reaching the solver is 64."""
    seen, cp, _ = _feddf_start(tiny, monkeypatch, {})
    want = _fedavg_reference([{k: v[i] for k, v in cp.items()} for i in range(3)])
    torch.testing.assert_close(seen["W"], want["W"], atol=1e-15, rtol=0)
    torch.testing.assert_close(seen["b"], want["b"], atol=1e-15, rtol=0)
    assert seen["cfg"].batch == 64


def test_feddf_student_init_weighted_restores_the_size_weighted_start(tiny, monkeypatch):
    """``student_init=weighted``: fedfeat's reading before issue 37, FedAvg by client size (5, 20, 45)."""
    seen, cp, sizes = _feddf_start(tiny, monkeypatch, {"student_init": "weighted"})
    w = torch.tensor(sizes, dtype=F64) / sum(sizes)
    torch.testing.assert_close(seen["W"], torch.tensordot(w, cp["W"], dims=1), atol=1e-15, rtol=0)
    assert (seen["W"] - cp["W"].mean(0)).abs().max() > 1e-3  # unequal sizes: not the uniform head


# ---------------------------------------------------------------------------------------------- Ratio Loss (8)
def test_ratio_loss_auxiliary_rows_are_the_first_63_of_each_class(tiny):
    """balanced-fl/Addressing-Class-Imbalance-FL ``FEMNIST-4-Losses/utils/sampling.py:56-61`` (``ratio_loss_data``):
    ``idx_temp = np.where(label_train == class_index); idx_temp[0][0:63]`` -- the first 63 rows of every class in
    the training set's order."""
    st, _ = tiny
    m = get_method("ratio-loss")
    assert (m.p.aux_per_class, m.p.aux_draw, m.p.aux_data) == (63, "first", "train")
    ctx = _ctx(tiny, m)
    label_train = st.labels("train")
    rows = np.concatenate([np.where(label_train == c)[0][0:63] for c in range(3)])
    x = torch.from_numpy(st.features_rows("train", rows)).to(F64)
    x = F.normalize(x, dim=-1) if m.p.normalize else x
    torch.testing.assert_close(m.aux(ctx), x.view(3, 63, -1), atol=0, rtol=0)


def test_ratio_loss_aux_draw_random_restores_the_seeded_draw(tiny):
    """``aux_draw=random``: fedfeat's reading before issue 37, a draw per class seeded with (seed, TAG_AUX_SET)."""
    m = get_method("ratio-loss", {"aux_draw": "random"})
    ctx = _ctx(tiny, m)
    old = draw_balanced(ctx, "train", 63, m.p.normalize, tag=TAG_AUX_SET, field="aux_data", size_field="x")
    torch.testing.assert_close(m.aux(ctx), old.x.view(3, 63, -1), atol=0, rtol=0)
    first = draw_balanced(
        ctx, "train", 63, m.p.normalize, tag=TAG_AUX_SET, field="aux_data", size_field="x", order="first"
    )
    assert not np.array_equal(np.sort(old.rows), np.sort(first.rows))  # 63 of 70: the draw leaves others out


def _fed_avg_reference(w):
    """``FEMNIST-4-Losses/models/Fed.py:7-13`` ``FedAvg(w)``: the sum of the clients' state dicts divided by
    ``len(w)``."""
    w_avg = {k: v.clone() for k, v in w[0].items()}
    for k in w_avg:
        for i in range(1, len(w)):
            w_avg[k] += w[i][k]
        w_avg[k] = torch.div(w_avg[k], len(w))
    return w_avg


def test_ratio_loss_aggregation_is_the_codes_uniform_fedavg():
    """``Fed.py:7-13`` averages the round's clients uniformly; ``aggregation=size`` (fedfeat's earlier reading)
    weighs them by size."""
    ctx = SimpleNamespace(device=torch.device("cpu"))
    glob, cp = _heads(3, seed=1)
    plan = _plan([5, 20, 45], [1, 2, 3], 1)
    got = get_method("ratio-loss").aggregate(ctx, plan, glob, cp)
    want = _fed_avg_reference([{k: v[i] for k, v in cp.items()} for i in range(3)])
    for k in want:
        torch.testing.assert_close(got[k], want[k], atol=1e-15, rtol=0)
    sized = get_method("ratio-loss", {"aggregation": "size"}).aggregate(ctx, plan, glob, cp)
    w = torch.tensor([5, 20, 45], dtype=F64) / 70
    torch.testing.assert_close(sized["W"], torch.tensordot(w, cp["W"], dims=1), atol=1e-15, rtol=0)


# ---------------------------------------------------------------------------------------------- FedNova (9)
def _fednova_reference(glob, cp, sizes, tau, a, mu):
    """``JYWa/FedNova distoptim/FedNova.py:169-190`` (``average``): ``tau_eff = sum(local_steps * ratio)`` if
    ``mu != 0`` else ``sum(local_normalizing_vec * ratio)``; each client's ``cum_grad * ratio * tau_eff / a_i``
    all-reduced (summed) and subtracted from ``old_init`` (gmf = 0)."""
    ratio = [n / sum(sizes) for n in sizes]
    if mu != 0:
        tau_eff = sum(t * r for t, r in zip(tau, ratio, strict=True))
    else:
        tau_eff = sum(v * r for v, r in zip(a, ratio, strict=True))
    out = {}
    for k, g in glob.items():
        cum = [(g - cp[k][i]) * ratio[i] * (tau_eff / a[i]) for i in range(len(sizes))]
        out[k] = g - sum(cum)
    return out


@pytest.mark.parametrize("mu", [0.0, 0.5])
def test_fednova_default_tau_eff_is_the_codes_in_every_case(mu):
    """mu > 0: ``tau_eff = sum p_i tau_i``; mu = 0: ``sum p_i a_i`` (FedNova.py:171-175). Two clients, n = (10, 30),
    tau = (2, 6), lr 0.1, momentum 0.5 (a_i from the reference's recursion, ``normalizing_vec``)."""
    sets = {"momentum": "0.5", "weight_decay": "0", "lr": "0.1", "mu": str(mu)}
    m = get_method("fednova", sets)
    assert m.p.tau_eff == "code"
    glob, cp = _heads(2, seed=2)
    sizes, tau = [10, 30], [2, 6]
    a = normalizing_vec(torch.tensor(tau), 0.5, 0.1 * mu).tolist()
    ctx = SimpleNamespace(device=torch.device("cpu"), offsets=torch.tensor([0, 40]), state={})
    got = m.aggregate(ctx, _plan(sizes, [1, 3], 2), glob, cp)
    want = _fednova_reference(glob, cp, sizes, tau, a, mu)
    for k in want:
        torch.testing.assert_close(got[k], want[k], atol=1e-13, rtol=0)
    old = get_method("fednova", {**sets, "tau_eff": "a"}).aggregate(ctx, _plan(sizes, [1, 3], 2), glob, cp)
    if mu:  # tau_eff=a, fedfeat's default before issue 37: sum p_i a_i, off the reference when mu > 0
        want_a = _fednova_reference(glob, cp, sizes, a, a, mu)  # tau_i replaced by a_i
        torch.testing.assert_close(old["W"], want_a["W"], atol=1e-13, rtol=0)
        assert (old["W"] - got["W"]).abs().max() > 1e-3
    else:
        torch.testing.assert_close(old["W"], got["W"], atol=0, rtol=0)


# ---------------------------------------------------------------------------------------------- FST-CBDG (4)
def test_fst_cbdg_table_rows_run_the_papers_text():
    """FST-CBDG has no public code: its text decides. Eq. 6 sums the synthetic loss over the n_k samples
    (``synthetic_loss=sum``); Algorithm 1 line 16 samples new instances every iteration (``synthetic_draw=
    iteration``). Every fst-cbdg row of every FST-CBDG table passes both; the method's defaults stay fedfeat's
    readings (mean, epoch), and the TOML names its sources."""
    from fedfeat.runs.reproduce import TABLES

    names = [f"fst-cbdg-table{i}" for i in (1, 2, 3, 4)]
    rows = [r for n in names for r in TABLES[n].rows if r.method == "fst-cbdg"]
    assert len(rows) == 8
    for r in rows:
        p = get_method("fst-cbdg", r.params).p
        assert (p.synthetic_loss, p.synthetic_draw) == ("sum", "iteration"), r.label
    d = get_method("fst-cbdg").p
    assert (d.synthetic_loss, d.synthetic_draw) == ("mean", "epoch")
    path = Path(__file__).resolve().parents[1] / "fedfeat/runs/tables/fst_cbdg.toml"
    text = path.read_text()
    assert "Eq. 6" in text and "Algorithm 1 line 16" in text

"""How closely the fused kernels follow the torch program, and that they agree with it on non-finite input.

FST-CBDG's class-balanced sampling (Eq. 7) starts each local update from the argmax of every sample's soft
label: a discrete decision. Two programs that round differently (the fused kernel's dot products and softmax
against torch's matmuls; the loop's per-client matmuls against the batched ones) give soft labels that differ in
the last float32 bit, and a sample whose two top soft labels are that close can take a different hard label;
its client then gets other synthetic classes for the round, and the heads part by ~1e-5 .. 1e-3 instead of
~1e-7. In float64 the same runs agree to ~1e-16 (no near-tie is that close): the gap is rounding, amplified by
that decision, not a difference in the mathematics. The tests check both halves: float64 tight, and float32
tight whenever the hard pseudo-label counts agree, bounded when one flips.
"""

import numpy as np
import pytest
import torch

from fedfeat.engine import rounds as engine
from fedfeat.engine.data import load_run_data
from fedfeat.engine.rounds import run_federated
from fedfeat.methods import get_method
from fedfeat.partition.make import make_partition
from fedfeat.store.synth import SynthParams, write_synthetic_store

RUNS = (("loop", "torch"), ("batched", "torch"), ("batched", "fused"))
TIGHT64 = 1e-10  # float64: every kernel against the loop (measured ~1e-15)
TIGHT32 = 1e-6  # float32, hard pseudo-label counts all equal (measured <= 1e-7)
# float32 where some count flipped on a near-tie: weights and biases, and accuracy points in any round (measured
# at 100 clients x 100 % x 10 rounds, seeds 0-9: W <= 1.2e-4, b <= 7.1e-4, <= 0.09 points; the run:
# W 5.1e-4, 0.03 points)
FLIP32 = 2e-3
FLIP_ACC = 0.25


def _store(tmp_path_factory, *, dim, per_class, clients, partition, **kw):
    p = SynthParams(classes=10, dim=dim, train_per_class=per_class, test_per_class=100, templates=2)
    st = write_synthetic_store(tmp_path_factory.mktemp("kx") / "s.zarr", p, stats=False, log=lambda *_: None)
    return st, make_partition(st.labels("train"), partition, clients=clients, seed=1, **kw)


@pytest.fixture(scope="module")
def mid(tmp_path_factory):
    """10 classes x 200 train, D = 64, Dirichlet alpha 0.1 over 40 clients (ragged, some below one batch)."""
    return _store(tmp_path_factory, dim=64, per_class=200, clients=40, partition="dirichlet", alpha=0.1)


def _fst(st_part, engine_, kernel, *, dtype, rounds, seed=0, sets=None):
    """FST-CBDG's final weights, per-round rows and every (round, client)'s hard pseudo-label counts."""
    m = get_method("fst-cbdg", sets or {})
    counts = {}
    begin = m.local_begin

    def local_begin(ctx, plan, glob):
        local = begin(ctx, plan, glob)
        for cid, c in zip(plan.clients.tolist(), local["pl_counts"].tolist()):
            counts[(plan.rnd, cid)] = c
        return local

    m.local_begin = local_begin
    data = load_run_data(*st_part, dtype=dtype)
    g, rows = run_federated(
        m, data, rounds=rounds, participation=1.0, seed=seed, engine=engine_, kernel=kernel
    )
    return g, rows, counts


def _gap(a, b) -> tuple[float, float]:
    """Max |difference| of the final weights, and of the accuracies over the rounds."""
    dw = max(float((a[0][k] - b[0][k]).abs().max()) for k in a[0])
    dacc = max(abs(x["test_acc"] - y["test_acc"]) for x, y in zip(a[1], b[1]))
    return dw, dacc


def _check_bounds(st_part, *, rounds, seed, sets=None):
    """Both kernels of the batched engine against the loop: float64 tight with equal counts; float32 tight where
    the counts agree, else within the flip bound. Returns the float32 gaps (for messages)."""
    out = {}
    for dtype in (torch.float64, torch.float32):
        ref, *others = (
            _fst(st_part, e, k, dtype=dtype, rounds=rounds, seed=seed, sets=sets) for e, k in RUNS
        )
        for (_, k), run in zip(RUNS[1:], others):
            dw, dacc = _gap(run, ref)
            same = run[2] == ref[2]
            out[dtype, k] = dw, dacc, same
            if dtype == torch.float64:
                assert same and dw <= TIGHT64 and dacc <= 1e-9, (k, dw, dacc)
            elif same:
                assert dw <= TIGHT32 and dacc <= 1e-9, (k, dw, dacc)
            else:
                assert dw <= FLIP32 and dacc <= FLIP_ACC, (k, dw, dacc)
    return out


def test_fst_kernels_follow_the_loop_to_rounding(mid):
    """40 clients x 100 % x 4 rounds, batch 16 (many steps, synthetic samples in most of them)."""
    _check_bounds(mid, rounds=4, seed=0, sets={"batch_size": "16"})


@pytest.mark.slow
def test_fst_kernels_follow_the_loop_at_cifar10_scale(tmp_path_factory):
    """The issue's scale: CIFAR-10 shape (50,000 x 1024), 100 clients x 100 % x 10 rounds, iid (~15 min on 2
    cores). Measured on a 2-core x86 host, max |difference| of W and b against the loop: seed 0 flips no count
    (float32: torch 4.5e-8, fused 6.7e-8; float64: 1.0e-16, 1.4e-16); seed 5 flips one in round 3 (a soft
    label's top two 7.5e-9 apart, one float32 ulp), after which the batched torch program parts from the loop by
    7.1e-4 and 0.09 points (the fused kernel keeps the loop's counts there: 6.3e-8); at seed 4 it is the fused
    kernel that flips (3.2e-4, 0.08 points; torch 4.5e-8). float64: <= 1.5e-16 at all three."""
    p = SynthParams()
    st = write_synthetic_store(tmp_path_factory.mktemp("kx") / "c.zarr", p, stats=False, log=lambda *_: None)
    st_part = st, make_partition(st.labels("train"), "iid", clients=100)  # (`fedfeat train`'s iid split)
    for seed in (0, 5, 4):
        _check_bounds(st_part, rounds=10, seed=seed)


def _with_bad_row(m, value, row):
    """``m`` with one training feature set to ``value`` after the context is built (the store and the run
    refuse such data up front; this is about the kernels), in row ``row`` of the client-major matrix."""
    setup = m.setup

    def bad_setup(ctx):
        setup(ctx)
        ctx.feats[row, 3] = value

    m.setup = bad_setup
    return m


@pytest.mark.parametrize("name", ["fedavg", "fst-cbdg"])
@pytest.mark.parametrize("value", [float("nan"), float("inf"), -float("inf")], ids=["nan", "inf", "-inf"])
def test_fused_and_torch_agree_on_non_finite_features(mid, monkeypatch, name, value):
    """One non-finite feature in one client's data: the torch program's logits, softmax and gradient are NaN, so
    is that client's head and the average; the fused kernel must give the same (``fastmath=True`` let LLVM drop
    the NaN: a normal-looking run). The run's own check (``check_finite``) is switched off to see the weights."""
    monkeypatch.setattr(engine, "check_finite", lambda *a, **k: None)
    data = load_run_data(*mid)
    row = int(data.offsets[7]) + 1  # a sample of client 7
    heads = {}
    for kernel in ("torch", "fused"):
        m = _with_bad_row(get_method(name, {"batch_size": "16"}), value, row)
        g, _ = run_federated(m, data, rounds=1, participation=1.0, seed=0, kernel=kernel)
        heads[kernel] = g
    for kernel, g in heads.items():
        assert not bool(torch.isfinite(g["W"]).any()), kernel  # the average of a NaN head: NaN everywhere
    np.testing.assert_array_equal(torch.isnan(heads["fused"]["W"]), torch.isnan(heads["torch"]["W"]))


def test_fused_kernel_keeps_nan_in_its_own_client():
    """At the kernel's level: a NaN feature makes its client's head NaN and leaves the other clients' heads
    finite and unchanged (each client is computed on its own)."""
    from fedfeat.engine import kernels

    rs = np.random.default_rng(0)
    K, D, sizes = 3, 8, np.array([5, 6, 7])
    starts = np.concatenate([[0], np.cumsum(sizes)[:-1]])
    feats = rs.standard_normal((int(sizes.sum()), D)).astype(np.float32)
    labels = rs.integers(0, K, feats.shape[0])
    Wg, bg = (rs.standard_normal((K, D)) * 0.3).astype(np.float32), np.zeros(K, np.float32)

    def epoch(f):
        W, b = np.zeros((3, K, D), np.float32), np.zeros((3, K), np.float32)
        kernels.linear_epoch(
            f, labels, starts, sizes, 4, 99, W, b, np.zeros_like(W), np.zeros_like(b), Wg, bg, lr=0.1,
            momentum=0.9, weight_decay=0.0, logit_scale=1.0, loss_out=np.zeros((2, 3)), threads=1, init=True,
            one_epoch=True,
        )  # fmt: skip
        return W

    clean = epoch(feats)
    bad = feats.copy()
    bad[starts[1] + 2, 0] = np.nan
    W = epoch(bad)
    assert np.isnan(W[1]).all()
    np.testing.assert_array_equal(W[[0, 2]], clean[[0, 2]])

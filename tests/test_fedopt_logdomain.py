"""FedOTP's transport in the log domain (issue 37, item 10): at the few-shot script's ``eps`` 0.01
(``scripts/fedotp_few_shot.sh``; also 0.005) the code's kernel ``K = exp(-(1 - sim) / eps)`` underflows float32 and
its scaling ``v`` overflows it, so the direct iteration ends in ``0 * inf``; the log-domain iteration in float32
equals the code's direct iteration run in float64 (``GLPOT``, the line-by-line transcription of ``GLP_OT.py``), and
at the default ``eps`` 0.1 it equals the code's direct iteration in float32 to float rounding."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from helpers_clip import pixel_store
from test_pfedprompt_fedopt import GLPOT, code_logits

from fedfeat.encoders.live import load_live_text
from fedfeat.engine.data import load_run_data
from fedfeat.engine.rounds import run_federated
from fedfeat.methods import fedopt, get_method
from fedfeat.methods.fedopt import (
    cot_plan,
    cot_plan_log,
    ot_logits,
    sinkhorn_plan,
    sinkhorn_plan_log,
    transport_plan,
)
from fedfeat.partition.make import make_partition
from fedfeat.store.featurestore import FeatureStore

F32_LOG_TINY = math.log(torch.finfo(torch.float32).tiny)  # -87.3: exp below this is subnormal or 0 in float32


def _sims(g, B, M, N=2):
    """Patch-prompt cosines ``[B, M, N]`` (float64) of the spread CLIP gives: each (image, class) problem centred at
    its own level in [-0.1, 0.35] (an unrelated class scores low), +- 0.05 over patches and prompts."""
    level = torch.rand(B, 1, 1, generator=g, dtype=torch.float64) * 0.45 - 0.1
    return (level + 0.05 * torch.randn(B, M, N, generator=g, dtype=torch.float64)).clamp(-1, 1)


def _marginals(ot, M, N, B, dtype):
    a = torch.full((B, M), 1.0 / M, dtype=dtype)
    b = torch.full((B, N), 1.0 / N, dtype=dtype) * (0.8 if ot == "cot" else 1.0)
    return a, b


def _code(ot, K, a, b, thresh=1e-3, max_iter=100):
    code = GLPOT(thresh, max_iter)
    return code.entropic_COT_fast(a, b, K, 0.01, max_iter) if ot == "cot" else code.Sinkhorn(K, a, b)


@pytest.mark.parametrize("ot", ["cot", "sinkhorn"])
@pytest.mark.parametrize("M", [49, 196])
@pytest.mark.parametrize("eps", [0.01, 0.005])
def test_float32_log_plan_equals_the_code_in_float64(ot, M, eps):
    """Two client batches of 64 (image, class) problems, each padded with 3 problems that must not count: each
    group's float32 log-domain plan is the code's float64 direct plan on that batch alone, to 1e-5; the code's
    direct plan in float32 is not finite."""
    g = torch.Generator().manual_seed(int(M + 1000 * eps))
    B, N = 64, 2
    sims = [_sims(g, B, M, N), _sims(g, B, M, N)]
    a, b = _marginals(ot, M, N, B, torch.float64)
    want = [_code(ot, torch.exp(-(1 - s) / eps), a, b) for s in sims]
    assert all(bool(w.isfinite().all()) for w in want)
    pad = torch.rand(3, M, N, generator=g, dtype=torch.float64)
    logK = torch.stack([torch.cat([-(1 - s) / eps, pad]) for s in sims]).float()  # [2, B + 3, M, N]
    assert float(logK.min()) < F32_LOG_TINY  # the direct kernel underflows float32
    valid = torch.tensor([[True] * B + [False] * 3] * 2)
    fn = cot_plan_log if ot == "cot" else sinkhorn_plan_log
    got = fn(logK, a[0].float(), b[0].float(), 100, 1e-3, valid=valid)
    assert got.dtype == torch.float32 and bool(got.isfinite().all())
    for i in range(2):
        torch.testing.assert_close(got[i, :B].double(), want[i], rtol=0, atol=1e-5)
        # the mass each problem moves: 1 (sinkhorn) or top_percent (cot)
        torch.testing.assert_close(got[i, :B].double().sum((1, 2)), want[i].sum((1, 2)), rtol=0, atol=1e-5)
    direct32 = _code(ot, torch.exp(-(1 - sims[0]) / eps).float(), a.float(), b.float())
    assert not bool(direct32.isfinite().all())  # 0 * inf where a problem's whole kernel column underflows


@pytest.mark.parametrize("ot", ["cot", "sinkhorn"])
@pytest.mark.parametrize("M", [49, 196])
def test_default_eps_log_plan_equals_the_direct_code_to_float_rounding(ot, M):
    """At the default eps 0.1 the log-domain plan is the code's direct plan: in float32 to float32 rounding, in
    float64 to float64 rounding."""
    g = torch.Generator().manual_seed(M)
    B, N = 64, 2
    s = _sims(g, B, M, N)
    fn = cot_plan_log if ot == "cot" else sinkhorn_plan_log
    for dtype, atol in ((torch.float32, 1e-6), (torch.float64, 1e-14)):
        a, b = _marginals(ot, M, N, B, dtype)
        want = _code(ot, torch.exp(-(1 - s.to(dtype)) / 0.1), a, b)
        got = fn((-(1 - s.to(dtype)) / 0.1).unsqueeze(0), a[0], b[0], 100, 1e-3)[0]
        torch.testing.assert_close(got, want, rtol=0, atol=atol)


@pytest.mark.parametrize("ot", ["cot", "sinkhorn"])
def test_transport_plan_is_the_direct_code_where_in_range_and_the_log_domain_per_group_below(ot):
    """``transport_plan`` (what ``ot_logits`` runs): at the default eps 0.1 in float32 every group takes the code's
    direct iteration, bit for bit (the defaults' results are unchanged); at eps 0.01 a group whose kernels stay in
    float32's range (similarities near 1) still does, and a group whose kernels underflow takes the log domain --
    per group, each as if alone, the latter = the code in float64 to 1e-5."""
    g = torch.Generator().manual_seed(3)
    B, M, N = 32, 49, 2
    near = (0.75 + 0.05 * torch.randn(B, M, N, generator=g, dtype=torch.float64)).clamp(-1, 1)
    sim = torch.stack([near, _sims(g, B, M, N)])  # [2, B, M, N]
    a, b = _marginals(ot, M, N, B, torch.float32)
    a, b = a[0], b[0]
    direct, log = (cot_plan, cot_plan_log) if ot == "cot" else (sinkhorn_plan, sinkhorn_plan_log)
    s32 = sim.float()
    got = transport_plan(s32, 0.1, a, b, ot, 100, 1e-3)
    assert torch.equal(got, direct(torch.exp(-(1.0 - s32) / 0.1), a, b, 100, 1e-3))
    got = transport_plan(s32, 0.01, a, b, ot, 100, 1e-3)
    assert bool(got.isfinite().all())
    assert torch.equal(got[0], direct(torch.exp(-(1.0 - s32[:1]) / 0.01), a, b, 100, 1e-3)[0])
    assert torch.equal(got[1], log(-(1.0 - s32[1:]) / 0.01, a, b, 100, 1e-3)[0])
    a64, b64 = _marginals(ot, M, N, B, torch.float64)
    for i in range(2):
        want = _code(ot, torch.exp(-(1 - sim[i]) / 0.01), a64, b64)
        torch.testing.assert_close(got[i].double(), want, rtol=0, atol=1e-5)


@pytest.mark.parametrize("ot", ["cot", "sinkhorn"])
def test_ot_logits_float32_and_float16_at_small_eps_equal_the_code_in_float64(ot):
    """``ot_logits`` at eps 0.01 on float32 features = the code's forward in float64; float16 features (the code's
    CUDA precision) are finite too (the transport is promoted to float32)."""
    g = torch.Generator().manual_seed(2)
    M, b, d, N, K = 49, 4, 16, 2, 5
    img, txt = torch.randn(M, b, d, generator=g), torch.randn(N, K, d, generator=g)
    want = code_logits(img.double(), txt.double(), ot, 0.01, 0.8, 1e-3, 100, 100.0)

    class P:
        eps, top_percent, thresh, max_iter, ot_stop = 0.01, 0.8, 1e-3, 100, "batch"

    P.ot = ot
    patches = F.normalize(img.permute(1, 0, 2), dim=-1).unsqueeze(0)  # [1, b, M, d]
    text = F.normalize(txt, dim=-1).unsqueeze(0)
    got = ot_logits(patches, text, None, P, 100.0)[0]
    assert got.dtype == torch.float32
    torch.testing.assert_close(got.double(), want, rtol=0, atol=1e-4)  # scale 100 x a plan to 1e-6
    half = ot_logits(patches.half(), text.half(), None, P, 100.0)[0]
    assert half.dtype == torch.float16 and bool(half.isfinite().all())
    torch.testing.assert_close(half.double(), want, rtol=0, atol=0.1)  # float16 sim and logits


# ---------------------------------------------------------------------------------------- a tiny run at eps 0.01
@pytest.fixture(scope="module")
def store(tmp_path_factory):
    d = tmp_path_factory.mktemp("otp")
    return pixel_store(d)


@pytest.mark.parametrize("eps", ["0.01", "0.005"])
def test_fedopt_runs_in_float32_at_small_eps(store, monkeypatch, eps):
    """``--set eps=0.01`` (the few-shot script's) in float32: the run completes with finite losses and accuracies,
    although its kernels are below float32's range (the direct form's ``exp`` underflows)."""
    st = FeatureStore.open(store)
    part = make_partition(
        st.labels("train"), "dirichlet-joint", clients=2, alpha=0.5, test_labels=st.labels("test")
    )
    data = load_run_data(st, part, local_test="joint")
    data.live = load_live_text(st)
    lows, orig = [], fedopt.cot_plan_log

    def spy(logK, *args, **kw):
        lows.append(float(logK.min()))
        assert logK.dtype == torch.float32
        return orig(logK, *args, **kw)

    monkeypatch.setattr(fedopt, "cot_plan_log", spy)
    sets = {"n_ctx": "4", "batch_size": "8", "lr": "0.05", "eps": eps, "precision": "fp32"}
    _, rows = run_federated(get_method("fedopt", sets), data, rounds=2, participation=1.0, seed=0)
    assert min(lows) < F32_LOG_TINY  # the direct kernel would underflow
    losses = [r["train_loss"] for r in rows if r["train_loss"] is not None]  # round 0 trains nothing
    assert len(losses) == 2 and all(math.isfinite(x) for x in losses)
    assert all(math.isfinite(r[k]) for r in rows for k in ("test_acc", "local_acc"))

"""``pfedprompt`` and ``fedopt`` (FedOTP) on the tiny open_clip ViT: their key equations by hand (pFedPrompt's
personalised memory score; FedOTP's transport plans against a line-by-line transcription of the code's
``Sinkhorn`` / ``entropic_COT_fast``), the cached patch features against open_clip's own tokens, batched engine = loop
engine, and local accuracy = each client's own model recomputed here."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from helpers_clip import (
    TINY_NAME,
    grab_setups,
    make_tiny_clip,
    personal_data,
    run_cli,
    same_personal_runs,
    write_cifar10,
)

from fedfeat.encoders.live import load_live_text
from fedfeat.engine.rounds import run_federated
from fedfeat.errors import FedfeatError
from fedfeat.methods import get_method
from fedfeat.methods.fedopt import cot_plan, ot_logits, sinkhorn_plan
from fedfeat.methods.pfedprompt import memory_logits
from fedfeat.store.featurestore import FeatureStore, normalize_pixels

FAST = {"n_ctx": "4", "batch_size": "8", "local_epochs": "2", "lr": "0.05"}
FRESH = {"optimizer_state": "fresh"}  # the batched program (carried optimisers run the clients one by one)
CPL = {"pseudo": "cpl", "pseudo_k": "3", "conf_quantile": 50.0, "regular_threshold": 0.5}


# ---------------------------------------------------------------------------------------- the code, transcribed
class GLPOT:
    """``HongxiaLee/FedOTP`` ``trainers/GLP_OT.py`` ``CustomCLIP.Sinkhorn`` and ``entropic_COT_fast``, line by line."""

    def __init__(self, thresh, max_iter):
        self.thresh, self.max_iter = thresh, max_iter

    def Sinkhorn(self, K, u, v):
        r = torch.ones_like(u)
        c = torch.ones_like(v)
        thresh = self.thresh
        for _i in range(self.max_iter):
            r0 = r
            r = u / torch.matmul(K, c.unsqueeze(-1)).squeeze(-1)
            c = v / torch.matmul(K.permute(0, 2, 1).contiguous(), r.unsqueeze(-1)).squeeze(-1)
            err = (r - r0).abs().mean()
            if err.item() < thresh:
                break
        T = torch.matmul(r.unsqueeze(-1), c.unsqueeze(-2)) * K
        return T

    def entropic_COT_fast(self, a, b, M, reg, numItermax=1000, stopThr=1e-9, verbose=False, log=False):
        dx = torch.ones_like(a)
        dy = torch.ones_like(b)
        stopThr = self.thresh
        K = M
        Kp = torch.matmul(torch.diag_embed(1 / a, dim1=1), K)
        Kq = torch.matmul(torch.diag_embed(1 / b, dim1=1), K.permute(0, 2, 1))
        err, cpt = 1, 0
        u = dx
        v = dy
        while cpt < numItermax:
            v0 = v
            temp = torch.div(dx, torch.matmul(Kp, v.unsqueeze(-1)).squeeze(-1))
            u = torch.minimum(temp, dx)
            v = torch.div(dy, torch.matmul(Kq, u.unsqueeze(-1)).squeeze(-1))
            cpt = cpt + 1
            err = (v - v0).abs().mean()
            if err.item() < stopThr:
                break
        Kprev = torch.matmul(torch.diag_embed(u, dim1=1), K)
        Kprev = torch.matmul(Kprev, torch.diag_embed(v, dim1=1))
        return Kprev


def code_logits(image_features, text_features, ot, eps, top_percent, thresh, max_iter, scale):
    """``CustomCLIP.forward`` after the encoders: ``image_features  # [M, b, d]`` patches, ``text_features  # [N, n_cls,
    d]`` (unnormalised), as the code."""
    M, b, _ = image_features.shape
    N, n_cls, _ = text_features.shape
    image_features = F.normalize(image_features, dim=2)
    text_features = F.normalize(text_features, dim=2)
    sim = torch.einsum("mbd,ncd->mnbc", image_features, text_features).contiguous()
    sim = sim.view(M, N, b * n_cls)
    sim = sim.permute(2, 0, 1)
    wdist = 1.0 - sim
    xx = torch.zeros(b * n_cls, M, dtype=sim.dtype, device=sim.device).fill_(1.0 / M)
    g = GLPOT(thresh, max_iter)
    if ot == "sinkhorn":
        yy = torch.zeros(b * n_cls, N, dtype=sim.dtype, device=sim.device).fill_(1.0 / N)
    else:
        top = min(torch.sum(xx).item(), top_percent)
        yy = torch.zeros(b * n_cls, N, dtype=sim.dtype, device=sim.device).fill_(1.0 / N) * top
    with torch.no_grad():
        KK = torch.exp(-wdist / eps)
        T = g.Sinkhorn(KK, xx, yy) if ot == "sinkhorn" else g.entropic_COT_fast(xx, yy, KK, 0.01, max_iter)
    sim_op = torch.sum(T * sim, dim=(1, 2))
    return scale * sim_op.contiguous().view(b, n_cls)


# ---------------------------------------------------------------------------------------- OT by hand and vs the code
def test_uniform_kernel_plans_and_logits_by_hand():
    """K = 1 everywhere (M = N = 2): COT's fixed point moves top_percent of the mass evenly -- u caps at 1, v = 1 /
    (2.5 * 2) = 0.2, T = 0.2 -- and Sinkhorn moves all of it, T = 1/4; the logits are then scale * mass * cos."""
    K = torch.ones(1, 1, 2, 2, dtype=torch.float64)
    a, b = torch.full((2,), 0.5, dtype=torch.float64), torch.full((2,), 0.4, dtype=torch.float64)
    T = cot_plan(K, a, b, max_iter=100, thresh=1e-12)
    torch.testing.assert_close(T, torch.full_like(T, 0.2), rtol=0, atol=1e-12)
    S = sinkhorn_plan(K, a, torch.full((2,), 0.5, dtype=torch.float64), max_iter=100, thresh=1e-12)
    torch.testing.assert_close(S, torch.full_like(S, 0.25), rtol=0, atol=1e-12)
    # every patch is [1, 0]; both prompts of class 0 are [1, 0], of class 1 [0.6, 0.8]: sim is constant per class
    patches = torch.tensor([1.0, 0.0], dtype=torch.float64).expand(1, 1, 2, 2)
    text = torch.tensor([[1.0, 0.0], [0.6, 0.8]], dtype=torch.float64).expand(1, 2, 2, 2)

    class P:
        eps, top_percent, thresh, max_iter, ot_stop = 0.1, 0.8, 1e-12, 100, "batch"

    P.ot = "cot"
    torch.testing.assert_close(
        ot_logits(patches, text, None, P, 100.0)[0, 0], torch.tensor([80.0, 48.0]).double()
    )
    P.ot = "sinkhorn"
    torch.testing.assert_close(
        ot_logits(patches, text, None, P, 100.0)[0, 0], torch.tensor([100.0, 60.0]).double()
    )


@pytest.mark.parametrize("ot", ["cot", "sinkhorn"])
def test_plans_equal_the_code_per_batch(ot):
    """Two batches (one OT group each, different sharpness, so they stop after different iteration counts), each
    padded with 2 problems of other values that must not count: each group's plan is the code's on that batch
    alone; the code on both batches at once differs (its stop is batch-level), and so does running max_iter
    iterations -- the per-group stop is what makes the batched plans equal the per-client code."""
    g = torch.Generator().manual_seed(0)
    M, N, P = 5, 2, 6
    f64 = torch.float64
    sims = [
        torch.rand(P, M, N, generator=g, dtype=f64) * 2 - 1,
        torch.rand(P, M, N, generator=g, dtype=f64) * 0.2,
    ]
    kern = [torch.exp(-(1 - sims[0]) / 0.3), torch.exp(-(1 - sims[1]) / 0.5)]
    a, top = torch.full((2 * P, M), 1.0 / M, dtype=f64), 0.8
    b = torch.full((2 * P, N), 1.0 / N, dtype=f64) * (top if ot == "cot" else 1.0)
    code = GLPOT(1e-3, 100)

    def ref(Kb):
        n = Kb.shape[0]
        if ot == "cot":
            return code.entropic_COT_fast(a[:n], b[:n], Kb, 0.01, 100)
        return code.Sinkhorn(Kb, a[:n], b[:n])

    fn = cot_plan if ot == "cot" else sinkhorn_plan
    want = [ref(k) for k in kern]
    padded = [torch.cat([k, torch.rand(2, M, N, generator=g, dtype=f64) + 1e-3]) for k in kern]
    valid = torch.tensor([[True] * P + [False] * 2] * 2)
    got = fn(torch.stack(padded), a[0], b[0], 100, 1e-3, valid=valid)
    for i in range(2):
        torch.testing.assert_close(got[i, :P], want[i], rtol=1e-10, atol=1e-13)
    joint = ref(torch.cat(kern))
    assert not torch.allclose(joint[:P], want[0], rtol=1e-5, atol=1e-9)
    fixed = fn(kern[0].unsqueeze(0), a[0], b[0], 100, 1e-3, stop="fixed")[0]
    assert not torch.allclose(fixed, want[0], rtol=1e-5, atol=1e-9)


@pytest.mark.parametrize("ot", ["cot", "sinkhorn"])
def test_ot_logits_equal_the_code_forward(ot):
    g = torch.Generator().manual_seed(1)
    M, b, d, N, K = 7, 3, 6, 2, 4
    img, txt = torch.randn(M, b, d, generator=g), torch.randn(N, K, d, generator=g)
    want = code_logits(img, txt, ot, 0.1, 0.8, 1e-3, 100, 100.0)

    class P:
        eps, top_percent, thresh, max_iter, ot_stop = 0.1, 0.8, 1e-3, 100, "batch"

    P.ot = ot
    patches = F.normalize(img.permute(1, 0, 2), dim=-1).unsqueeze(0)  # [1, b, M, d]
    got = ot_logits(patches, F.normalize(txt, dim=-1).unsqueeze(0), None, P, 100.0)[0]
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4)


# ---------------------------------------------------------------------------------------- pFedPrompt's score by hand
def test_memory_score_by_hand():
    """x = [1, 0]; memory keys [1, 0], [0, 1], [0.6, 0.8] with labels 0, 1, 1; alpha 2, beta 1:
    tip: A = [e^0, e^-1, e^-0.4] -> 2 * [1, e^-1 + e^-0.4]; softmax: A = e^{[1, 0, 0.6]} / Σ; drop entry 0 -> 2 *
    [0, e^-1 + e^-0.4]; a padded (invalid) entry adds nothing."""
    x = torch.tensor([[[1.0, 0.0]]], dtype=torch.float64)
    keys = torch.tensor([[[1.0, 0.0], [0.0, 1.0], [0.6, 0.8], [1.0, 0.0]]], dtype=torch.float64)
    vals = torch.tensor([[[1.0, 0.0], [0.0, 1.0], [0.0, 1.0], [1.0, 0.0]]], dtype=torch.float64)
    valid = torch.tensor([[True, True, True, False]])
    e1, e4 = math.exp(-1), math.exp(-0.4)
    got = memory_logits(x, keys, vals, valid, 2.0, 1.0, "tip")
    torch.testing.assert_close(got[0, 0], torch.tensor([2.0, 2 * (e1 + e4)], dtype=torch.float64))
    s = math.e + 1 + math.exp(0.6)
    got = memory_logits(x, keys, vals, valid, 2.0, 1.0, "softmax")
    torch.testing.assert_close(
        got[0, 0], torch.tensor([2 * math.e / s, 2 * (1 + math.exp(0.6)) / s]).double()
    )
    drop = torch.tensor([[[True, False, False, False]]])
    got = memory_logits(x, keys, vals, valid, 2.0, 1.0, "tip", drop)
    torch.testing.assert_close(got[0, 0], torch.tensor([0.0, 2 * (e1 + e4)], dtype=torch.float64))


# ---------------------------------------------------------------------------------------- on the tiny store
@pytest.fixture(scope="module")
def store(tmp_path_factory):
    d = tmp_path_factory.mktemp("pfp")
    tc = make_tiny_clip(d / "tiny")
    fx = write_cifar10(d / "data" / "cifar-10-batches-py", n_train=120, n_test=40)
    r = run_cli(["encode", "--dataset", "cifar10", "--root", fx.root, "--backbone", tc.config, "--pretrained",
                 tc.weights, "--out", d / "px", "--device", "cpu", "--pixels", "--chunk-rows", "16"])  # fmt: skip
    assert r.exit_code == 0, (r.output, r.exception)
    path = d / "px" / "cifar10" / f"{TINY_NAME}-tiny.zarr"
    assert FeatureStore.open(path).chunk_rows == 16  # the patch cache reads many pixel chunks
    return path


@pytest.fixture(scope="module")
def live(store):
    return load_live_text(FeatureStore.open(store))


def _data(store, live):
    return personal_data(store, live)


@pytest.fixture
def grab(monkeypatch):
    """The Context each method's setup saw (``ctx.state`` and ``ctx.cache`` after the run)."""
    from fedfeat.methods import fedopt, pfedprompt

    return grab_setups(monkeypatch, (fedopt.FedOTP, pfedprompt.PFedPrompt))


def _same_runs(name, sets, data, grab, rounds=2):
    return same_personal_runs(name, sets, data, grab, rounds)


@pytest.mark.parametrize("sets", [FRESH, CPL | FRESH, CPL])
def test_fedopt_batched_equals_loop_and_local_accuracy_is_each_clients_own(store, live, grab, sets):
    data = _data(store, live)
    m, g, rows, ctx = _same_runs("fedopt", FAST | sets, data, grab)
    assert m.uses_labels is ("pseudo" not in sets)
    assert set(g) == {"ctx", "client_local"} and g["client_local"].shape[0] == 3
    assert not torch.allclose(g["client_local"][0], g["client_local"][1])  # trained apart
    assert not torch.allclose(g["client_local"][0], m.init["local"]) and not torch.allclose(
        g["ctx"], m.init["ctx"]
    )
    if "pseudo" in sets:
        assert 0 < rows[-1]["pseudo_samples"] <= 3 * 10 * 3 and rows[-1]["pseudo_set_size"] >= 1
    # local accuracy from the code's forward (transcribed above) on each client's test patches, its own prompts
    st = FeatureStore.open(store)
    spec = st.attrs["pixels"]
    visual = live.model.visual
    C = len(ctx.local_test)
    text_all = m._text(g["ctx"].unsqueeze(0).expand(C, -1, -1), g["client_local"])
    mine = m._eval(ctx, text_all, [torch.as_tensor(r) for r in ctx.local_test])
    accs = []
    for k, r in enumerate(ctx.local_test):
        if len(r) == 0:
            continue
        px = torch.from_numpy(st.pixels("test", np.asarray(ctx.test_rows)[r.numpy()]))
        visual.output_tokens = True
        try:
            with torch.no_grad():
                _, tok = visual(normalize_pixels(px, spec["mean"], spec["std"]))
        finally:
            visual.output_tokens = False
        patches = (tok @ visual.proj).permute(1, 0, 2)  # [M, b, d], open_clip's own tokens
        with torch.no_grad():
            c = torch.stack([g["ctx"], g["client_local"][k]])
            text = m.learner.features(c)  # [2, K, d]
            z = code_logits(patches, text, "cot", 0.1, 0.8, 1e-3, 100, ctx.clip_logit_scale)
        torch.testing.assert_close(mine[k], z, rtol=1e-4, atol=1e-3)  # the method's evaluation logits
        accs.append(100 * float((z.argmax(1) == data.test_y[r]).double().mean()))
    assert rows[-1]["local_acc"] == pytest.approx(np.mean(accs), abs=1e-9)


def test_fedopt_patch_cache_is_open_clips_tokens_and_needs_pixels(store, live, grab):
    data = _data(store, live)
    m = get_method("fedopt", FAST)
    run_federated(m, data, rounds=0, participation=1.0, seed=0)
    ctx = grab[-1]
    st = FeatureStore.open(store)
    spec, visual = st.attrs["pixels"], live.model.visual
    rows = np.asarray(ctx.train_rows)[:16]
    visual.output_tokens = True
    try:
        with torch.no_grad():
            pooled, tok = visual(
                normalize_pixels(torch.from_numpy(st.pixels("train", rows)), spec["mean"], spec["std"])
            )
    finally:
        visual.output_tokens = False
    torch.testing.assert_close(ctx.cache["fedopt_train"][:16], F.normalize(tok @ visual.proj, dim=-1), atol=1e-5,
                               rtol=1e-5)  # fmt: skip
    assert (
        float(F.cosine_similarity(pooled, data.train_x[:16].float(), dim=-1).min()) > 0.999
    )  # = the store's features
    data.store = None
    with pytest.raises(FedfeatError, match="its store needs pixels"):
        run_federated(get_method("fedopt", FAST), data, rounds=0, participation=1.0, seed=0)
    with pytest.raises(FedfeatError, match="unified contexts"):
        get_method("fedopt", {"csc": "true"})


@pytest.mark.parametrize(
    "sets", [FRESH, CPL | FRESH | {"exclude_self": "true"}, {"attention": "softmax", "alpha": "3"}]
)
def test_pfedprompt_batched_equals_loop_and_local_accuracy_is_prompt_plus_own_memory(store, live, grab, sets):
    data = _data(store, live)
    m, g, rows, ctx = _same_runs("pfedprompt", FAST | sets, data, grab)
    assert m.uses_labels is ("pseudo" not in sets)
    p = m.p
    t = F.normalize(m.learner.features(g["ctx"].unsqueeze(0))[0], dim=-1)
    mine = m.local_logits(ctx, g, [torch.as_tensor(r) for r in ctx.local_test])
    accs = []
    for k, r in enumerate(ctx.local_test):
        if len(r) == 0:
            continue
        lo, hi = int(ctx.offsets[k]), int(ctx.offsets[k + 1])
        keys = F.normalize(
            ctx.feats[lo:hi], dim=-1
        )  # the client's training rows (its pseudo-labelled selection)
        if "pseudo_candidates" in ctx.state:
            c = ctx.state["pseudo_candidates"][lo:hi].double()
            vals = c / c.sum(1, keepdim=True)
        else:
            vals = F.one_hot(data.train_y[lo:hi], 10).double()
        x = ctx.test_x[r]
        aff = (x @ keys.T).double()
        A = torch.exp(-p.beta * (1 - aff)) if p.attention == "tip" else torch.softmax(p.beta * aff, -1)
        z = ctx.clip_logit_scale * (x @ t.T).double() + p.alpha * A @ vals
        torch.testing.assert_close(mine[k].double(), z, rtol=1e-5, atol=1e-4)
        accs.append(100 * float((z.argmax(1) == data.test_y[r]).double().mean()))
    assert rows[-1]["local_acc"] == pytest.approx(np.mean(accs), abs=1e-9)
    if "pseudo" in sets:
        assert rows[-1]["pseudo_label_acc"] is not None and rows[-1]["pseudo_samples"] == int(ctx.offsets[-1])
    # the memory changes the personalised prediction: without it (alpha 0) the local logits are other ones
    z0 = get_method("pfedprompt", FAST | sets | {"alpha": "0"})
    z0.learner = m.learner
    full = m.local_logits(ctx, g, [torch.as_tensor(r) for r in ctx.local_test])
    bare = z0.local_logits(ctx, g, [torch.as_tensor(r) for r in ctx.local_test])
    assert any(not torch.allclose(a, b) for a, b in zip(full, bare) if len(a))


def test_pfedprompt_memory_holds_each_clients_rows_and_self_slots_find_them(store, live):
    """Client c's memory is its training rows (unit features, one-hot labels) in order and nothing else;
    ``self_slots`` points every sample at its own entry (what ``exclude_self`` drops)."""
    from fedfeat.engine.data import build_context

    data = _data(store, live)
    m = get_method("pfedprompt", FAST)
    ctx = build_context(data, m, 0, torch.device("cpu"))
    m.setup(ctx)
    keys, values, valid = ctx.cache["memory"]
    sizes = ctx.offsets.diff()
    assert torch.equal(valid.sum(1), sizes) and len(set(sizes.tolist())) > 1  # ragged clients, padded memory
    pos = torch.stack([ctx.offsets[c] + torch.arange(int(sizes.min())) for c in range(3)])  # [3, B]
    slot = m.self_slots(ctx, torch.arange(3), pos)
    c = torch.arange(3).unsqueeze(1).expand_as(slot)
    torch.testing.assert_close(keys[c, slot], F.normalize(ctx.feats[pos], dim=-1))
    assert torch.equal(values[c, slot].argmax(-1), data.train_y[pos]) and bool(valid[c, slot].all())

"""fedclip and fed-mp: hand cases of the aggregation weights, the prototype stream and the loss; the batched Adam
against torch.optim.Adam; the batched engine against the loop engine on ragged clients."""

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from fedfeat.engine.context import Context, RoundPlan, make_plan
from fedfeat.engine.data import RunData, build_context
from fedfeat.engine.optim import BatchedAdam
from fedfeat.engine.rounds import run_federated
from fedfeat.errors import FedfeatError
from fedfeat.methods import get_method
from fedfeat.methods.fedmp import ADAPTER, adapter_init, clip_loss, entropy, prototype_stream, xi_weights
from fedfeat.partition.openvocab import OpenVocab


def test_xi_weights_hand_example():
    """ξ = (0.2, 0.6): linear ξ/Σξ = (1/4, 3/4); softmax = (1, e^0.4) / (1 + e^0.4)."""
    xi = torch.tensor([0.2, 0.6], dtype=torch.float64)
    assert xi_weights(xi, "linear").tolist() == pytest.approx([0.25, 0.75], abs=1e-15)
    e = math.exp(0.4)
    assert xi_weights(xi, "softmax").tolist() == pytest.approx([1 / (1 + e), e / (1 + e)], abs=1e-15)


def _ctx(text_raw, novel, client_classes):
    K, D = text_raw.shape
    ov = OpenVocab(
        base=torch.zeros(0, dtype=torch.int64), novel=torch.tensor(novel), client_classes=[torch.tensor(c) for c in client_classes],
        local_index=torch.zeros(0, dtype=torch.int64), val_x=None, val_y=None, val_offsets=None, query_x=None,
        query_y=None, qval_x=None, qval_y=None, base_x=None, base_y=None,
    )  # fmt: skip
    return Context(
        device=torch.device("cpu"), feats=torch.zeros(0, D, dtype=text_raw.dtype), offsets=torch.zeros(1, dtype=torch.int64),
        text=F.normalize(text_raw, dim=-1), text_all=F.normalize(text_raw, dim=-1)[None], test_x=torch.zeros(0, D),
        clip_logit_scale=100.0, seed=0, n_clients=len(client_classes), open_vocab=ov, text_raw=text_raw,
    )  # fmt: skip


def test_similarities_and_adaptive_weights_by_hand():
    """D = 2, α = 1. Novel class 2 has the prompt (1, 0). Client 0 holds class 0 (raw text (0, 2)) with residual
    (2, 0): t' = normalise((2, 2)) -> ξ_0 = cos 45° = 1/√2. Client 1 holds class 1 (raw (3, 0)), residual 0:
    ξ_1 = 1. Linear weights ξ/Σξ = (1/√2, 1)/(1 + 1/√2); softmax (e^{1/√2}, e)/(e^{1/√2} + e)."""
    ctx = _ctx(torch.tensor([[0.0, 2.0], [3.0, 0.0], [1.0, 0.0]], dtype=torch.float64), [2], [[0], [1]])
    m = get_method("fed-mp", {"alpha": "1"})
    plan = RoundPlan(1, torch.tensor([0, 1]), torch.tensor([4, 6]), torch.tensor([1, 1]), 18, 2)
    res = torch.tensor([[[2.0, 0.0]], [[0.0, 0.0]]], dtype=torch.float64)
    xi = m.similarities(ctx, plan, res)
    r = 1 / math.sqrt(2)
    assert xi.tolist() == pytest.approx([r, 1.0], abs=1e-12)
    assert xi_weights(xi, "linear").tolist() == pytest.approx([r / (1 + r), 1 / (1 + r)], abs=1e-12)
    s = math.exp(r) + math.e
    assert xi_weights(xi, "softmax").tolist() == pytest.approx([math.exp(r) / s, math.e / s], abs=1e-12)
    # the adapter is averaged with those weights; the residuals are dropped
    cp = {k: torch.stack([torch.zeros(2), torch.ones(2)]).double() for k in ADAPTER} | {"res": res}
    new = m.aggregate(ctx, plan, {}, cp)
    assert set(new) == set(ADAPTER)
    assert new["W1"].tolist() == pytest.approx([math.e / s] * 2, abs=1e-12)
    fedavg = get_method("fed-mp", {"adaptive": "false"}).aggregate(ctx, plan, {}, cp)  # by size: 6 / 10
    assert fedavg["b2"].tolist() == pytest.approx([0.6, 0.6], abs=1e-12)


def _two_class_entropy(a: float, b: float) -> float:
    p = torch.softmax(torch.tensor([a, b], dtype=torch.float64), 0)
    return float(-(p * p.log()).sum())


@pytest.mark.parametrize("batch", [1, 3])
def test_entropy_threshold_and_running_centroid_on_a_3_sample_stream(batch):
    """Text prototypes p0 = (1, 0, 0), p1 = (0, 1, 0); scale 10; ε = 0.1: threshold 0.1 ln 2 = 0.0693.
    s1 = (1, 0, 0): logits (10, 0), H = 4.5e-4 -> joins class 0: q̄0 = s1.
    s2 = (0.96, 0, 0.28): logits (9.6, 0), H = 6.6e-4 -> joins class 0: q̄0 = (s1 + s2) / 2 = (0.98, 0, 0.14).
    s3 = (0.6, 0.8, 0): logits (6, 8), H = 0.366 -> rejected; class 1 never gets a sample, so every prediction is
    text-only: (0, 0, 1). The same in one batch of 3 (the centroids are updated after the batch)."""
    z = torch.tensor([[1, 0, 0], [0.96, 0, 0.28], [0.6, 0.8, 0]], dtype=torch.float64)
    text = torch.tensor([[1.0, 0, 0], [0, 1.0, 0]], dtype=torch.float64)
    thr = 0.1 * math.log(2)
    assert entropy(10 * z[:1] @ text.T).item() == pytest.approx(_two_class_entropy(10, 0), abs=1e-12)
    assert _two_class_entropy(10, 0) < thr and _two_class_entropy(9.6, 0) < thr < _two_class_entropy(6, 8)
    pred, cent, counts = prototype_stream(z, text, torch.arange(3), scale=10, batch=batch, threshold=thr)
    assert pred.tolist() == [0, 0, 1] and counts.tolist() == [2, 0]
    torch.testing.assert_close(cent, torch.tensor([[0.98, 0, 0.14], [0, 0, 0]], dtype=torch.float64))
    # a threshold below s2's entropy keeps s1 only (strict <, as the code)
    _, cent, counts = prototype_stream(
        z, text, torch.arange(3), scale=10, batch=batch, threshold=_two_class_entropy(9.6, 0)
    )
    assert counts.tolist() == [1, 0] and cent[0].tolist() == [1, 0, 0]


@pytest.mark.parametrize("combine", ["cos", "sum"])
def test_text_only_until_every_class_has_a_visual_sample(combine):
    """p0 = (1, 0, 0), p1 = (0, 1, 0), scale 10, batch 1. a = (1, 0, 0) joins class 0. x = (0.7, 0.714, 0) is
    predicted by text: class 1 (with q̄0 = a it would score 0.7 + 0.7 > 0.714 for class 0 under Eq. 12, but class 1
    has no visual sample yet); its entropy ~ ln 2 keeps it out. c = (0, 0.6, 0.8): logits (0, 6), H = 0.017 -> joins
    class 1. x again: now Eq. 12, class 0: 0.7 + 0.7 = 1.4 against class 1: 0.714 + 0.714 · 0.6 = 1.143 (the unit
    single-sample centroids make "cos" and "sum" agree)."""
    x = [0.7, math.sqrt(1 - 0.49), 0]
    z = torch.tensor([[1, 0, 0], x, [0, 0.6, 0.8], x], dtype=torch.float64)
    text = torch.tensor([[1.0, 0, 0], [0, 1.0, 0]], dtype=torch.float64)
    pred, _, counts = prototype_stream(
        z, text, torch.arange(4), scale=10, batch=1, threshold=0.1 * math.log(2), combine=combine
    )
    assert pred.tolist() == [0, 1, 1, 0] and counts.tolist() == [1, 1]
    # the stream order matters: x first, then everything text-only until c arrives
    pred, _, _ = prototype_stream(z, text, torch.tensor([1, 0, 2, 3]), scale=10, batch=1, threshold=0.0693)
    assert pred[torch.tensor([1, 0, 2, 3])].tolist() == [1, 0, 1, 0]


def test_clip_loss_masks_padding_and_equals_the_unpadded_loss():
    """Zero logits over 2 samples: each direction is ln 2. A padded third row/column changes nothing."""
    z = torch.zeros(1, 2, 2, dtype=torch.float64)
    assert clip_loss(z, torch.ones(1, 2, dtype=torch.bool)).item() == pytest.approx(math.log(2), abs=1e-15)
    g = torch.Generator().manual_seed(0)
    L = torch.randn(2, 3, 3, generator=g, dtype=torch.float64) * 5
    mask = torch.tensor([[True, True, True], [True, True, False]])
    got = clip_loss(L, mask)
    for j, b in enumerate([3, 2]):
        sub, y = L[j, :b, :b], torch.arange(b)
        ref = (F.cross_entropy(sub, y) + F.cross_entropy(sub.T, y)) / 2
        assert got[j].item() == pytest.approx(ref.item(), abs=1e-12)


def test_batched_adam_equals_torch_adam_per_client_with_decay_and_ragged_steps():
    """Three clients with 5, 3 and 1 steps (the engine's prefix order: at step s the first n are active);
    weight decay 0.2, betas (0.9, 0.98), eps 1e-6: each client's parameters equal its own torch.optim.Adam's."""
    g = torch.Generator().manual_seed(3)
    steps = [5, 3, 1]
    p0 = {
        "W": torch.randn(3, 4, 4, generator=g, dtype=torch.float64),
        "b": torch.randn(3, 4, generator=g, dtype=torch.float64),
    }
    grads = [{k: torch.randn_like(v[: sum(s > t for s in steps)]) for k, v in p0.items()} for t in range(5)]
    kw = dict(lr=0.05, betas=(0.9, 0.98), eps=1e-6, weight_decay=0.2)
    params = {k: v.clone() for k, v in p0.items()}
    opt = BatchedAdam(**kw)
    opt.reset(params)
    for gr in grads:
        n = next(iter(gr.values())).shape[0]
        opt.step(params, {k: v.clone() for k, v in gr.items()}, n)
    assert opt.state["steps"].tolist() == steps
    for j in range(3):
        ref = {k: v[j].clone().requires_grad_(True) for k, v in p0.items()}
        topt = torch.optim.Adam(list(ref.values()), **kw)
        for t in range(steps[j]):
            for k in ref:
                ref[k].grad = grads[t][k][j].clone()
            topt.step()
        for k in ref:
            torch.testing.assert_close(params[k][j], ref[k].detach(), atol=1e-13, rtol=1e-12)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_batched_adam_on_cuda():
    p = {"w": torch.zeros(2, 3, device="cuda")}
    opt = BatchedAdam(lr=0.1)
    opt.reset(p)
    opt.step(p, {"w": torch.ones(1, 3, device="cuda")}, 1)
    assert opt.state["steps"].device == p["w"].device and p["w"][0].tolist() == pytest.approx([-0.1] * 3)


def _data(open_vocab: bool, dtype=torch.float64) -> RunData:
    """12 classes, D = 12, 3 clients of 5, 23 and 40 samples (1, 2 and 3 steps of 18: ragged), each holding 3
    classes (open vocabulary: classes 9-11 are novel, 10 query images each; closed: every class is tested)."""
    g = torch.Generator().manual_seed(11)
    K, D = 12, 12
    means = F.normalize(torch.randn(K, D, generator=g, dtype=torch.float64), dim=-1)
    text = F.normalize(means + 0.6 * torch.randn(K, D, generator=g, dtype=torch.float64), dim=-1) * 2.5
    client_classes = [[2, 0, 1], [3, 4, 5], [8, 6, 7]]
    sizes = [5, 23, 40]
    ys = [torch.tensor(c * 20)[:n] for c, n in zip(client_classes, sizes)]
    y = torch.cat(ys)
    x = 3 * (means[y] + 0.5 * torch.randn(len(y), D, generator=g, dtype=torch.float64))
    local = torch.cat([torch.tensor([c.index(int(v)) for v in yy]) for c, yy in zip(client_classes, ys)])
    test_classes = [9, 10, 11] if open_vocab else list(range(K))
    ty = torch.tensor(test_classes).repeat_interleave(10)
    tx = 3 * (means[ty] + 0.5 * torch.randn(len(ty), D, generator=g, dtype=torch.float64))
    by = torch.arange(9).repeat_interleave(4)
    bx = 3 * (means[by] + 0.5 * torch.randn(len(by), D, generator=g, dtype=torch.float64))
    ov = None
    if open_vocab:
        e = torch.zeros(0, D, dtype=dtype)
        ov = OpenVocab(
            base=torch.arange(9), novel=torch.tensor([9, 10, 11]), client_classes=[torch.tensor(c) for c in client_classes],
            local_index=local, val_x=e, val_y=torch.zeros(0, dtype=torch.int64), val_offsets=torch.zeros(4, dtype=torch.int64),
            query_x=tx.to(dtype), query_y=ty, qval_x=e, qval_y=torch.zeros(0, dtype=torch.int64), base_x=bx.to(dtype), base_y=by,
        )  # fmt: skip
    return RunData(
        train_x=x.to(dtype), train_y=y, offsets=torch.tensor([0, 5, 28, 68]), test_x=tx.to(dtype), test_y=ty,
        text_all=text[None].to(dtype), clip_logit_scale=100.0, class_names=[f"c{i}" for i in range(K)],
        train_counts=torch.bincount(y, minlength=K), open_vocab=ov,
    )  # fmt: skip


FAST = {
    "lr": "0.01"
}  # the paper's 5e-5 barely moves anything in 2 rounds: test the arithmetic with a visible step
CASES = [
    ("fedclip", False, {}),
    ("fedclip", True, {"adapter": "sum"}),
    ("fed-mp", True, {"uncertainty": "1"}),
    (
        "fed-mp",
        True,
        {"weights": "linear", "residual_draw": "per-client", "combine": "cos", "pseudo_label": "prediction"},
    ),
    ("fed-mp", True, {"adaptive": "false", "prototyping": "false", "normalize": "true"}),
]


@pytest.mark.parametrize("name, ov, sets", CASES, ids=[f"{c[0]}-{i}" for i, c in enumerate(CASES)])
def test_batched_equals_loop(name, ov, sets):
    runs = {}
    for engine in ("batched", "loop"):
        m = get_method(name, FAST | sets)
        runs[engine] = run_federated(m, _data(ov), rounds=2, participation=1.0, seed=5, engine=engine)
    (gb, mb), (gl, ml) = runs["batched"], runs["loop"]
    assert set(gb) == set(ADAPTER)
    for k in gb:
        torch.testing.assert_close(gb[k], gl[k], atol=1e-5, rtol=1e-5)
    for key in ("test_acc", "train_loss", "base_acc", "novel_f1"):
        a, b = [r.get(key) for r in mb], [r.get(key) for r in ml]
        assert a == pytest.approx(b, abs=1e-5), key
    assert mb[-1]["clients"] == [0, 1, 2] and mb[1]["bytes_up"] > 0
    g0 = adapter_init(5, 12, torch.float64)
    assert any(not torch.equal(gb[k], g0[k]) for k in gb)  # training moved the adapter


def test_fedmp_trains_residuals_that_start_shared_and_stay_local():
    """The residual block is one seeded draw for every client and round ("shared"); "per-client" draws differ by
    client and round. Its rows have norm ≈ α · r/√3 · √D (≈ 24 at D = 768 with α = 0.3, r = 5)."""
    m = get_method("fed-mp", FAST)
    ctx = build_context(_data(True), m, 5, torch.device("cpu"))
    m.setup(ctx)
    p1 = make_plan(ctx, 1, np.arange(3), 18, 2)
    p2 = make_plan(ctx, 2, np.array([1]), 18, 2)
    r1, r2 = m.local_params(ctx, p1)["res"], m.local_params(ctx, p2)["res"]
    assert r1.shape == (3, 3, 12) and torch.equal(r1[0], r1[2]) and torch.equal(r1[0], r2[0])
    assert r1.abs().max() <= 5 and float(r1.abs().max()) > 4
    pc = get_method("fed-mp", {"residual_draw": "per-client"})
    q1, q2 = pc.local_params(ctx, p1)["res"], pc.local_params(ctx, p2)["res"]
    assert not torch.equal(q1[0], q1[1]) and not torch.equal(q1[p1.clients.tolist().index(1)], q2[0])
    # the residual's size against a unit text feature, at CLIP ViT-L/14's D = 768
    big = type("C", (), {"seed": 0, "D": 768, "text": torch.zeros(1, 768), "device": "cpu"})()
    norms = 0.3 * m.residual_block(big, 500).norm(dim=1)
    assert float(norms.mean()) == pytest.approx(0.3 * 5 / math.sqrt(3) * math.sqrt(768), rel=0.02)  # 24.0


def test_fedmp_refuses_a_closed_run_and_has_no_fused_kernel():
    with pytest.raises(FedfeatError, match="--partition disjoint-classes"):
        run_federated(get_method("fed-mp"), _data(False), rounds=1, participation=1.0, seed=0)
    assert not get_method("fed-mp").has_fused() and not get_method("fedclip").has_fused()
    m = get_method("fedclip")
    assert (m.p.lr, m.p.beta1, m.p.beta2, m.p.eps, m.p.weight_decay, m.p.batch_size, m.p.local_epochs) == (
        5e-5, 0.9, 0.98, 1e-6, 0.2, 18, 2,
    )  # fmt: skip
    assert m.p.normalize is False and get_method("fed-mp").p.uncertainty == 0.1


def test_query_order_is_seeded_per_round_and_does_not_leak():
    """Two evaluations of the same round give the same predictions (the prototypes start empty each time);
    the order is a function of (seed, round)."""
    m = get_method("fed-mp", {"uncertainty": "1"})
    ctx = build_context(_data(True), m, 5, torch.device("cpu"))
    m.setup(ctx)
    glob = m.init_global(ctx)
    ov = ctx.open_vocab
    a = m.predict_classes(ctx, glob, ov.query_x, ov.novel)
    b = m.predict_classes(ctx, glob, ov.query_x, ov.novel)
    assert torch.equal(a, b) and set(a.tolist()) <= {9, 10, 11}


def test_resume_from_a_checkpoint_equals_the_uninterrupted_run(tmp_path):
    """Round 2 resumed from round 1's checkpoint (its query order comes from the checkpointed round)."""
    from fedfeat.engine import checkpoint

    sets = FAST | {"uncertainty": "1"}
    saved = []

    def on_ck(rnd, glob, state):
        checkpoint.save(tmp_path / "ck.safetensors", rnd, glob, state)
        saved.append(rnd)

    _, full = run_federated(
        get_method("fed-mp", sets), _data(True), rounds=2, participation=1.0, seed=5, on_checkpoint=on_ck,
        checkpoint_every=1,
    )  # fmt: skip
    assert saved == [1]
    resume = checkpoint.load(tmp_path / "ck.safetensors", "cpu")
    _, rest = run_federated(
        get_method("fed-mp", sets), _data(True), rounds=2, participation=1.0, seed=5, resume=resume
    )
    assert [r["round"] for r in rest] == [2]
    for key in ("test_acc", "train_loss", "base_acc", "agg_weights"):
        assert rest[0][key] == pytest.approx(full[2][key], abs=1e-12), key

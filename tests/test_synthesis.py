"""CReFF / CLIP2FL (fedfeat.methods.synthesis): hand-checkable cases of every numeric piece, the engines'
agreement, and many / medium / few accuracy on a hand-built prediction set."""

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from fedfeat.engine.data import load_run_data
from fedfeat.engine.rounds import evaluate, run_federated
from fedfeat.errors import FedfeatError
from fedfeat.methods import get_method
from fedfeat.methods.base import REGISTRY
from fedfeat.methods.synthesis import (
    class_ce_gradients,
    class_gradient_sums,
    draw_weights,
    kd_loss,
    match_distance,
    match_features,
    pcl_loss_code,
    pcl_loss_paper,
    retrain_head,
)
from fedfeat.partition.make import make_partition
from fedfeat.runs.writers import group_accuracy, shot_groups
from fedfeat.store.synth import SynthParams, write_synthetic_store

LN3 = math.log(3)


@pytest.fixture(scope="module")
def lt(tmp_path_factory):
    """A small long-tailed store: 10 classes x 120 train (IF 10 keeps 120 ... 12), D = 32, CLIP2FL's
    ``dirichlet-equal`` partition over 10 clients."""
    p = SynthParams(classes=10, dim=32, train_per_class=120, test_per_class=20, templates=2)
    st = write_synthetic_store(tmp_path_factory.mktemp("lt") / "s.zarr", p, stats=False, log=lambda *_: None)
    part = make_partition(st.labels("train"), "dirichlet-equal", clients=10, alpha=0.5, imbalance_factor=10)
    return st, part


# ------------------------------------------------------------------------------------ gradient matching
def test_match_distance_identical_zero_opposite_two_per_row():
    """One class, K = 2 rows of a 2-d weight gradient plus the bias "row": identical gradients are at distance
    0, opposite ones 2 per row (3 rows: 6), orthogonal rows 1; ``rows="mean"`` divides by K + 1 = 3."""
    f64 = torch.float64
    gW = torch.tensor([[[1.0, 2.0], [3.0, -4.0]]], dtype=f64)  # [C=1, K=2, D=2]
    gb = torch.tensor([[0.5, -1.5]], dtype=f64)  # [1, 2]
    assert match_distance(gW, gb, gW, gb, eps=0.0).tolist() == pytest.approx([0.0], abs=1e-7)
    assert match_distance(gW, gb, -gW, -gb, eps=0.0).tolist() == pytest.approx([6.0], abs=1e-6)
    orth_W = torch.tensor([[[-2.0, 1.0], [4.0, 3.0]]], dtype=f64)  # each row orthogonal to gW's
    orth_b = torch.tensor([[1.5, 0.5]], dtype=f64)
    assert match_distance(gW, gb, orth_W, orth_b, eps=0.0).item() == pytest.approx(3.0, abs=1e-6)
    # the reference's + 1e-6 in the denominator: 1 - |g|^2 / (|g|^2 + 1e-6), tiny for these norms
    assert match_distance(gW, gb, gW, gb).item() == pytest.approx(1e-6 * (1 / 5 + 1 / 25 + 1 / 2.5), rel=1e-6)
    assert match_distance(gW, gb, -gW, -gb, rows="mean").item() == pytest.approx(2.0, abs=1e-5)


def test_class_ce_gradient_custom_backward_equals_autograd():
    torch.manual_seed(0)
    V = torch.randn(3, 5, 4, dtype=torch.float64, requires_grad=True)
    W, b = torch.randn(4, 4, dtype=torch.float64), torch.randn(4, dtype=torch.float64)
    cls = torch.tensor([2, 0, 3])
    gW, gb = class_ce_gradients(V, cls, W, b)
    # autograd oracle: the mean CE gradient of an nn.Linear, per class, as a function of V
    ref_W, ref_b = [], []
    for i, c in enumerate(cls.tolist()):
        Wr, br = W.clone().requires_grad_(True), b.clone().requires_grad_(True)
        loss = F.cross_entropy(V[i] @ Wr.T + br, torch.full((5,), c))
        gw, gbb = torch.autograd.grad(loss, [Wr, br], create_graph=True)
        ref_W.append(gw)
        ref_b.append(gbb)
    ref_W, ref_b = torch.stack(ref_W), torch.stack(ref_b)
    torch.testing.assert_close(gW, ref_W)
    torch.testing.assert_close(gb, ref_b)
    R = torch.randn_like(gW)
    r = torch.randn_like(gb)
    (g1,) = torch.autograd.grad((gW * R).sum() + (gb * r).sum(), V)
    (g2,) = torch.autograd.grad((ref_W * R).sum() + (ref_b * r).sum(), V)
    torch.testing.assert_close(g1, g2)


@pytest.mark.parametrize("K", [3, 40])  # both backward paths of the class-gradient function
def test_fused_matching_step_equals_autograd_of_match_distance(K):
    """One matching step (the fused row-cosine backward, the hand-written class-gradient backward) moves V
    exactly as autograd through ``class_ce_gradients``'s formula and ``match_distance`` does."""
    torch.manual_seed(2)
    m, D = 4, 6
    V = torch.randn(K, m, D, dtype=torch.float64)
    W, b = torch.randn(K, D, dtype=torch.float64), torch.randn(K, dtype=torch.float64)
    gWr, gbr = torch.randn(K, K, D, dtype=torch.float64), torch.randn(K, K, dtype=torch.float64)
    gWr[0, 1] = 0  # a zero real row: cosine 0, as the reference's + 1e-6 gives
    present = torch.ones(K, dtype=torch.bool)
    for rows in ("sum", "mean"):
        got, first, _ = match_features(V, W, b, gWr, gbr, present, steps=1, lr=0.5, rows=rows)
        Vg = V.clone().requires_grad_(True)
        z = Vg @ W.T + b
        P = torch.softmax(z, -1) - F.one_hot(torch.arange(K), K).double().unsqueeze(1)
        gW, gb = P.transpose(1, 2) @ Vg / m, P.mean(1)
        loss = match_distance(gW, gb, gWr, gbr, 1e-6, rows).sum()
        (g,) = torch.autograd.grad(loss, Vg)
        torch.testing.assert_close(got, V - 0.5 * g)
        assert first == pytest.approx(loss.item() / K, rel=1e-12)


def test_matching_drives_the_distance_down():
    """Real gradients from real features of 3 classes; random federated features matched for 200 steps."""
    torch.manual_seed(1)
    K, m, D = 3, 20, 8
    X = F.normalize(torch.randn(K, 40, D) + 2 * torch.eye(K, D).unsqueeze(1), dim=-1)
    W, b = 0.3 * torch.randn(K, D), torch.zeros(K)
    gWr, gbr = class_ce_gradients(X, torch.arange(K), W, b)
    present = torch.tensor([True, True, False])  # class 2: no client holds it, no matching term
    V0 = torch.randn(K, m, D) / math.sqrt(D)
    V, first, last = match_features(V0, W, b, gWr, gbr, present, steps=200, lr=0.1)
    assert first > 1.0 and last < 0.1 * first
    torch.testing.assert_close(V[2], V0[2])  # unmatched class untouched


# ------------------------------------------------------------------------------------ client gradients
def test_per_class_gradient_of_a_two_class_head_hand_case():
    """Head W = [[ln 3, 0], [0, 0]], b = 0. Class 0 holds x = (1, 0) (logits (ln 3, 0), p = (3/4, 1/4),
    dCE/dz = (-1/4, 1/4)) and x = (0, 1) (p = (1/2, 1/2), dCE/dz = (-1/2, 1/2)); its gradient is the mean:
    gW = [[-1/8, -1/4], [1/8, 1/4]], gb = (-3/8, 3/8). Class 1 holds x = (1, 0): dCE/dz = (3/4, -3/4),
    gW = [[3/4, 0], [-3/4, 0]], gb = (3/4, -3/4). With <= 32 samples per class every repetition takes all."""
    x = torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 0.0]])
    y = torch.tensor([0, 0, 1])
    pos = torch.tensor([7, 8, 9])
    w, _ = draw_weights(pos, group=y, key=123, repeats=10, batch=32)
    assert w.tolist() == pytest.approx([0.5, 0.5, 1.0])
    W = torch.tensor([[LN3, 0.0], [0.0, 0.0]])
    gW, gb = class_gradient_sums(x, y, w, W, torch.zeros(2))
    torch.testing.assert_close(gW[0], torch.tensor([[-1 / 8, -1 / 4], [1 / 8, 1 / 4]]))
    torch.testing.assert_close(gb[0], torch.tensor([-3 / 8, 3 / 8]))
    torch.testing.assert_close(gW[1], torch.tensor([[3 / 4, 0.0], [-3 / 4, 0.0]]))
    torch.testing.assert_close(gb[1], torch.tensor([3 / 4, -3 / 4]))


def test_draws_are_subsets_of_32_per_repetition_and_engine_independent():
    """A group of 100 samples: each of 10 repetitions averages 32 of them, so the weights sum to 1, are
    multiples of 1/320, and cover more than 32 samples; a group of 5 gets 1/5 each. The weights of one
    client's samples do not depend on which other clients are drawn with it."""
    pos_a = torch.arange(100) + 1000  # client A: 100 samples of class 3
    pos_b = torch.arange(5) + 5000  # client B: 5 samples of class 3
    grp = torch.cat([torch.full((100,), 0), torch.full((5,), 1)])
    w, _ = draw_weights(torch.cat([pos_a, pos_b]), grp, key=99, repeats=10, batch=32)
    wa, wb = w[:100], w[100:]
    assert float(wa.sum()) == pytest.approx(1.0) and float(wb.sum()) == pytest.approx(1.0)
    assert torch.allclose(wa * 320, (wa * 320).round()) and int((wa > 0).sum()) > 32
    assert wb.tolist() == pytest.approx([0.2] * 5)
    alone, _ = draw_weights(pos_a, torch.zeros(100, dtype=torch.long), key=99, repeats=10, batch=32)
    assert torch.equal(alone, wa)
    other, _ = draw_weights(pos_a, torch.zeros(100, dtype=torch.long), key=98, repeats=10, batch=32)
    assert not torch.equal(other, wa)


# ------------------------------------------------------------------------------------ PCL and KD
def test_pcl_code_form_hand_case_two_classes_two_features():
    """v0 = (2, 0) of class 0, v1 = (0.5, 0.5) of class 1; text t0 = (1, 0), t1 = (0.6, 0.8); tau = 0.1.
    Logits s = <v, t> / tau: anchor 0 (20, 12), anchor 1 (5, 7). With the reference's 100 copies of each
    text feature and the anchor's own copy masked out, loss_i = -s_c + log(99 e^{s_c} + 100 e^{s_other});
    the loss is the mean over anchors."""
    V = torch.tensor([[2.0, 0.0], [0.5, 0.5]], dtype=torch.float64)
    y = torch.tensor([0, 1])
    text = torch.tensor([[1.0, 0.0], [0.6, 0.8]], dtype=torch.float64)
    l0 = -20 + math.log(99 * math.exp(20) + 100 * math.exp(12))
    l1 = -7 + math.log(99 * math.exp(7) + 100 * math.exp(5))
    assert pcl_loss_code(V, y, text, 0.1, 100).item() == pytest.approx((l0 + l1) / 2, rel=1e-12)


def _supcon_text_reference(V, y, text_rep, tau):
    """losses.SupConLoss_text as CLIP2FL calls it (m = 100): [N, N] logits against the repeated text
    features, self-contrast masked, mean log-probability of the positives, mean over anchors."""
    mask = (y[:, None] == y[None, :]).to(V.dtype)
    logits = V @ text_rep.T / tau
    logits = logits - logits.max(1, keepdim=True).values
    lmask = 1 - torch.eye(len(V), dtype=V.dtype)
    mask = mask * lmask
    log_prob = logits - torch.log((torch.exp(logits) * lmask).sum(1, keepdim=True))
    return (-(mask * log_prob).sum(1) / mask.sum(1)).mean()


def test_pcl_code_form_equals_the_reference_masked_matrix_at_m_100():
    torch.manual_seed(0)
    K, m, D = 3, 100, 6
    V = torch.randn(K * m, D, dtype=torch.float64) * 2
    y = torch.arange(K).repeat_interleave(m)
    text = F.normalize(torch.randn(K, D, dtype=torch.float64), dim=1)
    ref = _supcon_text_reference(V, y, text.repeat_interleave(100, 0), 0.1)
    assert pcl_loss_code(V, y, text, 0.1, 100).item() == pytest.approx(ref.item(), rel=1e-10)


def test_pcl_paper_form_hand_case():
    """Eq. 7 with cosines: cos(v0, t0) = 1, cos(v1, t1) = 1.4 / sqrt 2, cos(v0, v1) = 1 / sqrt 2;
    L = sum_i (cos(v_i, v_j) - cos(v_i, t_c)) / tau (one other feature in each denominator)."""
    V = torch.tensor([[2.0, 0.0], [0.5, 0.5]], dtype=torch.float64)
    text = torch.tensor([[1.0, 0.0], [0.6, 0.8]], dtype=torch.float64)
    c01 = 1 / math.sqrt(2)
    hand = (c01 - 1) / 0.1 + (c01 - 1.4 / math.sqrt(2)) / 0.1
    assert pcl_loss_paper(V, torch.tensor([0, 1]), text, 0.1).item() == pytest.approx(hand, rel=1e-12)


def test_kd_term_hand_case_and_zero_when_logits_equal():
    """T = 3, teacher logits (3 ln 3, 0) -> softmax(z/T) = (3/4, 1/4); student (0, 0) -> (1/2, 1/2):
    T^2 KL = 9 (3/4 ln(3/2) + 1/4 ln(1/2)). Student = teacher: 0."""
    mask = torch.ones(1, 1, dtype=torch.bool)
    zt = torch.tensor([[[3 * LN3, 0.0]]])
    hand = 9 * (0.75 * math.log(1.5) + 0.25 * math.log(0.5))
    assert kd_loss(torch.zeros(1, 1, 2), zt, 3.0, mask).item() == pytest.approx(hand, rel=1e-6)
    z = torch.randn(2, 4, 5)
    assert kd_loss(z, z.clone(), 3.0, torch.ones(2, 4, dtype=torch.bool)).abs().max().item() < 1e-6


def test_clip2fl_step_loss_is_creff_when_student_logits_equal_clip(lt):
    """A head at CLIP's scale initialised from the text features reproduces the teacher's logits
    100 cos(x, t_k) exactly, so clip2fl's local loss equals creff's (the KD term is 0); any other head
    makes it larger."""
    st, part = lt
    data = load_run_data(st, part, dtype=torch.float64)
    from fedfeat.engine.context import Batch
    from fedfeat.engine.data import build_context

    sets = {"logit_scale": "100", "init": "text"}
    c2, cr = get_method("clip2fl", sets), get_method("creff", sets)
    ctx = build_context(data, c2, 0, torch.device("cpu"))
    glob = c2.init_global(ctx)
    params = {k: v.unsqueeze(0) for k, v in glob.items()}
    x = ctx.feats[:16].unsqueeze(0)
    batch = Batch(
        x, torch.ones(1, 16, dtype=torch.bool), torch.arange(16)[None], 1, 0, 0, ctx.labels[:16][None]
    )
    a, b = c2.step_loss(ctx, params, batch, {}), cr.step_loss(ctx, params, batch, {})
    assert a.item() == pytest.approx(b.item(), abs=1e-9)
    params["W"] = params["W"] * 1.1
    assert c2.step_loss(ctx, params, batch, {}).item() > cr.step_loss(ctx, params, batch, {}).item() + 1e-6


# ------------------------------------------------------------------------------------ server re-training
def test_retrain_head_equals_nn_linear_with_torch_sgd():
    """Same init, same shuffles (13 samples, batch 4: the last batch of each epoch has 1 sample)."""
    torch.manual_seed(0)
    N, D, K, E = 13, 5, 3, 4
    x, y = torch.randn(N, D, dtype=torch.float64), torch.randint(0, K, (N,))
    order = torch.argsort(torch.rand(E, N), 1)
    lin = torch.nn.Linear(D, K).double()
    W0, b0 = lin.weight.detach().clone(), lin.bias.detach().clone()
    opt = torch.optim.SGD(lin.parameters(), lr=0.5)
    for e in range(E):
        for idx in order[e].split(4):
            opt.zero_grad()
            F.cross_entropy(lin(x[idx]), y[idx]).backward()
            opt.step()
    W, b = retrain_head(x, y, W0, b0, order, 4, 0.5)
    torch.testing.assert_close(W, lin.weight.detach())
    torch.testing.assert_close(b, lin.bias.detach())


# ------------------------------------------------------------------------------------ whole method
CASES = [
    ("creff", {"crt_epochs": "20", "match_steps": "15", "local_epochs": "2"}),
    ("clip2fl", {"crt_epochs": "20", "match_steps": "15", "local_epochs": "2", "eta": "0.1"}),
    ("clip2fl", {"crt_epochs": "10", "match_steps": "10", "local_epochs": "1", "num_features": "20",
                 "pcl_form": "paper", "feature_init": "text", "grad_batch": "4"}),
]  # fmt: skip


@pytest.mark.parametrize("name, sets", CASES, ids=["creff", "clip2fl", "clip2fl-paper-pcl"])
def test_batched_equals_loop(lt, name, sets):
    st, part = lt
    out = {}
    for engine in ("batched", "loop"):
        m = get_method(name, sets)
        data = load_run_data(st, part)
        g, met = run_federated(m, data, rounds=3, participation=0.4, seed=0, engine=engine)
        out[engine] = (g, met)  # g: the method's final weights (both heads)
    (gb, mb), (gl, ml) = out["batched"], out["loop"]
    assert len(mb) == 4 and mb[1]["clients"] == ml[1]["clients"]
    for k in ("test_acc", "fedavg_head_acc", "match_loss_last", "bytes_up", "bytes_down"):
        np.testing.assert_allclose([r[k] for r in mb[1:]], [r[k] for r in ml[1:]], atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(
        [r["per_class_acc"] for r in mb], [r["per_class_acc"] for r in ml], atol=1e-5, rtol=0
    )
    assert set(gb) == {"W", "b", "W_crt", "b_crt"}
    for k in gb:
        torch.testing.assert_close(gb[k], gl[k], atol=1e-5, rtol=1e-5)
    assert mb[1]["match_loss_last"] < mb[1]["match_loss_first"]
    assert mb[-1]["test_acc"] != mb[-1]["fedavg_head_acc"]  # the re-trained head is what is evaluated


def test_bytes_up_count_gradients_per_client_and_class(lt):
    """Round 1 uploads each sampled client's head (K D + K floats) and one K D + K gradient per class it
    holds; the broadcast is the FedAvg head plus the re-trained head."""
    st, part = lt
    data = load_run_data(st, part)
    m = get_method("creff", {"crt_epochs": "1", "match_steps": "1", "local_epochs": "1"})
    _, met = run_federated(m, data, rounds=1, participation=0.4, seed=0)
    K, D = 10, 32
    order, offsets = part.order_and_offsets()
    labels = st.labels("train")[order]
    held = sum(len(np.unique(labels[offsets[c] : offsets[c + 1]])) for c in met[1]["clients"])
    n = len(met[1]["clients"])
    assert met[1]["bytes_up"] == 4 * (K * D + K) * (n + held)
    assert met[1]["bytes_down"] == 4 * (K * D + K) * 2 * n


def test_same_seed_same_numbers(lt):
    st, part = lt
    runs = []
    for seed in (3, 3, 4):
        m = get_method("clip2fl", {"crt_epochs": "5", "match_steps": "5", "local_epochs": "1"})
        runs.append(run_federated(m, load_run_data(st, part), rounds=2, participation=0.4, seed=seed)[1])
    assert [r["test_acc"] for r in runs[0]] == [r["test_acc"] for r in runs[1]]
    assert [r["match_loss_first"] for r in runs[0][1:]] != [r["match_loss_first"] for r in runs[2][1:]]


def test_registry_defaults_and_validation():
    assert REGISTRY["creff"].uses_labels and REGISTRY["clip2fl"].uses_labels
    p = get_method("clip2fl").p
    assert (p.lr, p.momentum, p.local_epochs, p.batch_size) == (0.1, 0.0, 10, 32)
    assert (p.kd_alpha, p.kd_temperature, p.eta, p.pcl_temperature) == (1.0, 3.0, 1e-3, 0.1)
    assert (p.num_features, p.match_steps, p.lr_feature, p.crt_epochs, p.crt_lr) == (100, 100, 0.1, 300, 0.01)
    for bad in ({"crt_epochs": "0"}, {"pcl_repeats": "1"}, {"kd_temperature": "0"}, {"grad_batch": "0"}):
        with pytest.raises(FedfeatError):
            get_method("clip2fl", bad)
    with pytest.raises(FedfeatError, match="valid keys"):
        get_method("creff", {"eta": "0.1"})  # PCL is clip2fl's


# ------------------------------------------------------------------------------------ many / medium / few
class _Fixed:
    """A stand-in method whose predictions are given by hand."""

    def __init__(self, pred, K):
        self.logits = F.one_hot(torch.as_tensor(pred), K).double()

    def predict(self, ctx, glob, x):
        return self.logits


def test_many_medium_few_on_a_hand_built_prediction_set():
    """CIFAR-10-LT IF 100 counts (5000, 2997, 1796, 1077, 645, 387, 232, 139, 83, 50) with the paper's
    thresholds > 1500 / 200-1500 / < 200: many = {0, 1, 2}, medium = {3, 4, 5, 6}, few = {7, 8, 9}. Test set:
    4 images per class, right per class (4, 3, 2, 4, 1, 0, 2, 1, 0, 0) -> many 9/12, medium 7/16, few 1/12,
    all 17/40."""
    counts = np.array([5000, 2997, 1796, 1077, 645, 387, 232, 139, 83, 50])
    groups = shot_groups(counts, "1500,200")
    assert [g.tolist() for g in groups.values()] == [[0, 1, 2], [3, 4, 5, 6], [7, 8, 9]]
    right = [4, 3, 2, 4, 1, 0, 2, 1, 0, 0]
    test_y = torch.arange(10).repeat_interleave(4)
    pred = test_y.clone()
    for k, r in enumerate(right):
        pred[4 * k + r : 4 * k + 4] = (k + 1) % 10  # the rest wrong
    ev = evaluate(_Fixed(pred, 10), type("C", (), {"test_x": None})(), {}, test_y, 10)
    assert ev["acc"] == pytest.approx(100 * 17 / 40)
    ga = group_accuracy(ev["per_class_acc"], np.full(10, 4), groups)
    assert ga == pytest.approx({"many_acc": 75.0, "medium_acc": 100 * 7 / 16, "few_acc": 100 / 12})
    # ImageNet-LT thresholds "100,20": the bounds are medium (20-100 inclusive)
    g2 = shot_groups(np.array([101, 100, 20, 19]), "100,20")
    assert [g.tolist() for g in g2.values()] == [[0], [1, 2], [3]]

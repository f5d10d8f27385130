"""Server-side federated-feature synthesis and classifier re-training: CReFF and CLIP2FL, on cached features.

(Over ~600 lines on purpose: CLIP2FL is CReFF plus one loss term, and the two share every step of the round below;
splitting them would put one algorithm's steps in two files.)

CReFF (Shang et al., IJCAI 2022) and CLIP2FL (Shi et al., AAAI 2024, built on CReFF's code) as linear heads on
L2-normalised frozen CLIP image features. One round (CLIP2FL Algorithm 1; reference code ``main.py``):

1. **Real-feature gradients** (client, before local training; paper Eq. 3, ``Local.compute_gradient``). Each
   sampled client takes the server's *re-trained head of the previous round* ``(W^, b^)`` (round 1: a fresh
   ``nn.Linear`` init, as ``main.py``'s ``temp_model``) and, for every class ``c`` it holds, ``grad_repeats``
   (10) times draws ``min(32, n_kc)`` of its class-``c`` samples without replacement, takes the mean
   cross-entropy gradient w.r.t. ``W^`` ``[K, D]`` and ``b^`` ``[K]``, and averages over the repetitions.
2. **Local training** (paper Eq. 1-2): plain SGD (lr 0.1, no momentum, 10 epochs, batch 32) of the FedAvg head
   on CE; ``clip2fl`` adds ``alpha T^2 KL(softmax(z_clip / T) || softmax(z / T))`` with the CLIP zero-shot
   logits ``z_clip = 100 cos(x, t_k)``, exact from the cache.
3. **Aggregation**: FedAvg (Eq. 9, sample-weighted) of the heads; per class, the *uniform* mean of the real
   gradients over the round's clients that hold the class (Eq. 4; ``update_feature_syn``). Classes no sampled
   client holds get no matching term that round.
4. **Federated features** ``V`` ``[K*m, D]`` (m = 100 per class), kept across rounds, take ``match_steps`` (100)
   full-batch SGD steps (lr 0.1) on ``sum_c D(g_c^V, g_c^agg)`` (Eq. 5-6): the synthetic gradient is the mean
   CE gradient of ``(W^, b^)`` on the class's ``m`` features; ``D`` sums ``1 - cos`` over the weight's rows and
   adds one ``1 - cos`` for the whole bias vector (``Gradient_matching_loss.py``, metric 'ours', with its
   ``+1e-6`` in the denominator). ``clip2fl`` adds ``eta * PCL`` (Eq. 7-8, below).
5. **Re-training** (Eq. 10, ``feature_re_train``): a fresh ``nn.Linear(D, K)`` trained on the federated features
   for 300 epochs (batch 32, shuffled, last batch smaller, SGD 0.01). That head is what is evaluated
   (``predict``) and what next round's gradients use; the FedAvg head is what clients train from.

fedfeat's readings and choices (reference-notes.md, "Mapping to a frozen-CLIP-feature setting"):

* **Feature scale.** The reference initialises ``V`` with ``torch.randn`` (norm ~ sqrt(512) = 22.6, the scale
  of its ResNet-8 features); cached CLIP features are unit vectors, and the re-trained head is evaluated on
  them, so ``V`` is initialised as ``randn / sqrt(D)`` (same directions, norm ~ 1). ``feature_init=text``
  starts each class at its text prototype plus the same noise instead. lr 0.1 is kept: relative to the
  features' norm it is a larger step than the reference's (whose features are 22.6x longer).
  ``feature_scale=reference`` (issue 16) keeps the reference's scale instead: the noise is plain ``randn``,
  row norms ~ sqrt(D) (``main.py``: ``torch.randn(num_classes * num_of_feature, 512)``); the default ``unit``
  is the ``/ sqrt(D)`` above.
* **Server head** = plain ``x W^T + b`` (``nn.Linear``, no logit scale), as in the reference; the clients'
  FedAvg head is ``LinearHead``'s (``logit_scale`` 1, text init, the same as ``fedavg``'s, so that with the
  same client protocol ``creff``'s FedAvg head equals a ``fedavg`` run's; reported as ``fedavg_head_acc``).
  Round 0 evaluates that initial FedAvg head (no re-trained head exists yet).
* **Client-side augmentation cannot exist on cached features** and is dropped: DSA (differentiable Siamese
  augmentation, ``dsa_strategy = color_crop_cutout_flip_scale_rotate``, applied to the real images before
  ``compute_gradient``'s per-class gradients) -- the real gradients are taken on the un-augmented cached
  features; and the student's ``RandomCrop(32, padding=4)`` + ``RandomHorizontalFlip`` in local training
  (each local step sees the same cached feature of an image).
* **Gradient averaging**: the uniform per-class mean over clients of the reference (and Eq. 4) is the method;
  CReFF's clients already average over their samples, so a client with 3 samples of a class counts as much as
  one with 300. That is kept (it defines CReFF), and said here rather than "fixed".
* **PCL** (``pcl_form``). ``code`` (default, ``losses.SupConLoss_text`` as called by ``main.py``): anchors are
  the *unnormalised* federated features, contrasted with the normalised class text features repeated 100
  times (hard-coded ``repeat(100, 1)``), the anchor's own copy masked out; with logits
  ``s_k = <v, t_k> / tau`` the loss of an anchor of class c is
  ``-s_c + log((R - 1) e^{s_c} + R sum_{k != c} e^{s_k})``, ``R = pcl_repeats`` = 100, averaged over anchors.
  This is what the reference computes when ``m = 100``, evaluated here as a K-way softmax
  (``O(K m K D)``, not ``O((K m)^2 D)``). For ``m != 100`` the reference crashes (the bug: the 100 copies
  must line up with the ``m`` anchors of a class); fedfeat keeps the 99-vs-100 count weights. ``paper``:
  Eq. 7 literally: cosine similarities, numerator ``v_i`` vs its class prototype, denominator over the other
  *federated features*, summed over anchors (``O((K m)^2 D)`` per step). The code's form is the default
  although DESIGN.md prefers a paper's formula: Eq. 7 has no text feature in its denominator (not a
  contrastive loss as written), the issue asks for "the prototype contrastive loss against the class text
  features", and the paper's eta range was tuned with the code's loss.
* **Upload accounting**: each client uploads one ``[K, D] + [K]`` gradient per class it holds (counted in
  ``bytes_up``); the simulation adds them per class as they arrive (identical to averaging the uploads).
* ``alpha`` / ``T`` of the KD term are named ``kd_alpha`` / ``kd_temperature`` (``--alpha`` is the
  Dirichlet concentration on the command line).

Frozen backbone: the re-trained head depends only on the real-feature gradients and the server's loops, so
local training (and CLIP2FL's KD term) changes only the FedAvg head that clients train from, never the
evaluated model; in the paper the KD term acts through the ResNet-8 backbone, which a cached feature has not.

Randomness (engine-independent): the gradient draws are counter-based keys of (seed, round, repetition,
sample position) (a position names a client and a sample, never a batch slot); the feature init, the
round-1 head, each round's fresh head and its 300 shuffles come from ``rng.generator(seed, round, TAG)``.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F

from fedfeat.engine import rng
from fedfeat.engine.context import Context, RoundPlan, masked_mean
from fedfeat.engine.privacy import clip_factors
from fedfeat.errors import FedfeatError
from fedfeat.methods.base import register
from fedfeat.methods.head import LinearHead, LinearHeadParams

# random-stream tags of this module (fedfeat.engine.rng's own tags are < 100)
TAG_HEAD_INIT = 101  # round-1 gradient head (main.py's temp_model)
TAG_FEAT_INIT = 102  # federated features
TAG_GRAD_DRAW = 103  # clients' draws of up to 32 real samples per class and repetition
TAG_CRT_INIT = 104  # each round's fresh re-training head
TAG_CRT_SHUFFLE = 105  # each round's re-training shuffles (all epochs at once)


# ---------------------------------------------------------------------------------------------- pure pieces
def linear_init(K: int, D: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """``nn.Linear(D, K)``'s default init: ``W, b ~ U(-1/sqrt(D), 1/sqrt(D))`` -> ``[K, D], [K]``."""
    bound = 1 / math.sqrt(D)
    W = (torch.rand(K, D, generator=g) * 2 - 1) * bound
    b = (torch.rand(K, generator=g) * 2 - 1) * bound
    return W, b


class _ClassCEGradients(torch.autograd.Function):
    """``(gW, gb)`` of :func:`class_ce_gradients` with a hand-written backward (differentiable in ``V`` only).

    Autograd's generic backward hands MKL transposed operands with inner dimension K, several times slower
    on CPU than the contiguous ones used here (measured: matching 25 % faster at K = 10 and 100). Checked
    against autograd in ``tests/test_synthesis.py``.
    """

    @staticmethod
    def forward(ctx, V, Y, W, b):  # V [C, m, D], Y [C, 1, K] one-hot of each row's class, W [K, D], b [K]
        C, m, D = V.shape
        z = (W @ V.reshape(C * m, D).T).T.reshape(C, m, -1) + b  # [C, m, K]
        S = torch.softmax(z, -1)
        P = S - Y  # [C, m, K]: dCE/dz per feature
        ctx.save_for_backward(V, W, S, P)
        return torch.bmm(P.transpose(1, 2), V) / m, P.mean(1)  # [C, K, D], [C, K]

    @staticmethod
    def backward(ctx, dgW, dgb):  # [C, K, D], [C, K]
        V, W, S, P = ctx.saved_tensors
        C, m, D = V.shape
        dP = (torch.bmm(V, dgW.transpose(1, 2)) + dgb.unsqueeze(1)) / m  # [C, m, K]
        dZ = S * (dP - (dP * S).sum(-1, keepdim=True))  # softmax backward, [C, m, K]
        K = W.shape[0]
        if K <= 32:  # small K: both terms as one bmm of inner dimension 2K (measured faster at K = 10)
            A = torch.cat([P / m, dZ], -1)  # [C, m, 2K]
            return torch.bmm(A, torch.cat([dgW, W.expand(C, K, D)], 1)), None, None, None
        dV = (dZ.reshape(C * m, K) @ W).view(C, m, D)  # through the logits (no [C, K, D] copy of W)
        return torch.baddbmm(dV, P, dgW, alpha=1 / m), None, None, None  # + through gW


def class_ce_gradients(
    V: torch.Tensor, classes: torch.Tensor, W: torch.Tensor, b: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean-CE gradients of the head ``(W, b)`` on each class's features (paper Eq. 5), differentiable in V.

    ``V  # [C, m, D]`` (the m features of class ``classes[i]`` in row i), ``W  # [K, D]``, ``b  # [K]`` ->
    ``gW  # [C, K, D]``, ``gb  # [C, K]``: ``gW = (1/m) (softmax(V W^T + b) - onehot)^T V``, ``gb`` the mean
    of ``softmax - onehot``. ``W`` and ``b`` are constants here (the server's head is fixed while matching).
    """
    Y = F.one_hot(classes, W.shape[0]).to(V.dtype).unsqueeze(1)  # [C, 1, K]
    return _ClassCEGradients.apply(V, Y, W.detach(), b.detach())


def match_distance(
    gW_syn: torch.Tensor,
    gb_syn: torch.Tensor,
    gW_real: torch.Tensor,
    gb_real: torch.Tensor,
    eps: float = 1e-6,
    rows: str = "sum",
) -> torch.Tensor:
    """Gradient-matching distance per class (``Gradient_matching_loss.py``, metric 'ours') -> ``[C]``.

    ``sum_j (1 - <a_j, r_j> / (|a_j| |r_j| + eps))`` over the weight's rows ``gW  # [C, K, D]``, plus one such
    term for the whole bias vector ``gb  # [C, K]`` (``distance_wb`` reshapes a 1-d tensor to one row).
    ``rows="mean"`` divides by the number of rows, ``K + 1`` (paper Eq. 6's ``1/C``). Identical gradients
    give ~0 per row, opposite ones ~2 per row.
    """

    def d(a, r):
        return 1 - (a * r).sum(-1) / (a.norm(dim=-1) * r.norm(dim=-1) + eps)

    out = d(gW_syn, gW_real).sum(-1) + d(gb_syn, gb_real)  # [C]
    return out / (gW_syn.shape[1] + 1) if rows == "mean" else out


class _RowCosineDistance(torch.autograd.Function):
    """``sum_j (1 - <a_j, r_j> / (|a_j| |r_j| + eps))`` per leading index for a constant ``r``, given as its
    unit rows ``rh = r / |r|`` and ``e = eps / |r|`` (then ``cos = <a, rh> / (|a| + e)``), with the
    hand-derived backward ``d cos / da = rh / (|a| + e) - cos a / (|a| (|a| + e))``: 4 passes over
    ``a  # [C, K, D]`` instead of autograd's ~10 (the elementwise passes cost as much as the matmuls at
    K = 100)."""

    @staticmethod
    def forward(ctx, a, rh, e):  # a, rh [C, K, D]; e [C, K]
        na = torch.linalg.vector_norm(a, dim=-1)  # [C, K]
        den = na + e
        cos = torch.linalg.vecdot(a, rh) / den
        ctx.save_for_backward(a, rh, na, den, cos)
        return (1 - cos).sum(-1)  # [C]

    @staticmethod
    def backward(ctx, g):  # g [C]
        a, rh, na, den, cos = ctx.saved_tensors
        u = -g.unsqueeze(1) / den  # [C, K]
        v = torch.where(na > 0, g.unsqueeze(1) * cos / (na * den), torch.zeros_like(na))
        return rh * u.unsqueeze(-1) + a * v.unsqueeze(-1), None, None


def unit_rows(r: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``(r / |r|, eps / |r|)`` per row (zero rows: ``(0, inf)``, i.e. cosine 0 as the reference's)."""
    nr = torch.linalg.vector_norm(r, dim=-1, keepdim=True)
    pos = nr > 0
    rh = torch.where(pos, r / torch.where(pos, nr, 1), 0)
    e = torch.where(pos, eps / torch.where(pos, nr, 1), float("inf")).squeeze(-1)
    return rh, e


def pcl_loss_code(
    V: torch.Tensor, y: torch.Tensor, text: torch.Tensor, tau: float, repeats: int
) -> torch.Tensor:
    """CLIP2FL's prototype contrastive loss as its code computes it (``losses.SupConLoss_text``).

    ``V  # [N, D]`` federated features (not normalised), ``y  # [N]``, ``text  # [K, D]`` normalised class text
    features, each repeated ``R = repeats`` times in the contrast set with the anchor's own copy masked out:
    per anchor ``-s_c + log((R - 1) e^{s_c} + R sum_{k != c} e^{s_k})`` with ``s = V text^T / tau``; mean over
    anchors. Computed as ``CE(s + log w, c) + log(R - 1)`` with ``w_c = R - 1``, ``w_k = R``.
    """
    s = (text @ V.T).T / tau  # [N, K] (this orientation: MKL's [N, D] @ [D, K] is slower for K = 10)
    logw = torch.full_like(s, math.log(repeats))
    logw.scatter_(1, y.unsqueeze(1), math.log(repeats - 1))
    return F.cross_entropy(s + logw, y) + math.log(repeats - 1)


def pcl_loss_paper(V: torch.Tensor, y: torch.Tensor, text: torch.Tensor, tau: float) -> torch.Tensor:
    """CLIP2FL paper Eq. 7: ``sum_i -log(exp(cos(v_i, t_c)/tau) / sum_{j != i} exp(cos(v_i, v_j)/tau))``."""
    Vn = F.normalize(V, dim=1)
    pos = (Vn * F.normalize(text, dim=1)[y]).sum(1) / tau  # [N]
    sim = Vn @ Vn.T / tau  # [N, N]
    sim = sim.masked_fill(torch.eye(len(V), dtype=torch.bool, device=V.device), float("-inf"))
    return (torch.logsumexp(sim, 1) - pos).sum()


def kd_loss(z: torch.Tensor, z_teacher: torch.Tensor, T: float, mask: torch.Tensor) -> torch.Tensor:
    """``T^2 KL(softmax(z_t/T) || softmax(z/T))`` per client (``KDLoss``, batchmean over the client's real
    samples): ``z, z_teacher  # [n, B, K]``, ``mask  # [n, B]`` -> ``[n]``."""
    lt = F.log_softmax(z_teacher / T, -1)
    kl = (lt.exp() * (lt - F.log_softmax(z / T, -1))).sum(-1)  # [n, B]
    return T * T * masked_mean(kl, mask)


def draw_weights(
    pos: torch.Tensor, group: torch.Tensor, key: int, repeats: int, batch: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-sample weights of the real-gradient average, and the number of samples of each group.

    Items ``pos  # [M]`` (client-major positions) fall in groups ``group  # [M]`` (one per client and class).
    Repetition r keeps the ``min(batch, n_g)`` items of each group with the smallest counter-based key of
    ``(key, pos, r)``, i.e. a uniform draw without replacement (``np.random.permutation(idx)[:32]``); the mean
    over repetitions of the per-draw means is ``sum_i w_i g_i`` with ``w_i = (#draws of i) / (R min(32, n_g))``.
    Returns ``w  # [M]`` and ``inv  # [M]`` (the compact group index of each item).
    """
    _, inv, cnt = torch.unique(group, return_inverse=True, return_counts=True)
    items = pos.unsqueeze(0) * repeats + torch.arange(repeats).unsqueeze(1)  # [R, M]
    keys = rng.uniform_keys(key, items)  # [R, M]
    o1 = torch.argsort(keys, dim=1, stable=True)
    o2 = torch.argsort(inv[o1], dim=1, stable=True)
    order = o1.gather(1, o2)  # [R, M]: grouped, random within a group
    start = torch.cumsum(cnt, 0) - cnt  # [G]
    rank_sorted = torch.arange(len(pos)).unsqueeze(0) - start[inv[order]]  # [R, M]
    rank = torch.empty_like(order).scatter_(1, order, rank_sorted)
    draws = (rank < batch).sum(0)  # [M]
    n_sel = cnt.clamp(max=batch)[inv]
    return draws.to(torch.float64) / (repeats * n_sel), inv


def class_gradient_sums(
    x: torch.Tensor, y: torch.Tensor, w: torch.Tensor, W: torch.Tensor, b: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """``sum_i w_i dCE(x_i, y_i)/d(W, b)`` per class: ``x  # [M, D]``, ``y, w  # [M]`` -> ``[K, K, D], [K, K]``.

    Row c holds the weighted sum over the items of class c (over all clients given). One matmul per class
    present (a loop over classes, never over clients).
    """
    K = W.shape[0]
    G = torch.softmax(x @ W.T + b, -1) - F.one_hot(y, K).to(x.dtype)  # [M, K]
    G = G * w.to(x.dtype).unsqueeze(1)
    gb = torch.zeros(K, K, dtype=x.dtype, device=x.device).index_add_(0, y, G)
    gW = torch.zeros(K, K, x.shape[1], dtype=x.dtype, device=x.device)
    order = torch.argsort(y, stable=True)
    counts = torch.bincount(y, minlength=K).tolist()
    start = 0
    for c, n in enumerate(counts):
        if n:
            idx = order[start : start + n]
            gW[c] = G[idx].T @ x[idx]
            start += n
    return gW, gb


def client_gradient_norms(
    x: torch.Tensor,
    y: torch.Tensor,
    w: torch.Tensor,
    slot: torch.Tensor,
    m: int,
    W: torch.Tensor,
    b: torch.Tensor,
) -> torch.Tensor:
    """``[m]`` L2 norm of each client's whole gradient upload: its per-class sums ``sum_i w_i dCE(x_i)/d(W, b)`` over
    every class it holds (``class_gradient_sums`` per client), without forming them: the squared norm of a class's
    sum is ``sum_{i,j} (g_i . g_j)(x_i . x_j + 1)`` over its items (``g_i = w_i (softmax_i - onehot_i)``), one Gram
    product per class. ``slot  # [M]``: each item's client (0..m-1)."""
    K = W.shape[0]
    G = (torch.softmax(x @ W.T + b, -1) - F.one_hot(y, K).to(x.dtype)) * w.to(x.dtype).unsqueeze(1)  # [M, K]
    sq = torch.zeros(m, dtype=torch.float64, device=x.device)
    for c in torch.unique(y).tolist():
        idx = torch.nonzero(y == c).squeeze(1)
        g, xc, sc = G[idx].double(), x[idx].double(), slot[idx]
        A = (g @ g.T) * (xc @ xc.T + 1) * (sc.unsqueeze(0) == sc.unsqueeze(1))  # [Mc, Mc] within a client
        sq.index_add_(0, sc, A.sum(1))
    return torch.sqrt(sq.clamp_min(0))


def retrain_head(
    x: torch.Tensor,
    y: torch.Tensor,
    W0: torch.Tensor,
    b0: torch.Tensor,
    order: torch.Tensor,
    batch_size: int,
    lr: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain mini-batch SGD of a linear head on CE (``feature_re_train``), as a tight tensor loop.

    ``x  # [N, D]``, ``y  # [N]``, init ``W0  # [K, D]``, ``b0  # [K]``, ``order  # [E, N]`` the shuffles of
    all E epochs (a DataLoader with ``shuffle=True, drop_last=False``: the last batch of an epoch is smaller).
    The bias rides as an extra input column of ones, features and one-hot labels are gathered once per epoch
    (batches are views), and the step is the hand-derived gradient of the mean CE,
    ``W -= lr/n (softmax(x W^T + b) - onehot)^T x``, four tensor ops per step
    (the same numbers as ``nn.Linear`` + ``torch.optim.SGD``; see the tests). Returns ``(W, b)``.
    """
    N, D = x.shape
    K = W0.shape[0]
    X1 = torch.cat([x, torch.ones(N, 1, dtype=x.dtype, device=x.device)], 1)  # [N, D+1]
    Y1 = F.one_hot(y, K).to(x.dtype)  # [N, K]
    W1 = torch.cat([W0, b0.unsqueeze(1)], 1)  # [K, D+1]
    Xe = torch.empty_like(X1)  # [N, D+1] this epoch's order
    YeT = torch.empty(K, N, dtype=x.dtype, device=x.device)  # [K, N] its one-hot labels, transposed
    for e in range(order.shape[0]):
        torch.index_select(X1, 0, order[e], out=Xe)
        YeT.copy_(Y1.index_select(0, order[e]).T)
        for xb, yb in zip(Xe.split(batch_size), YeT.split(batch_size, 1)):
            # [K, B] layout: MKL's [B, D] @ [D, K] path is ~3x slower for K = 10 on CPU (measured)
            pt = torch.softmax(W1 @ xb.T, 0).sub_(yb)  # [K, B]: B * dCE/dz
            W1.addmm_(pt, xb, alpha=-lr / xb.shape[0])
    return W1[:, :D].contiguous(), W1[:, D].contiguous()


def match_features(
    V: torch.Tensor,
    W: torch.Tensor,
    b: torch.Tensor,
    gW_real: torch.Tensor,
    gb_real: torch.Tensor,
    present: torch.Tensor,
    *,
    steps: int,
    lr: float,
    eps: float = 1e-6,
    rows: str = "sum",
    extra=None,
) -> tuple[torch.Tensor, float, float]:
    """``steps`` plain SGD steps on ``sum_{c present} D(g_c^V, g_c^real) + extra(V)`` (paper Eq. 8).

    ``V  # [K, m, D]`` (returned updated, detached), the head ``W  # [K, D]``, ``b  # [K]`` (fixed),
    ``gW_real  # [K, K, D]``, ``gb_real  # [K, K]``, ``present  # [K]`` bool. Returns ``(V, first, last)``
    matching losses (per present class) at the first and last step.
    """
    cls = torch.nonzero(present).squeeze(1)
    every = len(cls) == V.shape[0]  # no gather / scatter of V when every class is matched
    gWr, gbr = (gW_real, gb_real) if every else (gW_real[cls], gb_real[cls])
    rh, e = unit_rows(gWr, eps)  # the real side of every cosine, once per round
    bh, be = unit_rows(gbr, eps)
    scale = 1 / (gWr.shape[1] + 1) if rows == "mean" else 1.0
    V = V.detach().clone()
    first = last = float("nan")
    for step in range(steps):
        Vg = V.requires_grad_(True)
        gW, gb = class_ce_gradients(Vg if every else Vg[cls], cls, W, b)
        # = match_distance(gW, gb, gWr, gbr, eps, rows).sum(), fused
        nb = torch.linalg.vector_norm(gb, dim=-1)
        loss = _RowCosineDistance.apply(gW, rh, e).sum() + (1 - (gb * bh).sum(-1) / (nb + be)).sum()
        loss = loss * scale
        last = float(loss.detach()) / max(len(cls), 1)
        if step == 0:
            first = last
        if extra is not None:
            loss = loss + extra(Vg)
        (g,) = torch.autograd.grad(loss, Vg)
        V = Vg.detach().sub_(g, alpha=lr)
    return V.detach(), first, last


# ---------------------------------------------------------------------------------------------- the methods
@dataclass(frozen=True)
class CReFFParams(LinearHeadParams):
    local_epochs: int = 10  # CLIP2FL options.py num_epochs_local_training
    batch_size: int = 32  # CLIP2FL options.py batch_size_local_training (paper: "client batch 32")
    lr: float = 0.1  # CLIP2FL options.py lr_local_training
    momentum: float = 0.0  # CLIP2FL main.py Local: SGD(lr) without momentum
    weight_decay: float = 0.0  # CLIP2FL main.py Local: no weight decay
    lr_decay: float = 1.0  # CLIP2FL main.py: constant lr
    logit_scale: float = 1.0  # ours: FedAvg head's scale as fedavg's (reference head: a plain nn.Linear)
    normalize: bool = True  # ours: L2-normalised CLIP features (main.py normalises them for the teacher)
    init: Literal["text", "zeros"] = "text"  # ours: FedAvg head from text as fedavg's (reference: random)
    templates: Literal["first", "ensemble"] = "first"  # main.py: one prompt, f"a photo of a {c}"
    num_features: int = 100  # options.py num_of_feature (m per class); paper: "100 ... for each class"
    feature_init: Literal["randn", "text"] = "randn"  # ours: options' randn scaled to unit norm (/ sqrt D)
    # the init noise's scale: unit = randn / sqrt(D) (ours, norm ~ 1 like cached features); reference = plain
    # randn, norm ~ sqrt(D) (CLIP2FL main.py: torch.randn(num_classes * num_of_feature, 512))
    feature_scale: Literal["unit", "reference"] = "unit"
    match_steps: int = 100  # options.py match_epoch (README: --match_epoch 100)
    lr_feature: float = 0.1  # options.py lr_feature (plain SGD on the features)
    match_rows: Literal["sum", "mean"] = "sum"  # Gradient_matching_loss.py sums over rows; paper Eq. 6: mean
    match_eps: float = 1e-6  # Gradient_matching_loss.py distance_wb: |a| |b| + 0.000001
    grad_batch: int = 32  # options.py batch_real (real samples per class per draw)
    grad_repeats: int = 10  # main.py compute_gradient: hard-coded range(10)
    crt_epochs: int = 300  # options.py crt_epoch
    crt_lr: float = 0.01  # options.py lr_net
    crt_batch_size: int = 32  # main.py feature_re_train(..., batch_size_local_training)

    def validate(self) -> None:
        super().validate()
        ints = ("num_features", "grad_batch", "grad_repeats", "crt_epochs", "crt_batch_size")
        bad = [k for k in ints if getattr(self, k) < 1]
        if bad or self.match_steps < 0:
            raise FedfeatError(f"{', '.join(bad) or 'match_steps'} must be >= 1 (match_steps >= 0)")
        if self.lr_feature <= 0 or self.crt_lr <= 0 or self.match_eps < 0:
            raise FedfeatError("lr_feature and crt_lr must be > 0 and match_eps >= 0")


@register
class CReFF(LinearHead):
    """CReFF: federated features matched to clients' per-class gradients; the server re-trains the head."""

    name = "creff"
    state_keys = {
        "syn": "server: [K*m, D] federated features, class-major, matched to the clients' gradients",
        "syn_y": "server: [K*m] int64 class of each federated feature",
        "head": "server: {'W': [K, D], 'b': [K]} the head the clients' gradients are taken at (previous round's)",
        "crt": "server: {'W': [K, D], 'b': [K]} the re-trained head that is evaluated (None until round 1 ends)",
        "agg": "server: this round's per-class gradient sums and client counts (None between rounds)",
        "info": "server: {figure: number} the round's synthesis / re-training figures, for round_metrics",
        "uploads": "server: int (client, class) gradients uploaded in the last round (bytes-up count)",
    }
    Params = CReFFParams
    uses_labels = True
    stacks = True  # the local step only; the feature synthesis and classifier re-training per run
    dp_client = True  # DP-FedAvg: the head's update and the class-gradient upload, each clipped and noised

    # ------------------------------------------------------------------ server state
    def setup(self, ctx: Context) -> None:
        p, K, D, dt = self.p, ctx.K, ctx.D, ctx.feats.dtype
        if ctx.dp is not None and ctx.dp.clip == "adaptive":
            raise FedfeatError(
                f"{self.name}: --dp-clip adaptive tracks the head updates' norms only, not the class gradients this "
                "method also uploads; use --dp-clip fixed"
            )
        g = rng.generator(ctx.seed, 0, TAG_FEAT_INIT)
        V = torch.randn(K * p.num_features, D, generator=g).to(dt)  # [K*m, D]
        if p.feature_scale == "unit":
            V = V / math.sqrt(D)
        if p.feature_init == "text":
            V = V + ctx.text.cpu().to(dt).repeat_interleave(p.num_features, 0)
        W, b = linear_init(K, D, rng.generator(ctx.seed, 0, TAG_HEAD_INIT))
        ctx.state.update(
            syn=V.to(ctx.device),  # [K*m, D] federated features, class-major, kept across rounds
            syn_y=torch.arange(K, device=ctx.device).repeat_interleave(p.num_features),  # [K*m]
            head={"W": W.to(ctx.device, dt), "b": b.to(ctx.device, dt)},  # gradients' head (previous round's)
            crt=None,  # the evaluated re-trained head (None until round 1 ends)
            agg=None,  # this round's per-class gradient sums
            info={},
        )
        ctx.state["uploads"] = 0  # (client, class) gradients uploaded in the last round

    # ------------------------------------------------------------------ client side
    def local_begin(self, ctx: Context, plan: RoundPlan, glob: dict) -> dict:
        """Real-feature gradients of the plan's clients w.r.t. the previous re-trained head (paper Eq. 3),
        for all clients at once; their per-class sums and client counts are added to this round's totals."""
        t0 = time.perf_counter()
        p, K = self.p, ctx.K
        sizes = plan.sizes
        seg = torch.repeat_interleave(torch.arange(plan.m), sizes)  # [M] client slot of each item
        pos = ctx.offsets[plan.clients][seg] + (
            torch.arange(int(sizes.sum())) - torch.repeat_interleave(torch.cumsum(sizes, 0) - sizes, sizes)
        )  # [M] client-major positions
        dev = ctx.device
        y = ctx.labels[pos.to(dev)]  # [M]
        group = plan.clients[seg] * K + y.cpu()  # one group per (client id, class)
        key = rng.stream_key(ctx.seed, plan.rnd, TAG_GRAD_DRAW)
        w, _ = draw_weights(pos, group, key, p.grad_repeats, p.grad_batch)
        sel = torch.nonzero(w > 0).squeeze(1)
        xs = ctx.feats[pos[sel].to(dev)]  # [Ms, D]
        head = ctx.state["head"]
        ws = w[sel].to(dev)
        if ctx.dp is not None:  # DP-FedAvg: each client's gradient upload clipped to C as a whole (dp_parts)
            slot = seg[sel].to(dev)
            norms = client_gradient_norms(xs, y[sel.to(dev)], ws, slot, plan.m, head["W"], head["b"])
            ws = ws * clip_factors(norms, float(ctx.state["dp"]["clip"])).to(ws.dtype)[slot]
        gW, gb = class_gradient_sums(xs, y[sel.to(dev)], ws, head["W"], head["b"])
        holders = torch.bincount(torch.unique(group) % K, minlength=K)  # [K] clients holding each class
        agg = ctx.state["agg"]
        if agg is None or agg["rnd"] != plan.rnd:  # first call this round (loop engine: one per client)
            agg = {"rnd": plan.rnd, "gW": 0 * gW, "gb": 0 * gb, "count": 0 * holders, "uploads": 0}
            agg["seconds"] = 0.0
            ctx.state["agg"] = agg
        agg["gW"] += gW
        agg["gb"] += gb
        agg["count"] = agg["count"] + holders
        agg["uploads"] += int(holders.sum())
        agg["seconds"] += time.perf_counter() - t0
        return {}

    def step_loss(self, ctx, params, batch, local):
        return self.ce(params, batch)[0]

    # ------------------------------------------------------------------ server side
    def feature_loss(self, ctx: Context):
        """Extra loss on the federated features ``[K*m, D]`` during matching (CLIP2FL: eta * PCL)."""
        return None

    def dp_parts(self) -> int:
        return 2  # the head's update and the class gradients, each clipped to C

    def server_update(self, ctx: Context, plan: RoundPlan, old: dict, new: dict) -> dict:
        p, st = self.p, ctx.state
        K, D, m = ctx.K, ctx.D, p.num_features
        agg = st["agg"]
        present = agg["count"] > 0  # [K]
        cnt = agg["count"].clamp_min(1).to(agg["gW"].dtype).to(ctx.device)
        if (
            ctx.dp is not None
        ):  # DP: noised sums over the sampled clients; which client holds what stays private
            agg = self._noised(ctx, plan, agg)
            present = torch.ones_like(present)
            cnt = torch.full_like(cnt, max(plan.m, 1))
        gW_real = agg["gW"] / cnt.view(K, 1, 1)  # [K, K, D] uniform mean over the clients holding c (Eq. 4)
        gb_real = agg["gb"] / cnt.view(K, 1)
        t0 = time.perf_counter()
        extra = self.feature_loss(ctx)
        V, first, last = match_features(
            st["syn"].view(K, m, D),
            st["head"]["W"],
            st["head"]["b"],
            gW_real,
            gb_real,
            present.to(ctx.device),
            steps=p.match_steps,
            lr=p.lr_feature,
            eps=p.match_eps,
            rows=p.match_rows,
            extra=None if extra is None else (lambda Vg: extra(Vg.view(K * m, D))),
        )
        st["syn"] = V.view(K * m, D)
        t1 = time.perf_counter()
        g = rng.generator(ctx.seed, plan.rnd, TAG_CRT_SHUFFLE)
        order = torch.argsort(torch.rand(p.crt_epochs, K * m, generator=g), dim=1)  # [E, K*m] all shuffles
        W0, b0 = linear_init(K, D, rng.generator(ctx.seed, plan.rnd, TAG_CRT_INIT))
        dt = st["syn"].dtype
        W, b = retrain_head(
            st["syn"],
            st["syn_y"],
            W0.to(ctx.device, dt),
            b0.to(ctx.device, dt),
            order.to(ctx.device),
            p.crt_batch_size,
            p.crt_lr,
        )
        st["head"] = st["crt"] = {"W": W, "b": b}
        st["info"] = {
            "match_loss_first": first,
            "match_loss_last": last,
            "classes_matched": int(present.sum()),
            "sec_gradients": agg["seconds"],
            "sec_matching": t1 - t0,
            "sec_retraining": time.perf_counter() - t1,
        }
        st["agg"] = None
        st["uploads"] = agg["uploads"]
        return new

    def _noised(self, ctx: Context, plan: RoundPlan, agg: dict) -> dict:
        """DP-FedAvg of the gradient uploads (``fedfeat.engine.privacy``): the clipped per-class sums plus
        ``N(0, (z sqrt(2) C)^2)`` per coordinate (the upload is the round's second clipped part), divided by the
        sampled clients (not by the clients holding a class, a count that would be released)."""
        from fedfeat.engine.privacy import TAG_DP_UPLOAD, add_noise

        dp = ctx.dp
        z, _ = dp.update_multiplier(max(plan.m, 1))
        std = z * math.sqrt(self.dp_parts()) * float(ctx.state["dp"]["clip"])
        key = rng.stream_key(ctx.seed, plan.rnd, TAG_DP_UPLOAD)
        noisy = add_noise(
            {"gW": agg["gW"].unsqueeze(0), "gb": agg["gb"].unsqueeze(0)}, std, key, torch.zeros(1)
        )
        return {**agg, "gW": noisy["gW"][0], "gb": noisy["gb"][0]}

    def upload_bytes(self, ctx: Context, plan: RoundPlan, cparams: dict) -> int:
        """The heads plus one ``[K, D] + [K]`` gradient per (client, class held)."""
        per = (ctx.K * ctx.D + ctx.K) * ctx.feats.element_size()
        return super().upload_bytes(ctx, plan, cparams) + ctx.state["uploads"] * per

    def broadcast(self, ctx: Context, glob: dict) -> dict:
        """The FedAvg head (clients train from it) and the re-trained head (their gradients use it)."""
        head = ctx.state["head"]
        return {**glob, "W_crt": head["W"], "b_crt": head["b"]}

    # ------------------------------------------------------------------ evaluation
    def predict(self, ctx: Context, glob: dict, x: torch.Tensor) -> torch.Tensor:
        crt = ctx.state.get("crt")
        if crt is None:  # round 0: no re-trained head yet, the initial global head is evaluated
            return super().predict(ctx, glob, x)
        return torch.addmm(crt["b"], x, crt["W"].T)

    def round_metrics(self, ctx: Context, data, glob: dict, ev: dict) -> dict:
        """Accuracy of the plain FedAvg head (what clients train from) and the server loops' figures."""
        pred = super().predict(ctx, glob, ctx.test_x).argmax(1)
        out = {"fedavg_head_acc": float((pred == data.test_y).double().mean()) * 100}
        out.update(ctx.state.get("info", {}))
        return out

    def final_weights(self, ctx: Context, glob: dict) -> dict[str, torch.Tensor]:
        return self.broadcast(ctx, glob)


@dataclass(frozen=True)
class CLIP2FLParams(CReFFParams):
    kd_alpha: float = 1.0  # CLIP2FL options.py alpha (paper Eq. 1's beta; an earlier commit used 2)
    kd_temperature: float = 3.0  # CLIP2FL options.py T (KD loss x T^2, main.py KDLoss)
    teacher_logit_scale: float = 100.0  # CLIP2FL main.py: clip_logits = 100 * img_n @ text_n.T
    eta: float = 1e-3  # options.py contrast_alpha (README 0.001); paper Eq. 8 eta, best in {1e-3, 1e-4, 1e-5}
    pcl_temperature: float = 0.1  # options.py ins_temp (tau of Eq. 7)
    pcl_repeats: int = 100  # main.py new_text_features: each text feature repeated 100 times (hard-coded)
    pcl_form: Literal["code", "paper"] = "code"  # code: losses.SupConLoss_text (module doc); paper: Eq. 7

    RANGES = {"teacher_logit_scale": "> 0"}  # the CLIP teacher's logit scale (its other fields: validate)

    def validate(self) -> None:
        super().validate()
        if self.kd_temperature <= 0 or self.pcl_temperature <= 0:
            raise FedfeatError("kd_temperature and pcl_temperature must be > 0")
        if self.kd_alpha < 0 or self.eta < 0:
            raise FedfeatError("kd_alpha and eta must be >= 0 (the paper's eta range: 1e-3, 1e-4, 1e-5)")
        if self.pcl_repeats < 2:
            raise FedfeatError("pcl_repeats must be >= 2 (the reference repeats each text feature 100 times)")


@register
class CLIP2FL(CReFF):
    """CLIP2FL: CReFF + CLIP zero-shot distillation on clients + text-prototype contrast on the server."""

    name = "clip2fl"
    state_keys = {
        "z_clip": "per-sample: [N, K] CLIP teacher logits 100 cos(x, t_k), made once (only when K <= D)"
    }
    Params = CLIP2FLParams
    stacks = True  # CReFF's + CLIP distillation in the local loss, per-run kd_alpha / kd_temperature
    dp_client = True  # CReFF's: the head's update and the class-gradient upload, each clipped and noised

    def setup(self, ctx: Context) -> None:
        super().setup(ctx)
        if ctx.K <= ctx.D:  # teacher logits of every training sample, when no larger than the features
            with torch.no_grad():
                z = self.p.teacher_logit_scale * (ctx.text @ ctx.feats.T).T
                ctx.state["z_clip"] = z.contiguous()  # [N, K] 100 cos(x, t_k)

    def step_loss(self, ctx, params, batch, local):
        p = self.p
        ce, z = self.ce(params, batch)  # [n], [n, B, K]
        table = ctx.state.get("z_clip")
        if table is not None:
            z_clip = table[batch.pos]  # [n, B, K] 100 cos(x, t_k), padding rows masked out in kd_loss
        else:
            with torch.no_grad():
                z_clip = p.teacher_logit_scale * torch.matmul(batch.x, ctx.text.T)
        return ce + p.kd_alpha * kd_loss(z, z_clip, p.kd_temperature, batch.mask)

    def feature_loss(self, ctx: Context):
        p = self.p
        if p.eta == 0:
            return None
        y, text = ctx.state["syn_y"], ctx.text
        if p.pcl_form == "code":
            return lambda V: p.eta * pcl_loss_code(V, y, text, p.pcl_temperature, p.pcl_repeats)
        return lambda V: p.eta * pcl_loss_paper(V, y, text, p.pcl_temperature)

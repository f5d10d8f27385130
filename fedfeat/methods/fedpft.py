"""FedPFT (Beitollahi et al., "Parametric Feature Transfer: One-shot Federated Learning with Foundation Models",
ICML 2024) on cached features: every client fits one Gaussian mixture per class it holds and uploads its
parameters once; the server samples synthetic features from all mixtures and trains a linear head on them.

The reference code is the Flower baseline ``adap/flower`` ``baselines/fedpft`` (read at commit
``fdef7afb1dca3030553be302366cfd285ed6632c``; ``utils.py``, ``strategy.py``, ``models.py``, ``conf/``):

1. **Client** (``utils.py:39-97`` ``learn_gmm``): for each class with **more than** ``n_mixtures`` samples, sklearn's
   ``GaussianMixture(n_components=n_mixtures, covariance_type=cov_type, random_state=seed, tol=tol,
   max_iter=max_iter)`` (its defaults otherwise: ``reg_covar=1e-6``, ``init_params="kmeans"``, ``n_init=1``) is
   fitted on the class's features (float64, ``models.py:119``); ``means_``, ``weights_``, ``covariances_`` are sent
   as **float16** with the class label and its sample count. Defaults (``conf/strategy/fedpft.yaml``):
   ``n_mixtures=1``, ``cov_type=spherical``, ``seed=0``, ``tol=1e-12``, ``max_iter=10000``.
   Here: ``fit_gmm``, sklearn's EM (``_initialize``, ``_e_step``, ``_m_step``, the ``|change| < tol`` stop) in
   torch float64, batched over every (client, class) pair of the round (padded, in chunks).
2. **Server** (``strategy.py:86-140``): per received mixture, ``gmm.sample(num_samples)``: as many synthetic
   features as the client had samples of that class, split over components by a multinomial on the weights
   (sklearn ``GaussianMixture.sample``); a fresh ``nn.Linear(D, K)`` is trained on all of them with cross-entropy,
   AdamW lr 1e-4 (torch's defaults otherwise: weight decay 0.01), batch 32, shuffled, 50 epochs
   (``models.py:174-226`` ``train``). Here: ``sample_mixtures`` then ``train_head``.
3. **Predict**: ``x W^T + b`` (the trained head's logits).

Where fedfeat differs, and why:
- the reference creates every sampling ``GaussianMixture`` with ``random_state=seed`` (0), so every (client, class)
  mixture is sampled from the *same* standard-normal draws (``RandomState(0)``); here each mixture gets its own
  draws from the run's stream (``rng.generator(seed, round, TAG_SAMPLE)``) -- independent noise, as the paper's
  sampling means. The transform from noise to features is sklearn's (``x = mu + z sqrt(var)``; full covariance:
  numpy ``multivariate_normal``'s SVD factor).
- ``init="kmeans"``: sklearn runs ``KMeans(n_init=1, random_state=seed)`` (greedy k-means++ and Lloyd); here a
  batched k-means++ (non-greedy) and Lloyd with fedfeat's counter-based stream. With the default ``n_mixtures=1``
  both are the single cluster: the fits are sklearn's exactly. ``init="random"`` is sklearn's random
  responsibilities (uniform, normalised per row) from the same stream.
- the features: the reference fits the vision tower's pooled output (un-normalised); here the store's cached image
  features, un-normalised by default (``normalize=False``, a switch).
- the head's initialisation is ``nn.Linear``'s (uniform in ``+-1/sqrt(D)``) from the run's stream.

**Rounds** (the paper and the code: one round, all clients, ``fraction_fit=1``): the mixtures are one-shot. A
client uploads them the first round it is sampled (``upload_bytes``: the float16 parameters plus the int64 label
and count of each mixture, as the reference's ndarrays); later samplings upload nothing. Every round in which
new mixtures arrived, the server trains a **fresh** head on samples from **all** mixtures received so far (what
Flower's ``aggregate_fit`` does with the results it has: a new ``nn.Linear`` each call); rounds without new
mixtures keep the head (``retrain="new"``; ``retrain="every"`` re-samples and re-trains every round, as the
reference's server would if run for several rounds).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F

from fedfeat.engine import rng
from fedfeat.engine.context import Context, RoundPlan
from fedfeat.engine.optim import BatchedSGD
from fedfeat.errors import FedfeatError
from fedfeat.methods.base import Method, check_ranges, register

TAG_INIT = 741  # the mixtures' initialisation (k-means++ / random responsibilities)
TAG_HEAD = 742  # the head's initialisation
TAG_SAMPLE = 743  # the synthetic features
TAG_SHUFFLE = 744  # the server's mini-batch shuffles
MAX_COMPONENTS = 64
CHUNK = 2**24  # float64 elements of one batched EM chunk's largest tensor


@dataclass(frozen=True)
class FedPFTParams:
    batch_size: int = 32  # the engine's plan only: clients run no SGD
    n_mixtures: int = 1  # conf/strategy/fedpft.yaml on_fit_config_fn.n_mixtures
    cov_type: Literal["spherical", "diag", "full"] = "spherical"  # fedpft.yaml cov_type
    tol: float = 1e-12  # fedpft.yaml tol
    max_iter: int = 10000  # fedpft.yaml max_iter
    reg_covar: float = 1e-6  # sklearn GaussianMixture default
    init: Literal["kmeans", "random"] = "kmeans"  # sklearn GaussianMixture default init_params
    kmeans_iter: int = 300  # sklearn KMeans default max_iter
    half: bool = True  # utils.py:91-93: the parameters are sent as float16
    server_epochs: int = 50  # fedpft.yaml num_epochs
    server_batch: int = 32  # fedpft.yaml server_batch_size
    server_lr: float = 1e-4  # fedpft.yaml server_opt.lr (AdamW)
    server_weight_decay: float = 0.01  # torch.optim.AdamW default (strategy.py:129 sets only lr)
    retrain: Literal["new", "every"] = "new"  # ours: re-train when new mixtures arrived / every round
    normalize: bool = False  # models.py:119: the reference fits un-normalised features

    RANGES = {
        "n_mixtures": f"[1, {MAX_COMPONENTS}]",
        "tol": ">= 0",
        "max_iter": ">= 1",
        "reg_covar": ">= 0",
        "kmeans_iter": ">= 1",
        "server_epochs": ">= 1",
        "server_batch": ">= 1",
        "server_lr": "> 0",
        "server_weight_decay": ">= 0",
    }

    @property
    def local_epochs(self) -> int:  # no local SGD: the engine's plan has no epochs
        return 0

    def validate(self) -> None:
        check_ranges(self)


# ------------------------------------------------------------------------------------------------ the batched EM
def _precision_chol(cov: torch.Tensor, cov_type: str) -> torch.Tensor:
    """sklearn ``_compute_precision_cholesky``: full ``inv(chol(cov))^T``, else ``1 / sqrt(cov)``."""
    if cov_type == "full":
        try:
            L = torch.linalg.cholesky(cov)
        except RuntimeError:  # torch's LinAlgError
            raise FedfeatError(
                "fedpft: a full covariance is not positive definite (too few samples of a class?); increase "
                "reg_covar, e.g. --set reg_covar=1e-3"
            ) from None
        eye = torch.eye(cov.shape[-1], dtype=cov.dtype, device=cov.device).expand_as(cov)
        return torch.linalg.solve_triangular(L, eye, upper=False).mT
    if bool((cov <= 0).any()):
        raise FedfeatError("fedpft: a variance is zero (a class of identical features); increase reg_covar")
    return cov.rsqrt()


def estimate_params(X, mask, resp, cov_type: str, reg: float):
    """sklearn ``_estimate_gaussian_parameters`` per group: ``X  # [G, n, D]`` (padded), ``mask  # [G, n]``,
    ``resp  # [G, n, k]`` -> ``(nk  # [G, k], means  # [G, k, D], cov)``; cov ``[G, k]`` spherical, ``[G, k, D]``
    diag, ``[G, k, D, D]`` full."""
    resp = resp * mask.unsqueeze(-1)
    nk = resp.sum(1) + 10 * torch.finfo(resp.dtype).eps
    rX = resp.mT @ X  # [G, k, D]
    means = rX / nk.unsqueeze(-1)
    if cov_type == "full":
        diff = X.unsqueeze(1) - means.unsqueeze(2)  # [G, k, n, D]
        cov = (resp.mT.unsqueeze(-1) * diff).mT @ diff / nk[..., None, None]
        cov = cov + reg * torch.eye(X.shape[-1], dtype=X.dtype, device=X.device)
        return nk, means, cov
    cov = resp.mT @ (X * X) / nk.unsqueeze(-1) - means**2 + reg  # avg_X2 - avg_means2 + reg_covar
    return nk, means, (cov.mean(-1) if cov_type == "spherical" else cov)


def log_gaussian_prob(X, means, pchol, cov_type: str):
    """sklearn ``_estimate_log_gaussian_prob``: ``[G, n, k]``."""
    D = X.shape[-1]
    if cov_type == "full":
        log_det = pchol.diagonal(dim1=-2, dim2=-1).log().sum(-1)  # [G, k]
        y = X.unsqueeze(1) @ pchol - (means.unsqueeze(2) @ pchol)  # [G, k, n, D]
        lp = (y * y).sum(-1).mT
    elif cov_type == "diag":
        log_det = pchol.log().sum(-1)
        prec = pchol**2
        lp = ((means**2) * prec).sum(-1).unsqueeze(1) - 2 * (X @ (means * prec).mT) + (X * X) @ prec.mT
    else:
        log_det = D * pchol.log()
        prec = pchol**2
        lp = (
            ((means**2).sum(-1) * prec).unsqueeze(1)
            - 2 * (X @ means.mT) * prec.unsqueeze(1)
            + (X * X).sum(-1, keepdim=True) * prec.unsqueeze(1)
        )
    return -0.5 * (D * math.log(2 * math.pi) + lp) + log_det.unsqueeze(1)


def fit_gmm(
    X, mask, resp0, cov_type: str = "spherical", reg: float = 1e-6, tol: float = 1e-12, max_iter: int = 100
):
    """sklearn ``GaussianMixture.fit`` (``BaseMixture.fit_predict``, one init) from the initial responsibilities
    ``resp0  # [G, n, k]``, for ``G`` groups at once: ``X  # [G, n, D]`` float64 padded, ``mask  # [G, n]``.
    Each group stops as sklearn's fit does (``|lower bound change| < tol`` or ``max_iter``), its parameters those of
    its last M-step. Returns ``(weights  # [G, k], means  # [G, k, D], cov, n_iter  # [G])``."""
    G = X.shape[0]
    n = mask.sum(1).to(X.dtype)  # [G]
    _, means, cov = estimate_params(X, mask, resp0, cov_type, reg)
    weights = (resp0 * mask.unsqueeze(-1)).sum(1) + 10 * torch.finfo(X.dtype).eps
    weights = weights / n.unsqueeze(-1)  # sklearn _initialize: weights /= n_samples
    pchol = _precision_chol(cov, cov_type)
    lower = torch.full((G,), -math.inf, dtype=X.dtype, device=X.device)
    active = torch.ones(G, dtype=torch.bool, device=X.device)
    n_iter = torch.zeros(G, dtype=torch.int64, device=X.device)

    def keep(a, b):  # a where active, else b
        return torch.where(active.view(-1, *([1] * (a.dim() - 1))), a, b)

    for _ in range(max_iter):
        wlp = log_gaussian_prob(X, means, pchol, cov_type) + weights.log().unsqueeze(1)  # E-step
        lpn = torch.logsumexp(wlp, -1)  # [G, n]
        log_resp = wlp - lpn.unsqueeze(-1)
        new_lower = (lpn * mask).sum(1) / n
        nk, m_new, c_new = estimate_params(X, mask, log_resp.exp(), cov_type, reg)  # M-step
        w_new = nk / nk.sum(-1, keepdim=True)
        weights, means, cov = keep(w_new, weights), keep(m_new, means), keep(c_new, cov)
        pchol = _precision_chol(cov, cov_type)
        change = new_lower - lower
        lower = torch.where(active, new_lower, lower)
        n_iter = n_iter + active.long()
        active = active & ~(change.abs() < tol)
        if not bool(active.any()):
            break
    return weights, means, cov, n_iter


def _uniform(key: int, items: torch.Tensor) -> torch.Tensor:
    return rng.uniform_keys(key, items).to(torch.float64) / float(1 << 62)


def init_resp(
    X, mask, k: int, how: str, ids: torch.Tensor, rows: torch.Tensor, key: int, kmeans_iter: int = 300
):
    """Initial responsibilities ``[G, n, k]`` of sklearn's ``init_params``: ``random`` (uniform, normalised per
    row) or ``kmeans`` (one-hot of a k-means++ seeded Lloyd clustering). Draws are counter-based: ``ids  # [G]``
    the groups' ids and ``rows  # [G, n]`` the samples' ids, so a group's draws do not depend on the batching."""
    G, n, _ = X.shape
    if k == 1:
        return mask.to(X.dtype).unsqueeze(-1)
    if how == "random":
        u = _uniform(key, rows.unsqueeze(-1) * MAX_COMPONENTS + torch.arange(k, device=X.device))  # [G, n, k]
        return u / u.sum(-1, keepdim=True) * mask.unsqueeze(-1)
    cnt = mask.sum(1)  # [G]
    gi = torch.arange(G, device=X.device)
    u = _uniform(key, ids.unsqueeze(-1) * MAX_COMPONENTS + torch.arange(k, device=X.device))  # [G, k]
    first = (u[:, 0] * cnt).long().clamp_max(cnt - 1)
    centers = [X[gi, first]]  # k-means++ (D^2 weighting), one center per step for every group
    d2 = ((X - centers[0].unsqueeze(1)) ** 2).sum(-1) * mask
    for j in range(1, k):
        cum = d2.cumsum(1)
        tot = cum[:, -1]
        pick = torch.searchsorted(cum, (u[:, j] * tot).unsqueeze(1).contiguous(), right=True).squeeze(1)
        pick = torch.where(tot > 0, pick.clamp_max(cnt - 1), (u[:, j] * cnt).long().clamp_max(cnt - 1))
        centers.append(X[gi, pick])
        d2 = torch.minimum(d2, ((X - centers[-1].unsqueeze(1)) ** 2).sum(-1) * mask)
    C = torch.stack(centers, 1)  # [G, k, D]
    m = mask.to(X.dtype)
    mean = (X * m.unsqueeze(-1)).sum(1) / cnt.unsqueeze(-1)
    var = (((X - mean.unsqueeze(1)) ** 2) * m.unsqueeze(-1)).sum(1) / cnt.unsqueeze(-1)
    tol = 1e-4 * var.mean(-1)  # sklearn KMeans: tol * mean per-feature variance
    active = torch.ones(G, dtype=torch.bool, device=X.device)
    for _ in range(kmeans_iter):  # Lloyd
        lab = torch.cdist(X, C).argmin(-1)  # [G, n]
        oh = F.one_hot(lab, k).to(X.dtype) * m.unsqueeze(-1)
        s = oh.sum(1)  # [G, k]
        newC = torch.where(s.unsqueeze(-1) > 0, oh.mT @ X / s.clamp_min(1).unsqueeze(-1), C)
        shift = ((newC - C) ** 2).sum((1, 2))
        C = torch.where(active.view(-1, 1, 1), newC, C)
        active = active & (shift > tol)
        if not bool(active.any()):
            break
    lab = torch.cdist(X, C).argmin(-1)
    return F.one_hot(lab, k).to(X.dtype) * m.unsqueeze(-1)


def fit_groups(feats, rows, group, p: FedPFTParams, key: int) -> dict:
    """Fit one mixture per group: ``rows  # [M]`` feature rows, ``group  # [M]`` their group id (sorted,
    non-decreasing, each group with more than ``n_mixtures`` rows). Groups are padded and fitted in chunks of
    similar size. Returns ``{"weights" [G, k], "means" [G, k, D], "cov", "n_iter" [G]}`` in group order."""
    dev = feats.device
    ids, cnt = torch.unique_consecutive(group, return_counts=True)
    G, D, k = ids.numel(), feats.shape[1], p.n_mixtures
    starts = torch.cumsum(cnt, 0) - cnt
    order = torch.argsort(cnt, stable=True)  # chunks of similar sizes: little padding
    per = k * D * (D + 1) if p.cov_type == "full" else 0
    out: dict = {}
    a = 0
    while a < G:
        b = a + 1
        while b < G and (b + 1 - a) * (int(cnt[order[b]]) * D * (k + 1) + per) <= CHUNK:
            b += 1
        sel = order[a:b]
        nmax = int(cnt[sel].max())
        pos = torch.arange(nmax, device=dev)
        mask = pos.unsqueeze(0) < cnt[sel].unsqueeze(1)  # [g, nmax]
        src = (starts[sel].unsqueeze(1) + pos).clamp_max(rows.numel() - 1)
        r = torch.where(mask, rows[src], torch.zeros_like(src))
        X = feats[r].to(torch.float64) * mask.unsqueeze(-1)
        resp0 = init_resp(X, mask, k, p.init, ids[sel], r, key, p.kmeans_iter)
        w, mu, cov, it = fit_gmm(X, mask, resp0, p.cov_type, p.reg_covar, p.tol, p.max_iter)
        for name, v in (("weights", w), ("means", mu), ("cov", cov), ("n_iter", it)):
            if name not in out:
                out[name] = torch.empty((G, *v.shape[1:]), dtype=v.dtype, device=dev)
            out[name][sel] = v
        a = b
    return out


# ------------------------------------------------------------------------------------------------ the server
def mixture_factor(cov: torch.Tensor, cov_type: str) -> torch.Tensor:
    """The per-component factor of sklearn's ``sample``: ``sqrt(var)`` (spherical ``[..., k]``, diag ``[..., k,
    D]``), or numpy ``multivariate_normal``'s ``sqrt(s)[:, None] * v`` of ``svd(cov)`` (full ``[..., k, D, D]``):
    ``x = mu + z @ factor``."""
    if cov_type != "full":
        return cov.sqrt()
    _, s, vh = torch.linalg.svd(cov)
    return s.sqrt().unsqueeze(-1) * vh


def transform_noise(z, means, factor, cov_type: str, chunk: int = 4096):
    """``x = mu + z * factor`` (or ``z @ factor`` full) row by row: ``z  # [M, D]``, ``means  # [M, D]`` and
    ``factor`` gathered per row (``[M]``, ``[M, D]`` or ``[M, D, D]``; full: a callable ``rows -> [r, D, D]``)."""
    if cov_type == "spherical":
        return means + z * factor.unsqueeze(-1)
    if cov_type == "diag":
        return means + z * factor
    out = torch.empty_like(z)
    step = max(1, CHUNK // (z.shape[1] ** 2))
    for a in range(0, z.shape[0], step):
        sl = slice(a, a + step)
        out[sl] = means[sl] + (
            z[sl].unsqueeze(1) @ factor(torch.arange(a, min(a + step, z.shape[0])))
        ).squeeze(1)
    return out


def sample_mixtures(mix: dict, cov_type: str, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """sklearn ``GaussianMixture.sample(num_samples)`` of every mixture (``strategy.py:97-115``), batched:
    ``mix["count"][g]`` draws of mixture ``g``, each from a component drawn by its weights, ``x = mu + z factor``
    with ``z ~ N(0, I)`` (float64 from ``gen``, on the CPU) -> ``(x  # [M, D] float64, y  # [M] its label)``.
    The parameters are used as received (float16 -> float64)."""
    means = mix["means"].to(torch.float64).cpu()
    weights = mix["weights"].to(torch.float64).cpu()
    cov = mix["cov"].to(torch.float64).cpu()
    count = mix["count"].cpu()
    g = torch.repeat_interleave(torch.arange(count.numel()), count)  # [M] mixture of each draw
    k = weights.shape[1]
    comp = (
        torch.multinomial(weights[g], 1, replacement=True, generator=gen).squeeze(1)
        if k > 1
        else torch.zeros_like(g)
    )
    z = torch.randn(g.numel(), means.shape[-1], generator=gen, dtype=torch.float64)
    fac = mixture_factor(cov, cov_type)
    if cov_type == "full":
        x = transform_noise(z, means[g, comp], lambda r: fac[g[r], comp[r]], cov_type)
    else:
        x = transform_noise(z, means[g, comp], fac[g, comp], cov_type)
    return x, mix["label"].cpu()[g]


def linear_init(K: int, D: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """``nn.Linear(D, K)``'s initialisation (kaiming-uniform with ``a = sqrt(5)``: ``U(+-1/sqrt(D))``; bias the
    same bound) from ``gen``: ``(W  # [K, D], b  # [K])`` float32."""
    bound = 1 / math.sqrt(D)
    W = (torch.rand(K, D, generator=gen) * 2 - 1) * bound
    b = (torch.rand(K, generator=gen) * 2 - 1) * bound
    return W, b


def train_head(W, b, x, y, epochs: int, batch: int, lr: float, weight_decay: float, gen: torch.Generator):
    """``models.py:174-226`` ``train`` on ``DataLoader(list(zip(x, y)), batch, shuffle=True, generator=gen)`` with
    ``AdamW(lr)``: per epoch the loader's iterator draws its base seed, then torch's ``RandomSampler`` its
    ``randperm(N)`` and (when exhausted) a second, empty-sliced one, all from ``gen`` (torch 2.x); mean cross-entropy per batch, ``drop_last=False``. Returns the trained
    ``(W, b)`` and the last epoch's mean loss."""
    W = W.detach().clone().requires_grad_(True)
    b = b.detach().clone().requires_grad_(True)
    opt = torch.optim.AdamW([W, b], lr=lr, weight_decay=weight_decay)
    N = x.shape[0]
    last = float("nan")
    for _ in range(epochs):
        torch.empty((), dtype=torch.int64).random_(generator=gen)  # _BaseDataLoaderIter's _base_seed
        perm = torch.randperm(N, generator=gen).to(x.device)
        torch.randperm(N, generator=gen)  # RandomSampler's trailing randperm(n)[: num_samples % n] (empty)
        tot = 0.0
        for a in range(0, N, batch):
            i = perm[a : a + batch]
            opt.zero_grad()
            loss = F.cross_entropy(x[i] @ W.T + b, y[i])
            loss.backward()
            opt.step()
            tot += float(loss.detach()) * i.numel()
        last = tot / max(N, 1)
    return W.detach(), b.detach(), last


# ------------------------------------------------------------------------------------------------ the method
@register
class FedPFT(Method):
    """FedPFT: one-shot upload of per-class Gaussian mixtures; a head trained on features sampled from them."""

    name = "fedpft"
    trains_clients = False  # clients upload statistics, no parameters are trained
    Params = FedPFTParams
    state_keys = {
        "mixtures": "server: the received mixtures {client [G], label [G], count [G], weights [G, k], means [G, k, D], "
        "cov} (as sent: float16)",
        "uploaded": "server: bool [clients], the clients whose mixtures were received",
        "info": "server: {figure: number} the round's uploads (bytes, mixtures), EM iterations, head loss",
    }
    shardable = False  # the mixtures are fitted on the server from every sampled client's rows
    no_stack_reason = "no local SGD: a server-side fit and head training per run"

    def setup(self, ctx: Context) -> None:
        ctx.state["mixtures"] = None
        ctx.state["uploaded"] = torch.zeros(ctx.n_clients, dtype=torch.bool)
        ctx.state["info"] = {}

    def init_global(self, ctx: Context) -> dict[str, torch.Tensor]:
        W, b = linear_init(ctx.K, ctx.D, rng.generator(ctx.seed, 0, TAG_HEAD))
        return {"W": W.to(ctx.device, ctx.feats.dtype), "b": b.to(ctx.device, ctx.feats.dtype)}

    def make_optimizer(self, rnd: int):
        return BatchedSGD(lr=self.p.server_lr)  # never steps (no local epochs); the round's lr for the hooks

    def step_loss(self, ctx: Context, params: dict, batch, local: dict) -> torch.Tensor:
        raise FedfeatError("fedpft runs no local SGD (local_epochs = 0)")

    def aggregate(self, ctx: Context, plan: RoundPlan, glob: dict, cparams: dict) -> dict:
        return glob  # the clients' upload is their mixtures (server_update), not parameters

    def client_mixtures(self, ctx: Context, clients: torch.Tensor) -> dict:
        """The mixtures of ``clients`` (sorted ids), one per class held with more than ``n_mixtures`` samples
        (``utils.py:75-79``), as sent (float16 with ``half``)."""
        p, K, o = self.p, ctx.K, ctx.offsets
        sizes = o[clients + 1] - o[clients]
        cl = torch.repeat_interleave(clients, sizes)  # [M] the client of each row
        rows = torch.arange(int(sizes.sum())) - torch.repeat_interleave(torch.cumsum(sizes, 0) - sizes, sizes)
        rows = rows + o[cl]
        key = cl * K + ctx.labels.cpu()[rows]
        order = torch.argsort(key, stable=True)
        rows, key = rows[order], key[order]
        ids, cnt = torch.unique_consecutive(key, return_counts=True)
        ok = cnt > p.n_mixtures
        keep = torch.repeat_interleave(ok, cnt)
        rows, key = rows[keep], key[keep]
        ids, cnt = ids[ok], cnt[ok]
        empty = ids.numel() == 0
        dev = ctx.feats.device
        if empty:
            fit = None
        else:
            fit = fit_groups(ctx.feats, rows.to(dev), key.to(dev), p, rng.stream_key(ctx.seed, TAG_INIT))
        dt = torch.float16 if p.half else torch.float32
        D, k = ctx.D, p.n_mixtures
        cov_shape = {"spherical": (k,), "diag": (k, D), "full": (k, D, D)}[p.cov_type]
        return {
            "client": ids // K,
            "label": ids % K,
            "count": cnt,
            "weights": fit["weights"].to(dt).cpu() if fit else torch.zeros(0, k, dtype=dt),
            "means": fit["means"].to(dt).cpu() if fit else torch.zeros(0, k, D, dtype=dt),
            "cov": fit["cov"].to(dt).cpu() if fit else torch.zeros(0, *cov_shape, dtype=dt),
            "n_iter": fit["n_iter"].cpu() if fit else torch.zeros(0, dtype=torch.int64),
        }

    def server_update(self, ctx: Context, plan: RoundPlan, old: dict, new: dict) -> dict:
        p = self.p
        up = ctx.state["uploaded"]
        clients = plan.clients.sort().values
        fresh = clients[~up[clients]]
        info = {"upload_bytes": 0, "mixtures_received": 0}
        if fresh.numel():
            got = self.client_mixtures(ctx, fresh)
            n_iter = got.pop("n_iter")
            info["upload_bytes"] = sum(
                int(v.numel() * v.element_size()) for k, v in got.items() if k != "client"
            )
            info["mixtures_received"] = int(got["label"].numel())
            if n_iter.numel():
                info["em_iter_max"] = int(n_iter.max())
            have = ctx.state["mixtures"]
            ctx.state["mixtures"] = got if have is None else {k: torch.cat([have[k], got[k]]) for k in have}
            up = up.clone()
            up[fresh] = True
            ctx.state["uploaded"] = up
        mix = ctx.state["mixtures"]
        out = old
        if mix is not None and mix["label"].numel() and (fresh.numel() or p.retrain == "every"):
            x, y = sample_mixtures(mix, p.cov_type, rng.generator(ctx.seed, plan.rnd, TAG_SAMPLE))
            W0, b0 = linear_init(ctx.K, ctx.D, rng.generator(ctx.seed, plan.rnd, TAG_HEAD))
            dev, dt = ctx.feats.device, ctx.feats.dtype
            W, b, loss = train_head(
                W0.to(dev, dt), b0.to(dev, dt), x.to(dev, dt), y.to(dev), p.server_epochs, p.server_batch,
                p.server_lr, p.server_weight_decay, rng.generator(ctx.seed, plan.rnd, TAG_SHUFFLE),
            )  # fmt: skip
            info["head_loss"] = loss
            info["synthetic"] = int(x.shape[0])
            out = {"W": W.to(old["W"].dtype), "b": b.to(old["b"].dtype)}
        ctx.state["info"] = info
        return out

    def upload_bytes(self, ctx: Context, plan: RoundPlan, cparams: dict) -> int:
        """The mixtures received this round: float16 weights, means and covariances, plus the int64 label and
        sample count of each (the reference's ndarrays); a client sampled again uploads nothing."""
        return int((ctx.state.get("info") or {}).get("upload_bytes", 0))

    def predict(self, ctx: Context, glob: dict, x: torch.Tensor) -> torch.Tensor:
        return x @ glob["W"].T + glob["b"]

    def round_metrics(self, ctx: Context, data, glob: dict, ev: dict) -> dict:
        return {k: v for k, v in (ctx.state.get("info") or {}).items() if k != "upload_bytes"}


__all__ = [
    "FedPFT",
    "FedPFTParams",
    "estimate_params",
    "fit_gmm",
    "init_resp",
    "linear_init",
    "log_gaussian_prob",
    "mixture_factor",
    "sample_mixtures",
    "train_head",
    "transform_noise",
]

"""CCVR (Luo et al., "No Fear of Heterogeneity: Classifier Calibration for Federated Learning with Non-IID Data",
NeurIPS 2021) as a linear head on cached features: FedAvg, then the classifier calibrated on virtual
representations sampled from the clients' per-class feature Gaussians.

The method (paper §4; no official code is public):

1. Federated training is FedAvg's (CE), here with CLIP2FL's Table 1 protocol (10 epochs, batch 32, SGD 0.1, no
   momentum or weight decay), so the baseline runs in the table's setting.
2. **Feature statistics** (§4, "Feature Distribution Estimation"). Every client k computes, for every class c it
   holds, the mean ``mu_{c,k}`` and the unbiased covariance ``Sigma_{c,k}`` (denominator ``N_{c,k} - 1``) of its
   features -- here the cached CLIP features the head sees (normalised as ``normalize`` says) -- and uploads them
   with ``N_{c,k}``. The server forms the global class Gaussians (Eq. 3-4)::

       mu_c    = sum_k N_{c,k} / N_c  mu_{c,k}
       Sigma_c = sum_k (N_{c,k} - 1) / (N_c - 1) Sigma_{c,k} + sum_k N_{c,k} / (N_c - 1) mu_{c,k} mu_{c,k}^T
                 - N_c / (N_c - 1) mu_c mu_c^T

   which is the unbiased covariance of the pooled features (``tests/test_baselines_server.py`` checks it). A class
   held with one sample has no covariance (``N - 1 = 0``): its term is zero. In the paper the features are the
   final global model's; a frozen backbone's never change, so the statistics are computed once, from every
   client, and uploaded once (counted in ``bytes_up`` of the first calibrating round).
3. **Virtual representations** (§4): ``M_c`` features per class drawn from ``N(mu_c, Sigma_c)`` (full covariance,
   through its eigendecomposition: singular covariances of rare classes are fine); M_c = 2000 (§5, the best value
   on CIFAR-10; as the reimplementation smduan/Fed-CCVR notes too). Classes no client holds get none. Drawn once
   from ``rng.generator(seed, TAG_VIRTUAL)``.
4. **Classifier re-training** (§4): the global classifier is re-trained on the virtual representations with
   cross-entropy, starting from the FedAvg head. The schedule (``calib_*``) could not be checked against the
   paper's text here: SGD lr 0.01 (CReFF's server re-training lr, ``lr_net``), batch 32 (the clients'), 10 epochs
   (smduan/Fed-CCVR ``conf.py`` ``retrain.epoch``) -- named switches.

**When** (``calibrate``): the paper calibrates once, post hoc, after federated training: ``final`` (default)
evaluates the plain FedAvg head every round and the calibrated head at the last round. ``every`` calibrates the
FedAvg head of every round (the same virtual features, fresh shuffles) and evaluates that: a curve of what
stopping at each round would give. Either way clients keep training from the FedAvg head (calibration is never sent
back), and ``fedavg_head_acc`` reports the uncalibrated head.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F

from fedfeat.engine import rng
from fedfeat.engine.context import Context, RoundPlan
from fedfeat.errors import FedfeatError
from fedfeat.methods.base import register
from fedfeat.methods.head import LinearHead, LinearHeadParams
from fedfeat.methods.serverdata import DistillConfig, distill_head

TAG_VIRTUAL = 731  # the virtual representations (drawn once)
TAG_CALIB = 732  # each calibration's shuffles


@dataclass(frozen=True)
class CCVRParams(LinearHeadParams):
    local_epochs: int = 10  # CLIP2FL Table 1 protocol (CLIP2FL options.py num_epochs_local_training)
    batch_size: int = 32  # CLIP2FL options.py batch_size_local_training
    lr: float = 0.1  # CLIP2FL options.py lr_local_training
    momentum: float = 0.0  # CLIP2FL main.py: plain SGD
    weight_decay: float = 0.0  # CLIP2FL main.py
    virtual_per_class: int = 2000  # M_c, CCVR §5 (best on CIFAR-10)
    calib_epochs: int = 10  # ours: not checkable here (smduan/Fed-CCVR conf.py retrain.epoch = 10)
    calib_batch: int = 32  # ours: the clients' batch (CReFF re-trains its head with it too)
    calib_lr: float = 0.01  # ours: CReFF's re-training lr (options.py lr_net), plain SGD
    calibrate: Literal["final", "every"] = "final"  # CCVR: post hoc, once (final); every: each round's head

    def validate(self) -> None:
        super().validate()
        if min(self.virtual_per_class, self.calib_epochs, self.calib_batch) < 1 or self.calib_lr <= 0:
            raise FedfeatError(
                "virtual_per_class, calib_epochs and calib_batch must be >= 1 and calib_lr > 0; "
                "e.g. --set virtual_per_class=2000"
            )


# ---------------------------------------------------------------------------------------------- pure pieces
def class_stats(x: torch.Tensor, y: torch.Tensor, K: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One client's upload: ``x  # [N, D]``, ``y  # [N]`` -> ``(n  # [K], mean  # [K, D], cov  # [K, D, D])``
    in float64; ``cov`` unbiased (``N_c - 1``), zero where ``N_c <= 1``, ``mean`` zero where ``N_c = 0``."""
    x = x.to(torch.float64)
    D = x.shape[1]
    n = torch.bincount(y, minlength=K)
    mean = torch.zeros(K, D, dtype=x.dtype, device=x.device).index_add_(0, y, x) / n.clamp_min(1).unsqueeze(1)
    cov = torch.zeros(K, D, D, dtype=x.dtype, device=x.device)
    for c in torch.nonzero(n > 1).squeeze(1).tolist():
        xc = x[y == c] - mean[c]
        cov[c] = xc.T @ xc / (xc.shape[0] - 1)
    return n, mean, cov


def merge_stats(stats) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The server's global class Gaussians (paper Eq. 3-4) from the clients' ``(n, mean, cov)`` (an iterable of
    ``class_stats`` outputs) -> ``(N  # [K], mu  # [K, D], Sigma  # [K, D, D])`` (float64; ``Sigma = 0`` where
    ``N_c <= 1``). Accumulated client by client: ``A = sum_k (N_{c,k} - 1) Sigma_{c,k} + N_{c,k} mu_{c,k}
    mu_{c,k}^T``, then ``Sigma_c = (A - N_c mu_c mu_c^T) / (N_c - 1)`` -- Eq. 4 times ``N_c - 1``."""
    N = msum = A = None
    for n, mean, cov in stats:
        nf = n.to(mean.dtype)
        term = (nf - 1).clamp_min(0).view(-1, 1, 1) * cov + nf.view(-1, 1, 1) * (
            mean.unsqueeze(2) * mean.unsqueeze(1)
        )
        if N is None:
            N, msum, A = n.clone(), nf.unsqueeze(1) * mean, term
        else:
            N, msum, A = N + n, msum + nf.unsqueeze(1) * mean, A + term
    Nf = N.to(msum.dtype)
    mu = msum / Nf.clamp_min(1).unsqueeze(1)  # Eq. 3
    Sigma = (A - Nf.view(-1, 1, 1) * (mu.unsqueeze(2) * mu.unsqueeze(1))) / (Nf - 1).clamp_min(1).view(
        -1, 1, 1
    )
    Sigma[N <= 1] = 0
    return N, mu, Sigma


def sample_virtual(
    N: torch.Tensor, mu: torch.Tensor, Sigma: torch.Tensor, per_class: int, gen: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """``per_class`` draws from ``N(mu_c, Sigma_c)`` for every class held (``N_c > 0``), class by class:
    ``mu_c + eps V_c diag(sqrt(max(lambda_c, 0)))^T`` with ``Sigma_c = V_c diag(lambda_c) V_c^T`` and ``eps ~ N(0, I)``
    from ``gen`` (CPU, float64) -> ``(x  # [V, D] float64, y  # [V])``."""
    xs, ys = [], []
    for c in torch.nonzero(N > 0).squeeze(1).tolist():
        lam, V = torch.linalg.eigh(Sigma[c])
        L = V * lam.clamp_min(0).sqrt()  # [D, D]: L L^T = Sigma_c
        eps = torch.randn(per_class, mu.shape[1], generator=gen, dtype=torch.float64).to(mu.device)
        xs.append(mu[c] + eps @ L.T)
        ys.append(torch.full((per_class,), c, dtype=torch.int64, device=mu.device))
    return torch.cat(xs), torch.cat(ys)


@register
class CCVR(LinearHead):
    """CCVR: FedAvg + classifier calibration on virtual representations from the clients' class Gaussians."""

    name = "ccvr"
    state_keys = {
        "calibrated": "server: {'W': [K, D], 'b': [K]} the head calibrated on virtual representations (None before)",
        "uploaded": "server: bool, True once the clients' feature statistics were uploaded (counted in bytes once)",
        "info": "server: {figure: number} the calibration's steps and loss, for round_metrics",
    }
    Params = CCVRParams
    shardable = True  # FedAvg locally; the calibration is a deterministic server step on every rank
    stacks = True  # FedAvg's local step; the classifier calibration per run, as alone

    def statistics(self, ctx: Context) -> dict:
        """Every client's class statistics, merged (Eq. 3-4), and the virtual representations drawn from them
        (``ctx.cache``: derived from the data and the seed, never checkpointed)."""
        if "ccvr" not in ctx.cache:
            K, o = ctx.K, ctx.offsets

            def uploads():
                for i in range(ctx.n_clients):
                    sl = slice(int(o[i]), int(o[i + 1]))
                    yield class_stats(ctx.feats[sl], ctx.labels[sl], K)

            held = 0
            for i in range(ctx.n_clients):
                held += int((torch.bincount(ctx.labels[int(o[i]) : int(o[i + 1])], minlength=K) > 0).sum())
            N, mu, Sigma = merge_stats(uploads())
            x, y = sample_virtual(
                N, mu, Sigma, self.p.virtual_per_class, rng.generator(ctx.seed, TAG_VIRTUAL)
            )
            ctx.cache["ccvr"] = {
                "x": x.to(ctx.feats.dtype),  # [V, D] virtual representations
                "target": F.one_hot(y, K).to(ctx.feats.dtype),  # [V, K]
                "held": held,  # (client, class) pairs uploaded
            }
        return ctx.cache["ccvr"]

    def setup(self, ctx: Context) -> None:
        ctx.state["calibrated"] = None
        ctx.state["uploaded"] = False
        ctx.state["info"] = {}

    def server_update(self, ctx: Context, plan: RoundPlan, old: dict, new: dict) -> dict:
        p = self.p
        if p.calibrate == "every" or plan.rnd >= ctx.rounds:
            vr = self.statistics(ctx)
            steps = p.calib_epochs * math.ceil(vr["x"].shape[0] / p.calib_batch)
            cfg = DistillConfig(steps=steps, batch=p.calib_batch, lr=p.calib_lr, loss="kl", optimizer="sgd")
            # KL to a one-hot target is the cross-entropy: the same gradient (softmax(z) - onehot) / B
            W, b, info = distill_head(
                new["W"], new["b"], vr["x"], vr["target"], p.logit_scale, cfg,
                rng.generator(ctx.seed, plan.rnd, TAG_CALIB),
            )  # fmt: skip
            ctx.state["calibrated"] = {"W": W, "b": b}
            ctx.state["info"] = {"calib_steps": info["distill_steps"], "calib_loss": info["distill_loss"]}
        return new  # clients keep training from the FedAvg head

    def upload_bytes(self, ctx: Context, plan: RoundPlan, cparams: dict) -> int:
        """The heads, plus every client's ``(N, mean, covariance)`` per class held, once (the first calibration)."""
        out = super().upload_bytes(ctx, plan, cparams)
        if ctx.state.get("calibrated") is not None and not ctx.state.get("uploaded"):
            ctx.state["uploaded"] = True
            out += self.statistics(ctx)["held"] * (1 + ctx.D + ctx.D * ctx.D) * ctx.feats.element_size()
        return out

    def predict(self, ctx: Context, glob: dict, x: torch.Tensor) -> torch.Tensor:
        cal = ctx.state.get("calibrated")
        return super().predict(ctx, glob if cal is None else cal, x)

    def round_metrics(self, ctx: Context, data, glob: dict, ev: dict) -> dict:
        """The uncalibrated FedAvg head's accuracy and the calibration's figures."""
        out = dict(ctx.state.get("info") or {})
        if ctx.state.get("calibrated") is not None:
            pred = super().predict(ctx, glob, ctx.test_x).argmax(1)
            out["fedavg_head_acc"] = float((pred == data.test_y).double().mean()) * 100
        return out

    def final_weights(self, ctx: Context, glob: dict) -> dict[str, torch.Tensor]:
        cal = ctx.state.get("calibrated")
        return glob if cal is None else {**glob, "W_cal": cal["W"], "b_cal": cal["b"]}


__all__ = ["CCVR", "CCVRParams", "class_stats", "merge_stats", "sample_virtual"]

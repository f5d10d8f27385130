"""Supervised linear heads on cached features: fedavg, fedprox, fedavgm, fedntd, centralized.

The baselines of FST-CBDG (Table 1-2: CLIP-FC-Centralized, FedAvg, FedNTD) and of CLIP2FL (FedAvg,
FedProx, FedAvgM), here all as one linear head ``logits = s * (x W^T + b)`` on L2-normalised CLIP image
features, initialised from the class text features (``W0 = T``, ``b0 = 0``) as FST-CBDG does, and trained with
FST-CBDG's lightweight protocol (SGD 0.01 / 0.9 / 1e-5, 1 local epoch, batch 50).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch
import torch.nn.functional as F

from fedfeat.engine.rounds import Batch, Context, RoundPlan, fused_batches, masked_mean
from fedfeat.errors import FedfeatError
from fedfeat.methods.base import Method, register


class _BatchedLinear(torch.autograd.Function):
    """Class-major logits ``z^T = W x^T + b`` per client with a hand-written backward.

    Layout matters on CPU for these thin products (K outputs per client): ``bmm(W, x^T)`` -> ``[n, K, B]`` runs
    ~2x faster than ``bmm(x, W^T)`` -> ``[n, B, K]``, and the weight gradient ``bmm(g, x)`` with a class-major
    ``g`` needs no transposed copy; autograd's generic baddbmm backward is several times slower than that one
    ``bmm`` (measured for 100 clients x 50 samples x 1024 dims x 10 classes: BENCHMARKS.md)."""

    @staticmethod
    def forward(ctx, x, W, b):  # x [n, B, D], W [n, K, D], b [n, K]
        ctx.save_for_backward(x, W)
        return torch.baddbmm(b.unsqueeze(2), W, x.transpose(1, 2))  # [n, K, B]

    @staticmethod
    def backward(ctx, g):  # g [n, K, B]
        x, W = ctx.saved_tensors
        gx = torch.bmm(g.transpose(1, 2), W) if ctx.needs_input_grad[0] else None
        gW = torch.bmm(g, x) if ctx.needs_input_grad[1] else None
        gb = g.sum(2) if ctx.needs_input_grad[2] else None
        return gx, gW, gb


def batched_linear(x: torch.Tensor, W: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Per-client linear layer: ``x  # [n, B, D]``, ``W  # [n, K, D]``, ``b  # [n, K]`` -> ``[n, B, K]`` (a
    transposed view of class-major storage: ``.transpose(1, 2)`` of it is contiguous)."""
    return _BatchedLinear.apply(x, W, b).transpose(1, 2)


@dataclass(frozen=True)
class LinearHeadParams:
    local_epochs: int = 1  # FST-CBDG §4.1: 1 local epoch per round (lightweight setting)
    batch_size: int = 50  # FedNTD default; FST-CBDG does not say (reference-notes: inference)
    lr: float = 0.01  # FST-CBDG §4.1
    momentum: float = 0.9  # FST-CBDG §4.1
    weight_decay: float = 1e-5  # FST-CBDG §4.1
    lr_decay: float = 1.0  # per-round lr factor; FedNTD's code uses 0.99 (switch), FST-CBDG says nothing
    logit_scale: float = 1.0  # ours (fedfeat's reading of FST-CBDG Eq. 2: no temperature); 100 = CLIP's scale
    normalize: bool = True  # L2-normalise image features (CLIP convention; head init from unit text features)
    init: Literal["text", "zeros"] = (
        "text"  # FST-CBDG: head initialised from "a photo of a {}." text features
    )
    templates: Literal["first", "ensemble"] = "first"  # first = "a photo of a {}."; ensemble = mean of all

    def validate(self) -> None:
        if self.local_epochs < 1 or self.batch_size < 1:
            raise FedfeatError(
                f"local_epochs and batch_size must be >= 1, got {self.local_epochs} and {self.batch_size}; "
                "e.g. --set batch_size=50"
            )
        if self.lr <= 0 or self.logit_scale <= 0:
            raise FedfeatError(
                f"lr and logit_scale must be > 0, got {self.lr} and {self.logit_scale}; e.g. --set lr=0.01"
            )
        if not 0 <= self.momentum < 1 or self.weight_decay < 0:
            raise FedfeatError(
                f"momentum must be in [0, 1) and weight_decay >= 0, got {self.momentum} and {self.weight_decay}; "
                "e.g. --set momentum=0.9"
            )


class LinearHead(Method):
    """Shared linear-head machinery (not registered)."""

    Params = LinearHeadParams

    def init_global(self, ctx: Context) -> dict[str, torch.Tensor]:
        W = ctx.text.clone() if self.p.init == "text" else torch.zeros_like(ctx.text)  # [K, D]
        return {"W": W, "b": torch.zeros(ctx.K, device=ctx.device, dtype=W.dtype)}

    def logits(self, params: dict, x: torch.Tensor) -> torch.Tensor:
        """``x  # [n, B, D]``, per-client ``W  # [n, K, D]`` -> ``[n, B, K]``."""
        return self.p.logit_scale * batched_linear(x, params["W"], params["b"])

    def predict(self, ctx: Context, glob: dict, x: torch.Tensor) -> torch.Tensor:
        if (
            x is ctx.test_x
        ):  # the evaluation: class-major logits on the cached transposed test set (a view back)
            return self.p.logit_scale * torch.addmm(glob["b"].unsqueeze(1), glob["W"], ctx.test_xT()).T
        return self.p.logit_scale * (x @ glob["W"].T + glob["b"])

    def fused_epoch(self, ctx, plan, glob, local, params, opt, epoch):
        """The epoch in ``fedfeat.engine.kernels.linear_epoch`` (SGD state: momentum buffers; the first epoch starts
        every client from ``glob``)."""
        from fedfeat.engine import kernels

        mode, mu, tau, beta = self.fused_loss()
        bufs = opt.state["fused"]  # momentum buffers (run_local)
        losses = np.zeros((int(plan.steps.max()), plan.m), dtype=np.float64)
        kernels.linear_epoch(
            ctx.feats.numpy(), ctx.labels.numpy(), **fused_batches(ctx, plan, epoch),
            W=params["W"].numpy(), b=params["b"].numpy(), mW=bufs["W"].numpy(), mb=bufs["b"].numpy(),
            Wg=glob["W"].contiguous().numpy(), bg=glob["b"].contiguous().numpy(),
            lr=opt.lr, momentum=opt.momentum, weight_decay=opt.weight_decay, logit_scale=self.p.logit_scale,
            mode=mode, mu=mu, tau=tau, beta=beta, loss_out=losses, threads=ctx.threads, init=epoch == 0,
            one_epoch=plan.epochs == 1,
        )  # fmt: skip
        return losses

    def ce(self, params: dict, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        z = self.logits(params, batch.x)  # [n, B, K]
        ce = F.cross_entropy(z.transpose(1, 2), batch.y, reduction="none")  # [n, B]
        return masked_mean(ce, batch.mask), z


@register
class FedAvg(LinearHead):
    """FedAvg (McMahan et al. 2017): local SGD on cross-entropy, sample-weighted averaging."""

    name = "fedavg"
    shardable = True  # no per-sample state: torchrun may shard its clients (engine.sharded_local)

    def step_loss(self, ctx, params, batch, local):
        return self.ce(params, batch)[0]

    def fused_loss(self):
        return 0, 0.0, 1.0, 0.0  # (mode, mu, tau, beta): kernels.CE


@register
class Centralized(FedAvg):
    """CLIP-FC-Centralized (FST-CBDG): a linear probe on all labelled training data, one 'client'."""

    name = "centralized"
    centralized = True  # the CLI loads the split as a single client holding every sample


@dataclass(frozen=True)
class FedProxParams(LinearHeadParams):
    mu: float = 0.01  # FedProx (Li et al. 2020) proximal weight; their grid {0.001, 0.01, 0.1, 1}


@register
class FedProx(LinearHead):
    """FedProx (Li et al. 2020): FedAvg + (mu/2) ||theta - theta_global||^2 in the local loss."""

    name = "fedprox"
    shardable = True
    Params = FedProxParams

    def local_begin(self, ctx, plan, glob):
        return {"glob": glob}

    def step_loss(self, ctx, params, batch, local):
        g = local["glob"]
        prox = sum(((params[k] - g[k]) ** 2).flatten(1).sum(1) for k in params)  # [n]
        return self.ce(params, batch)[0] + 0.5 * self.p.mu * prox

    def fused_loss(self):
        return 0, self.p.mu, 1.0, 0.0  # kernels.CE with the proximal term


@dataclass(frozen=True)
class FedAvgMParams(LinearHeadParams):
    server_momentum: float = 0.9  # FedAvgM (Hsu et al. 2019): beta in v = beta v + delta
    server_lr: float = 1.0  # Hsu et al. 2019


@register
class FedAvgM(FedAvg):
    """FedAvgM (Hsu et al. 2019): FedAvg with server momentum on the averaged update."""

    name = "fedavgm"
    shardable = True
    Params = FedAvgMParams

    def setup(self, ctx):
        ctx.state["v"] = None

    def server_update(self, ctx: Context, plan: RoundPlan, old: dict, new: dict) -> dict:
        delta = {k: old[k] - new[k] for k in old}  # pseudo-gradient
        v = ctx.state["v"]
        v = delta if v is None else {k: self.p.server_momentum * v[k] + delta[k] for k in delta}
        ctx.state["v"] = v
        return {k: old[k] - self.p.server_lr * v[k] for k in old}


@dataclass(frozen=True)
class FedNTDParams(LinearHeadParams):
    tau: float = 1.0  # FedNTD config/fedntd.json (the class default of 3 is overridden by the config)
    beta: float = 1.0  # FedNTD config/fedntd.json


def ntd_loss(
    z_local: torch.Tensor,
    z_global: torch.Tensor,
    y: torch.Tensor,
    mask: torch.Tensor,
    tau: float | torch.Tensor,
    beta: float | torch.Tensor,
) -> torch.Tensor:
    """FedNTD (Lee et al. 2022) per client: ``CE(z, y) + beta tau^2 KL(softmax(zg~/tau) || softmax(zl~/tau))``,
    where ``~`` removes the true-class column; KL is ``KLDivLoss(batchmean)``: summed over classes, averaged
    over the client's samples. Shapes: ``z_*  # [n, B, K]``, ``y, mask  # [n, B]`` -> ``[n]``; ``tau``, ``beta``
    one value, or one per client ``[n]`` (stacked runs, ``fedfeat.runs.stack``)."""
    K = z_local.shape[-1]
    ce = F.cross_entropy(z_local.transpose(1, 2), y, reduction="none")  # [n, B]
    ar = torch.arange(K - 1, device=y.device)
    nt = ar + (ar >= y.unsqueeze(-1)).long()  # [n, B, K-1] indices of the not-true classes
    t = tau.view(-1, 1, 1) if torch.is_tensor(tau) else tau
    zl = torch.gather(z_local, -1, nt) / t
    zg = torch.gather(z_global, -1, nt) / t
    pg = F.softmax(zg, -1)
    kl = (pg * (F.log_softmax(zg, -1) - F.log_softmax(zl, -1))).sum(-1)  # [n, B]
    return masked_mean(ce, mask) + beta * tau**2 * masked_mean(kl, mask)


@register
class FedNTD(LinearHead):
    """FedNTD (Lee et al. 2022): CE + not-true distillation from the frozen global model."""

    name = "fedntd"
    shardable = True
    Params = FedNTDParams

    def local_begin(self, ctx, plan, glob):
        return {"glob": {k: v.detach() for k, v in glob.items()}}

    def step_loss(self, ctx, params, batch, local):
        g = local["glob"]
        z = self.logits(params, batch.x)
        with torch.no_grad():
            zg = self.p.logit_scale * (batch.x @ g["W"].T + g["b"])  # [n, B, K]
        return ntd_loss(z, zg, batch.y, batch.mask, self.p.tau, self.p.beta)

    def fused_loss(self):
        return 1, 0.0, self.p.tau, self.p.beta  # kernels.NTD

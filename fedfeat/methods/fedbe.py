"""FedBE (Chen & Chao, "FedBE: Making Bayesian Model Ensemble Applicable to Federated Learning", ICLR 2021) as a
linear head on cached features: FedAvg, then a Bayesian model ensemble distilled into the averaged head on
unlabelled server data.

One round (paper §4; code hongyouc/FedBE@7eeb965 ``main.py``, ``swag.py``, ``models/Update.py`` ``ServerUpdate``):

1. Local training as FedAvg's (CE), with CLIP2FL's Table 1 protocol (10 epochs, batch 32, SGD 0.1, no momentum or
   weight decay), so the baseline runs in the table's setting.
2. **The global model distribution** (``gaussian``). ``paper`` (default): a diagonal Gaussian fitted to the
   client heads around their sample-weighted mean, ``mu = sum_i (n_i / n) w_i``, ``sigma^2 = sum_i (n_i / n)
   (w_i - mu)^2`` (element-wise; paper §4, "Gaussian"). ``code`` (``swag.py`` ``SWAG_server.construct_models``,
   ``mode="gaussian"``): per parameter tensor, the clients' updates ``g_i = w_i - w_global`` are normalised
   (``g_i / ||g_i||``), a diagonal Gaussian with the uniform mean ``a`` and variance ``clamp(mean(g^2) - a^2,
   1e-5)`` of those directions is sampled with its standard deviation scaled by ``var_scale`` (0.1), and the sample
   is rescaled by the mean update norm (times ``swag_stepsize``, 1) and added to ``w_global``.
3. **The ensemble**: M = 10 heads sampled from it (paper; ``--num_sample_teacher 10``), the clients' heads
   (``--use_client``) and the mean head (the FedAvg head is added for SWAG teachers: ``dont_add_fedavg`` is False),
   all with equal weight: the mean of their softmax outputs on the server set (paper: Bayesian model ensemble).
4. **Pseudo-labels**: that mean, sharpened ``p^(1/t) / sum`` with t = 0.5 (``utils/tools.py`` ``merge_logits`` ->
   ``temp_sharpen(logits, temp=args.temp)`` for the default ``--loss_type KL``, ``--temp 0.5``; floored at 1e-8).
   ``sharpen_temperature=1`` leaves the ensemble's probabilities as they are.
5. **Distillation with SWA** (``ServerUpdate.train``): the student starts as the FedAvg head and is trained on the
   pseudo-labels with ``(p (log p - log q)).mean()`` (over batch and classes), SGD lr 1e-3, momentum 0.9, weight
   decay 1e-5 (``set_opt``), 20 epochs (``--server_ep 20``) of shuffled batches of 128 (``--server_bs``); SWA
   (torchcontrib, ``swa_start=500, swa_freq=25``) averages the iterate every 25 steps after step 500, and the
   average is the new global head (``--use_SWA``). Fewer than 525 steps take no snapshot: the last iterate.

The code reads ``args.is_logit``, ``args.logit_method`` and ``args.soft_vote``, which its ``utils/options.py``
does not define; fedfeat takes the path the paper describes (probabilities, mean over the ensemble).

Server data (``fedfeat.methods.serverdata``): FedBE holds out 10,000 CIFAR-10 training images from the clients
(``utils/sampling.py``: ``50000 - num_data``); ``server_data=unassigned`` (default) is that, capped at
``server_size`` = 10,000 rows. No label is read. Samples are drawn from ``rng.generator(seed, round, TAG_SAMPLE)``,
the shuffles from ``(seed, round, TAG_DISTILL)``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch

from fedfeat.engine import rng
from fedfeat.engine.context import Context, RoundPlan
from fedfeat.errors import FedfeatError
from fedfeat.methods.base import register
from fedfeat.methods.head import LinearHead, LinearHeadParams
from fedfeat.methods.serverdata import (
    DISTILL_STATE,
    DistillConfig,
    check_source,
    distill_head,
    draw_set,
    mean_probs,
    server_step_metrics,
)

TAG_SERVER_SET = 721
TAG_SAMPLE = 722  # each round's sampled heads
TAG_DISTILL = 723  # each round's shuffles


@dataclass(frozen=True)
class FedBEParams(LinearHeadParams):
    local_epochs: int = 10  # CLIP2FL Table 1 protocol (CLIP2FL options.py num_epochs_local_training)
    batch_size: int = 32  # CLIP2FL options.py batch_size_local_training
    lr: float = 0.1  # CLIP2FL options.py lr_local_training
    momentum: float = 0.0  # CLIP2FL main.py: plain SGD
    weight_decay: float = 0.0  # CLIP2FL main.py
    server_data: str = "unassigned"  # FedBE utils/sampling.py: training images no client holds
    server_size: int = 10000  # FedBE: 50,000 - --num_data 40,000 held-out images; 0 = all
    samples: int = 10  # M, paper §4 / --num_sample_teacher 10
    gaussian: Literal["paper", "code"] = (
        "paper"  # paper §4 weighted mean / variance; code: swag.py (module doc)
    )
    var_scale: float = 0.1  # gaussian=code only: --var_scale 0.1 (std multiplier)
    swag_stepsize: float = 1.0  # gaussian=code only: --swag_stepsize 1.0
    ensemble_clients: bool = True  # paper / run.sh --use_client: the client heads join the ensemble
    ensemble_mean: bool = True  # paper / main.py: the FedAvg head joins the ensemble
    sharpen_temperature: float = 0.5  # utils/tools.py temp_sharpen with --temp 0.5 (1 = no sharpening)
    distill_epochs: int = 20  # --server_ep 20 (run.sh)
    distill_batch: int = 128  # --server_bs 128
    distill_lr: float = 1e-3  # models/Update.py set_opt: SGD(lr=1e-3, momentum=0.9, weight_decay=1e-5)
    distill_momentum: float = 0.9  # set_opt
    distill_weight_decay: float = 1e-5  # set_opt
    swa: bool = True  # --use_SWA (run.sh, FedBE rows)
    swa_start: int = 500  # set_opt: SWA(base_opt, swa_start=500, swa_freq=25)
    swa_freq: int = 25  # set_opt

    def validate(self) -> None:
        super().validate()
        check_source(self.server_data, "server_data")
        if self.server_size < 0 or self.samples < 0:
            raise FedfeatError("server_size (0: all) and samples must be >= 0; e.g. --set samples=10")
        if min(self.distill_epochs, self.distill_batch, self.swa_freq) < 1 or self.swa_start < 0:
            raise FedfeatError(
                "distill_epochs, distill_batch and swa_freq must be >= 1 and swa_start >= 0; e.g. --set swa_start=500"
            )
        if (
            self.sharpen_temperature <= 0
            or self.distill_lr <= 0
            or self.var_scale < 0
            or self.swag_stepsize <= 0
        ):
            raise FedfeatError(
                "sharpen_temperature, distill_lr and swag_stepsize must be > 0 and var_scale >= 0; "
                "e.g. --set sharpen_temperature=0.5"
            )
        if not (self.samples or self.ensemble_clients or self.ensemble_mean):
            raise FedfeatError(
                "the ensemble is empty: set samples >= 1 or ensemble_clients / ensemble_mean true"
            )
        if not 0 <= self.distill_momentum < 1 or self.distill_weight_decay < 0:
            raise FedfeatError("distill_momentum must be in [0, 1) and distill_weight_decay >= 0")


# ---------------------------------------------------------------------------------------------- pure pieces
def fit_gaussian(params: dict[str, torch.Tensor], weights: torch.Tensor) -> tuple[dict, dict]:
    """Paper §4: the diagonal Gaussian of the client models ``params  # {name: [m, ...]}`` with weights
    ``n_i / n`` (``weights  # [m]``, normalised here): ``mu = sum_i w_i theta_i``, ``var = sum_i w_i (theta_i -
    mu)^2`` -> ``(mu, var)``, each ``{name: [...]}``."""
    w = weights.to(next(iter(params.values())).dtype)
    w = w / w.sum()
    mu, var = {}, {}
    for k, v in params.items():
        wk = w.view(-1, *([1] * (v.dim() - 1)))
        mu[k] = (wk * v).sum(0)
        var[k] = (wk * (v - mu[k]) ** 2).sum(0)
    return mu, var


def sample_gaussian(mu: dict, var: dict, M: int, gen: torch.Generator) -> dict[str, torch.Tensor]:
    """``M`` draws ``mu + sqrt(var) eps``, ``eps ~ N(0, I)`` from ``gen`` (CPU) -> ``{name: [M, ...]}``."""
    out = {}
    for k in mu:
        eps = torch.randn((M, *mu[k].shape), generator=gen, dtype=torch.float64).to(mu[k])
        out[k] = mu[k] + var[k].sqrt() * eps
    return out


def sample_code(
    params: dict[str, torch.Tensor], base: dict[str, torch.Tensor], M: int, gen: torch.Generator,
    var_scale: float, stepsize: float,
) -> dict[str, torch.Tensor]:  # fmt: skip
    """FedBE's code (``swag.py`` ``SWAG_server``, ``compute_mean_sq`` / ``compute_var`` / ``construct_models`` with
    ``mode="gaussian"``, ``concentrate_num=1``), per tensor: ``g_i = theta_i - base``, ``d_i = g_i / ||g_i||``,
    ``a = mean_i d_i``, ``var = max(mean_i d_i^2 - a^2, 1e-5)``, sample ``s = a + sqrt(var) eps var_scale``, model
    ``s stepsize mean_i ||g_i|| + base`` -> ``{name: [M, ...]}``."""
    out = {}
    for k, v in params.items():
        g = v - base[k]  # [m, ...]
        norm = g.flatten(1).norm(dim=1).clamp_min(1e-12)  # [m]
        d = g / norm.view(-1, *([1] * (g.dim() - 1)))
        a = d.mean(0)
        var = (d.square().mean(0) - a.square()).clamp_min(1e-5)  # compute_var, then >= 1e-6
        eps = torch.randn((M, *a.shape), generator=gen, dtype=torch.float64).to(a)
        s = a + var.sqrt() * eps * var_scale
        out[k] = s * (stepsize * norm.mean()) + base[k]
    return out


def sharpen(p: torch.Tensor, t: float) -> torch.Tensor:
    """``utils/tools.py`` ``temp_sharpen``: ``max(p^(1/t), 1e-8)`` renormalised over the classes."""
    q = p.pow(1 / t).clamp_min(1e-8)
    return q / q.sum(-1, keepdim=True)


@register
class FedBE(LinearHead):
    """FedBE: FedAvg + a Gaussian over the client heads, sampled heads + clients + mean as the ensemble, distilled
    with SWA on unlabelled server data."""

    name = "fedbe"
    state_keys = DISTILL_STATE  # (serverdata) the FedAvg head and the distillation's figures
    Params = FedBEParams
    shardable = True  # the server step sees every client's head (aggregate), and is deterministic
    stacks = True  # FedAvg's local step; the Bayesian ensemble distillation per run, as alone

    def server_set(self, ctx: Context):
        if "fedbe_set" not in ctx.cache:  # drawn once (derived, not checkpointed)
            p = self.p
            ctx.cache["fedbe_set"] = draw_set(
                ctx, p.server_data, p.server_size, p.normalize, tag=TAG_SERVER_SET, field="server_data"
            )
        return ctx.cache["fedbe_set"]

    def setup(self, ctx: Context) -> None:
        self.server_set(ctx)  # fail before round 1 when the server has no data
        ctx.state["fedavg_head"] = None
        ctx.state["info"] = {}

    def ensemble(self, ctx: Context, plan: RoundPlan, glob: dict, cparams: dict) -> tuple[dict, dict]:
        """``(mean head, ensemble {name: [T, ...]})``: the sampled heads, the clients', the mean (step 2-3)."""
        p = self.p
        sizes = plan.sizes.to(ctx.device)
        mu, var = fit_gaussian(cparams, sizes)
        gen = rng.generator(ctx.seed, plan.rnd, TAG_SAMPLE)
        parts = []
        if p.ensemble_mean:
            parts.append({k: v.unsqueeze(0) for k, v in mu.items()})
        if p.samples:
            if p.gaussian == "paper":
                parts.append(sample_gaussian(mu, var, p.samples, gen))
            else:
                parts.append(sample_code(cparams, glob, p.samples, gen, p.var_scale, p.swag_stepsize))
        if p.ensemble_clients:
            parts.append(cparams)
        return mu, {k: torch.cat([q[k] for q in parts]) for k in mu}

    def aggregate(self, ctx: Context, plan: RoundPlan, glob: dict, cparams: dict) -> dict:
        p = self.p
        mu, ens = self.ensemble(ctx, plan, glob, cparams)
        s = self.server_set(ctx)
        with torch.no_grad():
            target = sharpen(mean_probs(s.x, ens["W"], ens["b"], p.logit_scale), p.sharpen_temperature)
        steps = p.distill_epochs * math.ceil(len(s) / p.distill_batch)
        cfg = DistillConfig(
            steps=steps, batch=p.distill_batch, lr=p.distill_lr, loss="kl_mean", optimizer="sgd",
            momentum=p.distill_momentum, weight_decay=p.distill_weight_decay,
            swa_start=p.swa_start if p.swa else -1, swa_freq=p.swa_freq,
        )  # fmt: skip
        W, b, info = distill_head(
            mu["W"], mu["b"], s.x, target, p.logit_scale, cfg, rng.generator(ctx.seed, plan.rnd, TAG_DISTILL)
        )
        info["server_rows"] = len(s)
        info["ensemble_size"] = int(ens["W"].shape[0])
        ctx.state["fedavg_head"] = mu
        ctx.state["info"] = info
        return {"W": W, "b": b}

    def round_metrics(self, ctx: Context, data, glob: dict, ev: dict) -> dict:
        """The FedAvg head's accuracy (before distillation) and the distillation's figures."""
        return server_step_metrics(ctx, data)


__all__ = ["FedBE", "FedBEParams", "fit_gaussian", "sample_code", "sample_gaussian", "sharpen"]

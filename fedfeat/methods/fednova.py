"""FedNova (Wang, Liu, Liang, Joshi, Poor, NeurIPS 2020): normalised averaging of heterogeneous local updates.

CLIP2FL's Table 1 baseline, here as a linear head ``logits = s * (x W^T + b)`` on cached CLIP features (LinearHead).
Local training is FedAvg's (local SGD on cross-entropy, optionally proximal); the server step normalises each
client's cumulative update by its local normalising vector before averaging (reference code ``JYWa/FedNova@47b4e09``
``distoptim/FedNova.py``, class ``FedNova``; ``FedNova.py:L`` below is a line there)::

    x_new = x - tau_eff * sum_i p_i * (x - x_i) / a_i,        p_i = n_i / sum_j n_j,   tau_eff = sum_i p_i a_i

(``tau_eff = sum_i p_i tau_i`` when ``mu != 0``, as the reference, FedNova.py:171-175)

``a_i = ||a_i||_1`` is the reference's ``local_normalizing_vec`` (FedNova.py:151-162), a function of the client's
local steps ``tau_i`` only: ``tau_i`` for vanilla SGD; ``sum_{t=1..tau_i} (1 - rho^t) / (1 - rho)`` with local
momentum ``rho`` (the paper's momentum case); ``(1 - (1 - lr mu)^tau_i) / (lr mu)`` for proximal SGD (the paper's
FedProx case); the reference's own recursion when both are on (``normalizing_vec``). ``tau_i`` is the number of
steps a client really takes, ``local_epochs * ceil(n_i / batch_size)`` (the engine's ``plan.steps * plan.epochs``,
as the reference's ``localE * len(train_loader)`` with ``drop_last=False``, train_LocalSGD.py:185; the paper's
introduction writes ``floor(E n_i / B)`` for the same count): heterogeneous steps come from clients' different sizes
at a fixed number of epochs. Weight decay is part of the local gradient (FedNova.py:116-117) and leaves ``a_i`` as
it is; the proximal term ``mu (x - x_global)`` is folded into the momentum buffer exactly as the reference does
(``d_p`` *is* the buffer when it is added, FedNova.py:135-139), which is FedProx's loss term, so ``mu`` reuses
FedProx's loss and fused kernel.

The method runs batched over clients: local updates are the engine's batched tensor program (or the fused CPU
kernel); ``aggregate`` computes every sampled client's ``a_i`` and weight at once (``[m]`` tensors) and applies one
weighted sum over the client axis.

Defaults are LinearHead's (CLIP2FL's table sets lr / epochs / batch / momentum / weight decay per row); the
reference's own defaults are ``gmf = 0``, ``mu = 0``, ``momentum = 0`` (train_LocalSGD.py:44-55, 104-107) with a
hard-coded ``weight_decay = 1e-4`` and ``nesterov = False`` (train_LocalSGD.py:178-179; Nesterov is not ported).

Switches (params below): ``tau_eff`` (``code``, the default: the reference's own choice, FedNova.py:171-175 --
``sum p_i tau_i`` when ``mu != 0``, ``sum p_i a_i`` otherwise; ``a``: ``sum p_i a_i`` always, fedfeat's default
before issue 37, which departs from the reference when ``mu > 0``; ``steps``: ``sum p_i tau_i`` always), ``weight_decay_in_a`` (count
weight decay as a decay in ``a_i``, as ``mu`` is), ``weights`` (``p_i`` over the round's sampled clients, or over
all clients as the reference's ``DataRatios``, where every client takes part in every round), ``gmf`` (the
reference's server momentum, FedNova.py:194-203).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from fedfeat.engine.context import Context, RoundPlan
from fedfeat.errors import FedfeatError
from fedfeat.methods.base import register
from fedfeat.methods.head import LinearHead, LinearHeadParams


@dataclass(frozen=True)
class FedNovaParams(LinearHeadParams):
    mu: float = 0.0  # FedNova.py:58 `mu`: proximal local SGD (FedNova.py:138-139); train_LocalSGD.py:104: 0
    gmf: float = 0.0  # FedNova.py:58 `gmf`, server (slow) momentum (FedNova.py:194-203); train_LocalSGD.py:44 default 0
    # code (issue 37): the reference's choice, JYWa/FedNova distoptim/FedNova.py:171-175 `if self.mu != 0:
    # local_steps * ratio else local_normalizing_vec * ratio` -- steps when mu != 0, a when mu = 0;
    # a: tau_eff = sum_i p_i a_i always (FedNova.py:175; the paper's normalised update; fedfeat's default before
    # issue 37, off the reference when mu > 0); steps: tau_eff = sum_i p_i tau_i always (FedNova.py:173)
    tau_eff: Literal["code", "a", "steps"] = "code"
    # False: weight decay is part of the gradient and a_i ignores it (FedNova.py:116-117, 151-162); True (ours): a_i
    # treats it as a decay like mu, with lr * (mu + weight_decay) in place of lr * mu
    weight_decay_in_a: bool = False
    # sampled: p_i = n_i / (samples of the round's clients), so sum p_i = 1 (forced by partial participation: the
    # reference runs every client every round); population: p_i = n_i / (all clients' samples), the reference's
    # DataRatios (util_v4.py:180-182) taken literally
    weights: Literal["sampled", "population"] = "sampled"

    def validate(self) -> None:
        super().validate()
        if self.mu < 0 or not 0 <= self.gmf < 1:
            raise FedfeatError(
                f"fednova needs mu >= 0 and gmf in [0, 1), got mu={self.mu}, gmf={self.gmf}; e.g. --set gmf=0"
            )
        decay = self.mu + (self.weight_decay if self.weight_decay_in_a else 0.0)
        if self.lr * decay >= 1:
            raise FedfeatError(
                f"fednova: lr * (mu{' + weight_decay' if self.weight_decay_in_a else ''}) = {self.lr * decay} >= 1 "
                "makes the local normalising vector a_i meaningless; lower mu, e.g. --set mu=0.01"
            )


def normalizing_vec(tau: torch.Tensor, rho: float, etamu: float) -> torch.Tensor:
    """``||a_i||_1`` of every client, the reference's ``local_normalizing_vec`` after ``tau_i`` steps
    (FedNova.py:151-162), in closed form over a ``[m, T]`` table: ``tau  # [m]`` local steps (int),
    ``rho`` local momentum, ``etamu`` = lr * mu -> ``[m]`` float64.

    Per step the reference does ``c = rho c + 1; v += c`` (if rho), ``v = v (1 - etamu) + 1`` (if etamu), ``v += 1``
    (if neither); that is ``v_t = (v_{t-1} + inc_t) q + r`` with ``inc_t = (1 - rho^t) / (1 - rho)`` (0 without
    momentum), ``q = 1 - etamu`` (1 without), ``r = 1`` unless only momentum is on; unrolled,
    ``v_tau = sum_{t=1..tau} (inc_t q + r) q^(tau - t)``.

    >>> normalizing_vec(torch.tensor([2, 4]), 0.5, 0.0).tolist()
    [2.5, 6.125]
    """
    tau = tau.to(torch.float64).cpu()
    T = int(tau.max()) if tau.numel() else 0
    t = torch.arange(1, T + 1, dtype=torch.float64)  # [T]
    inc = (1 - rho**t) / (1 - rho) if rho else torch.zeros_like(t)
    q = 1.0 - etamu if etamu else 1.0
    r = 1.0 if (etamu or not rho) else 0.0
    expo = tau.unsqueeze(1) - t.unsqueeze(0)  # [m, T]: tau_i - t, negative past the client's last step
    decay = torch.where(expo >= 0, torch.full_like(expo, q).pow(expo.clamp_min(0)), torch.zeros_like(expo))
    return (decay * (inc * q + r)).sum(1)


@register
class FedNova(LinearHead):
    """FedNova (Wang et al. 2020): local SGD, updates normalised by each client's local steps before averaging."""

    name = "fednova"
    state_keys = {
        "v": "server: {name: tensor like the head} momentum buffer (gmf), in units of update / lr, or None"
    }
    shardable = True  # no per-sample state; aggregate sees every client's parameters (engine.sharded_local)
    stacks = True  # + FedProx's term when mu > 0; its normalised aggregation per run
    Params = FedNovaParams

    def setup(self, ctx: Context) -> None:
        ctx.state["v"] = (
            None  # the server momentum buffer (gmf), in units of update / lr as FedNova.py:196-200
        )

    def local_begin(self, ctx, plan, glob):
        return {"glob": glob}

    def step_loss(self, ctx, params, batch, local):
        if not self.p.mu:
            return super().step_loss(ctx, params, batch, local)
        g = local["glob"]
        prox = sum(((params[k] - g[k]) ** 2).flatten(1).sum(1) for k in params)  # [n]
        return self.ce(params, batch)[0] + 0.5 * self.p.mu * prox

    def fused_loss(self):
        return 0, self.p.mu, 1.0, 0.0  # kernels.CE, with FedProx's proximal term when mu > 0

    def coefficients(self, ctx: Context, plan: RoundPlan) -> torch.Tensor:
        """``[m]`` float64 weights ``p_i tau_eff / a_i`` of the clients' updates (0 for a client without steps)."""
        lr = self.make_optimizer(plan.rnd).lr
        decay = self.p.mu + (self.p.weight_decay if self.p.weight_decay_in_a else 0.0)
        tau = (plan.steps * plan.epochs).cpu()  # [m] local steps
        a = normalizing_vec(tau, self.p.momentum, lr * decay)  # [m]
        n = plan.sizes.to(torch.float64).cpu()
        total = n.sum() if self.p.weights == "sampled" else float(ctx.offsets[-1])
        p = n / total
        by_a = self.p.tau_eff == "a" or (self.p.tau_eff == "code" and not self.p.mu)  # FedNova.py:171-175
        tau_eff = (p * (a if by_a else tau.to(torch.float64))).sum()
        return torch.where(a > 0, p * tau_eff / a.clamp_min(1e-300), torch.zeros_like(a))

    def aggregate(self, ctx: Context, plan: RoundPlan, glob: dict, cparams: dict) -> dict:
        """``x - sum_i c_i (x - x_i) = (1 - sum_i c_i) x + sum_i c_i x_i`` with ``c = coefficients`` (FedNova.py:183-205
        without the all-reduce: the clients' parameters are already on one client axis)."""
        c = self.coefficients(ctx, plan)
        rest = float(1 - c.sum())
        out = {}
        for k, g in glob.items():
            ck = c.to(device=g.device, dtype=g.dtype)
            out[k] = torch.tensordot(ck, cparams[k], dims=1).add_(g, alpha=rest)
        return out

    def server_update(self, ctx: Context, plan: RoundPlan, old: dict, new: dict) -> dict:
        """Server momentum ``gmf`` (FedNova.py:194-203): ``buf = d / lr`` in the first round, then
        ``buf = gmf buf + d / lr``; ``x = x_old - lr buf``, where ``d = x_old - x_new`` is the normalised update and
        ``lr`` this round's local learning rate."""
        if not self.p.gmf:
            return new
        lr = self.make_optimizer(plan.rnd).lr
        d = {k: (old[k] - new[k]) / lr for k in old}
        v = ctx.state["v"]
        v = d if v is None else {k: self.p.gmf * v[k] + d[k] for k in d}
        ctx.state["v"] = v
        return {k: old[k] - lr * v[k] for k in old}


__all__ = ["FedNova", "FedNovaParams", "normalizing_vec"]

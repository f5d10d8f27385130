"""FedDyn (Acar, Zhao, Navarro, Mattina, Whatmough, Saligrama, ICLR 2021): federated learning with dynamic
regularisation.

Here as a linear head ``logits = s * (x W^T + b)`` on cached CLIP features (``LinearHead``). Every client ``i`` of all
``N`` keeps a dual state; fedfeat stores it as FL-bench does, ``nu_i = sum over the rounds it took part in of
(theta_i - theta_g)`` (``ctx.state["nabla"]``, checkpointed; zero until the client is first sampled, and stored for
the clients sampled so far, so the state grows with the clients seen, not with the run's client count), which is the
paper's ``grad L_i = -alpha nu_i``. A round, as the public reference FL-bench
(``KarhouTam/FL-bench@06e658bca5af6ce732e25bb7c0f8be321e14a85e``, ``src/client/feddyn.py`` and
``src/server/feddyn.py``; ``client:L`` / ``server:L`` below are lines there)::

    client i, each mini-batch:  loss = CE + alpha <theta, nu_i - theta_g>                    (client:28-32)
                                gradient clipped to norm max_grad_norm, then SGD             (client:33-38)
    server:  nu_i += theta_i - theta_g  for the sampled clients                              (server:47-50)
             theta_g <- sum_i w_i theta_i + mean over all N clients of nu                   (server:42, 52-54)

with ``w_i`` FedAvg's sample weights (FL-bench's ``FedAvgServer.aggregate_client_updates``,
``src/server/fedavg.py:677-689``) and the dual sent as ``nu_i - theta_g`` (server:32-37).

Where FL-bench differs from the paper (Algorithm 1), each a switch, FL-bench's behaviour the default:

* ``prox``: the paper's local objective is ``CE - <grad L_i, theta> + alpha/2 ||theta - theta_g||^2``, whose
  gradient ``g + alpha nu_i + alpha (theta - theta_g)`` has a term ``alpha theta`` that FL-bench's loss lacks.
  FL-bench's comment (server:13) says it follows FL-Simulator, which puts that term in the optimiser's weight decay
  (``woodenchild95/FL-Simulator@502bec65570165d1ff1a6ce76375297145c734e3``, ``client/feddyn.py:10``:
  ``weight_decay = weight_decay + lamb``); FL-bench's optimiser has no such term. ``prox=True`` is the paper's
  objective, made as FL-Simulator makes it (``alpha`` added to the weight decay, outside the clipped gradient).
  Without it the head's norm grows by a factor > 1 every round when the clients' gradients vanish (the linear term
  ``-alpha theta_g`` pulls outward and nothing pulls back): a slow inflation of the logits, see the default below.
* ``weights``: ``samples`` (FL-bench) or ``uniform`` (the paper: ``1 / |P_t|`` over the round's clients).
* ``max_grad_norm``: FL-bench and FL-Simulator clip each client's gradient (``torch.nn.utils.clip_grad_norm_``
  over ``W`` and ``b`` together); the paper does not (0 switches it off).

Batched over clients. The correction ``alpha (nu_i - theta_g)`` is the gradient of the loss term ``alpha <theta,
nu_i - theta_g>`` of ``step_loss`` on the ``[n, B, D]`` batches of all active clients; its value is subtracted
again (``t - t.detach()``), so ``train_loss`` is the cross-entropy, comparable with FedAvg's. The clipping is a
per-client step of the optimiser (``ClippedSGD``: every client's norm at once); the server step and the duals of
all sampled clients are ``[m, K, D]`` operations in ``aggregate``. The fused CPU kernels compute the linear heads'
cross-entropy losses, not a linear term, so FedDyn runs the torch program on every device. FL-bench skips
mini-batches of one sample (client:24-25, for BatchNorm); fedfeat trains on them. The evaluated and broadcast model
is the corrected ``theta_g`` (FL-bench's ``public_model_params``; the paper's server model).

Defaults and their sources. ``alpha = 0.1`` and ``max_grad_norm = 10`` (server:23-24; the paper's grid for
``alpha`` is {0.1, 0.01, 0.001}). Local SGD is FL-bench's default optimiser, plain SGD: ``momentum = 0``,
``weight_decay = 0`` (FL-bench ``config/defaults.yaml`` ``optimizer``; the paper's experiments: SGD without
momentum), not the linear heads' 0.9 / 1e-5 (momentum 0.9 below: 81.1 %). The head runs at CLIP's logit scale,
``logit_scale = 100`` (the encoder's own; ``LinearHeadParams`` keeps 1), with ``lr = 1e-4``, FL-bench's 0.01
divided by 100 (the same weight step, as ``fedfeat.runs.divergence.hint`` advises every head at scale 1): ours,
measured. On the default synthetic store (``fedfeat synth``; Dirichlet 0.1, 100 clients, 10 % participation, seeds
0-2; zero-shot 71.9 %) these defaults give 86.8 % at round 10 (86.6-87.1; lowest round 75.2 %), 89.7 % at round
100, 87.4 % with 2 shards per client (FedAvg's defaults but scale 100 and lr 1e-4: 79.5 % and 86.8 %);
``prox=true`` the same (86.8 %). The cross-entropy's gradient grows with the logit scale, so FL-bench's clipping at
10 acts in many steps here (without it, ``max_grad_norm=0``: 86.4 %). At the linear heads' scale 1 with FL-bench's
lr 0.01 the first rounds fall below zero-shot (16.6 % at round 10, seed 0; FedAvg with the same plain SGD 12.3 %)
and recover only as clients come back (86.7 % at round 100): a client is sampled about once in 10 rounds, so its
dual is zero at its first visits and the round is FedAvg's plus the server's ``mean nu``, which keeps every visited
client's drift. There FL-bench's missing ``alpha theta`` term also shows: the head's norm grows from 3.2 to 118 by
round 100 (a rising logit temperature; ``prox=true``: 7.2); at these defaults it is 3.2 to 3.3. Batch and epochs
are the linear heads' (FST-CBDG's protocol; FL-bench: batch 32, 5 epochs). ``fedfeat sweep --method fedavg,feddyn``
at defaults therefore compares different heads; set ``logit_scale`` and ``lr`` alike to compare the algorithms.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from fedfeat.engine.context import Context, RoundPlan, fedavg
from fedfeat.engine.optim import BatchedSGD
from fedfeat.errors import FedfeatError
from fedfeat.methods.base import register
from fedfeat.methods.head import LinearHead, LinearHeadParams, client_rows, client_table, store_client_rows


@dataclass(frozen=True)
class FedDynParams(LinearHeadParams):
    lr: float = 1e-4  # ours, measured (module doc): FL-bench's 0.01 (config/defaults.yaml) / logit_scale
    logit_scale: float = 100.0  # CLIP's own (module doc: at the linear heads' 1 the first rounds collapse)
    momentum: float = 0.0  # FL-bench config/defaults.yaml optimizer.momentum (plain SGD, as the paper)
    weight_decay: float = 0.0  # FL-bench config/defaults.yaml optimizer.weight_decay
    alpha: float = 0.1  # FL-bench src/server/feddyn.py:23 (--alpha); the paper's grid {0.1, 0.01, 0.001}
    max_grad_norm: float = 10.0  # FL-bench src/server/feddyn.py:24; 0 = no clipping (the paper)
    # False: FL-bench's local loss (no alpha theta term); True: the paper's alpha/2 ||theta - theta_g||^2, made as
    # FL-Simulator client/feddyn.py:10 makes it (alpha added to the weight decay)
    prox: bool = False
    # samples: FedAvg's sample weights (FL-bench src/server/fedavg.py:677-689); uniform: 1/|P_t| (paper, Alg. 1)
    weights: Literal["samples", "uniform"] = "samples"

    def validate(self) -> None:
        super().validate()
        if self.alpha <= 0 or self.max_grad_norm < 0:
            raise FedfeatError(
                f"feddyn needs alpha > 0 and max_grad_norm >= 0 (0: no clipping), got alpha={self.alpha}, "
                f"max_grad_norm={self.max_grad_norm}; e.g. --set alpha=0.1"
            )


@dataclass
class ClippedSGD(BatchedSGD):
    """``BatchedSGD`` whose step first clips each client's gradient as ``torch.nn.utils.clip_grad_norm_`` does
    (``max_norm``; 0: no clipping): the norm of the client's per-tensor norms, every gradient times
    ``min(1, max_norm / (norm + 1e-6))``; then weight decay and momentum as ``torch.optim.SGD``."""

    max_norm: float = 0.0

    @torch.no_grad()
    def step(self, params: dict[str, torch.Tensor], grads: dict[str, torch.Tensor], n: int) -> None:
        if self.max_norm:
            norms = torch.stack([torch.linalg.vector_norm(g.flatten(1), dim=1) for g in grads.values()], 1)
            coef = (self.max_norm / (torch.linalg.vector_norm(norms, dim=1) + 1e-6)).clamp(max=1.0)  # [n]
            grads = {k: g * coef.view(-1, *([1] * (g.dim() - 1))) for k, g in grads.items()}
        super().step(params, grads, n)


@register
class FedDyn(LinearHead):
    """FedDyn (Acar et al. 2021): a dynamic regulariser per client; the server corrects the average by the duals."""

    name = "feddyn"
    Params = FedDynParams
    state_keys = {
        "nabla": "per-client: {ids: [V] sorted client ids, W: [V, K, D], b: [V, K]} nu_i = sum of theta_i - theta_g "
        "over its rounds, of the V clients sampled so far (others: zero; the paper's grad L_i = -alpha nu_i)",
    }
    divergence_hint = (
        "CLIP's logit scale with a small step, feddyn's defaults: --set logit_scale=100 --set lr=1e-4 (its "
        "docstring: at scale 1 its first rounds collapse until clients are sampled again)"
    )
    shardable = True  # aggregate sees every sampled client and updates the state identically on every rank
    stacks = True  # its own step_loss / optimiser / aggregate per run; the state is each run's own

    def setup(self, ctx: Context) -> None:
        ctx.state["nabla"] = client_table(ctx)

    def make_optimizer(self, rnd: int) -> ClippedSGD:
        """The linear heads' SGD (lr schedule, momentum, weight decay) with FL-bench's clipping; ``prox``: ``alpha``
        added to the weight decay (FL-Simulator client/feddyn.py:10)."""
        opt = super().make_optimizer(rnd)
        wd = opt.weight_decay + (self.p.alpha if self.p.prox else 0.0)
        return ClippedSGD(lr=opt.lr, momentum=opt.momentum, weight_decay=wd, max_norm=self.p.max_grad_norm)

    def local_begin(self, ctx: Context, plan: RoundPlan, glob: dict) -> dict:
        """``{"dual": {name: [m, ...]}}``: ``nu_i - theta_g`` of the plan's clients (FL-bench server:34-36)."""
        nu = client_rows(ctx.state["nabla"], plan.clients)
        return {"dual": {k: nu[k] - g for k, g in glob.items()}}

    def step_loss(self, ctx: Context, params: dict, batch, local: dict) -> torch.Tensor:
        """``CE + alpha <theta, nu_i - theta_g>``, the inner product's value taken out again -> ``[n]``."""
        dual = local["dual"]
        t = self.p.alpha * sum((params[k] * dual[k][: batch.n]).flatten(1).sum(1) for k in params)  # [n]
        return self.ce(params, batch)[0] + (t - t.detach())

    def aggregate(self, ctx: Context, plan: RoundPlan, glob: dict, cparams: dict) -> dict:
        """``nu_i += theta_i - theta_g`` for the round's clients, then ``sum_i w_i theta_i + mean_N nu``."""
        old = client_rows(ctx.state["nabla"], plan.clients)
        store_client_rows(
            ctx.state["nabla"], plan.clients, {k: old[k] + (cparams[k] - g) for k, g in glob.items()}
        )
        nu = ctx.state["nabla"]  # the clients sampled so far; the others' nu_i are zero
        w = plan.sizes if self.p.weights == "samples" else torch.ones(plan.m)
        avg = fedavg(cparams, w.to(glob["W"].device))
        return {k: avg[k] + nu[k].sum(0) / ctx.n_clients for k in avg}


__all__ = ["ClippedSGD", "FedDyn", "FedDynParams"]

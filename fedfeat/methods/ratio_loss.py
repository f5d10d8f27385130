"""Ratio Loss (Wang, Xu, Wang & Zhu, "Addressing Class Imbalance in Federated Learning", AAAI 2021) as a linear
head on cached features: the server monitors the global head's class imbalance with a small balanced auxiliary set
and the clients train with the class weights it derives.

The paper's two parts, as its official code runs them (balanced-fl/Addressing-Class-Imbalance-FL@cd0e996,
``FEMNIST-4-Losses``: ``main_nn.py``, ``models/Fed.py``, ``models/Update.py``; the paper's text could not be read
from this machine, so the equations below are the code's, which the paper's §"Monitoring" / §"Ratio Loss" describe):

1. **Monitoring** (``main_nn.py`` "monitor", ``Fed.py``). After a round's local training the server copies the
   global head ``W_t`` the round's clients started from and trains one copy per class ``p`` on the auxiliary data of
   that class alone, exactly as a client trains (``LocalUpdate(args)``: the clients' epochs, batch, lr, momentum,
   weight decay; plain CE). With ``Delta_p = W_p - W_t`` (the last layer's weight only, ``resnet.fc1.weight``):

   * ``search_neuron_new``: a weight ``(r, d)`` belongs to class p when p has the largest update there,
     ``p = argmax_q Delta_q[r, d]`` (the first on ties), and no other class comes close: fewer than two q have
     ``|Delta_q[r, d]| / |Delta_p[r, d]| > 0.8`` (when the largest update is 0: fewer than two are 0);
   * ``whole_determination``: over class p's weights, ``Ra_p = |sum Delta_p| / |sum mean_{q != p} Delta_q|``
     (10 when the denominator is 0), capped at 5000.

   A class the global head under-predicts moves its own weights far more than the other classes move them: a
   large ``Ra``. The monitor runs on the batched tensor program: all K copies train at once (``[K, K, D]``).
2. **Ratio Loss** (``Update.py`` ``Ratio_Cross_Entropy``): ``L = -(alpha + beta Ra_y) log softmax(z)_y``, averaged
   over the batch, with ``alpha = 1``, ``beta = 0.1`` (``whole_determination``: ``1.0 + 0.1 * ratio``). The
   weights computed after round t are the next round's (round 1: plain CE, ``ratio = None``).

Auxiliary data (``fedfeat.methods.serverdata``): the code takes the first 63 training images of every class
(``utils/sampling.py:56-61`` ``ratio_loss_data``: ``np.where(label_train == c)[0][0:63]``), from the same training
set the clients hold. ``aux_data=train`` with ``aux_draw=first`` (the defaults) is that: the first
``aux_per_class`` rows of every class in the store's row order; ``aux_draw=random`` is a seeded draw of them
(fedfeat's default before issue 37). ``aux_data=unassigned`` keeps it disjoint from the
clients' data, but CLIP2FL's long tail leaves the head class no unassigned image, so it fails at IF 100;
``store:PATH`` reads another store with the run's classes. These labels are the only ones the server reads.

Aggregation: the code's ``FedAvg(w)`` (``models/Fed.py:7-13``) is the *uniform* mean of the round's client models
(``torch.div(w_avg[k], len(w))``): ``aggregation=uniform`` (default); ``aggregation=size`` weighs them by client size
(fedfeat's default before issue 37).

Local training follows CLIP2FL's Table 1 protocol (10 epochs, batch 32, SGD 0.1, no momentum or weight decay), so
the baseline runs in the table's setting; the monitor's per-class copies train with it too. Shuffles of the
monitor come from ``rng.generator(seed, round, TAG_MONITOR)``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from fedfeat.engine import rng
from fedfeat.engine.context import Context, RoundPlan, fedavg
from fedfeat.engine.optim import BatchedSGD
from fedfeat.errors import FedfeatError
from fedfeat.methods.base import register
from fedfeat.methods.head import LinearHead, LinearHeadParams
from fedfeat.methods.serverdata import check_source, draw_balanced

TAG_AUX_SET = 741  # the auxiliary set (drawn once)
TAG_MONITOR = 742  # each round's shuffles of the per-class copies


@dataclass(frozen=True)
class RatioLossParams(LinearHeadParams):
    local_epochs: int = 10  # CLIP2FL Table 1 protocol (CLIP2FL options.py num_epochs_local_training)
    batch_size: int = 32  # CLIP2FL options.py batch_size_local_training
    lr: float = 0.1  # CLIP2FL options.py lr_local_training
    momentum: float = 0.0  # CLIP2FL main.py: plain SGD
    weight_decay: float = 0.0  # CLIP2FL main.py
    aux_data: str = "train"  # Ratio Loss code: training images (utils/sampling.py ratio_loss_data)
    aux_per_class: int = 63  # Ratio Loss code: idx_temp[0][0:63] per class (FEMNIST-4-Losses)
    # issue 37: first = each class's first aux_per_class rows in store order (utils/sampling.py:56-61, the code);
    # random = a seeded draw per class (fedfeat's default before issue 37)
    aux_draw: Literal["first", "random"] = "first"
    # issue 37: uniform = the code's FedAvg, the plain mean of the round's clients (models/Fed.py:7-13);
    # size = weighted by client size (fedfeat's default before issue 37)
    aggregation: Literal["uniform", "size"] = "uniform"
    ratio_alpha: float = 1.0  # Ratio Loss code whole_determination: 1.0 + 0.1 * ratio (paper's alpha)
    ratio_beta: float = 0.1  # Ratio Loss code whole_determination (paper's beta)
    dominance: float = 0.8  # Ratio Loss code search_neuron_new: |Delta_q| / |Delta_max| > 0.80
    ratio_cap: float = 5000.0  # Ratio Loss code whole_determination: "add a upper bound to the ratio"
    ratio_zero: float = 10.0  # Ratio Loss code whole_determination: res = 10 when the others' sum is 0

    def validate(self) -> None:
        super().validate()
        check_source(self.aux_data, "aux_data")
        if self.aux_per_class < 1:
            raise FedfeatError(
                f"aux_per_class must be >= 1, got {self.aux_per_class}; e.g. --set aux_per_class=63"
            )
        if self.ratio_alpha < 0 or self.ratio_beta < 0 or self.ratio_cap <= 0 or self.ratio_zero < 0:
            raise FedfeatError(
                "ratio_alpha, ratio_beta and ratio_zero must be >= 0 and ratio_cap > 0; e.g. --set ratio_beta=0.1"
            )
        if not 0 < self.dominance <= 1:
            raise FedfeatError(f"dominance must be in (0, 1], got {self.dominance}; e.g. --set dominance=0.8")


# ---------------------------------------------------------------------------------------------- pure pieces
def ratio_from_updates(delta: torch.Tensor, dominance: float = 0.8, zero: float = 10.0) -> torch.Tensor:
    """``Ra  # [K]`` from the per-class updates of the last layer's weight ``delta  # [K (aux class), K, D]``
    (``Fed.py`` ``search_neuron_new`` + ``whole_determination``, before the cap)."""
    Kc = delta.shape[0]
    top, arg = delta.max(0)  # [K, D]: the largest update at each weight and its class (first on ties)
    # [K, D] classes close to the largest (itself included); where the largest is 0: the zeros
    close = torch.where(top != 0, delta.abs() / top.abs() > dominance, delta == 0).sum(0)
    mine = arg.unsqueeze(0) == torch.arange(Kc, device=delta.device).view(-1, 1, 1)  # [Kc, K, D]
    own = mine & (close < 2)  # class p's weights
    others = (delta.sum(0, keepdim=True) - delta) / max(Kc - 1, 1)  # [Kc, K, D] mean over q != p
    num = (own * delta).flatten(1).sum(1)
    den = (own * others).flatten(1).sum(1)
    safe = den.abs().where(den != 0, torch.ones_like(den))
    return torch.where(den != 0, num.abs() / safe, torch.full_like(num, zero))


def ratio_weights(ra: torch.Tensor, alpha: float, beta: float, cap: float) -> torch.Tensor:
    """The Ratio Loss class weights ``alpha + beta min(Ra, cap)`` (``whole_determination``)."""
    return alpha + beta * ra.clamp(max=cap)


def train_class_copies(
    W: torch.Tensor, b: torch.Tensor, x: torch.Tensor, scale: float, epochs: int, batch: int, opt: BatchedSGD,
    gen: torch.Generator,
) -> torch.Tensor:  # fmt: skip
    """The monitor's K copies of the head ``(W  # [K, D], b  # [K])``, copy p trained on class p's auxiliary
    features ``x  # [K, A, D]`` with CE (label p), batched over the copies (``BatchedSGD``: torch.optim.SGD's rule
    per copy), ``epochs`` shuffled passes of ``batch`` (the last smaller) -> the copies' weights ``[K, K, D]``."""
    Kc, A, _ = x.shape
    params = {"W": W.unsqueeze(0).repeat(Kc, 1, 1), "b": b.unsqueeze(0).repeat(Kc, 1)}
    opt.reset(params)
    onehot = torch.eye(Kc, dtype=x.dtype, device=x.device).unsqueeze(1)  # [Kc, 1, K]: copy p's label is p
    for _ in range(epochs):
        order = torch.argsort(torch.rand(Kc, A, generator=gen), dim=1).to(x.device)  # [Kc, A] shuffles
        for s in range(0, A, batch):
            idx = order[:, s : s + batch]  # [Kc, B]
            xb = torch.gather(x, 1, idx.unsqueeze(2).expand(-1, -1, x.shape[2]))  # [Kc, B, D]
            z = scale * (torch.bmm(xb, params["W"].transpose(1, 2)) + params["b"].unsqueeze(1))  # [Kc, B, K]
            dz = (torch.softmax(z, -1) - onehot) * (scale / xb.shape[1])  # d mean-CE / d (xW^T + b)
            opt.step(params, {"W": torch.bmm(dz.transpose(1, 2), xb), "b": dz.sum(1)}, Kc)
    return params["W"]


@register
class RatioLoss(LinearHead):
    """Ratio Loss: class weights from the server's gradient-ratio monitor on balanced auxiliary data."""

    name = "ratio-loss"
    state_keys = {
        "weights": "server: [K] class weights of the local CE from the ratio monitor (round 1: ones)",
        "ratio": "server: [K] the monitor's last gradient ratios Ra (None before round 1 ends)",
    }
    Params = RatioLossParams
    shardable = True  # the weights are a deterministic server step; local training reads them only
    stacks = True  # per-run class weights of its monitor (torch program); the monitor per run

    def aux(self, ctx: Context):
        """The labelled, class-balanced auxiliary set, class-major: ``[K, A, D]`` (drawn once; ``ctx.cache``)."""
        if "ratio_aux" not in ctx.cache:
            p = self.p
            s = draw_balanced(
                ctx, p.aux_data, p.aux_per_class, p.normalize, tag=TAG_AUX_SET, field="aux_data",
                size_field="aux_per_class", order=p.aux_draw,
            )  # fmt: skip
            ctx.cache["ratio_aux"] = s.x.view(ctx.K, p.aux_per_class, ctx.D)
        return ctx.cache["ratio_aux"]

    def setup(self, ctx: Context) -> None:
        self.aux(ctx)  # fail before round 1 when the auxiliary set cannot be drawn
        ctx.state["weights"] = torch.ones(
            ctx.K, dtype=ctx.feats.dtype, device=ctx.device
        )  # round 1: plain CE
        ctx.state["ratio"] = None

    def local_begin(self, ctx, plan, glob):
        return {"w": ctx.state["weights"]}

    def sample_loss(self, ctx, z, y, local):
        """``-(alpha + beta Ra_y) log softmax(z)_y`` (``Ratio_Cross_Entropy``)."""
        return local["w"][y] * super().sample_loss(ctx, z, y, local)

    def aggregate(self, ctx: Context, plan: RoundPlan, glob: dict, cparams: dict) -> dict:
        """The code's ``FedAvg(w)`` (``models/Fed.py:7-13``): the uniform mean of the round's client heads;
        ``aggregation=size``: FedAvg by client size."""
        w = plan.sizes if self.p.aggregation == "size" else torch.ones_like(plan.sizes)
        return fedavg(cparams, w.to(ctx.device))

    def server_update(self, ctx: Context, plan: RoundPlan, old: dict, new: dict) -> dict:
        """The monitor on the head the round's clients started from (``old``): next round's class weights."""
        p = self.p
        opt = BatchedSGD(lr=p.lr, momentum=p.momentum, weight_decay=p.weight_decay)
        gen = rng.generator(ctx.seed, plan.rnd, TAG_MONITOR)
        with torch.no_grad():
            Wk = train_class_copies(
                old["W"], old["b"], self.aux(ctx), p.logit_scale, p.local_epochs, p.batch_size, opt, gen
            )
            ra = ratio_from_updates(Wk - old["W"].unsqueeze(0), p.dominance, p.ratio_zero)
        ctx.state["ratio"] = ra
        ctx.state["weights"] = ratio_weights(ra, p.ratio_alpha, p.ratio_beta, p.ratio_cap).to(ctx.feats.dtype)
        return new

    def round_metrics(self, ctx: Context, data, glob: dict, ev: dict) -> dict:
        """The class weights the next round's clients train with."""
        return {"ratio_weights": [float(v) for v in ctx.state["weights"]]}


__all__ = ["RatioLoss", "RatioLossParams", "ratio_from_updates", "ratio_weights", "train_class_copies"]

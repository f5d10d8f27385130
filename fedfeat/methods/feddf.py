"""FedDF (Lin et al., "Ensemble Distillation for Robust Model Fusion in Federated Learning", NeurIPS 2020) as a
linear head on cached features: FedAvg, then the server distils the ensemble of the round's client heads into the
averaged head on unlabelled server data.

One round (paper Algorithm 1; server step ported from epfml/federated-learning-public-code@44dd555
``codes/FedDF-code/pcode/aggregation/noise_knowledge_transfer.py``, cited below as ``nkt.py``):

1. Local training as FedAvg's (CE), with CLIP2FL's Table 1 protocol (10 epochs, batch 32, SGD 0.1, no momentum or
   weight decay: ``fedfeat.methods.synthesis.CReFFParams``' values), so the baseline runs in the table's setting.
2. The student starts as the *uniform* average of the round's client heads (``nkt.py``: ``use_fedavg_as_start``,
   whose FedAvg model is ``pcode/aggregation/fedavg.py:11-14`` ``_fedavg``: weights ``1.0 / n_selected_clients``);
   ``student_init=weighted`` starts from the sample-weighted FedAvg head (fedfeat's default before issue 37).
3. The teacher: the ensemble of the round's client heads, ``softmax(mean_i z_i / T)`` -- the average of the
   clients' logits (paper Algorithm 1, "AvgLogits"; the README's command line ``update_student_scheme=avg_logits``).
   The code's class default ``avg_losses`` (the mean of the per-teacher KL terms, whose gradient is that of the KL
   to ``mean_i softmax(z_i / T)``) and ``avg_probs`` are ``ensemble=...`` switches. For linear heads the mean of
   the logits is the logit of the mean head (uniform weights, ``nkt.py`` ``weights = 1 / n``); it is computed so.
4. Distillation (``nkt.py`` ``NoiseKTSolver``): ``KL(teacher || softmax(z / T))`` (``batchmean``), T = 1, Adam
   lr 1e-3 with cosine annealing over the step budget (stepped per batch), gradients clipped to norm 5, batches of
   64 from shuffled passes over the server set (the real-data loader's ``--batch_size``, README.md:84 and
   ``create_aggregator.py:224-231``; the 128 at ``nkt.py:107`` sizes only noise batches), at most 10,000 steps; every 100 steps the student's accuracy on a
   labelled validation split is measured and the run stops when the best is 1,000 steps old; the best-validated
   student is the new global head (``check_early_stopping``, ``best_models[0]``).

Server data (``fedfeat.methods.serverdata``): FedDF distils on another dataset (CIFAR-100 for CIFAR-10,
ImageNet-32 for CIFAR-100) and validates on 10 % of the training set held out (``--val_data_ratio 0.1``).
``server_data=store:PATH`` is that; the default ``unassigned`` (training rows no client holds; CLIP2FL's long tail
leaves 37,594 of CIFAR-10's images unassigned) runs on any store partitioned with ``--imbalance-factor``. The
validation split (``val_data``, ``val_size``) is labelled -- the only labels FedDF's server reads;
``early_stopping=none`` (the full step budget, last iterate) reads none. The distillation set leaves the validation
rows out when both come from the same source.

**What this means for a linear head.** The logits are linear in the head, so the ``avg_logits`` teacher is the
*uniform* mean head: the student itself (``student_init=uniform``, the code's), at any client sizes (with
``student_init=weighted`` only at equal sizes; CLIP2FL's ``dirichlet-equal`` clients differ by at most one
sample): the KL starts at ~0, and what moves the student is Adam turning rounding-level
gradients into lr-sized steps (``tests/test_baselines_server.py``), among which the validation split picks. FedDF
on cached features is then FedAvg up to that noise; ``ensemble=avg_losses`` / ``avg_probs`` (means of softmaxes)
give a teacher that differs from the student.

Deviations forced by cached features: no data augmentation of the server images (each has one cached feature);
the server's Adam, schedule and clipping act on the head only (there is nothing else to train). Shuffles are drawn
from ``rng.generator(seed, round, TAG_DISTILL)``; the server sets from ``(seed, TAG_*_SET)``, the same every round.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from fedfeat.engine import rng
from fedfeat.engine.context import Context, RoundPlan, fedavg
from fedfeat.errors import FedfeatError
from fedfeat.methods.base import register
from fedfeat.methods.head import LinearHead, LinearHeadParams
from fedfeat.methods.serverdata import (
    DISTILL_STATE,
    DistillConfig,
    check_source,
    distill_head,
    draw_set,
    head_logits,
    server_step_metrics,
)

TAG_VAL_SET = 711  # the labelled validation split
TAG_DISTILL_SET = 712  # the unlabelled distillation set
TAG_DISTILL = 713  # each round's shuffles


@dataclass(frozen=True)
class FedDFParams(LinearHeadParams):
    local_epochs: int = 10  # CLIP2FL Table 1 protocol (CLIP2FL options.py num_epochs_local_training)
    batch_size: int = 32  # CLIP2FL options.py batch_size_local_training
    lr: float = 0.1  # CLIP2FL options.py lr_local_training (FedDF's README: lr 0.1 too)
    momentum: float = 0.0  # CLIP2FL main.py: plain SGD (FedDF README: --momentum_factor 0)
    weight_decay: float = 0.0  # CLIP2FL main.py (FedDF README: --weight_decay 0)
    # server data (fedfeat.methods.serverdata): FedDF README data_name=cifar100 (store:PATH); ours: unassigned rows
    server_data: str = "unassigned"
    server_size: int = 0  # rows of the distillation set, 0 = all (FedDF README: data_percentage=1.0)
    # teacher: paper Algorithm 1 / README avg_logits; nkt.py class default avg_losses; avg_probs: nkt.py option
    ensemble: Literal["avg_logits", "avg_losses", "avg_probs"] = "avg_logits"
    temperature: float = 1.0  # nkt.py KL_temperature=1 (README sets none)
    distill_steps: int = 10000  # nkt.py total_n_server_pseudo_batches=1000 * 10 (README: 10000)
    # issue 37: the server's real-data loader uses --batch_size 64 (FedDF README.md:84; create_aggregator.py:224-231);
    # nkt.py:107's batch_size=128 sizes only the noise batches (fedfeat's 128 before issue 37)
    distill_batch: int = 64
    distill_lr: float = 1e-3  # nkt.py student_learning_rate=1e-3 (Adam)
    # issue 37: the student starts from the uniform mean of the client heads (pcode/aggregation/fedavg.py:11-14,
    # weights 1 / n_selected_clients); weighted = by client size (fedfeat's default before issue 37)
    student_init: Literal["uniform", "weighted"] = "uniform"
    lr_schedule: Literal["cosine", "constant"] = "cosine"  # nkt.py CosineAnnealingLR(T_max=total batches)
    clip_norm: float = 5.0  # nkt.py clip_grad_norm_(..., 5); 0 = none
    early_stopping: Literal["val", "none"] = "val"  # nkt.py check_early_stopping on the validation split
    eval_every: int = 100  # nkt.py eval_batches_freq=100
    patience: int = 1000  # README early_stopping_server_batches=1000 (aggregate()'s fallback: 2000)
    val_data: str = "unassigned"  # FedDF: --val_data_ratio 0.1 of the training set, held out (labelled)
    val_size: int = 5000  # FedDF: 10 % of CIFAR's 50,000 training images

    def validate(self) -> None:
        super().validate()
        check_source(self.server_data, "server_data")
        check_source(self.val_data, "val_data")
        if self.server_size < 0 or self.val_size < 1:
            raise FedfeatError(
                "server_size must be >= 0 (0: all) and val_size >= 1; e.g. --set val_size=5000"
            )
        if min(self.distill_steps, self.distill_batch, self.eval_every) < 1 or self.patience < 0:
            raise FedfeatError(
                "distill_steps, distill_batch and eval_every must be >= 1 and patience >= 0; "
                "e.g. --set distill_steps=10000"
            )
        if self.distill_lr <= 0 or self.temperature <= 0 or self.clip_norm < 0:
            raise FedfeatError(
                "distill_lr and temperature must be > 0 and clip_norm >= 0 (0: no clipping); e.g. --set distill_lr=1e-3"
            )


def teacher_targets(
    x: torch.Tensor, W: torch.Tensor, b: torch.Tensor, scale: float, T: float, ensemble: str
) -> torch.Tensor:
    """The distillation target on ``x  # [S, D]`` of the client heads ``W  # [m, K, D]``, ``b  # [m, K]`` (uniform
    weights, ``nkt.py``): ``avg_logits`` ``softmax(mean_i z_i / T)``; ``avg_losses`` ``mean_i softmax(z_i / T)``
    (the gradient of the mean of the per-teacher KL terms); ``avg_probs`` ``mean_i softmax(z_i)`` (the student
    still at T) -> ``[S, K]``."""
    if ensemble == "avg_logits":  # mean of the logits = logits of the mean head (linear in the head)
        z = head_logits(x, W.mean(0, keepdim=True), b.mean(0, keepdim=True), scale)[0]
        return torch.softmax(z / T, -1)
    t = T if ensemble == "avg_losses" else 1.0
    out = torch.empty(x.shape[0], W.shape[1], dtype=x.dtype, device=x.device)
    for i in range(0, x.shape[0], 8192):  # [m, chunk, K] logits at a time
        out[i : i + 8192] = torch.softmax(head_logits(x[i : i + 8192], W, b, scale) / t, -1).mean(0)
    return out


@register
class FedDF(LinearHead):
    """FedDF: FedAvg + server-side ensemble distillation of the client heads on unlabelled server data."""

    name = "feddf"
    state_keys = DISTILL_STATE  # (serverdata) the FedAvg head and the distillation's figures
    Params = FedDFParams
    shardable = True  # the server step sees every client's head (aggregate), and is deterministic
    stacks = True  # FedAvg's local step; the ensemble distillation per run, as alone

    def sets(self, ctx: Context) -> dict:
        """The validation split and the distillation set (drawn once; ``ctx.cache``: derived, not checkpointed)."""
        if "feddf_sets" not in ctx.cache:
            p = self.p
            out = {"val": None}
            exclude = None
            if p.early_stopping == "val":
                out["val"] = draw_set(
                    ctx, p.val_data, p.val_size, p.normalize, tag=TAG_VAL_SET, field="val_data", labelled=True
                )
                exclude = out["val"].rows if p.val_data == p.server_data else None
            out["x"] = draw_set(
                ctx, p.server_data, p.server_size, p.normalize, tag=TAG_DISTILL_SET, field="server_data",
                exclude=exclude,
            )  # fmt: skip
            ctx.cache["feddf_sets"] = out
        return ctx.cache["feddf_sets"]

    def setup(self, ctx: Context) -> None:
        self.sets(ctx)  # fail before round 1 when the server has no data
        ctx.state["fedavg_head"] = None
        ctx.state["info"] = {}

    def aggregate(self, ctx: Context, plan: RoundPlan, glob: dict, cparams: dict) -> dict:
        p = self.p
        # the student's start (nkt.py use_fedavg_as_start): uniform as fedavg.py:11-14, or by size (student_init)
        w = (
            plan.sizes.to(ctx.device)
            if p.student_init == "weighted"
            else torch.ones_like(plan.sizes, device=ctx.device)
        )
        avg = fedavg(cparams, w)
        sets = self.sets(ctx)
        x = sets["x"].x
        with torch.no_grad():
            target = teacher_targets(x, cparams["W"], cparams["b"], p.logit_scale, p.temperature, p.ensemble)
        cfg = DistillConfig(
            steps=p.distill_steps, batch=p.distill_batch, lr=p.distill_lr, loss="kl", temperature=p.temperature,
            optimizer="adam", schedule=p.lr_schedule, clip_norm=p.clip_norm,
            eval_every=p.eval_every if p.early_stopping == "val" else 0, patience=p.patience,
        )  # fmt: skip
        val = sets["val"]
        W, b, info = distill_head(
            avg["W"], avg["b"], x, target, p.logit_scale, cfg, rng.generator(ctx.seed, plan.rnd, TAG_DISTILL),
            val=None if val is None else (val.x, val.y),
        )  # fmt: skip
        info["server_rows"] = len(sets["x"])
        ctx.state["fedavg_head"] = avg
        ctx.state["info"] = info
        return {"W": W, "b": b}

    def round_metrics(self, ctx: Context, data, glob: dict, ev: dict) -> dict:
        """The accuracy of the student's start (``fedavg_head_acc``: the averaged head before distillation, uniform
        or weighted as ``student_init`` says) and the distillation's figures."""
        return server_step_metrics(ctx, data)


__all__ = ["FedDF", "FedDFParams", "teacher_targets"]

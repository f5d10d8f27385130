"""The prompt-learning part shared by the prompt method families (``promptfl``: PromptFL, FedTPG; ``pfedprompt``;
``fedopt``): CoOp's optimiser settings (``PromptParams``), the unsupervised modes' settings (``PromptFLParams``), the
zero-shot pseudo-labelling of the clients' training sets (``pseudo_label``), the round learning rate
(``round_lr``) and ``PromptMethod``, a method whose trainable part is (or feeds) CoOp contexts of the live text
tower. The families' docstrings (``fedfeat.methods.promptfl``) give the sources of every default.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F

from fedfeat.engine.context import Context
from fedfeat.engine.optim import BatchedSGD
from fedfeat.errors import FedfeatError
from fedfeat.methods.base import Method

TAG_CTX_INIT = 301


@dataclass(frozen=True)
class PromptParams:
    local_epochs: int = (
        5  # PromptFL configs/trainers/CoOp/vit_b16_ep50.yaml MAX_EPOCH 5 = local epochs (rn50: 10)
    )
    batch_size: int = 32  # CoOp configs/trainers/CoOp/*: DATALOADER.TRAIN_X.BATCH_SIZE 32
    lr: float = 0.002  # CoOp OPTIM.LR (PromptFL's configs and main_pipeline.sh: 0.001)
    momentum: float = 0.9  # Dassl OPTIM.MOMENTUM
    weight_decay: float = 5e-4  # Dassl OPTIM.WEIGHT_DECAY
    schedule: Literal["cosine", "constant"] = "cosine"  # CoOp LR_SCHEDULER cosine, here over the rounds
    warmup_rounds: int = 0  # CoOp WARMUP_EPOCH 1 at constant 1e-5; 0 here (see the module docstring)
    warmup_lr: float = 1e-5  # CoOp WARMUP_CONS_LR
    n_ctx: int = 16  # CoOp N_CTX 16 (FedCoPL's text prompt too)
    csc: bool = False  # CoOp CSC False: one context shared by all classes
    ctx_init: str = ""  # CoOp CTX_INIT "": random N(0, 0.02); e.g. "a photo of a" (then n_ctx = its tokens)
    ctx_std: float = 0.02  # CoOp nn.init.normal_(ctx_vectors, std=0.02)
    truncate: bool = (
        True  # cut prompts after the longest EOT (exact for causal towers; fedfeat.encoders.prompt)
    )
    normalize: bool = True  # L2-normalised image features (CoOp: image_features / norm)
    aggregation: Literal["size", "mean"] = "size"  # FedAvg by client size; "mean": PromptFL's average_weights

    def validate(self) -> None:
        if self.local_epochs < 1 or self.batch_size < 1:
            raise FedfeatError(
                f"local_epochs and batch_size must be >= 1, got {self.local_epochs} and {self.batch_size}; "
                "e.g. --set batch_size=32"
            )
        if self.lr <= 0 or self.weight_decay < 0 or not 0 <= self.momentum < 1 or self.warmup_lr <= 0:
            raise FedfeatError(
                f"need lr > 0, warmup_lr > 0, weight_decay >= 0 and momentum in [0, 1), got {self.lr}, "
                f"{self.warmup_lr}, {self.weight_decay}, {self.momentum}; e.g. --set lr=0.002"
            )
        if self.n_ctx < 1 and not self.ctx_init:
            raise FedfeatError(f"n_ctx must be >= 1, got {self.n_ctx}; e.g. --set n_ctx=16")
        if self.ctx_std <= 0 or self.warmup_rounds < 0:
            raise FedfeatError(
                f"ctx_std must be > 0 and warmup_rounds >= 0, got {self.ctx_std} and {self.warmup_rounds}"
            )


@dataclass(frozen=True)
class PromptFLParams(PromptParams):
    pseudo: Literal["none", "fpl", "cpl", "copl"] = "none"  # none: labelled; fpl / cpl / copl: unsupervised
    pseudo_k: int = 16  # FPL / CPL N_PSEUDOSHOTS: pseudo-labelled samples kept per class (per client here)
    conf_quantile: float = (
        60.0  # CPL CONF_QUANTILE: textual_fpl_config_PLL.yml (per dataset: pseudolabel.CPL_DEFAULTS)
    )
    regular_threshold: float = 0.90  # CPL REGULAR_THRESHOLD: the same yml (per dataset: CPL_DEFAULTS)

    def validate(self) -> None:
        super().validate()
        if self.pseudo_k < 1:
            raise FedfeatError(f"pseudo_k must be >= 1, got {self.pseudo_k}; e.g. --set pseudo_k=16")


def pseudo_label(ctx: Context, how: str, p) -> None:
    """Replace the clients' training sets by their pseudo-labelled selections (``fedfeat.methods.pseudolabel``): zero-shot
    probabilities ``softmax(logit_scale · cos(x, t_k))`` with the store's first template, per client; ``ctx.feats``
    and ``ctx.offsets`` become the kept rows (client-major), ``ctx.state`` gets their labels or candidate sets and
    their positions in the original order (``pseudo_rows``, for the pseudo-label accuracy)."""
    from fedfeat.methods import pseudolabel as pl

    with torch.no_grad():
        text = ctx.text.to(ctx.feats.dtype)
        probs = torch.cat(
            [
                torch.softmax(ctx.clip_logit_scale * F.normalize(x, dim=-1) @ text.T, -1)
                for x in ctx.feats.split(8192)
            ]
        )  # [N, K]
    params = {"k": p.pseudo_k}
    if how == "cpl":
        params |= {"conf_quantile": p.conf_quantile, "regular_threshold": p.regular_threshold}
    if how == "copl":  # FedCoPL's cooperative pseudo-labels (fedfeat.methods.copl), once from zero-shot CLIP
        params = {"round_index": 0}
    sel = pl.make_pseudo_labeller(how, **params)(
        probs, ctx.offsets
    )  # a fedfeat.methods.pseudolabel.Selection
    rows = sel.rows
    if how in ("fpl", "copl"):
        ctx.state["pseudo_labels"] = sel.candidates.float().argmax(1)
    else:
        ctx.state["pseudo_candidates"] = sel.candidates
    ctx.offsets = sel.offsets
    ctx.feats = ctx.feats[rows.to(ctx.feats.device)]
    ctx.state["pseudo_rows"] = rows


def round_lr(p, rnd: int, rounds: int) -> float:
    """The round's learning rate: ``warmup_lr`` for the first ``warmup_rounds`` rounds, then ``lr`` or its cosine
    decay ``lr · (1 + cos(π t / T)) / 2`` over the remaining rounds (Dassl's ``CosineAnnealingLR``, ``eta_min`` 0,
    stepped once per round: ``t`` = rounds done after the warm-up)."""
    if rnd <= p.warmup_rounds:
        return p.warmup_lr
    if p.schedule == "constant":
        return p.lr
    T = max(rounds - p.warmup_rounds, 1)
    t = rnd - 1 - p.warmup_rounds
    return p.lr * 0.5 * (1 + math.cos(math.pi * t / T))


class PromptMethod(Method):
    """A method whose trainable part is (or feeds) CoOp contexts of the live text tower."""

    needs_live_text = True
    runs_on = "cache + live text encoder"

    def setup(self, ctx: Context) -> None:
        p = self.p
        n_ctx = p.n_ctx
        if p.ctx_init:
            from fedfeat.encoders.prompt import phrase_tokens

            n_ctx = phrase_tokens(ctx.live.tower, p.ctx_init).shape[0]
        self.learner = ctx.live.learner(ctx.class_names, n_ctx, truncate=p.truncate)
        self.rounds = ctx.rounds

    def make_optimizer(self, rnd: int):
        p = self.p
        return BatchedSGD(lr=round_lr(p, rnd, self.rounds), momentum=p.momentum, weight_decay=p.weight_decay)

    def text_features(self, ctx: Context, params: dict) -> torch.Tensor:
        """Unit class text features ``[n, K, D]`` of the clients' parameters ``{name: [n, ...]}``."""
        return F.normalize(self.learner.features(params["ctx"]), dim=-1)

    def logits(self, ctx: Context, params: dict, x: torch.Tensor) -> torch.Tensor:
        """``x  # [n, B, D]`` -> ``[n, B, K]`` at CLIP's logit scale."""
        t = self.text_features(ctx, params).to(x.dtype)
        return ctx.clip_logit_scale * torch.bmm(x, t.transpose(1, 2))

    @torch.no_grad()
    def predict(self, ctx: Context, glob: dict, x: torch.Tensor) -> torch.Tensor:
        t = self.text_features(ctx, {k: v.unsqueeze(0) for k, v in glob.items()})[0].to(x.dtype)  # [K, D]
        return ctx.clip_logit_scale * x @ t.T


__all__ = ["PromptMethod", "PromptParams", "PromptFLParams", "pseudo_label", "round_lr", "TAG_CTX_INIT"]

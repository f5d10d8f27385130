"""Fed-Focal Loss (Sarkar, Narang, Rai 2020, arXiv:2011.06283): FedAvg with the focal loss as the local loss.

CLIP2FL's Table 1 baseline, here as a linear head ``logits = s * (x W^T + b)`` on cached CLIP features (LinearHead):
local SGD on ``FL(p_t) = -alpha_t (1 - p_t)^gamma log p_t`` (Lin et al. 2017, Eq. 5; ``p_t`` the softmax
probability of the true class), averaged over the client's mini-batch, and sample-weighted FedAvg on the server.
The method runs batched over clients: the loss is the per-sample ``sample_loss`` hook of ``LinearHead`` on the
``[n, B, K]`` logits of all active clients; the engine differentiates it and steps every client's head at once. It
has no fused CPU kernel (its loss is not FedAvg's), so CPU runs use the torch program.

Defaults and their sources. ``gamma = 2``: Lin et al. 2017 (their recommended value, Table 1a), the focal loss
along whose lines Fed-Focal reshapes cross-entropy; the Fed-Focal paper's own text (and any gamma it states) was not
reachable from fedfeat's sources, and a federated long-tailed benchmark that runs Fed-Focal as a baseline (the code of
"Decentralized Decoupled Training for Federated Long-Tailed Learning", RedGrape: ``focal_loss(alpha=-1, gamma=2)``)
uses the same value. ``alpha_t = 1`` for every class (no class weighting): that code's ``alpha=-1``; Lin et al.'s
``alpha = 0.25`` belongs to their binary (sigmoid) foreground/background form. ``log p_t`` is the exact
log-softmax (that code takes ``log(softmax + 1e-6)``). Fed-Focal's second part, the server's "tunable sampling" of client contributions, is
not run: CLIP2FL lists the method with the other loss-only baselines and its setting samples clients uniformly
(40 % per round). Other hyperparameters are LinearHead's (CLIP2FL's table sets lr / epochs / batch per row).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from fedfeat.engine.context import Context
from fedfeat.errors import FedfeatError
from fedfeat.methods.base import register
from fedfeat.methods.head import LinearHead, LinearHeadParams


@dataclass(frozen=True)
class FedFocalParams(LinearHeadParams):
    gamma: float = (
        2.0  # focusing parameter: Lin et al. 2017 Table 1a (Fed-Focal's own value not found; module doc)
    )

    def validate(self) -> None:
        super().validate()
        if self.gamma < 0:
            raise FedfeatError(
                f"fed-focal needs gamma >= 0 (0 = cross-entropy), got {self.gamma}; e.g. --set gamma=2"
            )


def focal_loss(z: torch.Tensor, y: torch.Tensor, gamma: float) -> torch.Tensor:
    """``-(1 - p_t)^gamma log p_t`` per sample: ``z  # [..., K]`` logits, ``y  # [...]`` labels -> ``[...]``.

    ``1 - p_t`` is clamped at the smallest normal number so that a sample classified with ``p_t == 1`` in floating
    point gives a finite gradient for ``gamma < 1`` (its loss is 0 either way)."""
    logpt = F.log_softmax(z, dim=-1).gather(-1, y.unsqueeze(-1)).squeeze(-1)
    if not gamma:
        return -logpt
    mod = (1 - logpt.exp()).clamp_min(torch.finfo(z.dtype).tiny) ** gamma
    return -mod * logpt


@register
class FedFocal(LinearHead):
    """Fed-Focal Loss (Sarkar et al. 2020): FedAvg with the focal loss (gamma = 2) as the local loss."""

    name = "fed-focal"
    shardable = True  # no per-sample state: torchrun may shard its clients (engine.sharded_local)
    stacks = True  # per-run gamma (no fused kernel: the torch program)
    dp_client = True  # DP-FedAvg (fedfeat.engine.privacy)
    dp_sample = "head"  # DP-SGD: per-sample gradients as outer products (LinearHead.dp_clipped_sums)
    Params = FedFocalParams

    def sample_loss(self, ctx: Context, z: torch.Tensor, y: torch.Tensor, local: dict) -> torch.Tensor:
        return focal_loss(z, y, self.p.gamma)  # [n, B]


__all__ = ["FedFocal", "FedFocalParams", "focal_loss"]

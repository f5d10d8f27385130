"""FedAvg with label smoothing (Szegedy et al. 2016): fedfeat's method-plugin example (README, "Your own method").

Each client minimises the label-smoothed cross-entropy of its linear head on cached CLIP features:
``(1 - eps) * CE(z, y) + eps * mean_k(-log softmax(z)_k)``. Everything else is FedAvg's: the head, its text
initialisation, local SGD, sample-weighted averaging. Only the per-sample loss is new, so the method runs on
fedfeat's batched path: ``sample_loss`` sees all active clients' mini-batches at once, ``z  # [n, B, K]``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from fedfeat.errors import FedfeatError
from fedfeat.methods import LinearHead, LinearHeadParams, register


@dataclass(frozen=True)
class LabelSmoothingParams(LinearHeadParams):  # FedAvg's defaults (lr 0.01, momentum 0.9, batch 50, ...)
    smoothing: float = 0.1  # eps: Szegedy et al. 2016, Sec. 7 (0.1 on ImageNet)

    def validate(self) -> None:
        super().validate()  # the head's own checks (lr > 0, batch_size >= 1, ...)
        if not 0.0 <= self.smoothing < 1.0:
            raise FedfeatError(f"smoothing must be in [0, 1), got {self.smoothing}; e.g. --set smoothing=0.1")


@register
class FedAvgLabelSmoothing(LinearHead):
    """FedAvg + label smoothing: local SGD on the label-smoothed cross-entropy, sample-weighted averaging."""

    name = "fedavg-ls"
    Params = LabelSmoothingParams

    def sample_loss(self, ctx, z: torch.Tensor, y: torch.Tensor, local: dict) -> torch.Tensor:
        # z [n, B, K] logits of n clients' mini-batches, y [n, B] labels -> [n, B] per-sample losses
        return F.cross_entropy(z.transpose(1, 2), y, reduction="none", label_smoothing=self.p.smoothing)

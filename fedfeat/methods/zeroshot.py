"""CLIP zero-shot classification (CLIP-ZS): argmax over classes of image . text, no training."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from fedfeat.methods.base import Method, register


@dataclass(frozen=True)
class ZeroShotParams:
    templates: Literal["first", "ensemble"] = (
        "first"  # FST-CBDG: "a photo of a {}."; ensemble: CLIP's averaging
    )
    normalize: bool = True  # cosine similarity (CLIP)
    batch_size: int = 1  # unused (no local training)
    local_epochs: int = 1  # unused


@register
class ZeroShot(Method):
    """CLIP-ZS: predict argmax_k cos(image, text_k); reads no training data at all."""

    name = "zeroshot"
    Params = ZeroShotParams
    uses_labels = False
    federated = False

    def init_global(self, ctx):
        return {"W": ctx.text.clone(), "b": torch.zeros(ctx.K, device=ctx.device)}

    def predict(self, ctx, glob, x):
        return ctx.clip_logit_scale * (x @ glob["W"].T)

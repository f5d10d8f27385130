"""Deep visual prompts (VPT-deep, Jia et al. ECCV 2022) on open_clip ViTs, batched across clients.

FedCoPL's visual prompt (``krumpguo/FedCoPL``; reference-notes "FedCoPL" defaults): ``P`` learnable tokens at each
of the first ``L`` transformer blocks of the image encoder (5 tokens x 11 of ViT-B/32's 12 blocks), N(0, 0.02);
before a prompted block the tokens are **appended at the end** of the sequence, after it they are stripped (the
last block gets none; only the CLS token is pooled). ``PromptedViT`` runs the open_clip ``VisionTransformer``'s own
modules (patch embedding, class and positional embeddings, ``ln_pre``, the residual blocks, ``ln_post``, pooling,
projection) with per-sample prompts: the prompts of ``n`` clients are ``[n, L, P, W]`` and each sample of the batch
gathers its own client's (``client_of_sample``), so the samples of all clients run in one forward and a sample's
output depends only on its client's prompts (tested). The encoder's parameters stay frozen; gradients reach only the
prompts.

ViTs only: a ResNet image tower (``ModifiedResNet``) has no token sequence to prompt -- a one-line error.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from fedfeat.encoders.attention import block_forward, plain, prompted_block_forward
from fedfeat.errors import FedfeatError


class PromptedViT:
    """An open_clip ``VisionTransformer`` run with per-sample deep prompts."""

    def __init__(self, visual: nn.Module, depth: int | None = None, n_tokens: int = 5):
        if not all(hasattr(visual, a) for a in ("transformer", "_embeds", "_pool", "conv1")):
            raise FedfeatError(
                f"visual prompts need a ViT image encoder; this model's is a {type(visual).__name__} (a ResNet?): "
                "use a ViT backbone such as ViT-B-32"
            )
        if getattr(visual, "attn_pool", None) is not None:
            raise FedfeatError(
                "visual prompts support CLIP-style ViTs (class-token pooling), not attention pooling"
            )
        blocks = visual.transformer.resblocks
        visual.eval().requires_grad_(False)  # frozen: only the prompts train
        self.visual, self.blocks = visual, blocks
        self.depth = len(blocks) - 1 if depth is None else depth  # FedCoPL: all but the last block
        if not 0 <= self.depth <= len(blocks):
            raise FedfeatError(f"prompt depth must be in 0..{len(blocks)}, got {self.depth}")
        if n_tokens < 1:
            raise FedfeatError(f"visual prompt tokens must be >= 1, got {n_tokens}")
        self.n_tokens = n_tokens
        self.width = int(visual.positional_embedding.shape[-1])
        self.batch_first = getattr(visual.transformer, "batch_first", True)
        # fedfeat.encoders.attention's blocks: the same function, no work on the prompt rows it strips
        self.fast = (
            self.batch_first
            and not getattr(visual.transformer, "grad_checkpointing", False)
            and all(plain(b) for b in blocks)
        )

    def init_prompts(self, generator: torch.Generator | None, std: float = 0.02) -> torch.Tensor:
        """``[depth, P, W]`` drawn N(0, std²) in float64 from ``generator`` (FedCoPL: ``nn.init.normal_(std=0.02)``)."""
        p = self.visual.positional_embedding
        v = torch.randn(self.depth, self.n_tokens, self.width, generator=generator, dtype=torch.float64) * std
        return v.to(device=p.device, dtype=p.dtype)

    def forward(
        self, images: torch.Tensor, prompts: torch.Tensor, client_of_sample: torch.Tensor
    ) -> torch.Tensor:
        """Image features ``[B, D]`` (unnormalised, as ``encode_image``) of ``images  # [B, 3, H, W]`` (normalised
        model inputs) with ``prompts  # [n, depth, P, W]`` and ``client_of_sample  # [B]`` (index into ``n``)."""
        v = self.visual
        x = v._embeds(images)  # [B, 1 + grid, W]
        if (
            self.fast
        ):  # the prompts' keys and values once per client; no work on the stripped rows (.attention)
            for i, blk in enumerate(self.blocks):
                if i < self.depth:
                    x = prompted_block_forward(blk, x, prompts[:, i].to(x.dtype), client_of_sample)
                else:
                    x = block_forward(blk, x)
            pooled, _ = v._pool(x)
            return pooled @ v.proj if v.proj is not None else pooled
        per = prompts.to(x.dtype)[client_of_sample]  # [B, depth, P, W]
        P = self.n_tokens
        if not self.batch_first:
            x = x.transpose(0, 1)
        for i, blk in enumerate(self.blocks):
            if i < self.depth:
                p = per[:, i]
                x = torch.cat(
                    [x, p if self.batch_first else p.transpose(0, 1)], dim=1 if self.batch_first else 0
                )
                x = blk(x)
                x = x[:, :-P] if self.batch_first else x[:-P]
            else:
                x = blk(x)
        if not self.batch_first:
            x = x.transpose(0, 1)
        pooled, _ = v._pool(x)
        return pooled @ v.proj if v.proj is not None else pooled


__all__ = ["PromptedViT"]

"""Independent prompt-learning steps on open_clip's own model: the ceilings and per-client peers of
``bench/bench_prompt.py`` and ``bench/bench_fedcopl.py``, and the tests' reference for fedfeat's prompt steps.

Nothing here imports fedfeat's learners (``fedfeat.encoders.prompt`` / ``vpt``, ``fedfeat.methods``): the modules
are open_clip's (``open_clip.create_model``; the only fedfeat import is the torchvision remedy that lets open_clip
import on a CPU torch), and the code is CoOp's and VPT-deep's, written from their public structure:

* **CoOp** (``KaiyangZhou/CoOp`` ``trainers/coop.py``): ``PromptLearner`` tokenises ``"X X ... X {class}."``, keeps the
  frozen token embeddings of ``[SOS]`` (prefix) and of ``{class}. [EOS] ...`` (suffix) and puts the learnable
  context between them; ``TextEncoder``: ``x = prompts + positional_embedding``, ``transformer``, ``ln_final``,
  ``x[arange, tokens.argmax(-1)] @ text_projection``. One deviation, exact: the prompts are cut after the longest
  prompt's EOT token (CLIP's text mask is causal, so the EOT output does not depend on later positions); CoOp runs
  all 77 positions, which would make the ceiling ~3x slower than the work fedfeat does -- a ceiling must not be.
* **VPT-deep** (Jia et al. 2022; FedCoPL's visual prompt): ``P`` tokens appended after the sequence before each of
  the first ``depth`` blocks of the open_clip ``VisionTransformer`` and stripped after it; CLS pooling, projection.

Every step here does the whole local step: the text side (``n x K`` prompts), the image side (FedCoPL: the uint8
pixels normalised and run through the prompted ViT), the loss (CE at CLIP's logit scale, a mean per client, summed
over clients), the backward -- the prompt tensors are the only leaves (the model's parameters
``requires_grad=False``, no gradient to pixels or token embeddings) -- and ``torch.optim.SGD``'s update.
``batched`` runs all clients in one forward (prompts with a leading client axis); ``loop_*`` is the plain per-client
PyTorch loop (one client after another, one ``torch.optim.SGD`` per client), as the papers' codes run clients.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def open_clip_model(config, weights):
    """``open_clip.create_model`` of a config file and checkpoint (frozen, eval) and its tokenizer."""
    # torchvision on a CPU torch: the one fedfeat import
    from fedfeat.encoders.remedy import import_open_clip

    oc = import_open_clip()
    oc.add_model_config(config)
    name = config.stem if hasattr(config, "stem") else str(config).rsplit("/", 1)[-1].removesuffix(".json")
    model = oc.create_model(name, pretrained=str(weights))
    model.eval().requires_grad_(False)
    return model, oc.get_tokenizer(name)


class CoOpText:
    """CoOp's prompt learner + text encoder over open_clip's ``CLIP`` text modules, batched over clients."""

    def __init__(self, model, tokenizer, class_names: list[str], n_ctx: int, truncate: bool = True):
        self.model, self.n_ctx, self.K = model, n_ctx, len(class_names)
        prompts = [" ".join(["X"] * n_ctx) + " " + name + "." for name in class_names]
        tokens = tokenizer(prompts)
        self.eot = tokens.argmax(-1)  # [K]
        L = int(self.eot.max()) + 1 if truncate else tokens.shape[1]
        with torch.no_grad():
            emb = model.token_embedding(tokens)[:, :L]
        self.prefix, self.suffix = emb[:, :1], emb[:, 1 + n_ctx :]
        self.L = L

    def features(self, ctx: torch.Tensor) -> torch.Tensor:
        """Unit text features ``[n, K, D]`` of unified contexts ``ctx  # [n, n_ctx, W]``."""
        n, K, W = ctx.shape[0], self.K, ctx.shape[-1]
        x = torch.cat(
            [
                self.prefix.expand(n, K, 1, W),
                ctx.unsqueeze(1).expand(n, K, self.n_ctx, W),
                self.suffix.expand(n, K, -1, W),
            ],
            dim=2,
        ).reshape(n * K, self.L, W)
        m = self.model
        x = x + m.positional_embedding[: self.L]
        x = m.transformer(x, attn_mask=m.attn_mask[: self.L, : self.L])
        x = m.ln_final(x)
        x = x[torch.arange(n * K), self.eot.repeat(n)] @ m.text_projection
        return F.normalize(x, dim=-1).view(n, K, -1)


class VPTImage:
    """VPT-deep over open_clip's ``VisionTransformer``: ``prompts  # [B, depth, P, W]`` (each sample its own)."""

    def __init__(self, visual, mean, std, depth: int):
        self.visual, self.depth = visual, depth
        self.mean = torch.tensor(mean, dtype=torch.float32).view(1, 3, 1, 1)
        self.std = torch.tensor(std, dtype=torch.float32).view(1, 3, 1, 1)

    def features(self, pixels: torch.Tensor, prompts: torch.Tensor) -> torch.Tensor:
        """Unit image features ``[B, D]`` of uint8 ``pixels  # [B, 3, H, W]``."""
        v = self.visual
        x = v._embeds((pixels.float() / 255 - self.mean) / self.std)  # conv1, CLS, positions, ln_pre
        P = prompts.shape[2]
        for i, blk in enumerate(v.transformer.resblocks):
            if i < self.depth:
                x = blk(torch.cat([x, prompts[:, i]], dim=1))[:, :-P]
            else:
                x = blk(x)
        pooled, _ = v._pool(x)
        return F.normalize(pooled @ v.proj, dim=-1)


def ce_per_client(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """``logits  # [n, B, K]``, ``y  # [n, B]`` -> the clients' mean CE ``[n]`` (CoOp's ``F.cross_entropy``)."""
    n, B, K = logits.shape
    return F.cross_entropy(logits.reshape(n * B, K), y.reshape(-1), reduction="none").view(n, B).mean(1)


def promptfl_loss(text: CoOpText, scale: float, ctx: torch.Tensor, x: torch.Tensor, y: torch.Tensor):
    """PromptFL / CoOp on cached image features ``x  # [n, B, D]`` (unit), labels ``y  # [n, B]``: ``[n]``."""
    t = text.features(ctx)
    return ce_per_client(scale * torch.bmm(x, t.transpose(1, 2)), y)


def fedcopl_loss(
    text: CoOpText, image: VPTImage, scale: float, params: dict, px: torch.Tensor, y: torch.Tensor
):
    """FedCoPL's local loss ``[n]``: ``params = {"text": [n, n_ctx, W], "vpt": [n, depth, P, W]}``, uint8
    ``px  # [n, B, 3, H, W]``, pseudo-labels ``y  # [n, B]``."""
    n, B = y.shape
    per = (
        params["vpt"]
        .unsqueeze(1)
        .expand(n, B, *params["vpt"].shape[1:])
        .reshape(n * B, *params["vpt"].shape[1:])
    )
    f = image.features(px.reshape(n * B, *px.shape[2:]), per).view(n, B, -1)
    t = text.features(params["text"])
    return ce_per_client(scale * torch.bmm(f, t.transpose(1, 2)), y)


def sgd_step(leaves: list[torch.Tensor], lr: float, momentum: float, weight_decay: float, loss_fn, opt=None):
    """One step of ``torch.optim.SGD`` on ``leaves`` (``requires_grad=True``): ``loss_fn()  # [n]`` summed,
    backward, update. Returns the optimiser (pass it back to continue its momentum) and the loss."""
    if opt is None:
        opt = torch.optim.SGD(leaves, lr=lr, momentum=momentum, weight_decay=weight_decay)
    opt.zero_grad(set_to_none=True)
    loss = loss_fn()
    loss.sum().backward()
    opt.step()
    return opt, loss.detach()


__all__ = [
    "open_clip_model",
    "CoOpText",
    "VPTImage",
    "promptfl_loss",
    "fedcopl_loss",
    "sgd_step",
    "ce_per_client",
]

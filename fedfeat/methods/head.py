"""The linear head every linear-head method shares, and the class a new method of that shape subclasses.

``logits = s * (x W^T + b)`` per client on L2-normalised CLIP image features, initialised from the class text
features (``W0 = T``, ``b0 = 0``) as FST-CBDG does, and trained with FST-CBDG's lightweight protocol (SGD 0.01 /
0.9 / 1e-5, 1 local epoch, batch 50). ``W  # [n, K, D]`` and ``b  # [n, K]`` carry a leading client axis: every
hook sees all active clients of a step at once.

A new local loss is one hook: ``sample_loss(ctx, z, y, local) -> [n, B]`` (or ``step_loss`` for a per-client
term, as FedProx's proximal term). The engine runs it batched over clients on the torch program (autograd, one
batched SGD step); the fused CPU kernel applies only to the classes that declare it (``fused_loss``), so a
subclass that changes the loss never inherits its parent's kernel (``Method.has_fused``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch
import torch.nn.functional as F

from fedfeat.engine.context import Batch, Context, fused_batches, masked_mean
from fedfeat.methods.base import Method, check_ranges


class _BatchedLinear(torch.autograd.Function):
    """Class-major logits ``z^T = W x^T + b`` per client with a hand-written backward.

    Layout matters on CPU for these thin products (K outputs per client): ``bmm(W, x^T)`` -> ``[n, K, B]`` runs
    ~2x faster than ``bmm(x, W^T)`` -> ``[n, B, K]``, and the weight gradient ``bmm(g, x)`` with a class-major
    ``g`` needs no transposed copy; autograd's generic baddbmm backward is several times slower than that one
    ``bmm`` (measured for 100 clients x 50 samples x 1024 dims x 10 classes: BENCHMARKS.md)."""

    @staticmethod
    def forward(ctx, x, W, b):  # x [n, B, D], W [n, K, D], b [n, K]
        ctx.save_for_backward(x, W)
        return torch.baddbmm(b.unsqueeze(2), W, x.transpose(1, 2))  # [n, K, B]

    @staticmethod
    def backward(ctx, g):  # g [n, K, B]
        x, W = ctx.saved_tensors
        gx = torch.bmm(g.transpose(1, 2), W) if ctx.needs_input_grad[0] else None
        gW = torch.bmm(g, x) if ctx.needs_input_grad[1] else None
        gb = g.sum(2) if ctx.needs_input_grad[2] else None
        return gx, gW, gb


def batched_linear(x: torch.Tensor, W: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Per-client linear layer: ``x  # [n, B, D]``, ``W  # [n, K, D]``, ``b  # [n, K]`` -> ``[n, B, K]`` (a
    transposed view of class-major storage: ``.transpose(1, 2)`` of it is contiguous)."""
    return _BatchedLinear.apply(x, W, b).transpose(1, 2)


@dataclass(frozen=True)
class LinearHeadParams:
    local_epochs: int = 1  # FST-CBDG §4.1: 1 local epoch per round (lightweight setting)
    batch_size: int = 50  # FedNTD default; FST-CBDG does not say (reference-notes: inference)
    lr: float = 0.01  # FST-CBDG §4.1
    momentum: float = 0.9  # FST-CBDG §4.1
    weight_decay: float = 1e-5  # FST-CBDG §4.1
    lr_decay: float = 1.0  # per-round lr factor; FedNTD's code uses 0.99 (switch), FST-CBDG says nothing
    logit_scale: float = 1.0  # ours (fedfeat's reading of FST-CBDG Eq. 2: no temperature); 100 = CLIP's scale
    normalize: bool = True  # L2-normalise image features (CLIP convention; head init from unit text features)
    init: Literal["text", "zeros"] = (
        "text"  # FST-CBDG: head initialised from "a photo of a {}." text features
    )
    templates: Literal["first", "ensemble"] = "first"  # first = "a photo of a {}."; ensemble = mean of all

    # valid ranges (``base.declared_ranges``: with the engine's batch_size, local_epochs, lr, lr_decay, momentum and
    # weight_decay); a subclass adds its own fields' in its own RANGES
    RANGES = {"logit_scale": "> 0"}

    def validate(self) -> None:
        # the one generic rule: every declared range, the subclass's included (make_params checks them first too)
        check_ranges(self)


class LinearHead(Method):
    """A linear head on cached features (not registered: subclasses are the methods)."""

    Params = LinearHeadParams

    def init_global(self, ctx: Context) -> dict[str, torch.Tensor]:
        W = ctx.text.clone() if self.p.init == "text" else torch.zeros_like(ctx.text)  # [K, D]
        return {"W": W, "b": torch.zeros(ctx.K, device=ctx.device, dtype=W.dtype)}

    def logits(self, params: dict, x: torch.Tensor) -> torch.Tensor:
        """``x  # [n, B, D]``, per-client ``W  # [n, K, D]`` -> ``[n, B, K]``."""
        return self.p.logit_scale * batched_linear(x, params["W"], params["b"])

    def predict(self, ctx: Context, glob: dict, x: torch.Tensor) -> torch.Tensor:
        if (
            x is ctx.test_x
        ):  # the evaluation: class-major logits on the cached transposed test set (a view back)
            return self.p.logit_scale * torch.addmm(glob["b"].unsqueeze(1), glob["W"], ctx.test_xT()).T
        return self.p.logit_scale * (x @ glob["W"].T + glob["b"])

    def fused_epoch(self, ctx, plan, glob, local, params, opt, epoch):
        """The epoch in ``fedfeat.engine.kernels.linear_epoch`` (SGD state: momentum buffers; the first epoch starts
        every client from ``glob``)."""
        from fedfeat.engine import kernels

        mode, mu, tau, beta = self.fused_loss()
        bufs = opt.state["fused"]  # momentum buffers (run_local)
        losses = np.zeros((int(plan.steps.max()), plan.m), dtype=np.float64)
        kernels.linear_epoch(
            ctx.feats.numpy(), ctx.labels.numpy(), **fused_batches(ctx, plan, epoch),
            W=params["W"].numpy(), b=params["b"].numpy(), mW=bufs["W"].numpy(), mb=bufs["b"].numpy(),
            Wg=glob["W"].contiguous().numpy(), bg=glob["b"].contiguous().numpy(),
            lr=opt.lr, momentum=opt.momentum, weight_decay=opt.weight_decay, logit_scale=self.p.logit_scale,
            mode=mode, mu=mu, tau=tau, beta=beta, loss_out=losses, threads=ctx.threads, init=epoch == 0,
            one_epoch=plan.epochs == 1,
        )  # fmt: skip
        return losses

    def ce(self, params: dict, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        """``(per-client mean CE  # [n], logits  # [n, B, K])`` of the batch."""
        z = self.logits(params, batch.x)  # [n, B, K]
        ce = F.cross_entropy(z.transpose(1, 2), batch.y, reduction="none")  # [n, B]
        return masked_mean(ce, batch.mask), z

    # ---- the local loss: override ``sample_loss`` (per sample) or ``step_loss`` (per client)
    def sample_loss(self, ctx: Context, z: torch.Tensor, y: torch.Tensor, local: dict) -> torch.Tensor:
        """The loss of each sample: ``z  # [n, B, K]`` logits of the ``n`` active clients' mini-batches (already
        times ``logit_scale``), ``y  # [n, B]`` labels (padding rows hold label 0 and are masked out by the caller)
        -> ``[n, B]``. Default: cross-entropy. ``local`` is what ``local_begin`` returned for this round."""
        return F.cross_entropy(z.transpose(1, 2), y, reduction="none")

    def step_loss(self, ctx: Context, params: dict, batch: Batch, local: dict) -> torch.Tensor:
        """Per-client mean of ``sample_loss`` over the real samples -> ``[n]``; the engine sums it, differentiates
        and steps every client's head at once."""
        return masked_mean(self.sample_loss(ctx, self.logits(params, batch.x), batch.y, local), batch.mask)

    def fused_loss(self):
        return 0, 0.0, 1.0, 0.0  # (mode, mu, tau, beta): kernels.CE

    def dp_clipped_sums(self, ctx: Context, params: dict, batch: Batch, local: dict, clip: float):
        """Sample-level DP (``dp_sample = "head"``): the gradient of sample ``i``'s ``sample_loss`` is
        ``s g_i (x) [x_i, 1]`` (``g_i``: its loss's gradient w.r.t. its logits ``z_i = s (W x_i + b)``), of norm
        ``s ||g_i|| sqrt(||x_i||^2 + 1)``; the clipped sum over a client's batch is one ``bmm``."""
        from fedfeat.engine.privacy import clip_factors

        s, x = self.p.logit_scale, batch.x
        with torch.enable_grad():
            z = self.logits({k: v.detach() for k, v in params.items()}, x).detach().requires_grad_(True)
            per = self.sample_loss(ctx, z, batch.y, local)  # [n, B]
            (g,) = torch.autograd.grad((per * batch.mask.to(per.dtype)).sum(), z)  # [n, B, K]
        g = g * batch.mask.unsqueeze(-1).to(g.dtype)
        if ctx is not None and batch.pos is not None:  # ||x_i||^2 of the run's fixed features, computed once
            if "dp_sqnorm" not in ctx.cache:
                ctx.cache["dp_sqnorm"] = ctx.feats.double().pow(2).sum(1)
            sq = ctx.cache["dp_sqnorm"][batch.pos]
        else:
            sq = x.double().pow(2).sum(-1)
        norms = s * g.double().norm(dim=-1) * torch.sqrt(sq + 1)  # [n, B]
        gs = g * (s * clip_factors(norms, clip)).to(g.dtype).unsqueeze(-1)
        sums = {"W": torch.bmm(gs.transpose(1, 2), x), "b": gs.sum(1)}
        return masked_mean(per.detach(), batch.mask), sums


__all__ = ["LinearHead", "LinearHeadParams", "batched_linear"]


# ---- per-client tables of a head's shape (SCAFFOLD's control variates, FedDyn's duals): the clients sampled so far
def client_rows(table: dict, clients: torch.Tensor) -> dict[str, torch.Tensor]:
    """``{name: [m, ...]}``: the rows of ``clients  # [m]`` in a per-client table ``{"ids": [V] sorted client ids,
    name: [V, ...]}``, zeros for a client the table does not hold (not sampled yet)."""
    ids = table["ids"]
    clients = clients.to(ids.device)
    pos = torch.searchsorted(ids, clients).clamp_max(max(len(ids) - 1, 0))
    held = ids[pos] == clients if len(ids) else torch.zeros(len(clients), dtype=torch.bool, device=ids.device)
    out = {}
    for k, v in table.items():
        if k != "ids":
            rows = v[pos] if len(ids) else v.new_zeros((len(clients), *v.shape[1:]))
            out[k] = torch.where(held.view(-1, *([1] * (v.dim() - 1))), rows, torch.zeros_like(rows))
    return out


def store_client_rows(table: dict, clients: torch.Tensor, rows: dict[str, torch.Tensor]) -> None:
    """Write ``rows  # {name: [m, ...]}`` of ``clients  # [m]`` into the table (``client_rows``), adding the
    clients it does not hold yet (``ids`` stay sorted): the table grows with the clients sampled so far, never with
    the run's client count."""
    clients = clients.to(table["ids"].device)
    new = clients[~torch.isin(clients, table["ids"])]
    if len(new):
        ids = torch.cat([table["ids"], new])
        order = torch.argsort(ids)
        table["ids"] = ids[order]
        for k in rows:
            table[k] = torch.cat([table[k], table[k].new_zeros((len(new), *table[k].shape[1:]))])[order]
    pos = torch.searchsorted(table["ids"], clients)
    for k, r in rows.items():
        table[k].index_copy_(0, pos, r)


def client_table(ctx: Context) -> dict[str, torch.Tensor]:
    """An empty per-client table for the head: ``{"ids": [0], "W": [0, K, D], "b": [0, K]}``."""
    kw = {"device": ctx.device, "dtype": ctx.text.dtype}
    return {
        "ids": torch.zeros(0, dtype=torch.int64, device=ctx.device),
        "W": torch.zeros(0, ctx.K, ctx.D, **kw),
        "b": torch.zeros(0, ctx.K, **kw),
    }

"""FedOTP (Li, Huang, Wang, Shi, "Global and Local Prompts Cooperation via Optimal Transport for Federated Learning",
CVPR 2024; "FedOPT" in FedCoPL's table), following the public code ``HongxiaLee/FedOTP`` at
9948611a2325adc5543e9185cf0aa92ff84a2936 (``trainers/GLP_OT.py``, ``federated_main.py``, ``utils/fed_utils.py``,
``configs/trainers/GLP_OT/vit_b16.yaml``, ``scripts/fedotp_*.sh``); registered as ``fedopt``.

Every client holds two CoOp text prompts (unified contexts of the frozen text tower, ``fedfeat.encoders.prompt``):
a **global** prompt, averaged by the server (FedAvg weighted by client sample counts: ``average_weights(...,
datanumber_client)``), and a **local** prompt that never leaves the client (``federated_main.py`` ``model ==
'FedOTP'``: ``ctx[:avg_prompt]`` is averaged, ``ctx[avg_prompt:num_prompt]`` is kept per client; every client starts
from the same initial prompts). An image is scored against a class by matching its ``M`` **patch features** (all
ViT tokens through ``ln_post`` and ``proj``, the class token dropped: ``ModifiedVisionTransformer.forward``) to the
class's ``N = 2`` prompt features by optimal transport (``CustomCLIP.forward``)::

    sim[m, n]  = cos(patch_m, text_{n,c})                       # unit features
    K[m, n]    = exp(-(1 - sim[m, n]) / eps)                    # no gradient through the plan
    T          = OT(K, a = 1/M on the patches, b = top_percent/N on the prompts)
    logit_c    = logit_scale * sum_{m,n} T[m, n] * sim[m, n]

``OT`` is ``entropic_COT_fast`` (``ot="cot"``, the default ``--OT COT``: unbalanced OT, the patches' scaling capped at
1 so that only ``top_percent`` of the image's mass is moved, "modify from ot.partial.entropic_partial_wasserstein")
or the balanced ``Sinkhorn`` (``ot="sinkhorn"``, ``b = 1/N``); both are ported here as ``cot_plan`` /
``sinkhorn_plan`` and tested against line-by-line transcriptions of the code. Where the code's kernel underflows
the working dtype (the few-shot script's eps 0.01 in float32: ``K`` down to ``exp(-200)``, the scalings past
``exp(88)``; the code's own float16 at any small eps), the same iteration runs in the log domain (``cot_plan_log`` /
``sinkhorn_plan_log``, chosen per batch by ``transport_plan``): the float64 plan to float32 rounding. The loss is
CE on the logits (the unsupervised modes: CE on FPL's hard pseudo-labels or CPL's candidate-set loss,
``pseudo=fpl|cpl|copl``, as ``promptfl``'s unsupervised mode, ``fedfeat.methods.prompt.pseudo_label``). Each client
is evaluated on its local test split with [global prompt, its own local prompt] (``local_acc``); the global test
accuracy uses the global prompt and the mean of the clients' local prompts (ours: the paper reports only
personalised accuracy).

Defaults (each field names its source): ``n_ctx`` 16 (``--n_ctx`` default, ``fedotp_few_shot.sh``; the CIFAR-100
script uses 4), random N(0, 0.02) contexts, SGD lr 0.001 (both scripts), momentum 0.9 and weight decay 5e-4 (Dassl
defaults), a constant learning rate (``single_step`` with ``--gamma 1``), batch 32, one local epoch
(``vit_b16.yaml``), FedAvg of the global prompt by client sample counts, ``ot="cot"``, ``top_percent`` 0.8 (both
scripts), ``eps`` 0.1 (``--eps`` default and the CIFAR-100 script; the few-shot script uses 0.01), ``thresh`` 1e-3,
``max_iter`` 100; test batches of 100. (The paper's FedCoPL comparison gives no settings of its own for FedOPT.)

Runs on the store's pixels (``encode --pixels``): the image encoder is frozen (``requires_grad_(False)`` for all but
the prompt learner) and the code's test transform has no randomness, so the patch features of every training and
test image are computed **once** at set-up through the store's live image tower and kept in memory (``[N, M, D]``,
unit-normalised; ``patch_dtype`` float16 halves them). The set-up checks that the recomputed class tokens
reproduce the store's cached features.

Where our setting forces a choice or the code has a quirk, each is a named switch (defaults documented):

* ``ot_stop``: the code stops the Sinkhorn / COT iterations when the mean change over the **whole mini-batch** of
  ``B x K`` problems falls below ``thresh`` (``err.item() < thresh``), so an image's plan depends on its batch-mates;
  ``"batch"`` (default) keeps that per client mini-batch (the code's batch is one client's), ``"fixed"`` always runs
  ``max_iter`` iterations (no coupling). Evaluation uses the code's test batches of ``eval_batch`` (100) per client.
* Training uses the store's single centre-crop view: the code's configs list ``random_resized_crop`` and
  ``random_flip`` for training (FedCoPL's protocol trains without augmentation; cached patches need one view).
* The code runs CLIP in float16 (``GLP_OT.PREC = "fp16"``): ``precision="auto"`` (fp16 text tower, prompts,
  similarities and transport on CUDA, fp32 on a CPU; ``fedfeat.methods.prompt``); the patch features are computed
  in float32 and cached as ``patch_dtype``.
* The code builds one SGD optimiser for all clients and rounds (momentum carries from client to client, the global
  and the local prompt alike): ``optimizer_state="carried"`` (the clients then train one after another);
  ``"fresh"``: each client starts each round with fresh state, batched.
* Round 0 of the code trains every client (``idxs_users = all`` at epoch 0) whatever ``--frac``; here the run's
  participation applies from the first round (FedCoPL's table trains all clients every round anyway).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch
import torch.nn.functional as F

from fedfeat.engine import rng
from fedfeat.engine.context import Batch, Context, RoundPlan, fedavg
from fedfeat.errors import FedfeatError
from fedfeat.methods.base import register
from fedfeat.methods.prompt import (
    TAG_CTX_INIT,
    PromptFLParams,
    PromptMethod,
    client_accuracies,
    client_weights,
    pseudo_label,
    pseudo_loss,
    pseudo_metrics,
)

ENCODE_BATCH = 256  # images per forward of the frozen image tower at set-up (a store chunk read at a time)
EVAL_ELEMENTS = 1 << 24  # evaluation: OT problems per pass bounded by this many similarity entries
MIN_COSINE = 0.99  # recomputed class tokens vs the store's cached features (float16 storage)


@dataclass(frozen=True)
class FedOTPParams(PromptFLParams):
    local_epochs: int = 1  # configs/trainers/GLP_OT/vit_b16.yaml:18 OPTIM.MAX_EPOCH 1 (rn50.yaml: 5)
    batch_size: int = 32  # vit_b16.yaml:3 TRAIN_X.BATCH_SIZE 32; federated_main.py:510 --train_batch_size 32
    lr: float = 0.001  # scripts/fedotp_*.sh LR=0.001 (--lr default 0.001)
    momentum: float = 0.9  # Dassl/dassl/config/defaults.py:157 OPTIM.MOMENTUM
    weight_decay: float = 5e-4  # Dassl/dassl/config/defaults.py:156 OPTIM.WEIGHT_DECAY
    # vit_b16.yaml:19 single_step (Dassl lr_scheduler.py:100-115 StepLR) with --gamma 1 (federated_main.py:103)
    schedule: Literal["cosine", "constant", "cosine-epoch"] = "constant"
    aggregation: Literal["size", "mean"] = (
        "size"  # federated_main.py:374 average_weights(.., datanumber_client)
    )
    # federated_main.py:161 one local_trainer (one SGD, GLP_OT.py:377) for every client of every round
    optimizer_state: Literal["fresh", "carried"] = "carried"
    precision: Literal["fp32", "fp16", "auto"] = "auto"  # federated_main.py:80 GLP_OT.PREC "fp16" (CUDA)
    n_ctx: int = 16  # federated_main.py:529 --n_ctx 16 (fedotp_few_shot.sh NCTX=16; fedotp_cifar100.sh 4)
    ot: Literal["cot", "sinkhorn"] = "cot"  # federated_main.py:535 --OT COT (GLP_OT.py:311-320); "sinkhorn"
    top_percent: float = 0.8  # both scripts TOP_PERCENT=0.8 (--top_percent default 1): the mass COT moves
    eps: float = 0.1  # federated_main.py:537 --eps 0.1 (= fedotp_cifar100.sh; fedotp_few_shot.sh: 0.01)
    thresh: float = 1e-3  # federated_main.py:538 --thresh 1e-3 (both scripts): the OT stopping threshold
    max_iter: int = 100  # federated_main.py:539 --max_iter 100 (both scripts)
    ot_stop: Literal["batch", "fixed"] = "batch"  # batch: the code's batch-level stop (per client batch)
    eval_batch: int = (
        100  # federated_main.py:511 --test_batch_size 100 (the batch-level stop couples a batch)
    )
    patch_dtype: Literal["float32", "float16"] = "float32"  # the cached patch features (float16: half memory)

    def validate(self) -> None:
        super().validate()
        if self.csc:
            raise FedfeatError(
                "fedopt's prompts are unified contexts (GLP_OT.CSC False); drop --set csc=true"
            )
        if not 0 < self.top_percent <= 1 or self.eps <= 0 or self.thresh < 0:
            raise FedfeatError(
                f"need 0 < top_percent <= 1, eps > 0, thresh >= 0; got {self.top_percent}, {self.eps}, "
                f"{self.thresh}; e.g. --set top_percent=0.8"
            )
        if self.max_iter < 1 or self.eval_batch < 1:
            raise FedfeatError(
                f"max_iter and eval_batch must be >= 1, got {self.max_iter} and {self.eval_batch}; "
                "e.g. --set max_iter=100"
            )


# ---------------------------------------------------------------------------------------- optimal transport
def _group_err(delta: torch.Tensor, valid: torch.Tensor | None) -> torch.Tensor:
    """``[G]`` mean of ``delta  # [G, P, X]`` over each group's valid problems (the code's ``.abs().mean()`` over
    its batch)."""
    if valid is None:
        return delta.mean(dim=(1, 2))
    w = valid.to(delta.dtype)
    return (delta * w.unsqueeze(-1)).sum(dim=(1, 2)) / (w.sum(1) * delta.shape[-1]).clamp_min(1)


def _change(new: torch.Tensor, old: torch.Tensor) -> torch.Tensor:
    """``|exp(new) - exp(old)|`` in float64 (the code's ``(v - v0).abs()`` on the scalings, from their logs: a scaling
    such as ``exp(80)`` at eps 0.01 overflows float32 but not float64), as ``exp(old) * |expm1(new - old)|``."""
    new, old = new.double(), old.double()
    return old.exp() * torch.expm1(new - old).abs()


def _lse_rows(logK: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """``log (K @ exp(g))``: ``[.., M]`` from ``logK  # [.., M, N]``, ``g  # [.., N]``."""
    return torch.logsumexp(logK + g.unsqueeze(-2), dim=-1)


def _lse_cols(logK: torch.Tensor, f: torch.Tensor) -> torch.Tensor:
    """``log (K^T @ exp(f))``: ``[.., N]`` from ``logK  # [.., M, N]``, ``f  # [.., M]``."""
    return torch.logsumexp(logK + f.unsqueeze(-1), dim=-2)


def cot_plan_log(
    logK: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    max_iter: int,
    thresh: float,
    valid: torch.Tensor | None = None,
    stop: str = "batch",
) -> torch.Tensor:
    """``entropic_COT_fast`` (GLP_OT.py:238-274) in the log domain on groups of problems: ``logK  # [G, P, M, N]`` the
    log kernels (``-(1 - sim) / eps``), ``a  # [G, P, M]`` and ``b  # [G, P, N]`` the marginals (broadcastable),
    ``valid  # [G, P]`` the real problems. The code's iteration, from ``u = v = 1``, ``u = min(1 / (diag(1/a) K v),
    1)``, ``v = 1 / (diag(1/b) K^T u)``, plan ``diag(u) K diag(v)``, is computed on ``f = log u``, ``g = log v``::

        f = min(log a - LSE_n(logK[m, n] + g[n]), 0)      # the cap u <= 1 of the patches' scaling
        g = log b - LSE_m(logK[m, n] + f[m])
        T = exp(f[m] + logK[m, n] + g[n])

    -- the same numbers in exact arithmetic, but finite in float32 at any ``eps`` (at eps 0.01 ``K`` underflows and
    ``v`` overflows float32). A group stops (``stop="batch"``) after the iteration in which the mean ``|v - v_prev|``
    over its valid problems (from the logs, in float64) falls below ``thresh`` -- one group is one of the code's
    batches; ``"fixed"`` runs ``max_iter`` iterations."""
    return _plan_log(logK, a, b, max_iter, thresh, valid, stop, cap=True)


def _plan_log(logK, a, b, max_iter, thresh, valid, stop, *, cap: bool) -> torch.Tensor:
    """The log-domain iteration both transports share: ``f = log a - LSE_n(logK + g)`` (``cap``: COT's ``min(., 0)``,
    its ``u <= 1``), ``g = log b - LSE_m(logK + f)`` from ``f = g = 0``; a group stops on the mean change of the
    scaling the code watches (COT: ``v = exp(g)``; Sinkhorn: ``r = exp(f)``); the plan ``exp(f + logK + g)``."""
    G = logK.shape[0]
    a, b = torch.broadcast_to(a, logK.shape[:-1]), torch.broadcast_to(b, logK.shape[:-2] + logK.shape[-1:])
    la, lb = a.log(), b.log()
    f, g = torch.zeros_like(la), torch.zeros_like(lb)  # u = v = 1
    active = torch.ones(G, dtype=torch.bool, device=logK.device)
    for _ in range(max_iter):
        f0, g0 = f, g
        f_new = la - _lse_rows(logK, g)
        if cap:
            f_new = f_new.clamp_max(0.0)  # u = min(dx / (Kp v), dx)
        g_new = lb - _lse_cols(logK, f_new)  # v = dy / (Kq u)
        on = active.view(G, 1, 1)
        f, g = torch.where(on, f_new, f), torch.where(on, g_new, g)
        if stop == "batch":
            watched = _change(g, g0) if cap else _change(f, f0)
            active = active & ~(_group_err(watched, valid) < thresh)
            if not bool(active.any()):
                break
    return torch.exp(f.unsqueeze(-1) + logK + g.unsqueeze(-2))


def sinkhorn_plan_log(
    logK: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    max_iter: int,
    thresh: float,
    valid: torch.Tensor | None = None,
    stop: str = "batch",
) -> torch.Tensor:
    """``CustomCLIP.Sinkhorn`` (GLP_OT.py:222-236) in the log domain on groups of problems (shapes as
    ``cot_plan_log``): the code's ``r = a / (K c)``, ``c = b / (K^T r)`` from ``r = c = 1``, plan ``(r c^T) * K``,
    computed on ``f = log r = log a - LSE_n(logK + h)``, ``h = log c = log b - LSE_m(logK + f)``, ``T = exp(f + logK +
    h)``. A group stops after the iteration in which the mean ``|r - r_prev|`` over its valid problems falls below
    ``thresh`` (``stop="batch"``)."""
    return _plan_log(logK, a, b, max_iter, thresh, valid, stop, cap=False)


def cot_plan(
    K: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    max_iter: int,
    thresh: float,
    valid: torch.Tensor | None = None,
    stop: str = "batch",
) -> torch.Tensor:
    """``entropic_COT_fast`` (GLP_OT.py:238-274) on groups of problems: ``K  # [G, P, M, N]`` the kernels, ``a  #
    [G, P, M]`` and ``b  # [G, P, N]`` the marginals (broadcastable), ``valid  # [G, P]`` the real problems. Per
    problem: ``Kp = diag(1/a) K``, ``Kq = diag(1/b) K^T``; from ``u = v = 1``, repeat ``u = min(1 / (Kp v), 1)``,
    ``v = 1 / (Kq u)``; the plan is ``diag(u) K diag(v)``. A group stops (``stop="batch"``) after the iteration in
    which the mean ``|v - v_prev|`` over its valid problems falls below ``thresh`` -- one group is one of the code's
    batches; ``"fixed"`` runs ``max_iter`` iterations."""
    G = K.shape[0]
    a, b = torch.broadcast_to(a, K.shape[:-1]), torch.broadcast_to(b, K.shape[:-2] + K.shape[-1:])
    dx, dy = torch.ones_like(a), torch.ones_like(b)
    Kp = (1 / a).unsqueeze(-1) * K  # torch.diag_embed(1 / a) @ K
    Kq = (1 / b).unsqueeze(-1) * K.transpose(-1, -2)  # torch.diag_embed(1 / b) @ K^T
    u, v = dx, dy
    active = torch.ones(G, dtype=torch.bool, device=K.device)
    for _ in range(max_iter):
        v0 = v
        u_new = torch.minimum(dx / (Kp @ v.unsqueeze(-1)).squeeze(-1), dx)
        v_new = dy / (Kq @ u_new.unsqueeze(-1)).squeeze(-1)
        on = active.view(G, 1, 1)
        u, v = torch.where(on, u_new, u), torch.where(on, v_new, v)
        if stop == "batch":
            active = active & ~(_group_err((v - v0).abs(), valid).double() < thresh)
            if not bool(active.any()):
                break
    return u.unsqueeze(-1) * K * v.unsqueeze(-2)


def sinkhorn_plan(
    K: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    max_iter: int,
    thresh: float,
    valid: torch.Tensor | None = None,
    stop: str = "batch",
) -> torch.Tensor:
    """``CustomCLIP.Sinkhorn`` (GLP_OT.py:222-236) on groups of problems (shapes as ``cot_plan``): from ``r = c = 1``,
    repeat ``r = a / (K c)``, ``c = b / (K^T r)``; the plan is ``(r c^T) * K``. A group stops after the iteration in
    which the mean ``|r - r_prev|`` over its valid problems falls below ``thresh`` (``stop="batch"``)."""
    G = K.shape[0]
    a, b = torch.broadcast_to(a, K.shape[:-1]), torch.broadcast_to(b, K.shape[:-2] + K.shape[-1:])
    r, c = torch.ones_like(a), torch.ones_like(b)
    Kt = K.transpose(-1, -2)
    active = torch.ones(G, dtype=torch.bool, device=K.device)
    for _ in range(max_iter):
        r0 = r
        r_new = a / (K @ c.unsqueeze(-1)).squeeze(-1)
        c_new = b / (Kt @ r_new.unsqueeze(-1)).squeeze(-1)
        on = active.view(G, 1, 1)
        r, c = torch.where(on, r_new, r), torch.where(on, c_new, c)
        if stop == "batch":
            active = active & ~(_group_err((r - r0).abs(), valid).double() < thresh)
            if not bool(active.any()):
                break
    return (r.unsqueeze(-1) @ c.unsqueeze(-2)) * K


def transport_plan(
    sim: torch.Tensor,
    eps: float,
    a: torch.Tensor,
    b: torch.Tensor,
    ot: str,
    max_iter: int,
    thresh: float,
    valid: torch.Tensor | None = None,
    stop: str = "batch",
) -> torch.Tensor:
    """The plans ``[G, P, M, N]`` of the kernels ``K = exp(-(1 - sim) / eps)`` of ``sim  # [G, P, M, N]``: ``cot_plan``
    (``ot="cot"``) or ``sinkhorn_plan``. Each group (one of the code's batches) runs the code's direct iteration in
    ``sim``'s dtype where that is exact -- every kernel entry in the dtype's normal range (``log K >= log tiny``) and
    the plan finite (no scaling overflowed) -- and otherwise the same iteration in the log domain (``cot_plan_log`` /
    ``sinkhorn_plan_log``, float32 at least): at the default ``eps`` 0.1 in float32 every group is direct (``log K >=
    -2 / eps = -20``), at the few-shot script's 0.01 ``K`` reaches ``exp(-200)``, below float32's ``exp(-87.3)``, and
    the scalings overflow, so such groups go through the log domain. Both paths are the same numbers in exact
    arithmetic, with the same stopping rule; the choice is per group, so a group's plan never depends on another's."""
    direct_fn, log_fn = (cot_plan, cot_plan_log) if ot == "cot" else (sinkhorn_plan, sinkhorn_plan_log)
    z = -(1.0 - sim) / eps  # the code's -wdist / eps
    ok = z.flatten(1).amin(1) >= math.log(torch.finfo(z.dtype).tiny)  # [G] no kernel entry underflows
    T = torch.empty_like(sim)
    if bool(ok.any()):
        g = ok.nonzero().squeeze(1)
        sub = None if valid is None else valid[g]
        T[g] = direct_fn(torch.exp(z[g]), a, b, max_iter, thresh, sub, stop)
        ok[g] = T[g].flatten(1).isfinite().all(1)  # a scaling overflowed: redo in the log domain
    if not bool(ok.all()):
        g = (~ok).nonzero().squeeze(1)
        # float32 at least: log potentials near 1 / eps keep too few digits in float16
        work = torch.promote_types(sim.dtype, torch.float32)
        sub = None if valid is None else valid[g]
        logK = -(1.0 - sim[g].to(work)) / eps
        T[g] = log_fn(logK, a.to(work), b.to(work), max_iter, thresh, sub, stop).to(sim.dtype)
    return T


def ot_logits(
    patches: torch.Tensor, text: torch.Tensor, valid: torch.Tensor | None, p, scale: float
) -> torch.Tensor:
    """FedOTP's logits (``CustomCLIP.forward``): ``patches  # [G, P, M, D]`` and ``text  # [G, N, K, D]`` unit
    features (group ``g``'s images scored against its prompts), ``valid  # [G, P]`` -> ``[G, P, K]``. The plan is
    computed without gradient (``transport_plan``: the code's direct iteration, or the log domain where its kernel
    would underflow); the gradient reaches the prompts through ``sim``."""
    G, P, M, _ = patches.shape
    N, Kc = text.shape[1], text.shape[2]
    sim = torch.einsum("gpmd,gnkd->gpkmn", patches, text)  # [G, P, K, M, N]
    with torch.no_grad():
        ok = None if valid is None else valid.repeat_interleave(Kc, dim=1)  # problems are (image, class)
        a = torch.full((M,), 1.0 / M, dtype=sim.dtype, device=sim.device)
        b = torch.full((N,), 1.0 / N, dtype=sim.dtype, device=sim.device)
        if p.ot == "cot":  # yy = 1/N * top_percent (top_percent = min(sum(xx), TOP_PERCENT) = TOP_PERCENT)
            b = b * p.top_percent
        T = transport_plan(
            sim.reshape(G, P * Kc, M, N), p.eps, a, b, p.ot, p.max_iter, p.thresh, ok, p.ot_stop
        )
    return scale * (T.view(G, P, Kc, M, N) * sim).sum(dim=(-2, -1))


# ---------------------------------------------------------------------------------------- the image tower
def vit_tokens(visual, images: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(class token [B, D], patch tokens [B, M, D])`` of normalised model inputs through an open_clip
    ``VisionTransformer``: every token through ``ln_post`` and ``proj``, as FedOTP's ``ModifiedVisionTransformer``."""
    x = visual._embeds(images)  # [B, 1 + M, W]
    if getattr(visual.transformer, "batch_first", True):
        x = visual.transformer(x)
    else:
        x = visual.transformer(x.transpose(0, 1)).transpose(0, 1)
    x = visual.ln_post(x)
    if visual.proj is not None:
        x = x @ visual.proj
    return x[:, 0], x[:, 1:]


def _check_vit(visual) -> None:
    if not all(hasattr(visual, a) for a in ("transformer", "_embeds", "ln_post", "conv1")):
        raise FedfeatError(
            f"fedopt matches patch tokens: it needs a ViT image encoder, this model's is a {type(visual).__name__} "
            "(a ResNet?); use a ViT backbone such as ViT-B-32"
        )
    if getattr(visual, "attn_pool", None) is not None or getattr(visual, "final_ln_after_pool", False):
        raise FedfeatError(
            "fedopt supports CLIP-style ViTs (class-token pooling, ln_post on every token), not attention pooling"
        )


@register
class FedOTP(PromptMethod):
    """FedOTP (Li et al. 2024): global + local CoOp prompts per client, matched to patch features by OT."""

    name = "fedopt"
    dp_client = True  # DP-FedAvg of the global prompts; the local prompts never leave their clients
    state_keys = {
        "client_local": "per-client: [C, n_ctx, W] each client's local CoOp prompt (never aggregated)"
    }
    Params = FedOTPParams
    uses_labels = True
    needs_pixels = True
    runs_on = "pixels (patch features cached at set-up) + live text encoder"

    def __init__(self, params):
        super().__init__(params)
        self.uses_labels = self.p.pseudo == "none"  # the unsupervised modes never see labels

    # ------------------------------------------------------------------ set-up
    def setup(self, ctx: Context) -> None:
        p = self.p
        st = ctx.store
        if st is None or not st.has_pixels:
            raise FedfeatError(
                "fedopt matches patch features: its store needs pixels; encode it with `fedfeat encode ... --pixels`"
            )
        if ctx.train_rows is None or ctx.test_rows is None:
            raise FedfeatError(
                "fedopt needs a closed partition with a test split (not --partition disjoint-classes)"
            )
        visual = ctx.live.model.visual
        _check_vit(visual)
        super().setup(ctx)
        rows = np.asarray(ctx.train_rows)
        if p.pseudo != "none":
            pseudo_label(ctx, p.pseudo, p)
            rows = rows[ctx.state["pseudo_rows"].cpu().numpy()]
        spec = st.attrs["pixels"]
        ctx.cache["fedopt_train"] = self._patches(ctx, visual, spec, "train", rows, ctx.feats)
        ctx.cache["fedopt_test"] = self._patches(
            ctx, visual, spec, "test", np.asarray(ctx.test_rows), ctx.test_x
        )
        g = rng.generator(ctx.seed, TAG_CTX_INIT)
        glob0 = self.learner.init_context(
            g, std=p.ctx_std
        )  # GLP_OT PromptLearner: ctx [N, n_ctx, W] ~ N(0, .02)
        local0 = self.learner.init_context(g, std=p.ctx_std)
        self.init = {"ctx": glob0, "local": local0}
        ctx.state["client_local"] = local0.unsqueeze(0).repeat(ctx.n_clients, 1, 1)

    @torch.no_grad()
    def _patches(self, ctx, visual, spec, split: str, rows: np.ndarray, cached: torch.Tensor) -> torch.Tensor:
        """Unit patch features ``[len(rows), M, D]`` of the store's ``split`` images ``rows`` (read chunk by chunk of
        the store, each once), and a check that their class tokens reproduce ``cached`` (the store's features)."""
        from fedfeat.store.featurestore import normalize_pixels

        dt = torch.float16 if self.p.patch_dtype == "float16" else torch.float32
        order = np.argsort(rows, kind="stable")
        chunk = rows[order] // ctx.store.chunk_rows
        starts = np.flatnonzero(np.r_[True, chunk[1:] != chunk[:-1]]) if len(rows) else np.zeros(0, np.int64)
        out, worst = None, 1.0
        for a, b in zip(starts, np.r_[starts[1:], len(rows)]):
            px_chunk = ctx.store.pixels(split, rows[order[a:b]])  # one store chunk's rows
            for s in range(0, b - a, ENCODE_BATCH):
                px = torch.from_numpy(px_chunk[s : s + ENCODE_BATCH]).to(ctx.device)
                cls, tok = vit_tokens(visual, normalize_pixels(px, spec["mean"], spec["std"]))
                if out is None:
                    out = torch.empty((len(rows), *tok.shape[1:]), dtype=dt, device=ctx.device)
                idx = torch.as_tensor(order[a + s : a + s + len(px)], device=ctx.device)
                out[idx] = F.normalize(tok.float(), dim=-1).to(dt)
                want = cached[idx.to(cached.device)].to(cls.device, torch.float32)
                worst = min(worst, float(F.cosine_similarity(cls.float(), want, dim=-1).min()))
        if out is None:
            W = int(visual.proj.shape[1]) if visual.proj is not None else int(visual.ln_post.weight.shape[0])
            return torch.zeros((0, 1, W), dtype=dt, device=ctx.device)
        if not worst >= MIN_COSINE:
            raise FedfeatError(
                f"the store's {split} pixels through its image encoder do not reproduce its features (cosine "
                f"{worst:.4f} < {MIN_COSINE}); re-encode the store with `fedfeat encode ... --pixels`"
            )
        return out

    def init_global(self, ctx: Context) -> dict[str, torch.Tensor]:
        return {"ctx": self.init["ctx"].clone()}

    # ------------------------------------------------------------------ the model
    def _text(self, ctx_global: torch.Tensor, ctx_local: torch.Tensor) -> torch.Tensor:
        """Unit text features ``[n, 2, K, D]`` of ``n`` clients' (global, local) contexts ``[n, n_ctx, W]`` each,
        in one tower forward (prompt 0 global, as the code's ``ctx[:avg_prompt]``)."""
        n = ctx_global.shape[0]
        c = torch.stack([ctx_global, ctx_local], dim=1).flatten(0, 1)  # [n * 2, n_ctx, W]
        t = self.learner.features(c)  # [n * 2, K, D]
        return F.normalize(t, dim=-1).view(n, 2, *t.shape[1:])

    def _logits(self, ctx: Context, patches: torch.Tensor, text: torch.Tensor, valid) -> torch.Tensor:
        return ot_logits(patches.to(text.dtype), text, valid, self.p, ctx.clip_logit_scale)

    # ------------------------------------------------------------------ local update
    def local_params(self, ctx: Context, plan: RoundPlan) -> dict:
        return {"local": ctx.state["client_local"][plan.clients.to(ctx.device)].clone()}

    def step_loss(self, ctx: Context, params: dict, batch: Batch, local: dict) -> torch.Tensor:
        n, B = batch.mask.shape
        cache = ctx.cache["fedopt_train"]
        patches = cache[batch.pos.reshape(-1)].view(n, B, *cache.shape[1:])
        logits = self._logits(
            ctx, patches, self._text(params["ctx"], params["local"]), batch.mask
        )  # [n, B, K]
        return pseudo_loss(ctx, logits, batch, self.p.pseudo)

    # ------------------------------------------------------------------ server
    def keep_local(self, ctx: Context, plan: RoundPlan, cparams: dict) -> None:
        ctx.state["client_local"][plan.clients.to(ctx.device)] = cparams["local"].detach()

    def aggregate(self, ctx: Context, plan: RoundPlan, glob: dict, cparams: dict) -> dict:
        self.keep_local(ctx, plan, cparams)
        w = client_weights(ctx, plan, self.p.aggregation)
        return (
            glob if w is None else fedavg({"ctx": cparams["ctx"]}, w)
        )  # average_weights(local_weights_0, ..., datanumber_client)

    def upload_bytes(self, ctx: Context, plan: RoundPlan, cparams: dict) -> int:
        return int(cparams["ctx"].numel() * cparams["ctx"].element_size())

    # ------------------------------------------------------------------ evaluation
    @torch.no_grad()
    def _eval(self, ctx: Context, text: torch.Tensor, rows: list[torch.Tensor]) -> list[torch.Tensor]:
        """Logits ``[len(rows[i]), K]`` of the test rows of each text set ``text[i]  # [2, K, D]``, in the code's test
        batches of ``eval_batch`` (one OT group each), many batches per pass."""
        E = self.p.eval_batch
        cache = ctx.cache["fedopt_test"]
        M = cache.shape[1]
        chunks = [(i, r[s : s + E]) for i, r in enumerate(rows) for s in range(0, len(r), E)]
        out: list[list[torch.Tensor]] = [[] for _ in rows]
        per_pass = max(1, EVAL_ELEMENTS // (E * text.shape[2] * M * text.shape[1]))
        for s in range(0, len(chunks), per_pass):
            part = chunks[s : s + per_pass]
            idx = torch.zeros(len(part), E, dtype=torch.int64)
            valid = torch.zeros(len(part), E, dtype=torch.bool)
            for j, (_, r) in enumerate(part):
                idx[j, : len(r)], valid[j, : len(r)] = r.cpu(), True
            idx, valid = idx.to(ctx.device), valid.to(ctx.device)
            owner = torch.as_tensor([i for i, _ in part], device=text.device)
            z = self._logits(
                ctx, cache[idx.view(-1)].view(len(part), E, *cache.shape[1:]), text[owner], valid
            )
            for j, (i, r) in enumerate(part):
                out[i].append(z[j, : len(r)])
        return [torch.cat(o).float() if o else torch.zeros(0, text.shape[2], device=text.device) for o in out]

    @torch.no_grad()
    def predict(self, ctx: Context, glob: dict, x: torch.Tensor) -> torch.Tensor:
        if x is not ctx.test_x:
            raise FedfeatError(
                "fedopt predicts from patch features: it evaluates the store's test images only"
            )
        local = ctx.state["client_local"].mean(
            0, keepdim=True
        )  # ours: the global prompt + the mean local one
        text = self._text(glob["ctx"].unsqueeze(0), local)
        return self._eval(ctx, text, [torch.arange(len(x))])[0]

    @torch.no_grad()
    def local_accuracies(self, ctx: Context, glob: dict, test_y: torch.Tensor) -> list[float]:
        """Each client's accuracy on its local test rows with [global prompt, its own local prompt]."""
        C = ctx.n_clients
        text = self._text(glob["ctx"].unsqueeze(0).expand(C, -1, -1), ctx.state["client_local"])
        rows = [torch.as_tensor(r, dtype=torch.int64) for r in ctx.local_test]
        return client_accuracies(self._eval(ctx, text, rows), rows, test_y)

    def round_metrics(self, ctx: Context, data, glob: dict, ev: dict) -> dict:
        return pseudo_metrics(ctx, data, self.p.pseudo)

    def final_weights(self, ctx: Context, glob: dict) -> dict[str, torch.Tensor]:
        """The global prompt and every client's local prompt (``[clients, n_ctx, W]``)."""
        return {**glob, "client_local": ctx.state["client_local"].clone()}

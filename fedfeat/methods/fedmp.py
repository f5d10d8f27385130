"""FedCLIP and Fed-MP (Zeng et al., NAACL 2024, "Open-Vocabulary Federated Learning with Multimodal Prototyping").

Reference code: ``huiminzeng/Fed-MP@a40e585``; the ``file:line`` cites below are to it.

**fedclip** (Fed-MP's FedCLIP baseline; Lu et al. 2023): a visual adapter ``f_A = softmax(Linear(D, D) -> tanh ->
Linear(D, D))`` re-weights the image feature, ``z' = normalise(f_A(z) ⊙ z)`` (paper Eq. 3 and the reference code
``nets/model.py``; Algorithm 1 line 9 writes ``z + f_A(z)``: ``adapter="sum"``), trained with CLIP's symmetric in-batch
loss (Eq. 5) against each sample's class prompt at CLIP's own logit scale, and averaged by FedAvg weighted by client
size. It also runs in the closed setting (vocabulary = all classes).

*Optimiser* (both methods). The paper (Appendix A) says AdamW at lr 1e-5; the code (``client_utils.py:184-185``,
``train.py:37-42``) runs ``torch.optim.Adam`` at lr 5e-5, betas (0.9, 0.98), eps 1e-6 and weight decay 0.2 (L2, added
to the gradient). Default: the code's (``optimizer="adam"``); ``--set optimizer=adamw lr=1e-5`` is the paper's reading
(``torch.optim.AdamW``'s decoupled decay, ``fedfeat.engine.optim.BatchedAdamW``, with ``weight_decay`` as set: the paper
gives none). 2 local epochs of batch 18 (``train.py:28-29``), 2 rounds (``train.py:27``, the run's ``--rounds``).

**fed-mp** adds three pieces (open-vocabulary runs only: ``--partition disjoint-classes``):

* *Client residuals* (Eq. 4): ``t'_c = normalise(t_c + α δ_c)`` with ``t_c`` the *unnormalised* stored text embedding
  (``ctx.text_raw``) and ``δ`` one row per position in the client's class list (``OpenVocab.local_index``), drawn
  uniform(-5, 5) and trained with the adapter. Their norm, ``α · 5/√3 · √D`` (≈ 24 at D = 768; ≈ 0.87 · √D · α/0.3),
  dwarfs a unit text feature: the perturbed prompt is mostly residual. They are re-initialised every round and never
  aggregated (Algorithm 1 line 6; the code's ``task_res`` sits in the global model, is seeded once and never
  updated): by default every client in every round starts from the same seeded ``[Kc, D]`` block, as the code
  effectively does (``residual_draw="per-client"``: a fresh draw per (round, client)). They are local parameters of
  the engine (``local_params``), optimised by the same Adam (weight decay included) and dropped by ``aggregate``.
* *Adaptive aggregation*: clients upload their perturbed text features ``T'_k``; the server scores
  ``ξ_k = mean cos(t_test, t')`` over the novel classes' prompts × the client's classes (Eq. 8; the code's
  ``get_task_similarity`` is ``|Y_k| / √N_test`` times it, a constant for equal-sized class lists) and averages the
  adapter with ``softmax(ξ)`` (Eq. 9, default) or ``ξ / Σ ξ`` (the code: ``weights="linear"``).
* *Multimodal prototyping* at test time (Eqs. 10-13, Appendix A, the code's ``eval.py`` / ``utils/core.py``): the
  query set streams in a shuffled order (seeded by (seed, round): each evaluation starts afresh) in batches of 18.
  A batch is predicted with the text prototypes (frozen prompts, no residual) until every class has a visual
  prototype, then with the centroids of the batches before it by the code's score ``z'·(p_c + q̄_c)`` (default
  ``combine="sum"``: ``eval.py:149-154`` with ``utils/core.py:19``, the text prototype plus the un-normalised running
  mean of the unit features), or the paper's Eq. 12, ``cos(z', p_c) + cos(z', q̄_c)`` (``combine="cos"``). After the
  batch, every sample whose entropy is below ``ε · ln N_test`` joins its pseudo-class's running centroid. Reading of
  ε (``uncertainty``): a fraction of the maximum entropy ``ln N_test`` (the code's ``get_threshold``,
  ``utils/core.py:23-28``, and Appendix A's "x % of the maximum entropy"); 0.1 is the code's default
  (``eval.py:43``); Appendix A uses 0.2 for Caltech / UCF / Flowers, 0.3 for FGVC / Food, 0.1 for Cars, which
  ``--preset`` applies (``fedfeat.partition.openvocab.PRESETS``; ``--set uncertainty=...`` wins). The
  pseudo-label and its entropy are the adapted CLIP's text-only prediction (Eq. 11, Algorithm 2 line 8: "the
  original pseudo prediction"); the code uses the batch's prediction itself (``pseudo_label="prediction"``). The
  entropy is computed stably (``p log p`` as 0 where ``p`` underflows; the code's NaN there drops the sample).
  The same procedure runs for the base accuracy (``classes = base``): it is the method's way to predict.

Image features reach the adapter unnormalised by default (``normalize=False``: the code feeds
``get_image_features``, the projected but unnormalised CLIP embedding) and are normalised after the product.
The code trains under fp16 autocast; here the store's dtype (float32) is used.

*Local model selection* (fed-mp). The code validates every local epoch on the client's held-out shots and means to
keep the best epoch's adapter, but ``client_utils.py:105`` resets ``adapter_state_dict = None`` inside the epoch loop,
so ``:113-117`` always returns the final epoch's: the default, ``local_select="final"``, uploads the final local
adapter. ``local_select="best-val"`` is the intended reading: after every local epoch each client scores its adapter
on its validation shots (``ctx.open_vocab.val_x``, the ``--local-val`` split) over its own classes against its
perturbed prompts ``t_c + α δ_c`` (``client_utils.py:121-167``), and uploads the adapter of the first epoch with the
best accuracy (``acc > best_acc``, ``best_acc`` starting at 0: an all-zero client keeps its final epoch,
``:106, 113``); the residuals are always the final ones (the code keeps only ``img_adap``, ``:109-111``). All
clients are scored at once (``[n, V, D]`` batches).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F

from fedfeat.engine import rng
from fedfeat.engine.context import Batch, Context, RoundPlan, fedavg, masked_mean
from fedfeat.engine.optim import BatchedAdam, BatchedAdamW
from fedfeat.errors import FedfeatError
from fedfeat.methods.base import Method, register

# stream tags of this module (fedfeat.engine.rng's are 1..5; these stay clear of them)
TAG_ADAPTER_INIT = 201
TAG_RESIDUAL = 202
TAG_QUERY_ORDER = 203

ADAPTER = ("W1", "b1", "W2", "b2")


@dataclass(frozen=True)
class FedCLIPParams:
    local_epochs: int = 2  # Fed-MP train.py --local_ep 2 (paper App. A: 2 local epochs)
    batch_size: int = 18  # Fed-MP train.py --batch_size 18
    lr: float = (
        5e-5  # Fed-MP train.py --lr (paper App. A says 1e-5 with AdamW; the code's Adam is the default)
    )
    beta1: float = 0.9  # Fed-MP train.py --beta1
    beta2: float = 0.98  # Fed-MP train.py --beta2
    eps: float = 1e-6  # Fed-MP train.py --eps
    weight_decay: float = 0.2  # Fed-MP train.py --weight_decay; torch.optim.Adam's L2 (added to the gradient)
    optimizer: Literal["adam", "adamw"] = (
        "adam"  # code: torch.optim.Adam (client_utils.py:184); "adamw": paper App. A (decoupled decay)
    )
    adapter: Literal["product", "sum"] = (
        "product"  # paper Eq. 3 and code: f_A(z) ⊙ z; "sum": Algorithm 1 line 9
    )
    normalize: bool = False  # engine-side L2 normalisation of image features; code: raw get_image_features
    templates: Literal["first", "ensemble"] = "first"  # Fed-MP prompts one template ("A photo of {c}.")
    # the server's weights: "size" (FedAvg by client samples); "uniform": FedCLIP's own code, client_weights =
    # 1 / (clients - held-out domains) (PersonalizedFL fedclip/methods/fed_at_clip.py:158-159, communication)
    aggregation: Literal["size", "uniform"] = "size"

    def validate(self) -> None:
        if self.local_epochs < 1 or self.batch_size < 1:
            raise FedfeatError(
                f"local_epochs and batch_size must be >= 1, got {self.local_epochs} and {self.batch_size}; "
                "e.g. --set batch_size=18"
            )
        if self.lr <= 0 or self.eps <= 0 or self.weight_decay < 0:
            raise FedfeatError(
                f"lr and eps must be > 0 and weight_decay >= 0, got {self.lr}, {self.eps}, {self.weight_decay}; "
                "e.g. --set lr=5e-5"
            )
        if not (0 <= self.beta1 < 1 and 0 <= self.beta2 < 1):
            raise FedfeatError(f"beta1 and beta2 must be in [0, 1), got {self.beta1} and {self.beta2}")


def adapter_init(seed: int, D: int, dtype=torch.float32, device="cpu") -> dict[str, torch.Tensor]:
    """``nn.Linear``'s default init for both layers (weights and biases uniform(±1/√D)), from a seeded stream."""
    g = rng.generator(seed, TAG_ADAPTER_INIT)
    bound = 1 / math.sqrt(D)
    shapes = {"W1": (D, D), "b1": (D,), "W2": (D, D), "b2": (D,)}
    return {
        k: ((torch.rand(s, generator=g, dtype=torch.float64) * 2 - 1) * bound).to(device=device, dtype=dtype)
        for k, s in shapes.items()
    }


def adapt(params: dict, x: torch.Tensor, mode: str = "product") -> torch.Tensor:
    """The adapted, normalised image features: ``x  # [n, B, D]`` with per-client adapters ``W  # [n, D, D]``
    (``bmm``), or ``x  # [N, D]`` with one adapter ``[D, D]`` -> same shape as ``x``."""
    h = torch.tanh(x @ params["W1"].transpose(-1, -2) + params["b1"].unsqueeze(-2))
    a = torch.softmax(h @ params["W2"].transpose(-1, -2) + params["b2"].unsqueeze(-2), dim=-1)
    return F.normalize(a * x if mode == "product" else x + a, dim=-1)


def clip_loss(logits: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Symmetric in-batch InfoNCE per client over its real samples: ``logits  # [n, B, B]`` (image i x text j),
    ``mask  # [n, B]`` -> ``[n]`` = (mean_i CE(row i, i) + mean_j CE(column j, j)) / 2. Padded rows and columns
    take no part (their logits are pushed to -1e9: exp gives exactly 0, and their own terms are masked out)."""
    both = mask.unsqueeze(2) & mask.unsqueeze(1)
    lm = logits.masked_fill(~both, -1e9)
    diag = logits.diagonal(dim1=1, dim2=2)  # [n, B]
    ce = (lm.logsumexp(2) - diag) + (lm.logsumexp(1) - diag)
    return masked_mean(ce, mask) / 2


def xi_weights(xi: torch.Tensor, mode: str) -> torch.Tensor:
    """Aggregation weights from the similarities ``xi  # [m]``: ``softmax`` (paper Eq. 9) or ``linear`` ξ/Σξ (code).

    >>> xi_weights(torch.tensor([0.2, 0.6]), "linear").tolist()
    [0.25, 0.75]
    """
    return torch.softmax(xi, 0) if mode == "softmax" else xi / xi.sum()


def entropy(logits: torch.Tensor) -> torch.Tensor:
    """``[N, K]`` logits -> ``[N]`` entropy of their softmax (0 · log 0 taken as 0)."""
    logp = torch.log_softmax(logits, -1)
    return -(logp.exp() * logp).sum(-1)


def prototype_stream(
    z: torch.Tensor,
    text: torch.Tensor,
    order: torch.Tensor,
    *,
    scale: float,
    batch: int,
    threshold: float,
    combine: str = "sum",
    pseudo_label: str = "text",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Multimodal prototyping over one query stream (Eqs. 10-13): ``z  # [N, D]`` adapted unit features, ``text  # [K, D]``
    unit text prototypes, ``order  # [N]`` the stream order -> ``pred  # [N]`` class indices (into ``text``), and the
    final ``centroids  # [K, D]`` (0 where empty) and ``counts  # [K]``.

    Batch by batch: predict with the text prototypes while some class has no visual sample, else by
    ``z·(p + q̄)`` (``combine="sum"``, the code) or ``cos(z, p) + cos(z, q̄)`` (``"cos"``, Eq. 12); then every sample
    whose entropy (of ``scale``· the pseudo-label scores) is below ``threshold`` is added to its pseudo-class's
    running centroid (``q̄ = Σ q / |Q|``, Eq. 13 / Appendix A). No host sync per batch."""
    K = text.shape[0]
    sums = torch.zeros_like(text)  # [K, D] Σ q per class
    counts = torch.zeros(K, dtype=z.dtype, device=z.device)
    pred = torch.empty(len(order), dtype=torch.int64, device=z.device)
    tcos = z @ text.T  # [N, K] cos(z', p_c)
    for s in range(0, len(order), batch):
        idx = order[s : s + batch]
        zb, tb = z[idx], tcos[idx]
        cent = sums / counts.clamp_min(1).unsqueeze(1)  # [K, D] q̄ (0 where empty)
        if combine == "cos":
            mm = tb + zb @ F.normalize(cent, dim=-1).T
        else:
            mm = tb + zb @ cent.T
        ready = (counts > 0).all()
        score = torch.where(ready, mm, tb)  # [b, K]
        p = score.argmax(1)
        pred[idx] = p
        pl_score = tb if pseudo_label == "text" else score
        pl = pl_score.argmax(1)
        keep = (entropy(scale * pl_score) < threshold).to(z.dtype)  # [b]
        sums.index_add_(0, pl, zb * keep.unsqueeze(1))
        counts.index_add_(0, pl, keep)
    return pred, sums / counts.clamp_min(1).unsqueeze(1), counts


@register
class FedCLIP(Method):
    """FedCLIP (Lu et al. 2023; Fed-MP's baseline): an attention adapter on image features, CLIP loss, FedAvg."""

    name = "fedclip"
    shardable = True  # torchrun may shard its clients
    dp_client = True  # DP-FedAvg: the server step runs on the noised mean of the clipped updates
    no_stack_reason = (
        "an adapter MLP, not a {W, b} head; its hooks read hyperparameters as scalars (self.p), so stacking would "
        "need per-client hyperparameter tensors in fedmp.py"
    )
    Params = FedCLIPParams
    uses_labels = True

    def init_global(self, ctx: Context) -> dict[str, torch.Tensor]:
        return adapter_init(ctx.seed, ctx.D, ctx.text.dtype, ctx.device)

    def make_optimizer(self, rnd: int):
        p = self.p
        opt = BatchedAdamW if p.optimizer == "adamw" else BatchedAdam
        return opt(lr=p.lr, betas=(p.beta1, p.beta2), eps=p.eps, weight_decay=p.weight_decay)

    def batch_text(self, ctx: Context, params: dict, batch: Batch) -> torch.Tensor:
        """``[n, B, D]`` each sample's (unit) class text feature."""
        return ctx.text[batch.y]

    def step_loss(self, ctx, params, batch, local):
        z = adapt(params, batch.x, self.p.adapter)  # [n, B, D]
        t = self.batch_text(ctx, params, batch)  # [n, B, D]
        logits = ctx.clip_logit_scale * torch.bmm(z, t.transpose(1, 2))  # [n, B, B]
        return clip_loss(logits, batch.mask)

    def predict(self, ctx: Context, glob: dict, x: torch.Tensor) -> torch.Tensor:
        return ctx.clip_logit_scale * adapt(glob, x, self.p.adapter) @ ctx.text.T

    def aggregate(self, ctx: Context, plan, glob: dict, cparams: dict) -> dict:
        """FedAvg of the adapters, by client size or uniformly (``aggregation``)."""
        w = plan.sizes if self.p.aggregation == "size" else torch.ones_like(plan.sizes)
        return fedavg(cparams, w.to(ctx.device))


@dataclass(frozen=True)
class FedMPParams(FedCLIPParams):
    alpha: float = 0.3  # residual scale α (paper Eq. 4; train.py --alpha 0.3)
    residual_init: float = 5.0  # δ ~ uniform(-r, r) (nets/model.py: nn.init.uniform_(task_res, -5, 5))
    residual_draw: Literal["shared", "per-client"] = (
        "shared"  # code: one seeded block for all; ours: per (round, client)
    )
    adaptive: bool = True  # adaptive aggregation (paper §4.3); False = FedAvg by size (Table 2 "w/o A.A.")
    weights: Literal["softmax", "linear"] = "softmax"  # paper Eq. 9 softmax(ξ); "linear": code's ξ / Σ ξ
    prototyping: bool = (
        True  # multimodal prototyping (paper §4.4); False = text prototypes (Table 2 "w/o M.P.")
    )
    uncertainty: float = 0.1  # ε: threshold ε · ln N_test (eval.py --uncertainty 0.1; App. A: 0.1 to 0.3)
    combine: Literal["sum", "cos"] = "sum"  # code z·(p + q̄) (eval.py:153, core.py:19); "cos": paper Eq. 12
    pseudo_label: Literal["text", "prediction"] = "text"  # paper Eq. 11 text-only; "prediction": the code's
    test_batch_size: int = 18  # query stream batch (eval.py --batch_size 18)
    local_select: Literal["final", "best-val"] = (
        "final"  # code's effective (client_utils.py:105, 113); "best-val": its intent, best local-val epoch
    )

    def validate(self) -> None:
        super().validate()
        if self.alpha < 0 or self.residual_init < 0 or self.uncertainty < 0 or self.test_batch_size < 1:
            raise FedfeatError(
                "alpha, residual_init and uncertainty must be >= 0 and test_batch_size >= 1, got "
                f"{self.alpha}, {self.residual_init}, {self.uncertainty}, {self.test_batch_size}; e.g. --set alpha=0.3"
            )


@register
class FedMP(FedCLIP):
    """Fed-MP (Zeng et al. 2024): FedCLIP + client residuals, adaptive aggregation, multimodal prototyping."""

    name = "fed-mp"
    state_keys = {
        "eval_round": "server: int, the round whose weights the next evaluation sees (its test query order)",
        "agg_weights": "server: {client id (str): weight} the last round's adaptive aggregation weights (adaptive)",
    }
    shardable = True
    no_stack_reason = (
        "FedCLIP's adapter MLP, not a {W, b} head, with per-client residuals and a keep-if-better local validation; "
        "its hooks read hyperparameters as scalars (self.p)"
    )
    Params = FedMPParams

    def setup(self, ctx: Context) -> None:
        if ctx.open_vocab is None:
            raise FedfeatError(
                "fed-mp is an open-vocabulary method: run it with --partition disjoint-classes "
                "(fedclip runs in either setting)"
            )
        ctx.state["eval_round"] = 0  # the round whose weights the next evaluation sees (its query order)
        if self.p.local_select == "best-val" and len(ctx.open_vocab.val_y) == 0:
            raise FedfeatError(
                "fed-mp local_select=best-val scores each local epoch on the clients' validation shots, and this "
                "run has none; run with --local-val paper or code, or --set local_select=final"
            )

    def text_raw(self, ctx: Context) -> torch.Tensor:
        return ctx.text_raw if ctx.text_raw is not None else ctx.text

    def residual_block(self, ctx: Context, rows: int, *key: int) -> torch.Tensor:
        g = rng.generator(ctx.seed, TAG_RESIDUAL, *key)
        r = self.p.residual_init
        u = torch.rand((rows, ctx.D), generator=g, dtype=torch.float64) * (2 * r) - r
        return u.to(device=ctx.device, dtype=ctx.text.dtype)

    def trainable_count(self, ctx: Context, plan: RoundPlan, cparams: dict) -> int:
        """The adapter plus a client's own residual rows: ``k_c x D`` for its ``k_c`` classes (``res`` is padded to
        the largest client's class count), the mean over the round's clients, rounded."""
        if not plan.m:
            return 0
        shared = sum(v[0].numel() for k, v in cparams.items() if k != "res")
        ks = [len(ctx.open_vocab.client_classes[int(c)]) for c in plan.clients]
        return int(shared + round(sum(ks) / len(ks) * ctx.D))

    def local_params(self, ctx: Context, plan: RoundPlan) -> dict[str, torch.Tensor]:
        """``res  # [m, Kc, D]``: the clients' residuals δ, fresh each round (never aggregated)."""
        Kc = max(len(c) for c in ctx.open_vocab.client_classes)
        if self.p.residual_draw == "shared":
            return {"res": self.residual_block(ctx, Kc).expand(plan.m, Kc, ctx.D).contiguous()}
        blocks = [self.residual_block(ctx, Kc, plan.rnd, int(c)) for c in plan.clients]
        return {"res": torch.stack(blocks)}

    # ---- local model selection (local_select="best-val")
    def local_begin(self, ctx: Context, plan: RoundPlan, glob: dict) -> dict:
        """For ``best-val``: the plan's clients' validation shots ``[m, V, D]`` (mask ``[m, V]``, labels as indices
        into the client's class list), their class ids ``[m, Kc]`` (mask), and the best score so far."""
        if self.p.local_select != "best-val":
            return {}
        ov = ctx.open_vocab
        dev, m = ctx.device, plan.m
        offs = ov.val_offsets.tolist()
        rows = [torch.arange(offs[int(c)], offs[int(c) + 1]) for c in plan.clients]
        V = max(1, max(len(r) for r in rows))
        Kc = max(len(c) for c in ov.client_classes)
        x = torch.zeros(m, V, ctx.D, dtype=ov.val_x.dtype, device=dev)
        y = torch.zeros(m, V, dtype=torch.int64, device=dev)
        vmask = torch.zeros(m, V, dtype=torch.bool, device=dev)
        ids = torch.zeros(m, Kc, dtype=torch.int64, device=dev)
        cmask = torch.zeros(m, Kc, dtype=torch.bool, device=dev)
        for j, (c, r) in enumerate(zip(plan.clients.tolist(), rows)):  # once per round, not per step
            cls = ov.client_classes[c].to(dev)
            ids[j, : len(cls)], cmask[j, : len(cls)] = cls, True
            r = r.to(ov.val_x.device)
            x[j, : len(r)], vmask[j, : len(r)] = ov.val_x[r].to(dev), True
            y[j, : len(r)] = (ov.val_y[r].to(dev).unsqueeze(1) == cls.unsqueeze(0)).to(torch.int64).argmax(1)
        acc0 = torch.zeros(m, dtype=torch.float64, device=dev)
        return {"val": (x, y, vmask, ids, cmask), "best_acc": acc0, "best": None}

    @torch.no_grad()
    def local_val_acc(self, ctx: Context, params: dict, local: dict, n: int) -> torch.Tensor:
        """``[n]`` each client's accuracy on its validation shots: argmax over its own classes of
        ``z' · normalise(t_c + α δ_c)`` (the code's ``validate``, ``client_utils.py:121-167``)."""
        x, y, vmask, ids, cmask = (t[:n] for t in local["val"])
        z = adapt({k: params[k][:n] for k in ADAPTER}, x, self.p.adapter)  # [n, V, D]
        res = params["res"][:n, : ids.shape[1]]
        t = F.normalize(self.text_raw(ctx)[ids] + self.p.alpha * res, dim=-1)  # [n, Kc, D]
        logits = torch.bmm(z, t.transpose(1, 2)).masked_fill(~cmask.unsqueeze(1), -torch.inf)
        hit = (logits.argmax(-1) == y) & vmask
        return hit.sum(1).double() / vmask.sum(1).clamp_min(1).double()

    def keep_if_better(self, ctx: Context, params: dict, local: dict, n: int) -> None:
        """After a local epoch: clients ``[:n]`` whose adapter scores above their best so far keep a copy of it."""
        acc = self.local_val_acc(ctx, params, local, n)
        if local["best"] is None:
            # all m rows: a row never scored keeps best_acc 0, and so its final adapter
            m = local["best_acc"].shape[0]
            local["best"] = {k: params[k].new_zeros((m, *params[k].shape[1:])) for k in ADAPTER}
        better = acc > local["best_acc"][:n]
        for k in ADAPTER:
            b = local["best"][k][:n]
            b.copy_(torch.where(better.view(-1, *[1] * (b.dim() - 1)), params[k][:n].detach(), b))
        local["best_acc"][:n] = torch.where(better, acc, local["best_acc"][:n])

    def step_loss(self, ctx, params, batch, local):
        if "val" in local and batch.step == 0 and batch.epoch > 0:  # params as the previous epoch left them
            self.keep_if_better(ctx, params, local, batch.n)
        return super().step_loss(ctx, params, batch, local)

    @torch.no_grad()
    def local_end(self, ctx, plan, local, params):
        if "val" not in local or local["best"] is None:  # final, or one local epoch: nothing to choose
            return
        acc = self.local_val_acc(ctx, params, local, plan.m)
        final = (acc > local["best_acc"]) | (local["best_acc"] <= 0)  # code: no better epoch -> the final one
        for k in ADAPTER:
            params[k].copy_(
                torch.where(final.view(-1, *[1] * (params[k].dim() - 1)), params[k], local["best"][k])
            )

    def batch_text(self, ctx, params, batch):
        li = ctx.open_vocab.local_index[batch.pos]  # [n, B] residual row of each sample
        res = params["res"]  # [n, Kc, D]
        r = torch.gather(res, 1, li.unsqueeze(-1).expand(-1, -1, res.shape[-1]))
        return F.normalize(self.text_raw(ctx)[batch.y] + self.p.alpha * r, dim=-1)

    def perturbed_text(self, ctx: Context, plan: RoundPlan, res: torch.Tensor):
        """What the clients upload (Eq. 6): ``[m, Kc, D]`` unit ``t_c + α δ_c`` and its ``[m, Kc]`` mask."""
        cls = [ctx.open_vocab.client_classes[int(c)] for c in plan.clients]
        ids = torch.zeros(res.shape[:2], dtype=torch.int64, device=res.device)
        mask = torch.zeros(res.shape[:2], dtype=torch.bool, device=res.device)
        for j, c in enumerate(cls):
            ids[j, : len(c)] = c
            mask[j, : len(c)] = True
        return F.normalize(self.text_raw(ctx)[ids] + self.p.alpha * res, dim=-1), mask

    def similarities(self, ctx: Context, plan: RoundPlan, res: torch.Tensor) -> torch.Tensor:
        """``ξ  # [m]`` (Eq. 8): mean cosine between the novel prompts and each client's perturbed prompts."""
        L, mask = self.perturbed_text(ctx, plan, res)
        g = ctx.text[ctx.open_vocab.novel].mean(0)  # [D] mean of unit novel prompts: mean_g cos = ḡ · L
        return masked_mean(L @ g, mask)

    def aggregate(self, ctx, plan, glob, cparams):
        adapter = {k: cparams[k] for k in ADAPTER}
        if not self.p.adaptive:
            w = plan.sizes if self.p.aggregation == "size" else torch.ones_like(plan.sizes)
            return fedavg(adapter, w.to(ctx.device))
        w = xi_weights(self.similarities(ctx, plan, cparams["res"]), self.p.weights)
        ctx.state["agg_weights"] = dict(zip(map(str, plan.clients.tolist()), w.tolist()))
        return fedavg(adapter, w)

    def server_update(self, ctx, plan, old, new):
        ctx.state["eval_round"] = plan.rnd
        return new

    def upload_bytes(self, ctx, plan, cparams):
        adapter = sum(cparams[k].numel() * cparams[k].element_size() for k in ADAPTER)
        n_text = sum(len(ctx.open_vocab.client_classes[int(c)]) for c in plan.clients)
        return int(adapter + n_text * ctx.D * cparams["res"].element_size())

    def predict_classes(self, ctx, glob, x, classes):
        if not self.p.prototyping:
            return super().predict_classes(ctx, glob, x, classes)
        z = adapt(glob, x, self.p.adapter)  # [N, D]
        key = rng.stream_key(ctx.seed, int(ctx.state.get("eval_round", 0)), TAG_QUERY_ORDER)
        order = torch.argsort(rng.uniform_keys(key, torch.arange(len(x), device=x.device)))
        pred, _, _ = prototype_stream(
            z, ctx.text[classes], order, scale=ctx.clip_logit_scale, batch=self.p.test_batch_size,
            threshold=self.p.uncertainty * math.log(len(classes)), combine=self.p.combine,
            pseudo_label=self.p.pseudo_label,
        )  # fmt: skip
        return classes[pred]

    def round_metrics(self, ctx, data, glob, ev):
        return {"agg_weights": ctx.state.get("agg_weights")} if self.p.adaptive else {}

"""Prompt learning through the live text encoder: PromptFL and its unsupervised (pseudo-labelled) modes, and
FedTPG (a prompt generator shared by the clients; its section below).

**promptfl** (Guo et al., "PromptFL: Let Federated Participants Cooperatively Learn Prompts Instead of Models",
IEEE TMC 2023; the baseline of Fed-MP's and FedCoPL's tables): every client trains CoOp context vectors
(``fedfeat.encoders.prompt``; Zhou et al. IJCV 2022) on its labelled data with the frozen CLIP, the server averages them
(FedAvg weighted by client sample counts). Image features come from the store (they do not depend on the
prompt); only the ``K`` class prompts go through the text tower, once per step for all active clients. The loss
is CoOp's: cross-entropy of ``logit_scale · cos(image, prompt_k)`` with CLIP's own logit scale.

Defaults (each field names its source): CoOp's optimiser (``configs/trainers/CoOp/*.yaml`` + Dassl: SGD lr 0.002,
momentum 0.9, weight decay 5e-4, batch 32, cosine schedule), 16 unified context tokens initialised N(0, 0.02),
class token at the end; 5 local epochs per round (PromptFL's ViT-B/16 config, ``PEILab-Federated-Learning/
PromptFL`` ``configs/trainers/CoOp/vit_b16_ep50.yaml``; its configs use lr 0.001). The cosine schedule runs over the
federated rounds (one value per round; the optimiser state is made anew for each client each round, as FedAvg
clients do). PromptFL's code instead shares one optimiser and one ``CosineAnnealingLR(T_max=local epochs)`` across
all clients and rounds, stepped per local epoch, so its learning rate oscillates and momentum leaks from client to
client -- a quirk not reproduced. CoOp's one warm-up epoch at a constant 1e-5 is ``warmup_rounds`` (default 0: a
warm-up round at 1e-5 would be a wasted round of communication). Aggregation is FedAvg by client size (PromptFL's
paper); ``aggregation="mean"`` is its code's unweighted ``average_weights`` (without the code's bug of also
averaging every earlier round's client weights: its list is never cleared).

**Unsupervised mode** (``pseudo=fpl|cpl``; FedCoPL's FPL / CPL baselines, whose federated versions are
unreleased): the method never reads labels (``uses_labels`` is False: the engine hands it none). At setup every
client pseudo-labels its own data with zero-shot CLIP (the store's first template) through a reusable
pseudo-labeller of ``fedfeat.methods.pseudolabel``; its selected samples become its training set (aggregation weights are
the selected-set sizes, as FedCoPL weights by them) and the loss is CE on hard labels (FPL) or CPL's
candidate-set loss ``-log Σ_{j∈S} p_j`` (``cc``). Pseudo-labels are fixed for the run (FPL's static labels; CPL
refreshes its candidate sets with the trained model during training, which this mode does not yet do: a
documented deviation). ``round_metrics`` reports the pseudo-labels' accuracy (``pseudo_label_acc``; for CPL:
the share of samples whose candidate set holds the true class) against the true labels.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F

from fedfeat.engine import rng
from fedfeat.engine.context import Batch, Context, RoundPlan, fedavg, masked_mean
from fedfeat.errors import FedfeatError
from fedfeat.methods.base import register
from fedfeat.methods.prompt import (  # noqa: F401  (re-exported: promptfl.PromptParams ...)
    TAG_CTX_INIT,
    PromptFLParams,
    PromptMethod,
    PromptParams,
    pseudo_label,
    round_lr,
)


@register
class PromptFL(PromptMethod):
    """PromptFL (Guo et al. 2023): CoOp text prompts trained through the live text encoder, FedAvg of contexts."""

    name = "promptfl"
    shardable = True  # torchrun may shard its clients (pseudo-labels are fixed at set-up on every rank)
    Params = PromptFLParams
    uses_labels = True

    def __init__(self, params):
        super().__init__(params)
        self.uses_labels = self.pseudo == "none"  # the unsupervised modes never see labels

    @property
    def pseudo(self) -> str:
        return getattr(self.p, "pseudo", "none")

    def setup(self, ctx: Context) -> None:
        super().setup(ctx)
        if self.pseudo != "none":
            pseudo_label(ctx, self.pseudo, self.p)

    def init_global(self, ctx: Context) -> dict[str, torch.Tensor]:
        p = self.p
        g = rng.generator(ctx.seed, TAG_CTX_INIT)
        return {"ctx": self.learner.init_context(g, csc=p.csc, phrase=p.ctx_init, std=p.ctx_std)}

    def step_loss(self, ctx: Context, params: dict, batch: Batch, local: dict) -> torch.Tensor:
        logits = self.logits(ctx, params, batch.x)  # [n, B, K]
        n, B, K = logits.shape
        if self.pseudo == "cpl":
            from fedfeat.methods.pseudolabel import cc_loss

            loss = cc_loss(logits, ctx.state["pseudo_candidates"][batch.pos], batch.mask)  # [n, B]
        else:
            y = batch.y if self.pseudo == "none" else ctx.state["pseudo_labels"][batch.pos]
            loss = F.cross_entropy(logits.reshape(n * B, K), y.reshape(-1), reduction="none").view(n, B)
        return masked_mean(loss, batch.mask)

    def aggregate(self, ctx: Context, plan: RoundPlan, glob: dict, cparams: dict) -> dict:
        w = plan.sizes.to(ctx.device)
        if int(w.sum()) == 0:  # no sampled client holds a (pseudo-labelled) sample
            return glob
        if self.p.aggregation == "mean":  # every sampled client that trained counts alike
            w = (w > 0).to(w.dtype)
        return fedavg(cparams, w)

    def round_metrics(self, ctx: Context, data, glob: dict, ev: dict) -> dict:
        if self.pseudo == "none" or "pseudo_rows" not in ctx.state:
            return {}
        rows = ctx.state["pseudo_rows"]
        truth = data.train_y[rows.to(data.train_y.device)]
        out = {"pseudo_samples": len(rows)}
        if self.pseudo in ("fpl", "copl"):
            out["pseudo_label_acc"] = 100 * float(
                (ctx.state["pseudo_labels"].to(truth.device) == truth).double().mean()
            )
        else:
            cand = ctx.state["pseudo_candidates"].to(truth.device)
            out["pseudo_label_acc"] = 100 * float(cand[torch.arange(len(truth)), truth].double().mean())
            out["pseudo_set_size"] = float(cand.sum(1).double().mean())
        return out


# ---------------------------------------------------------------------------------------- FedTPG
# FedTPG (Qiu et al., "Federated Text-driven Prompt Generation for Vision-Language Models", ICLR 2024; Fed-MP's
# baseline), following the public code ``boschresearch/FedTPG`` (``model/prompt_net.py``, ``model/FedTPG.py``,
# ``federated/server.py``, ``federated/client.py``, ``config/defaults.py``, ``Launch_FL.py``).
#
# A *prompt generator* shared by all clients maps the class names' text embeddings to CoOp context vectors:
#
# * input: the frozen, L2-normalised text features of the bare class names (``clip.tokenize(classname)``, no
#   template), ``[Kc, D]``, computed once through the live tower;
# * ``PromptTranslator``: learnable queries ``soft_prompt  # [n_ctx, W]`` (N(0, 0.02)) cross-attend to them --
#   ``x = MHA(LN(q), LN_ctx(e), LN_ctx(e))`` (4 heads, ``kdim = vdim = D``, **no residual** around the cross
#   attention, as the code), then ``x = FF(x) + x`` with ``FF = LN -> Linear(W, 8W) -> GEGLU -> Linear(4W, W)``;
#   then ``depth`` self-attention blocks (pre-norm, residual; the code's default depth is 0);
# * the ``n_ctx`` outputs are the unified context of every class's prompt ``[SOS] ctx {class}. [EOS]`` (depth 1:
#   text prompts only), encoded by the frozen text tower; loss CE at CLIP's logit scale.
#
# Clients train the generator with SGD (lr 0.003, momentum 0.9, weight decay 1e-5, cosine over the rounds; batch 200,
# one local epoch per round: ``config/defaults.py`` and ``Launch_FL.py``) and the server averages the generators
# **unweighted** (``server.py``: ``w_glob[k] / num_selected``; ``aggregation="size"`` weights by sample counts).
#
# Deviations, each named: the generator runs in float32 (the code calls ``meta_net.half()``); the code keeps one
# optimizer and scheduler per client across rounds (momentum carried between a client's rounds), here each client
# starts each round with a fresh optimizer at the round's cosine learning rate, as FedAvg clients do; the
# generator's context is the run's vocabulary (all classes: fedfeat's closed partitions give every client the same
# label space; FedTPG's own split gives each client 20 classes of its own -- the open-vocabulary
# ``disjoint-classes`` runs, where each client would see only its classes, are not supported yet).

TAG_GENERATOR_INIT = 302


@dataclass(frozen=True)
class FedTPGParams(PromptParams):
    local_epochs: int = 1  # client.py: one pass over the train loader per round
    batch_size: int = 200  # Launch_FL.py --batch_size 200
    lr: float = 0.003  # config/defaults.py OPTIM.LR
    momentum: float = 0.9  # OPTIM.MOMENTUM
    weight_decay: float = 1e-5  # OPTIM.WEIGHT_DECAY
    n_ctx: int = 4  # Launch_FL.py --n_ctx 4 (MODEL.N_CTX)
    depth: int = 0  # Launch_FL.py --model_depth 0: self-attention blocks after the cross attention
    heads: int = 4  # PromptTranslator cross_heads = self_heads = 4
    ff_mult: int = 4  # FeedForward mult 4 (GEGLU: Linear(W, 2·4W))
    aggregation: Literal["size", "mean"] = "mean"  # server.py: unweighted mean; "size": FedAvg by samples

    def validate(self) -> None:
        super().validate()
        if self.csc or self.ctx_init:
            raise FedfeatError(
                "fedtpg generates its contexts: csc and ctx_init do not apply; drop those --set keys"
            )
        if self.depth < 0 or self.heads < 1 or self.ff_mult < 1:
            raise FedfeatError(
                f"need depth >= 0, heads >= 1, ff_mult >= 1, got {self.depth}, {self.heads}, {self.ff_mult}"
            )


def _uniform(g, shape, bound, dtype, device):
    return ((torch.rand(shape, generator=g, dtype=torch.float64) * 2 - 1) * bound).to(
        device=device, dtype=dtype
    )


def _attn_init(g, pre: str, W: int, kv: int, dtype, device) -> dict:
    """``nn.MultiheadAttention(W, kdim=kv, vdim=kv)``'s init: xavier-uniform projections (one ``[3W, W]`` block
    when ``kv == W``), zero in-projection and output biases, the output weight ``uniform(±1/√W)``."""
    z = {}
    if kv == W:
        b = math.sqrt(6 / (W + 3 * W))
        qkv = _uniform(g, (3 * W, W), b, dtype, device)
        z[pre + "Wq"], z[pre + "Wk"], z[pre + "Wv"] = (
            qkv[:W].clone(),
            qkv[W : 2 * W].clone(),
            qkv[2 * W :].clone(),
        )
    else:
        z[pre + "Wq"] = _uniform(g, (W, W), math.sqrt(6 / (2 * W)), dtype, device)
        z[pre + "Wk"] = _uniform(g, (W, kv), math.sqrt(6 / (W + kv)), dtype, device)
        z[pre + "Wv"] = _uniform(g, (W, kv), math.sqrt(6 / (W + kv)), dtype, device)
    z[pre + "bqkv"] = torch.zeros(3 * W, dtype=dtype, device=device)
    z[pre + "Wo"] = _uniform(g, (W, W), 1 / math.sqrt(W), dtype, device)
    z[pre + "bo"] = torch.zeros(W, dtype=dtype, device=device)
    return z


def _ln_init(pre: str, dim: int, dtype, device) -> dict:
    return {
        pre + "w": torch.ones(dim, dtype=dtype, device=device),
        pre + "b": torch.zeros(dim, dtype=dtype, device=device),
    }


def _ff_init(g, pre: str, W: int, mult: int, dtype, device) -> dict:
    z = _ln_init(pre + "ln_", W, dtype, device)
    z[pre + "W1"] = _uniform(g, (2 * mult * W, W), 1 / math.sqrt(W), dtype, device)
    z[pre + "b1"] = _uniform(g, (2 * mult * W,), 1 / math.sqrt(W), dtype, device)
    z[pre + "W2"] = _uniform(g, (W, mult * W), 1 / math.sqrt(mult * W), dtype, device)
    z[pre + "b2"] = _uniform(g, (W,), 1 / math.sqrt(mult * W), dtype, device)
    return z


def generator_init(seed: int, n_ctx: int, W: int, D: int, depth: int, mult: int, dtype, device) -> dict:
    """The generator's parameters (names flat, no client axis), as ``PromptTranslator.__init__`` draws them."""
    g = rng.generator(seed, TAG_GENERATOR_INIT)
    z = {
        "soft_prompt": (torch.randn(n_ctx, W, generator=g, dtype=torch.float64) * 0.02).to(
            device=device, dtype=dtype
        )
    }
    z |= _ln_init("x_ln_", W, dtype, device) | _ln_init("x_lnctx_", D, dtype, device)
    z |= _attn_init(g, "x_", W, D, dtype, device) | _ff_init(g, "x_ff_", W, mult, dtype, device)
    for i in range(depth):
        z |= _ln_init(f"s{i}_ln_", W, dtype, device) | _attn_init(g, f"s{i}_", W, W, dtype, device)
        z |= _ff_init(g, f"s{i}_ff_", W, mult, dtype, device)
    return z


def _ln(x, P, pre):  # per-client LayerNorm: x [n, L, C], weight/bias [n, C]
    y = F.layer_norm(x, x.shape[-1:], eps=1e-5)
    return y * P[pre + "w"].unsqueeze(1) + P[pre + "b"].unsqueeze(1)


def _mha(q_in, kv_in, P, pre: str, heads: int):
    """Batched ``nn.MultiheadAttention`` (no dropout, no mask): ``q_in  # [n, Lq, W]``, ``kv_in  # [n, Lk, C]``."""
    n, Lq, W = q_in.shape
    b = P[pre + "bqkv"]
    q = torch.baddbmm(b[:, None, :W], q_in, P[pre + "Wq"].transpose(1, 2))
    k = torch.baddbmm(b[:, None, W : 2 * W], kv_in, P[pre + "Wk"].transpose(1, 2))
    v = torch.baddbmm(b[:, None, 2 * W :], kv_in, P[pre + "Wv"].transpose(1, 2))
    dh = W // heads
    q, k, v = (t.view(n, -1, heads, dh).transpose(1, 2) for t in (q, k, v))  # [n, h, L, dh]
    a = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(dh), dim=-1)  # [n, h, Lq, Lk]
    o = (a @ v).transpose(1, 2).reshape(n, Lq, W)
    return torch.baddbmm(P[pre + "bo"].unsqueeze(1), o, P[pre + "Wo"].transpose(1, 2))


def _ff(x, P, pre: str):
    h = torch.baddbmm(P[pre + "b1"].unsqueeze(1), _ln(x, P, pre + "ln_"), P[pre + "W1"].transpose(1, 2))
    a, gates = h.chunk(2, dim=-1)
    return torch.baddbmm(P[pre + "b2"].unsqueeze(1), a * F.gelu(gates), P[pre + "W2"].transpose(1, 2))


def generate(P: dict, emb: torch.Tensor, depth: int, heads: int) -> torch.Tensor:
    """Contexts ``[n, n_ctx, W]`` of per-client generators ``P  # {name: [n, ...]}`` from the class-name embeddings
    ``emb  # [Kc, D]`` (``PromptTranslator.forward``)."""
    n = P["soft_prompt"].shape[0]
    e = emb.unsqueeze(0).expand(n, -1, -1)
    kv = _ln(e, P, "x_lnctx_")
    x = _mha(_ln(P["soft_prompt"], P, "x_ln_"), kv, P, "x_", heads)  # no residual (CrossAttention.forward)
    x = _ff(x, P, "x_ff_") + x
    for i in range(depth):
        h = _ln(x, P, f"s{i}_ln_")
        x = _mha(h, h, P, f"s{i}_", heads) + x
        x = _ff(x, P, f"s{i}_ff_") + x
    return x


@register
class FedTPG(PromptFL):
    """FedTPG (Qiu et al. 2024): a text-driven prompt generator shared by all clients, FedAvg of the generator."""

    name = "fedtpg"
    shardable = True
    Params = FedTPGParams
    uses_labels = True

    def setup(self, ctx: Context) -> None:
        super().setup(ctx)
        if ctx.open_vocab is not None:
            raise FedfeatError(
                "fedtpg in the open-vocabulary setting (--partition disjoint-classes) is not supported yet; use a "
                "closed partition (dirichlet, shard, iid, ...)"
            )
        W = ctx.live.tower.width
        if W % self.p.heads:
            raise FedfeatError(
                f"the text width {W} is not divisible by heads = {self.p.heads}; --set heads=..."
            )
        with torch.no_grad():  # the bare class names, as FedTPG.forward's clip.tokenize(classname)
            self.name_emb = F.normalize(
                ctx.live.tower.encode(ctx.class_names, truncate=self.p.truncate), dim=-1
            )

    def init_global(self, ctx: Context) -> dict[str, torch.Tensor]:
        p, tw = self.p, ctx.live.tower
        return generator_init(
            ctx.seed, p.n_ctx, tw.width, self.name_emb.shape[1], p.depth, p.ff_mult, tw.dtype, tw.device
        )

    def text_features(self, ctx: Context, params: dict) -> torch.Tensor:
        c = generate(params, self.name_emb, self.p.depth, self.p.heads)  # [n, n_ctx, W]
        return F.normalize(self.learner.features(c), dim=-1)

"""pFedMoAP: a personalised mixture of prompt experts with a local attention gating network.

Luo, Chen, Wu, "Mixture of Experts Made Personalized: Federated Prompt Learning for Vision-Language Models", ICLR
2025, following ``ljaiverson/pFedMoAP`` at a481de35edc7c83244709f540f5fe573df4455dc (``trainers/pfedmoap.py``,
``federated_main.py``, ``configs/trainers/PFEDMOAP/vit_b16.yaml``, ``Dassl/dassl/config/defaults.py``,
``utils/fed_utils.py``, ``train.sh``); registered as ``pfedmoap``.

Each client trains a CoOp prompt (its **local expert**, started every round from the server's FedAvg of the uploaded
prompts, federated_main.py:375, 392) and keeps a **gating network**, a multi-head attention (pfedmoap.py:429-471)
over the unit text features of its local prompt and of ``num_experts - 1`` **non-local experts**, other clients'
last uploaded prompts (frozen, ``no_grad``, pfedmoap.py:185-210) that the server sends it (``sparse_selection``,
:321-356: the nearest by the L2 distance of the prompts, or the first others in one random order fixed per run). The
gating works on features subsampled by ``pool`` (every ``D // gating_embed_dim``-th dimension, :171, 176-183)::

    local = s * x t_k^T                                           x, t_k unit; s = CLIP's logit scale
    q = pool(x) for every class,  k = v = [pool(t_k), pool(t^1_k), .., pool(t^{E-1}_k)]
    o_k(x) = W_o concat_h softmax(scaling * (W_q q)_h (W_k k)_h^T) (W_v v)_h          (:464-471, no 1/sqrt(d))
    logits_k = lmbda * local_k + s * pool(x) . o_k(x)                                (:227-234)
    loss = CE(logits, y)                                                             (:373-374)

A client without non-local experts (its first participation: federated_main.py:362-374) trains its prompt alone
(``logits = local``, :236-237). Only prompts are uploaded; the gating network never leaves its client
(federated_main.py:384-387: ``local_gatings``). The server averages the uploaded prompts by client sample counts
(``average_weights(local_prompts, idxs_users, datanumber_client)``, :392). Evaluation (``local_acc``): each client
with its last uploaded prompt, its gating network and the experts selected for it among the stored prompts (a client
that never trained with experts: its prompt alone; one that never trained: the global prompt; :396-410). The global
test accuracy uses the averaged prompt alone (ours: the code reports per-client accuracy only).

Defaults (each field names its source): ``n_ctx`` 16, prompt SGD lr 0.002 (the config file's ``OPTIM.LR`` is merged
after ``--lr 0.001``, federated_main.py:166, 185-186) with Dassl's per-epoch cosine over the 5 local epochs after
one warm-up epoch at 1e-5, gating SGD lr 0.01 constant (``OPTIMGATING``: single_step, gamma 1), both momentum 0.9 and
weight decay 5e-4, batch 32, ``num_experts`` 10 (``min(num_experts, num_users)``), ``nearest`` selection, 8 heads,
``gating_embed_dim`` 128, ``lmbda`` 0.5, ``scaling`` 10, fp16 CLIP on CUDA (``PREC "fp16"``: ``precision="auto"``),
one trainer (both optimisers, the scheduler) for every client and round (``optimizer_state="carried"``).

Readings of ours where the code is broken or sequential (docs/paper-code.md):

* ``nearest`` selection: the code's ``torch.topk`` is called on a Python list (a TypeError) and would index the
  filtered list; it is only reached with more trained clients than ``num_experts`` (never at the defaults: 10
  clients, 10 experts). Here: the ``num_experts - 1`` other clients nearest by ``||P_i - P_j||``, by client id.
* Experts are chosen from the prompts stored at the start of the round (the code runs clients one after another, so
  later clients see this round's prompts of earlier ones), and at evaluation from the prompts after the round.
* Every client's gating network starts from the one initial network (the code's ``local_gatings`` start as ``{}``,
  which ``!= []`` loads nothing, so in a client's first round with experts it starts from the previous client's).
* A client whose only selectable experts are none (one trained client) trains its prompt alone (the code keeps the
  previous client's non-local features).
* ``gating_embed_dim`` larger than the feature dimension ``D`` pools nothing (``D // 128 = 0`` is a zero slice step
  in the code); the gating's width is the pooled width, ``ceil(D / (D // gating_embed_dim))``.
* ``dropout=0.1`` is passed to the code's ``MultiheadAttention`` but never applied there: no dropout.

Batched over the sampled clients (``[n, ...]`` prompts and gating weights, one text-tower forward per step for all);
the unsupervised modes of ``fedfeat.methods.prompt`` (``pseudo=fpl|cpl|copl``) replace the labels.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F

from fedfeat.engine import rng
from fedfeat.engine.context import Batch, Context, RoundPlan, fedavg
from fedfeat.engine.optim import BatchedSGD
from fedfeat.errors import FedfeatError
from fedfeat.methods.base import register
from fedfeat.methods.prompt import (
    TAG_CTX_INIT,
    PersonalEval,
    PromptFLParams,
    PromptMethod,
    client_scores,
    client_weights,
    per_client_scores,
    pseudo_label,
    pseudo_loss,
    refuse_open_vocab,
    round_lr,
)

TAG_GATING_INIT = 331  # the one initial gating network (nn.Linear's default initialisation)
TAG_EXPERT_ORDER = 332  # the random selection's order of the clients (pfedmoap.py:296-297), drawn once
GATING = ("wq", "bq", "wk", "bk", "wv", "bv", "wo", "bo")  # W_q, W_k, W_v, W_o (pfedmoap.py:441-444)


@dataclass(frozen=True)
class PFedMoAPParams(PromptFLParams):
    n_ctx: int = 16  # pFedMoAP federated_main.py:40 --n_ctx 16 (train.sh NCTX=16)
    # vit_b16.yaml / rn50.yaml OPTIM.LR 0.002, merged after extend_cfg's --lr 0.001 (federated_main.py:166, 185-186)
    lr: float = 0.002
    local_epochs: int = 5  # federated_main.py:17 --local_epochs 5 (reset_cfg :107-108 MAX_EPOCH)
    batch_size: int = 32  # federated_main.py:22 --train_batch_size 32 (:188; train.sh passes its SHOTS=16)
    momentum: float = 0.9  # Dassl/dassl/config/defaults.py:157 OPTIM.MOMENTUM (:194 OPTIMGATING.MOMENTUM)
    weight_decay: float = 5e-4  # defaults.py:156 OPTIM.WEIGHT_DECAY (:193 OPTIMGATING.WEIGHT_DECAY)
    # vit_b16.yaml OPTIM LR_SCHEDULER cosine, WARMUP_EPOCH 1 constant 1e-5, stepped per local epoch (pfedmoap.py:383)
    schedule: Literal["cosine", "constant", "cosine-epoch"] = "cosine-epoch"
    warmup_epochs: int = 1  # vit_b16.yaml WARMUP_EPOCH 1
    aggregation: Literal["size", "mean"] = (
        "size"  # federated_main.py:392 average_weights(.., datanumber_client)
    )
    optimizer_state: Literal["fresh", "carried"] = "carried"  # federated_main.py:219 one local_trainer
    precision: Literal["fp32", "fp16", "auto"] = "auto"  # federated_main.py:142 PFEDMOAP.PREC "fp16"
    num_experts: int = 10  # federated_main.py:44 --num_experts 10 (train.sh 10); min(., clients) (:144)
    sparse_selection: Literal["nearest", "random"] = "nearest"  # federated_main.py:45 (train.sh nearest)
    gating_heads: int = 8  # federated_main.py:46 --gating_heads 8
    gating_embed_dim: int = 128  # federated_main.py:47 --gating_embed_dim 128 (pool: every D // 128-th dim)
    lmbda: float = 0.5  # federated_main.py:48 --lmbda 0.5 (train.sh LMBDA=0.5): the local logits' weight
    scaling: float = (
        10.0  # federated_main.py:49 --scaling 10.0 (train.sh SCALING=10.0): attention score factor
    )
    gating_lr: float = (
        0.01  # vit_b16.yaml OPTIMGATING.LR 0.01 (single_step, GAMMA 1, warm-up at 0.01: constant)
    )

    def validate(self) -> None:
        super().validate()
        if self.csc:
            raise FedfeatError("pfedmoap's prompts are unified (PFEDMOAP.CSC False); drop --set csc=true")
        if self.num_experts < 1 or self.gating_heads < 1 or self.gating_embed_dim < 1:
            raise FedfeatError(
                f"need num_experts, gating_heads and gating_embed_dim >= 1, got {self.num_experts}, "
                f"{self.gating_heads} and {self.gating_embed_dim}; e.g. --set num_experts=10"
            )
        if self.lmbda < 0 or self.scaling <= 0 or self.gating_lr <= 0:
            raise FedfeatError(
                f"need lmbda >= 0, scaling > 0 and gating_lr > 0, got {self.lmbda}, {self.scaling} and "
                f"{self.gating_lr}; e.g. --set lmbda=0.5 scaling=10 gating_lr=0.01"
            )


# ---------------------------------------------------------------------------------------- the model
def pool_step(D: int, embed_dim: int) -> int:
    """``reduce_times = output_dim // gating_embed_dim`` (pfedmoap.py:171), at least 1 (ours: ``D < embed_dim``)."""
    return max(D // embed_dim, 1)


def moe_logits(
    x: torch.Tensor,
    t: torch.Tensor,
    experts: torch.Tensor,
    emask: torch.Tensor,
    gate: dict[str, torch.Tensor],
    heads: int,
    scaling: float,
    step: int,
    scale: float,
) -> torch.Tensor:
    """The gating network's logits ``s * pool(x) . o_k(x)`` (pfedmoap.py:231-234, 446-471), batched over clients.

    ``x  # [n, B, D]`` unit image features, ``t  # [n, K, D]`` unit local text features, ``experts  # [n, E1, K, d]``
    the non-local experts' pooled unit text features (``emask  # [n, E1]`` which are real), ``gate`` the clients'
    attention weights (``w*  # [n, d, d]``, ``b*  # [n, d]``, nn.Linear's ``y = x W^T + b``) -> ``[n, B, K]``."""
    n, B, _ = x.shape
    px = x[..., ::step]  # [n, B, d] (pool)
    kv = torch.cat([t[..., ::step].unsqueeze(1), experts.to(t.dtype)], 1)  # [n, E, K, d]
    d = px.shape[-1]
    dk = d // heads

    def lin(z, w, b):  # nn.Linear per client: z [n, ..., d]
        shape = z.shape
        return (torch.bmm(z.reshape(n, -1, d), w.transpose(1, 2)) + b.unsqueeze(1)).view(shape)

    Q = lin(px, gate["wq"], gate["bq"]).view(n, B, heads, dk)  # the query is the same for every class
    Kx = lin(kv, gate["wk"], gate["bk"]).view(n, -1, kv.shape[2], heads, dk)  # [n, E, K, h, dk]
    V = lin(kv, gate["wv"], gate["bv"]).view(n, -1, kv.shape[2], heads, dk)
    s = torch.einsum("nbhc,nekhc->nkhbe", Q, Kx) * scaling  # [n, K, h, B, E]
    keep = torch.cat([torch.ones_like(emask[:, :1]), emask], 1)  # the local expert is always there
    s = s.masked_fill(~keep[:, None, None, None, :], float("-inf"))
    a = torch.softmax(s, dim=-1)
    o = torch.einsum("nkhbe,nekhc->nkbhc", a, V).reshape(n, -1, B, d)  # [n, K, B, d] (combine_heads)
    o = lin(o, gate["wo"], gate["bo"])
    return scale * torch.einsum("nbd,nkbd->nbk", px, o)


def select_experts(
    prompts: torch.Tensor,
    seen: torch.Tensor,
    clients: torch.Tensor,
    k: int,
    how: str,
    order: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``sparse_selection`` (pfedmoap.py:321-356) for ``clients  # [m]``: up to ``k`` other clients that hold a stored
    prompt (``seen  # [C]``), the nearest by ``||P_i - P_j||`` (``how="nearest"``, a client with a prompt of its own)
    or the first in the fixed random ``order`` (``"random"``, and a client without a prompt). Returns client ids
    ``[m, k]`` and which are real ``[m, k]``."""
    C = prompts.shape[0]
    m = clients.shape[0]
    if k == 0:
        return torch.zeros(m, 0, dtype=torch.int64), torch.zeros(m, 0, dtype=torch.bool)
    flat = prompts.reshape(C, -1).double().cpu()
    clients, seen = clients.cpu(), seen.cpu()
    pos = torch.empty(C, dtype=torch.float64)
    pos[order.cpu()] = torch.arange(C, dtype=torch.float64)
    score = pos.expand(m, C).clone()
    if how == "nearest":
        dist = torch.cdist(flat[clients], flat)  # [m, C]
        near = seen[clients]
        score[near] = dist[near]
    cand = seen.expand(m, C) & (torch.arange(C) != clients[:, None])
    score = score.masked_fill(~cand, float("inf"))
    val, idx = torch.topk(score, k, dim=1, largest=False)
    return idx, torch.isfinite(val)


class _GatingSGD(BatchedSGD):
    """The two Dassl SGDs of pfedmoap.py:277-283 as one: ``lr`` for the prompt (the per-epoch schedule), ``gating_lr``
    for the gating weights; ``gated`` ([n] bool) the clients whose gating is in use: the others' gating weights get no
    gradient and torch's SGD skips them (their momentum untouched)."""

    def __init__(self, lr, momentum, weight_decay, gating_lr):
        super().__init__(lr=lr, momentum=momentum, weight_decay=weight_decay)
        self.gating_lr = gating_lr
        self.gated: torch.Tensor | None = None

    @torch.no_grad()
    def step(self, params, grads, n):
        prompt = {k: g for k, g in grads.items() if k not in GATING}
        if prompt:
            super().step(params, prompt, n)
        gate = {k: g for k, g in grads.items() if k in GATING}
        if gate and (self.gated is None or bool(self.gated[:n].any())):
            lr, self.lr = self.lr, self.gating_lr
            try:
                super().step(params, gate, n)
            finally:
                self.lr = lr


@register
class PFedMoAP(PersonalEval, PromptMethod):
    """pFedMoAP (Luo et al. 2025): a local prompt expert plus downloaded non-local ones, mixed by a local gating."""

    name = "pfedmoap"
    Params = PFedMoAPParams
    state_keys = {
        "client_prompt": "per-client: [C, n_ctx, W] each client's last uploaded prompt (its expert for the others)",
        "client_seen": "per-client: [C] bool whether the client has uploaded a prompt",
        "client_gated": "per-client: [C] bool whether the client has trained its gating network",
        **{
            f"client_{k}": f"per-client: [C, d{', d' if k[0] == 'w' else ''}] the gating's {k}"
            for k in GATING
        },
    }

    uses_labels = True

    def __init__(self, params):
        super().__init__(params)
        self.uses_labels = self.p.pseudo == "none"  # the unsupervised modes never see labels

    def setup(self, ctx: Context) -> None:
        refuse_open_vocab(ctx, self.name, "per-client prompts and gating networks")
        super().setup(ctx)
        p = self.p
        if p.pseudo != "none":
            pseudo_label(ctx, p.pseudo, p)
        g = rng.generator(ctx.seed, TAG_CTX_INIT)
        self.init = {"ctx": self.learner.init_context(g, phrase=p.ctx_init, std=p.ctx_std)}
        with torch.no_grad():
            D = int(self.learner.features(self.init["ctx"][None]).shape[-1])
        self.pool_every = pool_step(D, p.gating_embed_dim)
        d = len(range(0, D, self.pool_every))
        if d % p.gating_heads:
            raise FedfeatError(
                f"the gating width {d} (D = {D} pooled every {self.pool_every}) is not divisible by gating_heads = "
                f"{p.gating_heads}; set --set gating_heads=N with N dividing {d}"
            )
        self.n_experts = min(p.num_experts, ctx.n_clients)  # federated_main.py:144
        gg = rng.generator(ctx.seed, TAG_GATING_INIT)
        bound = 1 / math.sqrt(
            d
        )  # nn.Linear: kaiming_uniform_(a=sqrt(5)) and its bias, both U(-1/sqrt(d), 1/sqrt(d))
        dev, dt = self.tower.device, self.tower.dtype
        gate = {}
        for k in GATING:
            shape = (d, d) if k[0] == "w" else (d,)
            gate[k] = ((torch.rand(shape, generator=gg, dtype=torch.float64) * 2 - 1) * bound).to(dev, dt)
        self.init_gate = gate
        self.order = torch.randperm(ctx.n_clients, generator=rng.generator(ctx.seed, TAG_EXPERT_ORDER))
        C = ctx.n_clients
        ctx.state["client_prompt"] = self.init["ctx"].unsqueeze(0).repeat(C, 1, 1).contiguous()
        ctx.state["client_seen"] = torch.zeros(C, dtype=torch.bool, device=dev)
        ctx.state["client_gated"] = torch.zeros(C, dtype=torch.bool, device=dev)
        for k, v in gate.items():
            ctx.state[f"client_{k}"] = v.unsqueeze(0).repeat(C, *([1] * v.dim())).contiguous()

    def init_global(self, ctx: Context) -> dict[str, torch.Tensor]:
        return {"ctx": self.init["ctx"].clone()}

    def make_optimizer(self, rnd: int):
        p = self.p
        self._opt = _GatingSGD(round_lr(p, rnd, self.rounds), p.momentum, p.weight_decay, p.gating_lr)
        return self._opt

    def local_params(self, ctx: Context, plan: RoundPlan) -> dict:
        c = plan.clients.to(ctx.device)
        return {k: ctx.state[f"client_{k}"][c].clone() for k in GATING}

    @torch.no_grad()
    def _experts(self, ctx: Context, clients: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The clients' non-local experts: pooled unit text features ``[m, E1, K, d]`` and which are real."""
        idx, real = select_experts(
            ctx.state["client_prompt"], ctx.state["client_seen"], clients.cpu(), self.n_experts - 1,
            self.p.sparse_selection, self.order,
        )  # fmt: skip
        m, E1 = idx.shape
        if E1 == 0 or not bool(real.any()):
            K, d = ctx.K, self.init_gate["bq"].shape[0]
            return torch.zeros(m, E1, K, d, dtype=self.tower.dtype, device=ctx.device), real.to(ctx.device)
        uniq, inv = torch.unique(idx[real], return_inverse=True)
        t = F.normalize(self.learner.features(ctx.state["client_prompt"][uniq.to(ctx.device)]), dim=-1)
        t = t[..., :: self.pool_every]  # [u, K, d]
        out = torch.zeros(m, E1, *t.shape[1:], dtype=t.dtype, device=t.device)
        out[real.to(t.device)] = t[inv.to(t.device)]
        return out, real.to(ctx.device)

    def local_begin(self, ctx: Context, plan: RoundPlan, glob: dict) -> dict:
        c = plan.clients.to(ctx.device)
        experts, real = self._experts(ctx, plan.clients)
        # a client's first participation trains its prompt alone (federated_main.py:362-374)
        gated = (
            ctx.state["client_seen"][c] & real.any(1) if real.shape[1] else torch.zeros_like(c, dtype=bool)
        )
        self._opt.gated = gated
        return {"experts": experts, "emask": real, "gated": gated}

    def _logits(self, ctx, x, t, gate, experts, emask, gated):
        local = client_scores(ctx.clip_logit_scale, x, t)  # [n, B, K]
        if not bool(gated.any()):
            # the gating still in the graph (zero gradient) so that every parameter is differentiated
            return local + 0 * sum(v.sum() for v in gate.values()).to(local.dtype)
        x = x.to(t.dtype)
        moe = moe_logits(
            x,
            t,
            experts,
            emask,
            gate,
            self.p.gating_heads,
            self.p.scaling,
            self.pool_every,
            ctx.clip_logit_scale,
        )
        return torch.where(gated[:, None, None], self.p.lmbda * local + moe.to(local.dtype), local)

    def step_loss(self, ctx: Context, params: dict, batch: Batch, local: dict) -> torch.Tensor:
        n = params["ctx"].shape[0]
        t = F.normalize(self.learner.features(params["ctx"]), dim=-1)
        gate = {k: params[k] for k in GATING}
        z = self._logits(ctx, batch.x, t, gate, local["experts"][:n], local["emask"][:n], local["gated"][:n])
        return pseudo_loss(ctx, z, batch, self.p.pseudo)

    def aggregate(self, ctx: Context, plan: RoundPlan, glob: dict, cparams: dict) -> dict:
        c = plan.clients.to(ctx.device)
        gated = self._round_gated(ctx, plan)
        ctx.state["client_prompt"][c] = cparams["ctx"].detach()  # the uploads (federated_main.py:387)
        ctx.state["client_seen"][c] = True
        if bool(gated.any()):  # local_gatings (:385-386): the gating never leaves its client
            for k in GATING:
                ctx.state[f"client_{k}"][c[gated]] = cparams[k][gated].detach()
            ctx.state["client_gated"][c[gated]] = True
        w = client_weights(ctx, plan, self.p.aggregation)
        return glob if w is None else fedavg({"ctx": cparams["ctx"]}, w)

    def _round_gated(self, ctx: Context, plan: RoundPlan) -> torch.Tensor:
        """Which of the plan's clients trained with experts this round (from the round-start state, as
        ``local_begin``: the carried engine runs ``local_begin`` once per client)."""
        c = plan.clients.to(ctx.device)
        if self.n_experts < 2:
            return torch.zeros(len(c), dtype=torch.bool, device=ctx.device)
        seen = ctx.state["client_seen"]
        others = int(seen.sum()) - seen[c].long()  # other clients with a stored prompt
        return seen[c] & (others > 0)

    def upload_bytes(self, ctx: Context, plan: RoundPlan, cparams: dict) -> int:
        return int(cparams["ctx"].numel() * cparams["ctx"].element_size())

    @torch.no_grad()
    def local_logits(self, ctx: Context, glob: dict, rows: list) -> list[torch.Tensor]:
        """Each client's logits on its test rows with its own model (federated_main.py:396-410): its stored prompt
        (the global one if it never trained), its gating network and experts if it has trained one."""
        C = ctx.n_clients
        seen, gated = ctx.state["client_seen"], ctx.state["client_gated"]
        prompts = torch.where(seen[:, None, None], ctx.state["client_prompt"], glob["ctx"].unsqueeze(0))
        t = F.normalize(self.learner.features(prompts), dim=-1)  # [C, K, D]
        experts, real = self._experts(ctx, torch.arange(C))
        gated = gated & (real.any(1) if real.shape[1] else torch.zeros_like(gated))
        gate = {k: ctx.state[f"client_{k}"] for k in GATING}
        chunk = 64

        def score(
            x,
        ):  # [C, E, D] -> [C, E, K], a few rows at a time (the gating's [C, K, rows, d] temporaries)
            return torch.cat(
                [self._logits(ctx, x[:, s : s + chunk], t, gate, experts, real, gated).float()
                 for s in range(0, x.shape[1], chunk)], 1,
            )  # fmt: skip

        return per_client_scores(ctx, rows, score)

    def final_weights(self, ctx: Context, glob: dict) -> dict[str, torch.Tensor]:
        """The global prompt, every client's stored prompt and gating network (``client_*``, ``[clients, ...]``)."""
        keys = ("prompt", *GATING)
        return {**glob, **{f"client_{k}": ctx.state[f"client_{k}"].clone() for k in keys}}

    @torch.no_grad()
    def predict(self, ctx: Context, glob: dict, x: torch.Tensor) -> torch.Tensor:
        """The global test accuracy with the averaged prompt alone (ours; the code reports per-client accuracy)."""
        t = self.text_features(ctx, {"ctx": glob["ctx"].unsqueeze(0)})
        return client_scores(ctx.clip_logit_scale, x.unsqueeze(0), t)[0].float()


__all__ = ["PFedMoAP", "PFedMoAPParams", "moe_logits", "pool_step", "select_experts"]

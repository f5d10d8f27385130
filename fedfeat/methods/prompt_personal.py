"""Two personalised text-prompt methods on the live text tower: FedPGP and PromptFolio.

**FedPGP** (Cui, Li, Wang, Shi, "Harmonizing Generalization and Personalization in Federated Prompt Learning",
ICML 2024), following ``TianyuCuiOvO/FedPGP`` at d43045b33f42beb192e8ac7b2da0222bf6cec3e6 (``trainers/fedpgp.py``,
``federated_main.py``, ``fed_utils.py``, ``configs/trainers/PLOT/vit_b16.yaml``, ``scripts/plot_basetonew_base.sh``);
registered as ``fedpgp``. Each client's CoOp context (16 unified tokens) is a **global** prompt ``sigma`` (averaged
by the server) plus a client-specific **low-rank** adaptation ``U V`` (``U  # [n_ctx, r]``, ``V  # [r, W]``, ``r`` the
``bottleneck``; never leaves the client)::

    ctx_i = sigma + U_i V_i                                       (fedpgp.py:142-146)
    loss  = CE(logit_scale * cos(x, t_k(ctx_i)), y)
            + mu * mean_k CE([cos(t0_k, t_k(sigma)), cos(t_k(sigma), t_k(ctx_i))] / temp, 0)   (fedpgp.py:357-366)

``t0`` are the text features of the prompt the learner is built on, ``"X X ... X {class}."`` (the learner's
``embedding`` buffer, fedpgp.py:119-131, 266): the contrastive term pulls the global prompt's features towards the
hand-crafted prompt's (positive) and pushes them away from the personalised prompt's (negative). Only ``sigma`` is
averaged (``federated_main.py:344-349``: ``average_weights(local_weights_0 = sigma, .., datanumber_client)``); each
client downloads the average and its own ``U, V`` (``:388-399``); every client starts from the same ``U, V, sigma``
(each N(0, 0.02), fedpgp.py:96-104). Each client is evaluated on its local test split with ``sigma + U_i V_i``
(``local_acc``); the global test accuracy uses ``sigma`` alone (ours: the code reports personalised accuracy only).

Defaults (each field names its source): ``n_ctx`` 16, SGD lr 0.001 (momentum 0.9, weight decay 5e-4: Dassl), a
constant rate (``single_step`` with ``--gamma 1``), 2 local epochs, batch 32, ``temp`` 0.5, and the authors' script's
``bottleneck`` 8 and ``mu`` 0.5 (``federated_main.py``'s argparse defaults: 4 and 1); fp32 (``FEDPGP.PREC "fp32"``);
one SGD for every client and round (``optimizer_state="carried"``: one ``local_trainer``); FedAvg of ``sigma`` by
client sample counts. The script's ``NUM_PROMPT=2`` repeats the class list (``tokenized_prompts.repeat(N, 1)``) so
that its logits have ``2K`` columns scored against labels ``< K``; here ``N`` is 1 (the argparse default).
``anchor="template"`` uses the store's hand-crafted template text features as ``t0`` (the paper's "hand-crafted
prompt") instead of the code's ``"X X ... X {class}."``.

**PromptFolio** (Pan et al., "Federated Learning from Vision-Language Foundation Models:
Theoretical Analysis and Method", NeurIPS 2024), following ``PanBikang/PromptFolio`` at
8f729aab78b27ad78ad441b75deebb0e51d5b26c (``trainers/PromptFolio.py``, ``federated_main.py``,
``Dassl/dassl/engine/trainer.py``, ``configs/trainers/PromptFolio/vit_b16.yaml``); registered as ``promptfolio``.
Each client holds two CoOp contexts, a **global** one (averaged) and a **local** one (kept), and mixes their unit
text features with the portfolio weight ``theta`` (the code's ``frac``; 0 fully global, 1 fully local)::

    t_k = (1 - theta) * t_k(ctx_global) / |.| + theta * t_k(ctx_local) / |.|     (PromptFolio.py:221-233)
    loss = CE(logit_scale * x . t_k, y)                                           (PromptFolio.py:342-345)

(the mixture is not re-normalised.) The server averages the global contexts (``fed_aggregate_model``:
``ctx[:1]`` by client sample counts, PromptFolio.py:412-417); a client downloads its own state with the global
context replaced by the average (``fed_download_model``, :419-423). Evaluation: each client with its own portfolio
(``local_acc``); the global test accuracy with the global prompt alone (ours, ``theta = 0``).

Defaults: ``theta`` 0.4 (``--frac_p``, federated_main.py:399), ``n_ctx`` 8 (``--n_ctx``, :412), lr 0.001
(``--lr``, :416, set after the config file), one local epoch (``cfg.OPTIM.MAX_EPOCH = 1``, :121), batch 16
(``--train_batch_size``, :418), Dassl's per-epoch cosine with one constant warm-up epoch at 1e-5 (``vit_b16.yaml``),
one optimiser and scheduler for every client and round (``optimizer_state="carried"``), fp16 CLIP on CUDA
(``PLOT.PREC "fp16"``, :86: ``precision="auto"``), FedAvg of the global context by client sample counts.

Both methods run batched over the sampled clients (per-client parts as ``[n, ...]`` tensors, one text-tower forward
per step for all of them) and support the unsupervised modes of ``fedfeat.methods.prompt`` (``pseudo=fpl|cpl|copl``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F

from fedfeat.engine import rng
from fedfeat.engine.context import Batch, Context, RoundPlan, fedavg
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
)


# ---------------------------------------------------------------------------------------- parameters
@dataclass(frozen=True)
class FedPGPParams(PromptFLParams):
    n_ctx: int = 16  # FedPGP federated_main.py:438 --n_ctx 16 (plot_basetonew_base.sh NCTX=16)
    lr: float = 0.001  # federated_main.py:440 --lr 0.001 (script LR=0.001; vit_b16.yaml OPTIM.LR 0.001)
    local_epochs: int = 2  # federated_main.py:468 --local_epoch 2 (script LOCAL_EPOCH=2)
    batch_size: int = 32  # federated_main.py:471 --train_batch_size 32 (the script passes the shot count)
    momentum: float = 0.9  # Dassl/dassl/config/defaults.py:157 OPTIM.MOMENTUM
    weight_decay: float = 5e-4  # Dassl/dassl/config/defaults.py:156 OPTIM.WEIGHT_DECAY
    # PLOT/vit_b16.yaml LR_SCHEDULER single_step, --gamma 1 (federated_main.py:441): a constant rate
    schedule: Literal["cosine", "constant", "cosine-epoch"] = "constant"
    aggregation: Literal["size", "mean"] = (
        "size"  # federated_main.py:349 average_weights(.., datanumber_client)
    )
    optimizer_state: Literal["fresh", "carried"] = (
        "carried"  # federated_main.py:170 one local_trainer (one SGD)
    )
    precision: Literal["fp32", "fp16", "auto"] = "fp32"  # federated_main.py:86 FEDPGP.PREC "fp32"
    bottleneck: int = 8  # plot_basetonew_base.sh BOTTLENECK 8 (--bottleneck default 4, federated_main.py:467)
    mu: float = (
        0.5  # plot_basetonew_base.sh MU 0.5 (--mu default 1, federated_main.py:450): contrastive weight
    )
    temp: float = 0.5  # federated_main.py:451 --temp 0.5 (script TEMP=0.5)
    # code: t0 = features of "X X .. X {class}." (fedpgp.py:266); template: the store's hand-crafted text features
    anchor: Literal["code", "template"] = "code"

    def validate(self) -> None:
        super().validate()
        if self.csc or self.ctx_init:
            raise FedfeatError(
                "fedpgp's prompt is a unified random context sigma + U V (FEDPGP.CSC False, no CTX_INIT: "
                "fedpgp.py:91-104); drop --set csc / ctx_init"
            )
        if self.bottleneck < 1 or self.temp <= 0 or self.mu < 0:
            raise FedfeatError(
                f"need bottleneck >= 1, temp > 0 and mu >= 0, got {self.bottleneck}, {self.temp} and {self.mu}; "
                "e.g. --set bottleneck=8 temp=0.5 mu=0.5"
            )


@dataclass(frozen=True)
class PromptFolioParams(PromptFLParams):
    n_ctx: int = 8  # PromptFolio federated_main.py:412 --n_ctx 8
    lr: float = 0.001  # federated_main.py:416 --lr 0.001 (reset_cfg :123 overrides vit_b16.yaml's 0.002)
    local_epochs: int = 1  # federated_main.py:121 cfg.OPTIM.MAX_EPOCH = 1
    batch_size: int = 16  # federated_main.py:418 --train_batch_size 16 (:141 overrides vit_b16.yaml's 32)
    momentum: float = 0.9  # Dassl/dassl/config/defaults.py:157 OPTIM.MOMENTUM
    weight_decay: float = 5e-4  # Dassl/dassl/config/defaults.py:156 OPTIM.WEIGHT_DECAY
    # vit_b16.yaml LR_SCHEDULER cosine, WARMUP_EPOCH 1, constant 1e-5, stepped per local epoch (Dassl)
    schedule: Literal["cosine", "constant", "cosine-epoch"] = "cosine-epoch"
    warmup_epochs: int = 1  # vit_b16.yaml WARMUP_EPOCH 1
    aggregation: Literal["size", "mean"] = "size"  # PromptFolio.py:417 average_weights (datanumber_client)
    optimizer_state: Literal["fresh", "carried"] = "carried"  # federated_main.py one local_trainer
    precision: Literal["fp32", "fp16", "auto"] = "auto"  # federated_main.py:86 PLOT.PREC "fp16"
    theta: float = 0.4  # federated_main.py:399 --frac_p 0.4 (PROMPTFL.FRAC): 0 fully global, 1 fully local

    def validate(self) -> None:
        super().validate()
        if self.csc:
            raise FedfeatError("promptfolio's contexts are unified (PROMPTFL.CSC False); drop --set csc=true")
        if not 0 <= self.theta <= 1:
            raise FedfeatError(f"theta must be in [0, 1], got {self.theta}; e.g. --set theta=0.4")


# ---------------------------------------------------------------------------------------- the two models
def pgp_contexts(sigma: torch.Tensor, U: torch.Tensor, V: torch.Tensor) -> torch.Tensor:
    """FedPGP's personalised context ``sigma + U @ V`` (fedpgp.py:142-146): ``sigma  # [n, n_ctx, W]``, ``U  # [n,
    n_ctx, r]``, ``V  # [n, r, W]``."""
    return sigma + torch.matmul(U, V)


def pgp_contrastive(
    t0: torch.Tensor, t_sigma: torch.Tensor, t_full: torch.Tensor, temp: float
) -> torch.Tensor:
    """FedPGP's contrastive term per client (fedpgp.py:358-364): ``t0  # [K, D]`` (or ``[n, K, D]``), ``t_sigma``,
    ``t_full  # [n, K, D]`` -> ``[n]``, the mean over the classes of ``CE([cos(t0, t_sigma), cos(t_sigma, t_full)] /
    temp, 0)``."""
    posi = F.cosine_similarity(t0.expand_as(t_sigma), t_sigma, dim=-1)  # [n, K]
    nega = F.cosine_similarity(t_sigma, t_full, dim=-1)
    z = torch.stack([posi, nega], dim=-1) / temp  # [n, K, 2]
    return (torch.logsumexp(z, dim=-1) - z[..., 0]).mean(-1)


def folio_features(t_global: torch.Tensor, t_local: torch.Tensor, theta: float) -> torch.Tensor:
    """PromptFolio's portfolio text features (PromptFolio.py:226-232): the unit features of the global and the local
    prompt mixed, ``(1 - theta) t_g / |t_g| + theta t_l / |t_l|`` (not re-normalised)."""
    return (1 - theta) * F.normalize(t_global, dim=-1) + theta * F.normalize(t_local, dim=-1)


class _Personal(PersonalEval, PromptMethod):
    """What both methods share: a global context (``glob["ctx"]``), per-client parts kept in ``ctx.state`` (the
    ``LOCAL`` keys, ``[C, ...]``), the pseudo-label modes, and per-client evaluation on the local test rows."""

    uses_labels = True
    LOCAL: tuple[str, ...] = ()

    def __init__(self, params):
        super().__init__(params)
        self.uses_labels = self.p.pseudo == "none"  # the unsupervised modes never see labels

    def setup(self, ctx: Context) -> None:
        refuse_open_vocab(ctx, self.name, "per-client prompts")
        super().setup(ctx)
        if self.p.pseudo != "none":
            pseudo_label(ctx, self.p.pseudo, self.p)

    def _local_state(self, ctx: Context, init: dict[str, torch.Tensor]) -> None:
        """Every client starts from the same local parts (the codes' one initial state for all clients)."""
        for k, v in init.items():
            ctx.state[f"client_{k}"] = v.unsqueeze(0).repeat(ctx.n_clients, *([1] * v.dim())).contiguous()

    def init_global(self, ctx: Context) -> dict[str, torch.Tensor]:
        return {"ctx": self.init["ctx"].clone()}

    def local_params(self, ctx: Context, plan: RoundPlan) -> dict:
        c = plan.clients.to(ctx.device)
        return {k: ctx.state[f"client_{k}"][c].clone() for k in self.LOCAL}

    def keep_local(self, ctx: Context, plan: RoundPlan, cparams: dict) -> None:
        c = plan.clients.to(ctx.device)
        for k in self.LOCAL:  # the local parts stay with their clients
            ctx.state[f"client_{k}"][c] = cparams[k].detach()

    def aggregate(self, ctx: Context, plan: RoundPlan, glob: dict, cparams: dict) -> dict:
        self.keep_local(ctx, plan, cparams)
        w = client_weights(ctx, plan, self.p.aggregation)
        return glob if w is None else fedavg({"ctx": cparams["ctx"]}, w)

    def upload_bytes(self, ctx: Context, plan: RoundPlan, cparams: dict) -> int:
        return int(cparams["ctx"].numel() * cparams["ctx"].element_size())

    def step_loss(self, ctx: Context, params: dict, batch: Batch, local: dict) -> torch.Tensor:
        logits = client_scores(ctx.clip_logit_scale, batch.x, self.client_text(ctx, params))  # [n, B, K]
        return pseudo_loss(ctx, logits, batch, self.p.pseudo)

    def client_text(self, ctx: Context, params: dict) -> torch.Tensor:
        """The clients' classifier text features ``[n, K, D]`` of their parameters ``{name: [n, ...]}``."""
        raise NotImplementedError

    def _all_clients(self, ctx: Context, glob: dict) -> dict:
        C = ctx.n_clients
        return {
            "ctx": glob["ctx"].unsqueeze(0).expand(C, *glob["ctx"].shape),
            **{k: ctx.state[f"client_{k}"] for k in self.LOCAL},
        }

    @torch.no_grad()
    def local_logits(self, ctx: Context, glob: dict, rows: list) -> list[torch.Tensor]:
        """Each client's logits ``[len(rows[i]), K]`` on its test rows ``rows[i]`` (of ``ctx.test_x``) with its own
        model; all clients at once, ``EVAL_ROWS`` rows per client and pass."""
        t = self.client_text(ctx, self._all_clients(ctx, glob))  # [C, K, D]
        return per_client_scores(ctx, rows, lambda x: client_scores(ctx.clip_logit_scale, x, t).float())

    def final_weights(self, ctx: Context, glob: dict) -> dict[str, torch.Tensor]:
        """The global context and every client's local parts (``client_*``, ``[clients, ...]``)."""
        return {**glob, **{f"client_{k}": ctx.state[f"client_{k}"].clone() for k in self.LOCAL}}


@register
class FedPGP(_Personal):
    """FedPGP (Cui et al. 2024): a global prompt + a client low-rank adaptation, with a contrastive term."""

    name = "fedpgp"
    dp_client = True  # DP-FedAvg of the global prompt; the low-rank factors never leave their clients
    Params = FedPGPParams
    LOCAL = ("U", "V")
    state_keys = {
        "client_U": "per-client: [C, n_ctx, bottleneck] each client's low-rank factor U (never aggregated)",
        "client_V": "per-client: [C, bottleneck, W] each client's low-rank factor V (never aggregated)",
    }

    def setup(self, ctx: Context) -> None:
        super().setup(ctx)
        p = self.p
        dev, dt, W = self.tower.device, self.tower.dtype, self.learner.width
        g = rng.generator(ctx.seed, TAG_CTX_INIT)

        def normal(*shape):  # nn.init.normal_(., std=0.02), drawn in float64 (as PromptLearner.init_context)
            return (torch.randn(shape, generator=g, dtype=torch.float64) * p.ctx_std).to(dev, dt)

        U, V, sigma = (
            normal(p.n_ctx, p.bottleneck),
            normal(p.bottleneck, W),
            normal(p.n_ctx, W),
        )  # fedpgp.py:96-104
        self.init = {"ctx": sigma, "U": U, "V": V}
        self._local_state(ctx, {"U": U, "V": V})
        with torch.no_grad():
            if p.anchor == "template":
                t0 = ctx.text.to(dev)
            else:  # the learner's own "X X .. X {class}." embeddings through the tower (fedpgp.py:124, 266)
                x_ctx = self.tower.embed(self.learner.tokens[:1, 1 : 1 + self.learner.n_ctx])  # [1, n_ctx, W]
                t0 = self.learner.features(x_ctx)[0]
        self.anchor = F.normalize(t0.float(), dim=-1)  # [K, D]

    def _both(self, params: dict) -> tuple[torch.Tensor, torch.Tensor]:
        """Unit text features of the global ``sigma`` and of the personalised ``sigma + U V``, ``[n, K, D]`` each, in
        one tower forward."""
        sigma = params["ctx"]
        n = sigma.shape[0]
        full = pgp_contexts(sigma, params["U"], params["V"])
        t = F.normalize(self.learner.features(torch.cat([sigma, full])), dim=-1)
        return t[:n], t[n:]

    def client_text(self, ctx: Context, params: dict) -> torch.Tensor:
        sigma, U, V = params["ctx"], params["U"], params["V"]
        return F.normalize(self.learner.features(pgp_contexts(sigma, U, V)), dim=-1)

    def step_loss(self, ctx: Context, params: dict, batch: Batch, local: dict) -> torch.Tensor:
        p = self.p
        t_sigma, t_full = self._both(params)
        logits = client_scores(ctx.clip_logit_scale, batch.x, t_full)  # [n, B, K]
        ce = pseudo_loss(ctx, logits, batch, p.pseudo)  # [n]
        if p.mu == 0:
            return ce
        con = pgp_contrastive(self.anchor.to(t_sigma.dtype), t_sigma, t_full, p.temp)
        return ce + p.mu * con.to(ce.dtype)

    @torch.no_grad()
    def predict(self, ctx: Context, glob: dict, x: torch.Tensor) -> torch.Tensor:
        """The global test accuracy with the global prompt ``sigma`` alone (ours; the code reports personalised
        accuracy only)."""
        t = self.text_features(ctx, {"ctx": glob["ctx"].unsqueeze(0)})  # [1, K, D]
        return client_scores(ctx.clip_logit_scale, x.unsqueeze(0), t)[0].float()


@register
class PromptFolio(_Personal):
    """PromptFolio (Pan et al. 2024): a global and a local CoOp prompt per client, their features mixed by theta."""

    name = "promptfolio"
    dp_client = True  # DP-FedAvg of the global prompt; the local prompts never leave their clients
    Params = PromptFolioParams
    LOCAL = ("local",)
    state_keys = {
        "client_local": "per-client: [C, n_ctx, W] each client's local CoOp context (never aggregated)"
    }

    def setup(self, ctx: Context) -> None:
        super().setup(ctx)
        p = self.p
        g = rng.generator(ctx.seed, TAG_CTX_INIT)
        # PromptFolio.py:113-118: ctx [N = 2, n_ctx, W] ~ N(0, .02) (or the phrase), ctx[0] global, ctx[1] local
        glob0 = self.learner.init_context(g, phrase=p.ctx_init, std=p.ctx_std)
        local0 = self.learner.init_context(g, phrase=p.ctx_init, std=p.ctx_std)
        self.init = {"ctx": glob0, "local": local0}
        self._local_state(ctx, {"local": local0})

    def client_text(self, ctx: Context, params: dict) -> torch.Tensor:
        g, loc = params["ctx"], params["local"]
        n = g.shape[0]
        t = self.learner.features(torch.cat([g, loc]))  # one tower forward: [2n, K, D]
        return folio_features(t[:n], t[n:], self.p.theta)

    @torch.no_grad()
    def predict(self, ctx: Context, glob: dict, x: torch.Tensor) -> torch.Tensor:
        """The global test accuracy with the global prompt alone (ours: ``theta = 0``, "fully global")."""
        t = self.text_features(ctx, {"ctx": glob["ctx"].unsqueeze(0)})
        return client_scores(ctx.clip_logit_scale, x.unsqueeze(0), t)[0].float()


__all__ = [
    "FedPGP",
    "FedPGPParams",
    "PromptFolio",
    "PromptFolioParams",
    "folio_features",
    "pgp_contexts",
    "pgp_contrastive",
]

"""FedTPG's CoOp baselines as text-prompt methods through the live text tower: **fedkgcoop** (federated KgCoOp) and
**fedcocoop** (federated CoCoOp), batched over the sampled clients like PromptFL and FedTPG
(``fedfeat.methods.promptfl``).

**fedkgcoop** (Yao et al., "Visual-Language Prompt Tuning with Knowledge-guided Context Optimization", CVPR 2023):
CoOp contexts trained with ``CE + λ · (1 - mean_k cos(w_k, w_k^clip))`` -- the learned class text features ``w_k``
pulled towards those of a hand-crafted prompt ``w_k^clip`` (frozen, computed once). The code's distance is
``1 - mean cosine`` (``htyao89/KgCoOp@c43ccc3`` ``KgCoOp/trainers/kgcoop.py:238-241``; the paper writes a squared L2
distance, which on unit vectors is ``2 (1 - cos)``: the same up to the factor 2 folded into λ). The federated
version is FedTPG's ``coop`` model run with ``--w 8`` (``boschresearch/FedTPG@f141c29``, "TPG": ``README.md:58``
"``coop`` for a federated variant of CoOp (and with ``--w 8`` for KgCoOp)"; the loss ``federated/client.py:141``
``F.cross_entropy(output, labels) + self.w*score``, the score ``model/custom_coop.py:173-176``).

**fedcocoop** (Zhou et al., "Conditional Prompt Learning for Vision-Language Models", CVPR 2022): a meta-net
``Linear(D, D/16) -> ReLU -> Linear(D/16, W)`` maps each (unit) image feature to a bias added to every context token,
so each image has its own class prompts (``KaiyangZhou/CoOp@ff61507`` ``trainers/cocoop.py:95-99,144-161``); the
logits of image ``i`` are ``logit_scale · cos(x_i, t_k(x_i))`` (``cocoop.py:183-189``). FedTPG@f141c29 ships no
CoCoOp model (``federated/client.py:64-69`` builds ``fedtpg``, ``coop`` or ``vlp`` only): the federated version here
runs CoCoOp's prompt learner (``n_ctx`` 4, ``ctx_init`` "a photo of a": ``configs/trainers/CoCoOp/
vit_b16_c4_ep10_batch1_ctxv1.yaml:33-34``, the config of CoCoOp's base-to-new script ``scripts/cocoop/
base2new_train.sh:13``) in FedTPG's federated harness, as the ``coop`` baseline does; FedAvg of contexts + meta-net.
Batched: the ``n x B`` images of a step give ``n x B x Kc`` prompts through the tower in one forward (padding rows
skipped); evaluation encodes ``N x K`` prompts in blocks (``eval_prompts``).

The federated harness (both methods; FedTPG's, ``fedfeat.methods.promptfl`` FedTPG section): SGD lr 0.003, momentum
0.9, weight decay 1e-5 (``config/defaults.py:72-75``), cosine over the rounds (``:78``, ``MAX_EPOCH`` = rounds), batch
200 (``Launch_FL.py:103``), one pass over the client's data per round (``client.py:98``), every client keeping its
optimiser and scheduler across rounds (``optimizer_state="per-client"``, ``client.py:86-88``), each client's own
classes in its prompts and CE (``classes="client"``, ``client.py:96``), unweighted FedAvg (``server.py:158-160``),
CLIP in fp16 (``precision="auto"``). Each reading is a switch of the Params below.

TPG's ``coop`` as published does not run: ``CoOpCLIP.forward`` calls ``self.encode_text(classnames, dataname)``
(``custom_coop.py:152``) where ``encode_text`` takes one argument (``:185``); the readings are what the code says.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F

from fedfeat.data.templates import fill
from fedfeat.engine import rng
from fedfeat.engine.context import Batch, Context, masked_mean
from fedfeat.errors import FedfeatError
from fedfeat.methods.base import register
from fedfeat.methods.prompt import TAG_CTX_INIT, PromptParams
from fedfeat.methods.promptfl import FedTPG, PromptFL, _uniform, check_tpg_optimizer

TAG_META_INIT = 303

# TPG: boschresearch/FedTPG@f141c29; KG: htyao89/KgCoOp@c43ccc3; COOP: KaiyangZhou/CoOp@ff61507


@dataclass(frozen=True)
class CoOpFLParams(PromptParams):
    """FedTPG's federated harness for its CoOp baselines (shared by fedkgcoop and fedcocoop)."""

    local_epochs: int = 1  # TPG federated/client.py:98 one pass over the train loader per round
    batch_size: int = 200  # TPG Launch_FL.py:103 --batch_size 200
    lr: float = 0.003  # TPG config/defaults.py:73 OPTIM.LR
    momentum: float = 0.9  # TPG config/defaults.py:75 OPTIM.MOMENTUM
    weight_decay: float = 1e-5  # TPG config/defaults.py:74 OPTIM.WEIGHT_DECAY
    n_ctx: int = 4  # TPG Launch_FL.py:97 --n_ctx 4 (MODEL.N_CTX; custom_coop.py:88)
    # TPG server.py:158-160 unweighted mean of the sampled clients; "size": FedAvg by samples
    aggregation: Literal["size", "mean"] = "mean"
    # TPG client.py:96 each client's own classes (relabelled, dm_federated.py:114); "all": the vocabulary
    classes: Literal["client", "all"] = "client"
    # TPG custom_coop.py:43-56 clip.build_model: CLIP in fp16; "auto": fp16 on CUDA, fp32 on a CPU
    precision: Literal["fp32", "fp16", "auto"] = "auto"
    # TPG client.py:86-88 one optimizer + scheduler per client kept across rounds; fresh; carried (one for all)
    optimizer_state: Literal["fresh", "carried", "per-client"] = "per-client"
    # the contexts kept in float32 and cast to the tower's dtype on use (TPG custom_coop.py:90 torch.empty(n_ctx,
    # 512) is float32, :190 ctx.to(self.dtype)); False: in the tower's dtype (CoOp's / CoCoOp's ctx_vectors dtype)
    ctx_fp32: bool = True

    def validate(self) -> None:
        super().validate()
        check_tpg_optimizer(self)


@dataclass(frozen=True)
class FedKgCoOpParams(CoOpFLParams):
    # λ: TPG README.md:58 "--w 8 for KgCoOp" (Launch_FL.py:122 --w -> config/utils.py:53 TRAIN.W; client.py:141
    # loss = CE + w * score; config/defaults.py:95 TRAIN.W 8.0); KG scripts/base2new_train.sh:8,32 TRAINER.COOP.W
    kg_weight: float = 8.0
    # the hand-crafted prompt: TPG custom_coop.py:24-40 CUSTOM_TEMPLATES[dataset] (KG kgcoop.py:37-54), its generic
    # entry "a photo of a {}." (ImageNet, Caltech101, SUN397, StanfordCars; e.g. --set kg_template='a photo of a
    # {}, a type of pet.'), encoded once by the store's text tower; "store": the store's own text embeddings
    # (its --templates, template choice applied)
    kg_template: str = "a photo of a {}."

    def validate(self) -> None:
        super().validate()
        if self.kg_weight < 0:
            raise FedfeatError(f"kg_weight must be >= 0, got {self.kg_weight}; e.g. --set kg_weight=8")
        if self.kg_template != "store" and self.kg_template.count("{}") != 1:
            raise FedfeatError(
                f"kg_template {self.kg_template!r} needs one '{{}}' slot for the class name (or 'store'); e.g. "
                "--set kg_template='a photo of a {}.'"
            )


@dataclass(frozen=True)
class FedCoCoOpParams(CoOpFLParams):
    # COOP configs/trainers/CoCoOp/vit_b16_c4_ep10_batch1_ctxv1.yaml:33-34 N_CTX 4, CTX_INIT "a photo of a"
    # (scripts/cocoop/base2new_train.sh:13); "": N(0, 0.02) (vit_b16_c4_ep10_batch1.yaml)
    ctx_init: str = "a photo of a"
    # COOP trainers/cocoop.py:86,101-102 ctx and meta_net in CLIP's dtype (fp16 with PREC fp16)
    ctx_fp32: bool = False
    meta_reduction: int = (
        16  # COOP trainers/cocoop.py:96-98 Linear(vis_dim, vis_dim // 16), Linear(.., ctx_dim)
    )
    # ours: prompts per tower call at evaluation (N test images x K classes, no gradient)
    eval_prompts: int = 8192

    def validate(self) -> None:
        super().validate()
        if self.n_ctx < 1:  # (with ctx_init the init's words set the count; a given n_ctx must still be one)
            raise FedfeatError(f"n_ctx must be >= 1, got {self.n_ctx}; e.g. --set n_ctx=4")
        if self.meta_reduction < 1 or self.eval_prompts < 1:
            raise FedfeatError(
                f"meta_reduction and eval_prompts must be >= 1, got {self.meta_reduction}, {self.eval_prompts}"
            )
        if self.csc:
            raise FedfeatError("fedcocoop's contexts are unified (CoCoOp has no CSC); drop --set csc")


class _CoOpFL(FedTPG):
    """FedTPG's harness (per-client class lists and optimisers: ``FedTPG._class_lists``, ``local_begin``,
    ``local_end``, ``make_optimizer``) around CoOp contexts instead of the generator."""

    def setup(self, ctx: Context) -> None:
        PromptFL.setup(
            self, ctx
        )  # the learner, the tower in the run's precision (not FedTPG's generator inputs)
        if self.p.optimizer_state == "per-client":
            from fedfeat.engine.rounds import dist_info

            if dist_info()[1] > 1:
                raise FedfeatError(
                    f"{self.name} optimizer_state=per-client keeps each client's optimiser in this process; run it "
                    "in one process or --set optimizer_state=fresh"
                )
        self._class_lists(ctx)

    def init_global(self, ctx: Context) -> dict[str, torch.Tensor]:
        """CoOp's contexts (``PromptLearner.init_context``'s draw), float32 with ``ctx_fp32``."""
        p, lr = self.p, self.learner
        g = rng.generator(ctx.seed, TAG_CTX_INIT)
        if p.ctx_init:
            v = lr.init_context(g, csc=p.csc, phrase=p.ctx_init, std=p.ctx_std)
        else:  # drawn in float64 and rounded once to the contexts' dtype
            shape = (lr.K, lr.n_ctx, lr.width) if p.csc else (lr.n_ctx, lr.width)
            v = torch.randn(shape, generator=g, dtype=torch.float64) * p.ctx_std
        dtype = torch.float32 if p.ctx_fp32 else self.tower.dtype
        return {"ctx": v.to(device=self.tower.device, dtype=dtype)}

    def text_features(self, ctx: Context, params: dict) -> torch.Tensor:
        return F.normalize(self.learner.features(params["ctx"]), dim=-1)

    def class_text(self, params: dict, cls: torch.Tensor, valid: torch.Tensor | None) -> torch.Tensor:
        """Unit text features ``[n, Kc, D]`` of the classes ``cls  # [n, Kc]`` (a class's prompt does not depend on
        the other classes: ``valid`` unused)."""
        return F.normalize(self.learner.features(params["ctx"], cls), dim=-1)

    def _ce(self, ctx: Context, logits: torch.Tensor, batch: Batch, local: dict) -> torch.Tensor:
        """Per-client CE ``[n]`` over each client's class list (``logits  # [n, B, Kc]``)."""
        n, B, Kc = logits.shape
        valid = local["valid"][:n]
        if self.masked:
            logits = logits.masked_fill(~valid[:, None, :], float("-inf"))
        y = torch.gather(local["lut"][:n], 1, batch.y)  # [n, B] the labels within each client's list
        loss = F.cross_entropy(logits.reshape(n * B, Kc), y.reshape(-1), reduction="none").view(n, B)
        return masked_mean(loss, batch.mask)


def kg_score(t: torch.Tensor, t0: torch.Tensor, valid: torch.Tensor | None = None) -> torch.Tensor:
    """KgCoOp's knowledge-guided score ``1 - mean_k cos(t_k, t0_k)`` per client: ``t, t0  # [n, Kc, D]`` -> ``[n]``,
    the mean over each client's real classes (``valid  # [n, Kc]``; None: all) (TPG ``custom_coop.py:173-176``,
    ``CosineSimilarity(dim=1, eps=1e-07)``)."""
    cos = F.cosine_similarity(t, t0.to(t.dtype), dim=-1, eps=1e-7)  # [n, Kc]
    if valid is None:
        return 1.0 - cos.mean(1)
    v = valid.to(cos.dtype)
    return 1.0 - (cos * v).sum(1) / v.sum(1).clamp_min(1)


@register
class FedKgCoOp(_CoOpFL):
    """Federated KgCoOp (FedTPG's baseline): CoOp contexts + the knowledge-guided regulariser, FedAvg of contexts."""

    name = "fedkgcoop"
    shardable = True
    dp_client = True  # DP-FedAvg of the contexts
    Params = FedKgCoOpParams
    uses_labels = True

    def setup(self, ctx: Context) -> None:
        super().setup(ctx)
        p = self.p
        with torch.no_grad():  # w^clip: TPG custom_coop.py:155-163 encode_text of the template, normalised
            if p.kg_template == "store":
                t0 = ctx.text
            else:
                t0 = self.tower.encode([fill(p.kg_template, c) for c in ctx.class_names], truncate=p.truncate)
            self.kg_text = F.normalize(t0.to(self.tower.device), dim=-1).to(self.tower.dtype)  # [K, D]

    def step_loss(self, ctx: Context, params: dict, batch: Batch, local: dict) -> torch.Tensor:
        n = batch.n
        cls = local["cls"][:n]
        t = self.class_text(params, cls, None)  # [n, Kc, D]
        x = batch.x.to(t.dtype) if t.dtype == torch.float16 else batch.x
        logits = ctx.clip_logit_scale * torch.bmm(x, t.to(x.dtype).transpose(1, 2))  # [n, B, Kc]
        loss = self._ce(ctx, logits, batch, local)
        if self.p.kg_weight:
            score = kg_score(t, self.kg_text[cls], local["valid"][:n] if self.masked else None)
            loss = loss + self.p.kg_weight * score.to(loss.dtype) * batch.mask.any(1).to(loss.dtype)
        return loss


def meta_init(seed: int, D: int, W: int, reduction: int, dtype, device) -> dict:
    """CoCoOp's meta-net ``Linear(D, D // r) -> ReLU -> Linear(D // r, W)`` with ``nn.Linear``'s default init
    (weights and biases ``U(±1/√fan_in)``)."""
    g = rng.generator(seed, TAG_META_INIT)
    H = D // reduction
    b1, b2 = 1 / math.sqrt(D), 1 / math.sqrt(H)
    return {
        "meta_W1": _uniform(g, (H, D), b1, dtype, device),
        "meta_b1": _uniform(g, (H,), b1, dtype, device),
        "meta_W2": _uniform(g, (W, H), b2, dtype, device),
        "meta_b2": _uniform(g, (W,), b2, dtype, device),
    }


def meta_bias(P: dict, x: torch.Tensor) -> torch.Tensor:
    """The per-client meta-nets on image features ``x  # [n, B, D]`` -> ``[n, B, W]`` (``cocoop.py:148``)."""
    x = x.to(P["meta_W1"].dtype)
    h = torch.relu(torch.baddbmm(P["meta_b1"].unsqueeze(1), x, P["meta_W1"].transpose(1, 2)))
    return torch.baddbmm(P["meta_b2"].unsqueeze(1), h, P["meta_W2"].transpose(1, 2))


@register
class FedCoCoOp(_CoOpFL):
    """Federated CoCoOp: contexts shifted per image by a meta-net, FedAvg of contexts + meta-net."""

    name = "fedcocoop"
    shardable = True
    dp_client = True  # DP-FedAvg of the contexts
    Params = FedCoCoOpParams
    uses_labels = True

    def setup(self, ctx: Context) -> None:
        super().setup(ctx)
        D = ctx.text.shape[1]
        if D // self.p.meta_reduction < 1:
            raise FedfeatError(
                f"the feature dimension {D} is below meta_reduction = {self.p.meta_reduction}; --set meta_reduction=1"
            )

    def init_global(self, ctx: Context) -> dict[str, torch.Tensor]:
        glob = super().init_global(ctx)
        D, W, c = ctx.text.shape[1], self.tower.width, glob["ctx"]
        return glob | meta_init(ctx.seed, D, W, self.p.meta_reduction, c.dtype, c.device)

    def shifted(self, P: dict, x: torch.Tensor) -> torch.Tensor:
        """Each image's contexts ``ctx + meta_net(x_i)``: ``x  # [n, B, D]`` unit image features -> ``[n, B, n_ctx,
        W]`` (``cocoop.py:144-151``)."""
        c = P["ctx"]
        return c.unsqueeze(1) + meta_bias(P, x).unsqueeze(2).to(c.dtype)

    def image_text(self, shifted: torch.Tensor, cls: torch.Tensor | None) -> torch.Tensor:
        """Unit text features ``[R, Kc, D]`` of the prompts of ``R`` images, ``shifted  # [R, n_ctx, W]`` their
        contexts, ``cls  # [R, Kc]`` the classes of each (None: every class, ``Kc = K``) (``cocoop.py:152-186``)."""
        return F.normalize(self.learner.features(shifted, cls), dim=-1)

    def step_loss(self, ctx: Context, params: dict, batch: Batch, local: dict) -> torch.Tensor:
        n, B = batch.mask.shape
        P = {k: v[:n] for k, v in params.items()}
        rows = batch.mask.reshape(-1).nonzero().squeeze(1)  # the real images only (padding: no prompts)
        shifted = self.shifted(P, batch.x).reshape(n * B, *P["ctx"].shape[1:])[rows]  # [R, n_ctx, W]
        t = self.image_text(shifted, local["cls"][:n][rows // B])  # [R, Kc, D]
        x = batch.x.reshape(n * B, -1)[rows]
        x = x.to(t.dtype) if t.dtype == torch.float16 else x
        logits_r = ctx.clip_logit_scale * torch.bmm(t.to(x.dtype), x.unsqueeze(2)).squeeze(2)  # [R, Kc]
        logits = logits_r.new_zeros(n * B, logits_r.shape[1]).index_copy(0, rows, logits_r)
        return self._ce(ctx, logits.view(n, B, -1), batch, local)

    @torch.no_grad()
    def logits_over(
        self, ctx: Context, glob: dict, x: torch.Tensor, classes: torch.Tensor | None
    ) -> torch.Tensor:
        """Float logits ``[N, Kv]`` of ``x  # [N, D]`` over ``classes  # [Kv]`` (None: all), each image through its
        own prompts, in blocks of ``eval_prompts`` prompts."""
        P = {k: v.unsqueeze(0) for k, v in glob.items()}
        Kv = self.learner.K if classes is None else len(classes)
        cls = None if classes is None else classes.to(self.tower.device)[None]
        step = max(1, self.p.eval_prompts // max(Kv, 1))
        out = []
        for s in range(0, x.shape[0], step):
            xb = x[s : s + step]
            t = self.image_text(
                self.shifted(P, xb.unsqueeze(0))[0], None if cls is None else cls.expand(len(xb), -1)
            )
            xt = xb.to(t.dtype) if t.dtype == torch.float16 else xb
            lg = ctx.clip_logit_scale * torch.bmm(t.to(xt.dtype), xt.unsqueeze(2)).squeeze(2)
            out.append(lg.float() if lg.dtype == torch.float16 else lg)
        return torch.cat(out) if out else x.new_zeros(0, Kv)

    @torch.no_grad()
    def predict(self, ctx: Context, glob: dict, x: torch.Tensor) -> torch.Tensor:
        return self.logits_over(ctx, glob, x, None)

    @torch.no_grad()
    def predict_classes(
        self, ctx: Context, glob: dict, x: torch.Tensor, classes: torch.Tensor
    ) -> torch.Tensor:
        """Each image's prompts for ``classes`` only (a class's prompt does not depend on the other classes)."""
        return classes[self.logits_over(ctx, glob, x, classes).argmax(1).to(classes.device)]


__all__ = [
    "CoOpFLParams",
    "FedCoCoOp",
    "FedCoCoOpParams",
    "FedKgCoOp",
    "FedKgCoOpParams",
    "kg_score",
    "meta_bias",
    "meta_init",
]

"""The prompt-learning part shared by the prompt method families (``promptfl``: PromptFL, FedTPG; ``pfedprompt``;
``fedopt``): CoOp's optimiser settings (``PromptParams``), the unsupervised modes' settings (``PromptFLParams``), the
zero-shot pseudo-labelling of the clients' training sets (``pseudo_label``), the learning rates (``round_lr`` per
round, ``epoch_lr`` per local epoch) and ``PromptMethod``, a method whose trainable part is (or feeds) CoOp contexts
of the live text tower. The families' docstrings (``fedfeat.methods.promptfl``) give the sources of every default.

Readings ``PromptMethod`` implements for every prompt family (each a ``PromptParams`` field; ``PromptParams``'
defaults are the plain FedAvg reading, a family's params override them with its code's):

* ``schedule``: ``"cosine"`` / ``"constant"`` one learning rate per round (``round_lr``); ``"cosine-epoch"`` the
  per-local-epoch schedule of CoOp's trainer (Dassl ``build_lr_scheduler``: ``CosineAnnealingLR(T_max=MAX_EPOCH)``
  wrapped in ``ConstantWarmupScheduler`` -- ``warmup_epochs`` epochs at ``warmup_lr``, then the cosine from ``lr``,
  stepped once per epoch; ``epoch_lr``), set in ``epoch_begin``.
* ``optimizer_state``: ``"fresh"`` every client makes its optimiser (and scheduler) each round; ``"carried"`` one
  optimiser and one scheduler for every client of every round (``fedfeat.engine.rounds.run_carried``): momentum
  carries from client to client, and the per-epoch schedule counts the local epochs of every client that ran before
  (the count is ``ctx.state["prompt_lr_steps"]``, checkpointed).
* ``precision``: ``"fp32"``; ``"fp16"`` the text tower, the contexts (or generator), the logits and the SGD update in
  half precision as OpenAI's CLIP runs (``TextTower.cast``); ``"auto"`` fp16 on a CUDA device, fp32 on a CPU (fp16
  matmuls on a CPU run ~25x slower than fp32: measured 29.4 s vs 1.15 s for one step of 20 ViT-B/16 prompts on a
  2-core EPYC).
* ``optimizer``: ``"sgd"`` (CoOp's, PromptFL's and FedTPG's codes); ``"adamw"`` ``torch.optim.AdamW`` at ``lr`` and a
  decoupled ``weight_decay`` (``momentum`` unused), the reading of Fed-MP's App. A, whose CLIP baselines all ran AdamW
  at lr 1e-5 (``fed-mp-table1`` passes it); fp32 only (fp16 is refused).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Literal, Optional

import torch
import torch.nn.functional as F

from fedfeat.engine.context import Context
from fedfeat.engine.optim import BatchedAdamW, BatchedSGD
from fedfeat.errors import FedfeatError
from fedfeat.methods.base import Method

TAG_CTX_INIT = 301
# ctx.state: the steps of the one scheduler every client shares (optimizer_state="carried", schedule="cosine-epoch")
LR_STEPS = "prompt_lr_steps"


@dataclass(frozen=True)
class PromptParams:
    # PromptFL configs/trainers/CoOp/vit_b16_ep50.yaml MAX_EPOCH 5 = local epochs (rn50: 10)
    local_epochs: int = 5
    batch_size: int = 32  # CoOp configs/trainers/CoOp/*: DATALOADER.TRAIN_X.BATCH_SIZE 32
    lr: float = 0.002  # CoOp OPTIM.LR (PromptFLParams: PromptFL's 0.001)
    momentum: float = 0.9  # Dassl OPTIM.MOMENTUM
    weight_decay: float = 5e-4  # Dassl OPTIM.WEIGHT_DECAY
    # CoOp LR_SCHEDULER cosine, here over the rounds; "cosine-epoch": Dassl's per local epoch (epoch_lr)
    schedule: Literal["cosine", "constant", "cosine-epoch"] = "cosine"
    warmup_rounds: int = (
        0  # ours: the round schedules' warm-up rounds at warmup_lr (cosine-epoch: warmup_epochs)
    )
    warmup_lr: float = 1e-5  # CoOp WARMUP_CONS_LR
    n_ctx: int = 16  # CoOp N_CTX 16 (FedCoPL's text prompt too)
    csc: bool = False  # CoOp CSC False: one context shared by all classes
    ctx_init: str = ""  # CoOp CTX_INIT "": random N(0, 0.02); e.g. "a photo of a" (then n_ctx = its tokens)
    ctx_std: float = 0.02  # CoOp nn.init.normal_(ctx_vectors, std=0.02)
    # cut prompts after the longest EOT (exact for causal towers; fedfeat.encoders.prompt)
    truncate: bool = True
    # ours: unified contexts run [SOS] + contexts once per client, each class only its name .. [EOS] attending to
    # the prefix's cached keys / values (exact under the causal mask; fedfeat.encoders.prompt TextTower.forward_shared).
    # Used where every class shares the client's context (not csc); off: the full prompt per class
    shared_prefix: bool = False
    normalize: bool = True  # L2-normalised image features (CoOp: image_features / norm)
    aggregation: Literal["size", "mean"] = "size"  # FedAvg by client size; "mean": PromptFL's average_weights
    # Dassl WARMUP_EPOCH (CoOp's and PromptFL's configs: 1): the per-epoch schedule's warm-up ("cosine-epoch" only)
    warmup_epochs: int = 1
    # FedAvg clients: a fresh optimiser per client per round; "carried": one for every client and round
    optimizer_state: Literal["fresh", "carried"] = "fresh"
    # the text tower, prompts, logits and update in fp32; "fp16": CLIP's half precision; "auto": fp16 on CUDA only
    precision: Literal["fp32", "fp16", "auto"] = "fp32"
    # CoOp's / Dassl's SGD; "adamw": torch.optim.AdamW (betas 0.9 / 0.999, eps 1e-8, decoupled weight_decay; momentum
    # unused) -- Fed-MP App. A: "all baseline methods that use CLIP ... are optimized via AdamW", lr 1e-5
    optimizer: Literal["sgd", "adamw"] = "sgd"

    def validate(self) -> None:
        if self.local_epochs < 1 or self.batch_size < 1:
            raise FedfeatError(
                f"local_epochs and batch_size must be >= 1, got {self.local_epochs} and {self.batch_size}; "
                "e.g. --set batch_size=32"
            )
        if self.lr <= 0 or self.weight_decay < 0 or not 0 <= self.momentum < 1 or self.warmup_lr <= 0:
            raise FedfeatError(
                f"need lr > 0, warmup_lr > 0, weight_decay >= 0 and momentum in [0, 1), got {self.lr}, "
                f"{self.warmup_lr}, {self.weight_decay}, {self.momentum}; e.g. --set lr=0.002"
            )
        if self.n_ctx < 1 and not self.ctx_init:
            raise FedfeatError(f"n_ctx must be >= 1, got {self.n_ctx}; e.g. --set n_ctx=16")
        if self.ctx_std <= 0 or self.warmup_rounds < 0 or self.warmup_epochs < 0:
            raise FedfeatError(
                f"ctx_std must be > 0 and warmup_rounds, warmup_epochs >= 0, got {self.ctx_std}, "
                f"{self.warmup_rounds} and {self.warmup_epochs}"
            )
        if self.schedule == "cosine-epoch" and self.warmup_rounds:
            raise FedfeatError(
                "schedule=cosine-epoch warms up for warmup_epochs local epochs (Dassl's warm-up), not warmup_rounds; "
                "use --set warmup_rounds=0 (and warmup_epochs=N), or a round schedule (--set schedule=cosine)"
            )


# "PFL" below: PromptFL's code, PEILab-Federated-Learning/PromptFL@da401e7 (the reading its tables came from)


@dataclass(frozen=True)
class PromptFLParams(PromptParams):
    # PFL configs/trainers/CoOp/vit_b16_ep50.yaml:17 (rn50_ep50.yaml:17), scripts/main_pipeline.sh:9
    lr: float = 0.001
    # PFL vit_b16_ep50.yaml:19-22 cosine + 1 constant warm-up epoch, stepped per epoch (trainers/promptfl.py:300)
    schedule: Literal["cosine", "constant", "cosine-epoch"] = "cosine-epoch"
    # PFL utils.py:76-85 average_weights (paper: FedAvg by size)
    aggregation: Literal["size", "mean"] = "mean"
    optimizer_state: Literal["fresh", "carried"] = "carried"  # PFL federated_main.py:163 one local_trainer
    precision: Literal["fp32", "fp16", "auto"] = "auto"  # PFL federated_main.py:99 PREC fp16 (CoOp's default)
    pseudo: Literal["none", "fpl", "cpl", "copl"] = "none"  # none: labelled; fpl / cpl / copl: unsupervised
    pseudo_k: int = 16  # FPL / CPL N_PSEUDOSHOTS: pseudo-labelled samples kept per class (per client here)
    # CPL CONF_QUANTILE (0-100); None: cpl_dataset's value (pseudolabel.cpl_preset), else CPL_GENERAL's 60
    # (textual_fpl_config_PLL.yml); a value given here wins over cpl_dataset's
    conf_quantile: Optional[float] = None  # noqa: UP045  (base._coerce parses typing.Optional, not X | None)
    # CPL REGULAR_THRESHOLD; None: cpl_dataset's, else CPL_GENERAL's 0.90
    regular_threshold: Optional[float] = None  # noqa: UP045
    # ours: the dataset whose CPL settings apply (CPL's scripts/run-textPT_ALL.sh per dataset:
    # pseudolabel.CPL_DEFAULTS); "": CPL_GENERAL. pseudo=cpl only
    cpl_dataset: str = ""
    # FPL's selection (pseudo=fpl): "stream" = the FPL code's per-class leaderboards (menghini-neurips23-code
    # utils/clip_pseudolabels.py:48-109; fedfeat.methods.pseudolabel.fpl_select); "topk": the exact top-k per class
    fpl_select: Literal["stream", "topk"] = "stream"

    def validate(self) -> None:
        super().validate()
        if self.pseudo_k < 1:
            raise FedfeatError(f"pseudo_k must be >= 1, got {self.pseudo_k}; e.g. --set pseudo_k=16")
        if self.conf_quantile is not None and not 0 <= self.conf_quantile <= 100:
            raise FedfeatError(
                f"conf_quantile is a percentile in [0, 100], got {self.conf_quantile}; e.g. --set conf_quantile=60"
            )
        if self.regular_threshold is not None and not 0 < self.regular_threshold <= 1:
            raise FedfeatError(
                f"regular_threshold must be in (0, 1], got {self.regular_threshold}; e.g. --set regular_threshold=0.9"
            )
        if self.cpl_dataset:
            if self.pseudo != "cpl":
                raise FedfeatError(
                    f"cpl_dataset={self.cpl_dataset} applies to pseudo=cpl only; add --set pseudo=cpl or drop "
                    "cpl_dataset"
                )
            known = cpl_datasets()
            if not is_cpl_dataset(self.cpl_dataset):
                raise FedfeatError(
                    f"cpl_dataset '{self.cpl_dataset}' has no CPL settings; known: {', '.join(known)} "
                    "(e.g. --set cpl_dataset=dtd)"
                )

    def cpl_settings(self) -> tuple[float, float]:
        """``(conf_quantile, regular_threshold)`` in force: the explicit values, else ``cpl_dataset``'s, else CPL's
        general ones."""
        from fedfeat.methods.pseudolabel import CPL_GENERAL, cpl_preset

        q, t = cpl_preset(self.cpl_dataset) if self.cpl_dataset else CPL_GENERAL
        return (
            float(q if self.conf_quantile is None else self.conf_quantile),
            float(t if self.regular_threshold is None else self.regular_threshold),
        )


# The datasets CPL / FedCoPL ran with CPL's general settings (no per-dataset line in run-textPT_ALL.sh)
CPL_GENERAL_DATASETS = ("cifar10", "cifar100", "ucf101")


def _norm(name: str) -> str:
    return re.sub(r"[^a-z0-9]", "", name.lower())


def cpl_datasets() -> list[str]:
    """The dataset names ``cpl_dataset`` accepts (any spelling ``pseudolabel.cpl_preset`` knows works too)."""
    from fedfeat.methods.pseudolabel import CPL_DEFAULTS

    return sorted({*CPL_DEFAULTS, *CPL_GENERAL_DATASETS})


def is_cpl_dataset(name: str) -> bool:
    from fedfeat.methods.pseudolabel import CPL_GENERAL, cpl_preset

    return _norm(name) in {_norm(k) for k in cpl_datasets()} or cpl_preset(name) != CPL_GENERAL


def pseudo_label(ctx: Context, how: str, p) -> None:
    """Replace the clients' training sets by their pseudo-labelled selections (``fedfeat.methods.pseudolabel``): zero-shot
    probabilities ``softmax(logit_scale · cos(x, t_k))`` with the store's first template, per client; ``ctx.feats``
    and ``ctx.offsets`` become the kept rows (client-major), ``ctx.state`` gets their labels or candidate sets and
    their positions in the original order (``pseudo_rows``, for the pseudo-label accuracy)."""
    from fedfeat.methods import pseudolabel as pl

    with torch.no_grad():
        text = ctx.text.to(ctx.feats.dtype)
        probs = torch.cat(
            [
                torch.softmax(ctx.clip_logit_scale * F.normalize(x, dim=-1) @ text.T, -1)
                for x in ctx.feats.split(8192)
            ]
        )  # [N, K]
    params = {"k": p.pseudo_k}
    if how == "cpl":
        q, t = p.cpl_settings() if hasattr(p, "cpl_settings") else (p.conf_quantile, p.regular_threshold)
        params |= {"conf_quantile": q, "regular_threshold": t}
    if how == "fpl":
        params["select"] = getattr(p, "fpl_select", "stream")
    if how == "copl":  # FedCoPL's cooperative pseudo-labels (fedfeat.methods.copl), once from zero-shot CLIP
        params = {"round_index": 0}
    sel = pl.make_pseudo_labeller(how, **params)(
        probs, ctx.offsets
    )  # a fedfeat.methods.pseudolabel.Selection
    rows = sel.rows
    if how in ("fpl", "copl"):
        ctx.state["pseudo_labels"] = sel.candidates.float().argmax(1)
    else:
        ctx.state["pseudo_candidates"] = sel.candidates
    ctx.offsets = sel.offsets
    ctx.feats = ctx.feats[rows.to(ctx.feats.device)]
    ctx.state["pseudo_rows"] = rows


def round_lr(p, rnd: int, rounds: int) -> float:
    """The round's learning rate: ``warmup_lr`` for the first ``warmup_rounds`` rounds, then ``lr`` or its cosine
    decay ``lr · (1 + cos(π t / T)) / 2`` over the remaining rounds (Dassl's ``CosineAnnealingLR``, ``eta_min`` 0,
    stepped once per round: ``t`` = rounds done after the warm-up). ``schedule="cosine-epoch"``: ``lr`` (the
    epochs' rates are ``epoch_lr``'s)."""
    if rnd <= p.warmup_rounds:
        return p.warmup_lr
    if p.schedule in ("constant", "cosine-epoch"):
        return p.lr
    T = max(rounds - p.warmup_rounds, 1)
    t = rnd - 1 - p.warmup_rounds
    return p.lr * 0.5 * (1 + math.cos(math.pi * t / T))


def epoch_lr(p, t: int) -> float:
    """The learning rate of the epoch after ``t`` scheduler steps of Dassl's ``build_lr_scheduler`` (``KaiyangZhou/
    Dassl.pytorch@c61a1b5`` ``dassl/optim/lr_scheduler.py:129-141``, ``WARMUP_RECOUNT`` True): ``warmup_lr`` while
    ``t < warmup_epochs`` (``ConstantWarmupScheduler``: its successor is not stepped meanwhile), then
    ``CosineAnnealingLR(T_max = local_epochs)`` (``eta_min`` 0) after ``t - warmup_epochs`` steps,
    ``lr · (1 + cos(π s / T)) / 2``: torch's recursive form continues the cosine past ``T`` (back up to ``lr`` at
    ``2T``), which a scheduler shared by every client reaches (``optimizer_state="carried"``)."""
    if t < p.warmup_epochs:
        return p.warmup_lr
    s = t - p.warmup_epochs
    return p.lr * 0.5 * (1 + math.cos(math.pi * s / p.local_epochs))


def resolve_precision(p, device) -> torch.dtype:
    """``precision`` as a dtype: ``"auto"`` is fp16 on a CUDA device (the reference codes' CLIP), fp32 elsewhere."""
    how = getattr(p, "precision", "fp32")
    if how == "auto":
        how = "fp16" if torch.device(device).type == "cuda" else "fp32"
    return torch.float16 if how == "fp16" else torch.float32


class PromptMethod(Method):
    """A method whose trainable part is (or feeds) CoOp contexts of the live text tower."""

    needs_live_text = True
    runs_on = "cache + live text encoder"
    state_keys = {  # pseudo_label (pseudo != "none") and epoch_begin
        "pseudo_rows": "per-sample: [N_kept] int64 original client-major positions of the pseudo-labelled rows kept",
        "pseudo_labels": "per-sample: [N_kept] int64 hard pseudo-labels of the kept rows (fpl, copl)",
        "pseudo_candidates": "per-sample: [N_kept, K] bool candidate label sets of the kept rows (cpl)",
        LR_STEPS: "server: int client-epochs run so far, the carried cosine-epoch scheduler's count",
    }
    no_stack_reason = (
        "a live encoder: a step is the text (and image) encoder's forward of each run's prompts; stacking would be a "
        "larger encoder batch, not less overhead"
    )

    def setup(self, ctx: Context) -> None:
        p = self.p
        self.dtype = resolve_precision(p, ctx.device)
        self.tower = ctx.live.tower.cast(self.dtype) if self.dtype == torch.float16 else ctx.live.tower
        n_ctx = p.n_ctx
        if p.ctx_init:
            from fedfeat.encoders.prompt import phrase_tokens

            n_ctx = phrase_tokens(self.tower, p.ctx_init).shape[0]
        if self.tower is ctx.live.tower:
            self.learner = ctx.live.learner(
                ctx.class_names, n_ctx, truncate=p.truncate, shared_prefix=p.shared_prefix
            )
        else:
            from fedfeat.encoders.prompt import PromptLearner

            self.learner = PromptLearner(
                self.tower, ctx.class_names, n_ctx, truncate=p.truncate, shared_prefix=p.shared_prefix
            )
        self.rounds = ctx.rounds

    def make_optimizer(self, rnd: int):
        p = self.p
        if getattr(p, "optimizer", "sgd") == "adamw":  # Fed-MP App. A's reading of the CLIP baselines
            if self.dtype == torch.float16:  # eps 1e-8 and v = g² underflow in fp16: inf / NaN steps
                raise FedfeatError(
                    f"{self.name} optimizer=adamw runs in fp32 only (its eps and second moments underflow in "
                    "fp16); add --set precision=fp32"
                )
            self._opt = BatchedAdamW(lr=round_lr(p, rnd, self.rounds), weight_decay=p.weight_decay)
            return self._opt
        self._opt = BatchedSGD(
            lr=round_lr(p, rnd, self.rounds), momentum=p.momentum, weight_decay=p.weight_decay
        )
        return self._opt

    def epoch_begin(self, ctx: Context, plan, local: dict, epoch: int) -> None:
        """``schedule="cosine-epoch"``: the epoch's learning rate (``epoch_lr``), counted per client from its first
        local epoch (``optimizer_state="fresh"``: a scheduler made with the client's optimiser each round), or over
        every client-epoch run so far (``"carried"``: one scheduler, stepped at the end of each client's epoch;
        a client without samples never steps it, as its empty loader never reaches ``update_lr``)."""
        p = self.p
        if getattr(p, "schedule", "") != "cosine-epoch":
            return
        if self.carries_optimizer():
            t = int(ctx.state.get(LR_STEPS, 0))
            self._opt.lr = epoch_lr(p, t)
            if int(plan.sizes.sum()) > 0:
                ctx.state[LR_STEPS] = t + 1
        else:
            self._opt.lr = epoch_lr(p, epoch)

    def text_features(self, ctx: Context, params: dict) -> torch.Tensor:
        """Unit class text features ``[n, K, D]`` of the clients' parameters ``{name: [n, ...]}``."""
        return F.normalize(self.learner.features(params["ctx"]), dim=-1)

    def logits(self, ctx: Context, params: dict, x: torch.Tensor) -> torch.Tensor:
        """``x  # [n, B, D]`` -> ``[n, B, K]`` at CLIP's logit scale (fp16 text features: fp16 logits, as CLIP's
        ``logit_scale.exp() * image_features @ text_features.t()`` in half precision)."""
        t = self.text_features(ctx, params)
        if t.dtype == torch.float16:
            x = x.to(t.dtype)
        else:
            t = t.to(x.dtype)
        return ctx.clip_logit_scale * torch.bmm(x, t.transpose(1, 2))

    @torch.no_grad()
    def predict(self, ctx: Context, glob: dict, x: torch.Tensor) -> torch.Tensor:
        t = self.text_features(ctx, {k: v.unsqueeze(0) for k, v in glob.items()})[0]  # [K, D]
        if t.dtype == torch.float16:
            return (ctx.clip_logit_scale * x.to(t.dtype) @ t.T).float()
        return ctx.clip_logit_scale * x @ t.to(x.dtype).T


def pseudo_loss(ctx: Context, logits: torch.Tensor, batch, pseudo: str) -> torch.Tensor:
    """The prompt methods' local loss per client ``[n]``: CE on the true labels (``pseudo="none"``), on FPL's /
    CoPL's hard pseudo-labels, or CPL's candidate-set loss ``-log sum_{j in S} p_j`` (``cc``); ``logits  # [n, B, K]``,
    padding rows masked out (``batch.mask``)."""
    from fedfeat.engine.context import masked_mean

    n, B, K = logits.shape
    if pseudo == "cpl":
        from fedfeat.methods.pseudolabel import cc_loss

        loss = cc_loss(logits, ctx.state["pseudo_candidates"][batch.pos], batch.mask)  # [n, B]
    else:
        y = batch.y if pseudo == "none" else ctx.state["pseudo_labels"][batch.pos]
        loss = F.cross_entropy(logits.reshape(n * B, K), y.reshape(-1), reduction="none").view(n, B)
    return masked_mean(loss, batch.mask)


def client_weights(ctx: Context, plan, aggregation: str) -> torch.Tensor | None:
    """The prompts' aggregation weights ``[m]``: client sizes (``"size"``: FedAvg; the selected-set sizes in the
    unsupervised modes), or 1 for every sampled client that trained (``"mean"``); None when no sampled client holds
    a (pseudo-labelled) sample (the server then keeps its prompt)."""
    w = plan.sizes.to(ctx.device)
    if int(w.sum()) == 0:
        return None
    return (w > 0).to(w.dtype) if aggregation == "mean" else w


def client_scores(scale: float, x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """Each client's logits: ``x  # [n, B, D]``, ``t  # [n, K, D]`` (its own text features) -> ``scale * x t^T  #
    [n, B, K]`` (fp16 text features: fp16 logits, as ``PromptMethod.logits``)."""
    if t.dtype == torch.float16:
        x = x.to(t.dtype)
    else:
        t = t.to(x.dtype)
    return scale * torch.bmm(x, t.transpose(1, 2))


def refuse_open_vocab(ctx: Context, name: str, kept: str) -> None:
    """A personalised prompt method keeps per-client parts (``kept``) over the run's classes: one line refusing the
    open-vocabulary setting."""
    if ctx.open_vocab is not None:
        raise FedfeatError(
            f"{name} keeps {kept} over the run's classes; the open-vocabulary setting (--partition disjoint-classes) "
            "is not supported: use a closed partition"
        )


EVAL_ROWS = (
    1024  # local test rows per client and pass (bounds a [clients, rows, classes or memory] temporary)
)


@torch.no_grad()
def per_client_scores(ctx: Context, rows: list, score) -> list[torch.Tensor]:
    """Each client's scores ``[len(rows[i]), K]`` on its test rows ``rows[i]`` (of ``ctx.test_x``), all clients at
    once, ``EVAL_ROWS`` rows per client and pass: ``score(x  # [C, E, D]) -> [C, E, K]`` scores every client's block
    with its own model (the personalised prompt methods' local evaluation)."""
    C = len(rows)
    lens = [len(r) for r in rows]
    out: list[list[torch.Tensor]] = [[] for _ in range(C)]
    for s in range(0, max(lens, default=0), EVAL_ROWS):
        idx = torch.zeros(C, EVAL_ROWS, dtype=torch.int64)
        for i, r in enumerate(rows):
            part = torch.as_tensor(r[s : s + EVAL_ROWS], dtype=torch.int64)
            idx[i, : len(part)] = part
        z = score(ctx.test_x[idx.to(ctx.test_x.device)])
        for i in range(C):
            out[i].append(z[i, : max(0, min(EVAL_ROWS, lens[i] - s))])
    return [torch.cat(o) if o else torch.zeros(0, ctx.K, device=ctx.device) for o in out]


def client_accuracies(logits: list[torch.Tensor], rows: list, test_y: torch.Tensor) -> list[float]:
    """Each client's accuracy (%) of its logits on its local test rows (clients without rows left out)."""
    return [
        100 * float((z.argmax(1) == test_y[torch.as_tensor(r).to(test_y.device)]).double().mean())
        for z, r in zip(logits, rows)
        if len(r)
    ]


def pseudo_metrics(ctx: Context, data, pseudo: str) -> dict:
    """The pseudo-labels' accuracy against the true labels (a metric only: ``pseudo_label_acc``; for CPL the share of
    samples whose candidate set holds the true class, and ``pseudo_set_size``), and how many samples were kept."""
    if pseudo == "none" or "pseudo_rows" not in ctx.state:
        return {}
    rows = ctx.state["pseudo_rows"]
    truth = data.train_y[rows.to(data.train_y.device)]
    out: dict = {"pseudo_samples": len(rows)}
    if not len(rows):
        return out
    if "pseudo_labels" in ctx.state:
        y = ctx.state["pseudo_labels"].to(truth.device)
        out["pseudo_label_acc"] = 100 * float((y == truth).double().mean())
    else:
        cand = ctx.state["pseudo_candidates"].to(truth.device)
        hit = cand[torch.arange(len(truth), device=truth.device), truth]
        out["pseudo_label_acc"] = 100 * float(hit.double().mean())
        out["pseudo_set_size"] = float(cand.sum(1).double().mean())
    return out


class PersonalEval:
    """The evaluation hooks of a personalised prompt method whose ``local_logits(ctx, glob, rows)`` scores each
    client's local test rows with its own model (FedPGP / PromptFolio's personalised prompt, pFedMoAP's mixture,
    pFedPrompt's memory): each client's accuracy there (the ``local_accuracies`` capability) and the pseudo-label
    figures of the round. Mixed in before ``PromptMethod``."""

    @torch.no_grad()
    def local_accuracies(self, ctx: Context, glob: dict, test_y: torch.Tensor) -> list[float]:
        """Each client's accuracy on its local test rows with its own model (``local_logits``)."""
        rows = [torch.as_tensor(r, dtype=torch.int64) for r in ctx.local_test]
        return client_accuracies(self.local_logits(ctx, glob, rows), rows, test_y)

    def round_metrics(self, ctx: Context, data, glob: dict, ev: dict) -> dict:
        return pseudo_metrics(ctx, data, self.p.pseudo)


__all__ = [
    "client_weights",
    "pseudo_loss",
    "pseudo_metrics",
    "PersonalEval",
    "PromptMethod", "PromptParams", "PromptFLParams", "pseudo_label", "round_lr", "epoch_lr", "resolve_precision",
    "cpl_datasets", "TAG_CTX_INIT", "LR_STEPS",
]  # fmt: skip

"""Prompt learning through the live text encoder: PromptFL and its unsupervised (pseudo-labelled) modes, and
FedTPG (a prompt generator shared by the clients; its section below).

**promptfl** (Guo et al., "PromptFL: Let Federated Participants Cooperatively Learn Prompts Instead of Models",
IEEE TMC 2023; the baseline of Fed-MP's and FedCoPL's tables): every client trains CoOp context vectors
(``fedfeat.encoders.prompt``; Zhou et al. IJCV 2022) on its labelled data with the frozen CLIP, the server averages
them. Image features come from the store (they do not depend on the prompt); only the ``K`` class prompts go through
the text tower, once per step for all active clients. The loss is CoOp's: cross-entropy of
``logit_scale · cos(image, prompt_k)`` with CLIP's own logit scale.

Defaults are the reading PromptFL's tables came from, its code (``PEILab-Federated-Learning/PromptFL@da401e7``,
"PFL"; built on CoOp ``KaiyangZhou/CoOp@ff61507`` and Dassl ``KaiyangZhou/Dassl.pytorch@c61a1b5``); each is a
switch of ``PromptFLParams`` / ``PromptParams`` (``fedfeat.methods.prompt``):

* ``lr`` 0.001 (PFL ``configs/trainers/CoOp/vit_b16_ep50.yaml:17``, ``scripts/main_pipeline.sh:9``; CoOp's own
  configs use 0.002), SGD momentum 0.9, weight decay 5e-4 (Dassl's defaults), batch 32, 16 unified context tokens
  N(0, 0.02), class token at the end, 5 local epochs (``vit_b16_ep50.yaml:18`` MAX_EPOCH; rn50: 10).
* ``aggregation="mean"``: PFL ``utils.py:76-85`` ``average_weights`` is unweighted; ``"size"`` is the paper's
  FedAvg by client sample counts. (The code's list of client weights is never cleared, ``federated_main.py:161,186``,
  and holds ``state_dict()`` views that alias the one local model's tensors, so its "average" is the last client's
  prompt summed and divided in fp16 -- bugs, not reproduced: every sampled client's trained prompt counts once.)
* ``schedule="cosine-epoch"``: the yaml's cosine schedule with one constant warm-up epoch at 1e-5
  (``vit_b16_ep50.yaml:19-22``) is Dassl's ``build_lr_scheduler`` (``CosineAnnealingLR(T_max=MAX_EPOCH)`` in a
  ``ConstantWarmupScheduler``), stepped at the end of every local epoch (``trainers/promptfl.py:300-301``):
  ``fedfeat.methods.prompt.epoch_lr``; ``warmup_epochs`` 1, ``warmup_lr`` 1e-5. ``"cosine"``: one rate per round,
  cosine over the rounds (``warmup_rounds``); ``"constant"``.
* ``optimizer_state="carried"``: PFL builds one ``local_trainer`` (``federated_main.py:163``) whose SGD and scheduler
  serve every client of every round (``trainers/promptfl.py:265-266``), so momentum carries from client to client
  and the schedule counts every client's local epochs (with 10 clients x 5 epochs its cosine runs through 5 periods
  a round: the learning rate oscillates). The engine runs the clients one after another
  (``fedfeat.engine.rounds.run_carried``, ascending client id as PFL's ``range(USERS)``); the scheduler's count is
  checkpointed. ``"fresh"``: each client makes its optimiser and scheduler each round, as FedAvg clients do (batched
  over clients).
* ``precision="auto"``: PFL runs CLIP in half precision (``federated_main.py:99`` PREC "fp16", CoOp's default:
  the contexts, the text tower, the logits and the SGD update in fp16); ``"auto"`` is fp16 on a CUDA device and fp32
  on a CPU, where fp16 matmuls are ~25x slower (``fedfeat.methods.prompt``); ``"fp16"`` / ``"fp32"`` force one.
  Image features are the store's, L2-normalised in fp32, then rounded to fp16.
* **No augmentation** (a forced choice, no switch): CoOp / PFL train on ``random_resized_crop`` + ``random_flip``
  views (``vit_b16_ep50.yaml:13``); the store holds one centre crop per image (CLIP's eval transform), which every
  epoch reuses.
* **Open vocabulary** (``--partition disjoint-classes``): training is over the base classes only (the logits of the
  novel classes are masked: their names never reach training, as CoOp's ``SUBSAMPLE_CLASSES=base``); evaluation
  ranks the novel (base) classes' prompts.

(PFL as published does not run as is: ``federated_main.py`` imports ``trainers.coop`` and ``draw``, which the
repository lacks, and the trainer reads ``cfg.TRAINER.COOP`` where the config defines ``TRAINER.PROMPTFL``; the
readings above are what the code says.)

**Unsupervised mode** (``pseudo=fpl|cpl|copl``; FedCoPL's FPL / CPL baselines, whose federated versions are
unreleased): the method never reads labels (``uses_labels`` is False: the engine hands it none). At setup every
client pseudo-labels its own data with zero-shot CLIP (the store's first template) through a reusable
pseudo-labeller of ``fedfeat.methods.pseudolabel``; its selected samples become its training set (aggregation weights are
the selected-set sizes with ``aggregation="size"``) and the loss is CE on hard labels (FPL) or CPL's candidate-set
loss ``-log Σ_{j∈S} p_j`` (``cc``). CPL's quantiles: ``cpl_dataset`` names the dataset whose settings apply
(``pseudolabel.cpl_preset``: CPL's per-dataset ``CONF_QUANTILE`` / ``REGULAR_THRESHOLD``; ``--set pseudo=cpl --set
cpl_dataset=dtd``); an explicit ``--set conf_quantile=..`` / ``regular_threshold=..`` wins over it; neither: CPL's
general 60 / 0.90. Pseudo-labels are fixed for the run (FPL's static labels; CPL refreshes its candidate sets with the
trained model during training, which this mode does not yet do: a documented deviation). ``round_metrics`` reports
the pseudo-labels' accuracy (``pseudo_label_acc``; for CPL: the share of samples whose candidate set holds the true
class) against the true labels. Not in the open-vocabulary setting.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal

import torch
import torch.nn.functional as F

from fedfeat.engine import rng
from fedfeat.engine.context import Batch, Context, RoundPlan, fedavg, masked_mean
from fedfeat.engine.optim import BatchedSGD
from fedfeat.errors import FedfeatError
from fedfeat.methods.base import register
from fedfeat.methods.prompt import (  # noqa: F401  (re-exported: promptfl.PromptParams ...)
    TAG_CTX_INIT,
    PromptFLParams,
    PromptMethod,
    PromptParams,
    client_weights,
    epoch_lr,
    pseudo_label,
    pseudo_loss,
    pseudo_metrics,
    round_lr,
)


def _average(cparams: dict, w: torch.Tensor) -> dict:
    """``fedavg``; half-precision parameters are averaged in float32 and rounded once (the reference codes add the
    fp16 tensors one by one: the result differs by rounding only)."""
    if not any(v.dtype == torch.float16 for v in cparams.values()):
        return fedavg(cparams, w)
    out = fedavg({k: v.float() for k, v in cparams.items()}, w)
    return {k: out[k].to(cparams[k].dtype) for k in out}


@register
class PromptFL(PromptMethod):
    """PromptFL (Guo et al. 2023): CoOp text prompts trained through the live text encoder, FedAvg of contexts."""

    name = "promptfl"
    shardable = True  # torchrun may shard its clients (pseudo-labels are fixed at set-up on every rank)
    dp_client = True  # DP-FedAvg of the contexts (fedfeat.engine.privacy)
    dp_sample = "text"  # DP-SGD through the text tower (dp_clipped_sums; true labels only)
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
        self.novel = None  # [K] bool: the classes training must not see (open vocabulary)
        if ctx.open_vocab is not None:
            if self.pseudo != "none":
                raise FedfeatError(
                    f"{self.name} pseudo={self.pseudo} is not supported in the open-vocabulary setting (--partition "
                    "disjoint-classes); drop --set pseudo or use a closed partition"
                )
            self.novel = torch.zeros(len(ctx.class_names), dtype=torch.bool, device=ctx.device)
            self.novel[ctx.open_vocab.novel.to(ctx.device)] = True
        if self.pseudo != "none":
            pseudo_label(ctx, self.pseudo, self.p)

    def init_global(self, ctx: Context) -> dict[str, torch.Tensor]:
        p = self.p
        g = rng.generator(ctx.seed, TAG_CTX_INIT)
        return {"ctx": self.learner.init_context(g, csc=p.csc, phrase=p.ctx_init, std=p.ctx_std)}

    def step_loss(self, ctx: Context, params: dict, batch: Batch, local: dict) -> torch.Tensor:
        logits = self.logits(ctx, params, batch.x)  # [n, B, K]
        if self.novel is not None:  # open vocabulary: CE over the base classes
            logits = logits.masked_fill(self.novel, float("-inf"))
        return pseudo_loss(ctx, logits, batch, self.pseudo)

    def aggregate(self, ctx: Context, plan: RoundPlan, glob: dict, cparams: dict) -> dict:
        w = client_weights(ctx, plan, self.p.aggregation)
        return glob if w is None else _average(cparams, w)

    def round_metrics(self, ctx: Context, data, glob: dict, ev: dict) -> dict:
        return pseudo_metrics(ctx, data, self.pseudo)

    def dp_clipped_sums(self, ctx: Context, params: dict, batch: Batch, local: dict, clip: float):
        """Sample-level DP (``dp_sample = "text"``): the loss reaches the context only through the class text
        features ``t  # [n, K, D]``, so sample ``i``'s gradient is ``J^T (s g_i (x) x_i)`` (``g_i``: its CE's gradient
        w.r.t. its logits, ``J = dt / dctx``). Its norms: one batched vector-Jacobian product per ``vjp_chunk``
        samples (``is_grads_batched``); the clipped sum: one ordinary backward pass with the clipped cotangent."""
        from fedfeat.engine.privacy import clip_factors

        if self.pseudo != "none":
            raise FedfeatError(
                f"--dp sample needs the true labels' per-sample loss; {self.name} pseudo={self.pseudo} is not "
                "supported (drop --set pseudo, or use --dp client)"
            )
        n, B = batch.x.shape[:2]
        s = ctx.clip_logit_scale
        chunk = max(1, int(ctx.dp.vjp_chunk))
        with torch.enable_grad():
            leaves = {k: v.detach().requires_grad_(True) for k, v in params.items()}
            t = self.text_features(ctx, leaves)  # [n, K, D]
            tt = t.detach().to(batch.x.dtype).requires_grad_(True)
            z = s * torch.bmm(batch.x, tt.transpose(1, 2))  # [n, B, K]
            if self.novel is not None:  # open vocabulary: CE over the base classes
                z = z.masked_fill(self.novel, float("-inf"))
            K = z.shape[-1]
            per = F.cross_entropy(z.reshape(n * B, K), batch.y.reshape(-1), reduction="none").view(n, B)
            (g,) = torch.autograd.grad((per * batch.mask.to(per.dtype)).sum(), z)  # [n, B, K]
            g = (g * batch.mask.unsqueeze(-1).to(g.dtype)).to(t.dtype)
            x = batch.x.to(t.dtype)
            names = list(leaves)
            norms = torch.zeros(n, B, dtype=torch.float64, device=g.device)
            for a in range(0, B, chunk):
                cot = s * g[:, a : a + chunk, :, None] * x[:, a : a + chunk, None, :]  # [n, b, K, D]
                per_grads = torch.autograd.grad(
                    t,
                    [leaves[k] for k in names],
                    cot.transpose(0, 1),
                    retain_graph=True,
                    is_grads_batched=True,
                )  # each [b, n, ...]
                norms[:, a : a + chunk] = torch.sqrt(
                    sum(v.double().flatten(2).pow(2).sum(-1) for v in per_grads)
                ).T
            f = clip_factors(norms, clip).to(g.dtype)  # [n, B]
            cot = s * torch.bmm(
                (g * f.unsqueeze(-1)).transpose(1, 2), x
            )  # [n, K, D]: sum_i f_i s g_i (x) x_i
            sums = dict(zip(names, torch.autograd.grad(t, [leaves[k] for k in names], cot)))
        return masked_mean(per.detach(), batch.mask), sums


# ---------------------------------------------------------------------------------------- FedTPG
# FedTPG (Qiu et al., "Federated Text-driven Prompt Generation for Vision-Language Models", ICLR 2024; Fed-MP's
# baseline), following the public code ``boschresearch/FedTPG@f141c29`` ("TPG" below: ``model/prompt_net.py``,
# ``model/FedTPG.py``, ``federated/server.py``, ``federated/client.py``, ``config/defaults.py``, ``Launch_FL.py``).
#
# A *prompt generator* shared by all clients maps the class names' text embeddings to CoOp context vectors:
#
# * input: the frozen, L2-normalised text features of the bare class names (``clip.tokenize(classname)``, no
#   template; ``model/FedTPG.py:159-167``), ``[Kc, D]``, computed once through the live tower;
# * ``PromptTranslator``: learnable queries ``soft_prompt  # [n_ctx, W]`` (N(0, 0.02)) cross-attend to them --
#   ``x = MHA(LN(q), LN_ctx(e), LN_ctx(e))`` (4 heads, ``kdim = vdim = D``, **no residual** around the cross
#   attention, as the code), then ``x = FF(x) + x`` with ``FF = LN -> Linear(W, 8W) -> GEGLU -> Linear(4W, W)``;
#   then ``depth`` self-attention blocks (pre-norm, residual; the code's default depth is 0);
# * the ``n_ctx`` outputs are the unified context of every class's prompt ``[SOS] ctx {class}. [EOS]`` (depth 1:
#   text prompts only), encoded by the frozen text tower; loss CE at CLIP's logit scale.
#
# Clients train the generator with SGD (lr 0.003, momentum 0.9, weight decay 1e-5, cosine over the rounds; batch 200,
# one local epoch per round: ``config/defaults.py:71-82`` and ``Launch_FL.py:100-103``) and the server averages the
# generators **unweighted** (``server.py:158-160``: ``w_glob[k] / num_selected``; ``aggregation="size"`` weights by
# sample counts). Training images go through CLIP's eval transform (``dataloader/dm_federated.py:144``
# ``_transform(224)``): the store's centre crops are exactly what TPG trains on.
#
# Readings, each a switch (defaults: TPG's):
#
# * ``classes="client"``: a client's generator input and its classifier are its own classes only (``client.py:96``
#   ``classnames = self.available_classes``, labels relabelled within them: ``dm_federated.py:114`` ``relabel=True``):
#   the generator attends to its classes' name embeddings and the CE runs over them. Batched over clients: each
#   client's class list padded to the longest, the padding masked out of the attention and the logits (an exact
#   restriction). A client's classes are those of its training samples (open vocabulary: its drawn classes).
#   ``"all"``: every client sees the run's whole training vocabulary (open vocabulary: the base classes).
#   Evaluation conditions the generator on the classes asked about: all of them (closed; ``server.py:191``), or the
#   novel (base) classes' names for the novel (base) accuracy of the open-vocabulary setting (``server.py:263-265``
#   ``test('base')``, ``test('new')``) -- the base-to-novel generalisation FedTPG was built for.
# * ``precision="auto"``: TPG runs CLIP in fp16 (``clip.build_model`` -> ``convert_weights``) and halves the generator
#   (``model/FedTPG.py:107`` ``self.meta_net.half()``), so the generator's weights, its SGD update and the text
#   tower compute in fp16; ``"auto"`` is fp16 on a CUDA device, fp32 on a CPU (fp16 ~25x slower there).
# * ``optimizer_state="per-client"``: every TPG client builds its optimizer and scheduler once (``client.py:86-88``)
#   and keeps them across rounds: its momentum carries from its last round to its next, and its cosine
#   (``T_max`` = the rounds) steps once per round it trains (``client.py:115``). Kept per client in ``ctx.state``
#   (checkpointed); with partial participation each client's rate follows its own count of trained rounds. ``"fresh"``:
#   each client starts each round with a fresh optimiser at the round's cosine rate (FedAvg clients); ``"carried"``:
#   one optimiser for all clients (PromptFL's code, not TPG's).

TAG_GENERATOR_INIT = 302
CLIENT_MOMENTUM, CLIENT_ROUNDS = "tpg_momentum", "tpg_rounds"  # ctx.state keys (optimizer_state="per-client")


def check_tpg_optimizer(p, who: str = "") -> None:
    """FedTPG's harness keeps one SGD and cosine schedule per client (``optimizer_state=per-client``): refuse the
    schedule and optimiser that reading cannot hold (FedTPG's own params and its CoOp baselines'; ``who`` prefixes
    the AdamW line)."""
    if p.schedule == "cosine-epoch" and p.optimizer_state == "per-client":
        raise FedfeatError(
            "schedule=cosine-epoch with optimizer_state=per-client is not a reading of FedTPG's code; use "
            "--set schedule=cosine (TPG's) or optimizer_state=fresh"
        )
    if p.optimizer == "adamw" and p.optimizer_state == "per-client":
        raise FedfeatError(
            f"{who}optimizer=adamw keeps no per-client AdamW state (optimizer_state=per-client is TPG's SGD); "
            "add --set optimizer_state=fresh"
        )


@dataclass(frozen=True)
class FedTPGParams(PromptParams):
    local_epochs: int = 1  # TPG client.py:98: one pass over the train loader per round
    batch_size: int = 200  # TPG Launch_FL.py:103 --batch_size 200
    lr: float = 0.003  # TPG config/defaults.py:73 OPTIM.LR
    momentum: float = 0.9  # TPG config/defaults.py:75 OPTIM.MOMENTUM
    weight_decay: float = 1e-5  # TPG config/defaults.py:74 OPTIM.WEIGHT_DECAY
    n_ctx: int = 4  # TPG Launch_FL.py:97 --n_ctx 4 (MODEL.N_CTX)
    depth: int = 0  # TPG Launch_FL.py:94 --model_depth 0: self-attention blocks after the cross attention
    heads: int = 4  # TPG prompt_net.py PromptTranslator cross_heads = self_heads = 4
    ff_mult: int = 4  # TPG prompt_net.py FeedForward mult 4 (GEGLU: Linear(W, 2·4W))
    # TPG server.py:158-160 unweighted mean; "size": FedAvg by samples
    aggregation: Literal["size", "mean"] = "mean"
    # TPG client.py:96 each client's own classes; "all": the vocabulary
    classes: Literal["client", "all"] = "client"
    precision: Literal["fp32", "fp16", "auto"] = "auto"  # TPG FedTPG.py:107 meta_net.half() + CLIP fp16
    # TPG client.py:86-88 one optimizer + scheduler per client, kept across rounds; fresh; carried (one for all)
    optimizer_state: Literal["fresh", "carried", "per-client"] = "per-client"

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
        check_tpg_optimizer(self, "fedtpg ")


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


def _mha(q_in, kv_in, P, pre: str, heads: int, key_mask=None):
    """Batched ``nn.MultiheadAttention`` (no dropout): ``q_in  # [n, Lq, W]``, ``kv_in  # [n, Lk, C]``; ``key_mask  #
    [n, Lk]`` bool, False: a key no query attends to (``key_padding_mask``'s complement)."""
    n, Lq, W = q_in.shape
    b = P[pre + "bqkv"]
    q = torch.baddbmm(b[:, None, :W], q_in, P[pre + "Wq"].transpose(1, 2))
    k = torch.baddbmm(b[:, None, W : 2 * W], kv_in, P[pre + "Wk"].transpose(1, 2))
    v = torch.baddbmm(b[:, None, 2 * W :], kv_in, P[pre + "Wv"].transpose(1, 2))
    dh = W // heads
    q, k, v = (t.view(n, -1, heads, dh).transpose(1, 2) for t in (q, k, v))  # [n, h, L, dh]
    s = q @ k.transpose(-1, -2) / math.sqrt(dh)  # [n, h, Lq, Lk]
    if key_mask is not None:
        s = s.masked_fill(~key_mask[:, None, None, :], float("-inf"))
    a = torch.softmax(s, dim=-1)
    o = (a @ v).transpose(1, 2).reshape(n, Lq, W)
    return torch.baddbmm(P[pre + "bo"].unsqueeze(1), o, P[pre + "Wo"].transpose(1, 2))


def _ff(x, P, pre: str):
    h = torch.baddbmm(P[pre + "b1"].unsqueeze(1), _ln(x, P, pre + "ln_"), P[pre + "W1"].transpose(1, 2))
    a, gates = h.chunk(2, dim=-1)
    return torch.baddbmm(P[pre + "b2"].unsqueeze(1), a * F.gelu(gates), P[pre + "W2"].transpose(1, 2))


def generate(P: dict, emb: torch.Tensor, depth: int, heads: int, key_mask=None) -> torch.Tensor:
    """Contexts ``[n, n_ctx, W]`` of per-client generators ``P  # {name: [n, ...]}`` from the class-name embeddings
    ``emb  # [Kc, D]`` (every client the same) or ``[n, Kc, D]`` (each its own, ``key_mask  # [n, Kc]`` marking the
    real ones) (``PromptTranslator.forward``)."""
    n = P["soft_prompt"].shape[0]
    e = emb.unsqueeze(0).expand(n, -1, -1) if emb.dim() == 2 else emb
    kv = _ln(e.to(P["soft_prompt"].dtype), P, "x_lnctx_")
    x = _mha(_ln(P["soft_prompt"], P, "x_ln_"), kv, P, "x_", heads, key_mask)  # no residual (CrossAttention)
    x = _ff(x, P, "x_ff_") + x
    for i in range(depth):
        h = _ln(x, P, f"s{i}_ln_")
        x = _mha(h, h, P, f"s{i}_", heads) + x
        x = _ff(x, P, f"s{i}_ff_") + x
    return x


@dataclass
class _ClientSGD(BatchedSGD):
    """``BatchedSGD`` with one learning rate per client (``lrs  # [m]``; None: ``lr`` for all): TPG's per-client
    schedulers under partial participation."""

    lrs: torch.Tensor | None = field(default=None)

    @torch.no_grad()
    def step(self, params: dict, grads: dict, n: int) -> None:
        if self.lrs is None:
            return super().step(params, grads, n)
        for k, g in grads.items():
            p = params[k][:n]
            d = (g if g.is_contiguous() else g.contiguous()).add_(p, alpha=self.weight_decay)
            if self.momentum:
                bufs = self.state["buf"]
                if bufs[k] is None:
                    bufs[k] = torch.zeros_like(params[k])
                d = bufs[k][:n].mul_(self.momentum).add_(d)
            lr = self.lrs[:n].view(-1, *([1] * (p.dim() - 1)))
            p.copy_((p.float() - lr * d.float()).to(p.dtype))


@register
class FedTPG(PromptFL):
    """FedTPG (Qiu et al. 2024): a text-driven prompt generator shared by all clients, FedAvg of the generator."""

    name = "fedtpg"
    dp_client = True  # DP-FedAvg of the prompt generator
    state_keys = {  # optimizer_state="per-client"
        CLIENT_MOMENTUM: "per-client: {name: [C, *param shape]} each client's SGD momentum buffers",
        CLIENT_ROUNDS: "per-client: [C] int64 rounds each client has run (its scheduler's step)",
    }
    shardable = True
    Params = FedTPGParams
    uses_labels = True

    def setup(self, ctx: Context) -> None:
        super().setup(ctx)
        p = self.p
        W = self.tower.width
        if W % p.heads:
            raise FedfeatError(f"the text width {W} is not divisible by heads = {p.heads}; --set heads=...")
        if p.optimizer_state == "per-client":
            from fedfeat.engine.rounds import dist_info

            if dist_info()[1] > 1:
                raise FedfeatError(
                    "fedtpg optimizer_state=per-client keeps each client's optimiser in this process; run it in one "
                    "process or --set optimizer_state=fresh"
                )
        with torch.no_grad():  # the bare class names, as FedTPG.forward's clip.tokenize(classname)
            self.name_emb = F.normalize(self.tower.encode(ctx.class_names, truncate=p.truncate), dim=-1)
        self._class_lists(ctx)

    def _class_lists(self, ctx: Context) -> None:
        """Each client's classes (``classes="client"``) or the training vocabulary (``"all"``), padded: ``self.cls  #
        [C, Kc]`` ids, ``self.valid  # [C, Kc]`` bool, ``self.lut  # [C, K]`` a class's position in its client's list."""
        K, C, ov = len(ctx.class_names), ctx.n_clients, ctx.open_vocab
        vocab = ov.base.cpu() if ov is not None else torch.arange(K)
        if self.p.classes == "all":
            lists = [vocab] * C
        elif ov is not None:
            lists = [c.cpu() for c in ov.client_classes]
        else:  # the classes of each client's training samples
            lab, off = ctx.labels.cpu(), ctx.offsets.tolist()
            lists = [torch.unique(lab[off[i] : off[i + 1]]) for i in range(C)]
        lists = [c if len(c) else vocab for c in lists]  # a client without samples never trains
        Kc = max(len(c) for c in lists)
        cls = torch.stack([torch.cat([c, c[:1].expand(Kc - len(c))]) for c in lists])  # pad: its first class
        valid = torch.arange(Kc)[None, :] < torch.tensor([len(c) for c in lists])[:, None]
        lut = torch.zeros(C, K, dtype=torch.int64)
        for i, c in enumerate(lists):
            lut[i, c] = torch.arange(len(c))
        self.cls, self.valid, self.lut = (t.to(ctx.device) for t in (cls, valid, lut))
        self.masked = not bool(valid.all())

    def init_global(self, ctx: Context) -> dict[str, torch.Tensor]:
        p, tw = self.p, self.tower
        return generator_init(
            ctx.seed, p.n_ctx, tw.width, self.name_emb.shape[1], p.depth, p.ff_mult, tw.dtype, tw.device
        )

    # ---- the per-client optimisers of TPG's clients (optimizer_state="per-client")
    def make_optimizer(self, rnd: int):
        if self.p.optimizer_state != "per-client":
            return super().make_optimizer(rnd)
        p = self.p
        self._opt = _ClientSGD(lr=p.lr, momentum=p.momentum, weight_decay=p.weight_decay)
        return self._opt

    def local_begin(self, ctx: Context, plan: RoundPlan, glob: dict) -> dict:
        ids = plan.clients.to(ctx.device)
        local = {"cls": self.cls[ids], "valid": self.valid[ids], "lut": self.lut[ids]}
        if self.p.optimizer_state == "per-client":
            p = self.p
            if CLIENT_MOMENTUM not in ctx.state:
                ctx.state[CLIENT_MOMENTUM] = {
                    k: torch.zeros((ctx.n_clients, *v.shape), dtype=v.dtype, device=v.device)
                    for k, v in glob.items()
                }
                ctx.state[CLIENT_ROUNDS] = torch.zeros(ctx.n_clients, dtype=torch.int64, device=ctx.device)
            t = ctx.state[CLIENT_ROUNDS][
                ids
            ].tolist()  # rounds each client trained before (its scheduler's steps)
            lrs = [
                round_lr(p, s + 1, self.rounds) for s in t
            ]  # CosineAnnealingLR(T_max = rounds) after s steps
            self._opt.lr = lrs[0] if plan.m else p.lr
            self._opt.lrs = (
                None if len(set(lrs)) <= 1 else torch.tensor(lrs, dtype=torch.float32, device=ctx.device)
            )
            if p.momentum:
                self._opt.state["buf"] = {k: v[ids].clone() for k, v in ctx.state[CLIENT_MOMENTUM].items()}
        return local

    def local_end(self, ctx: Context, plan: RoundPlan, local: dict, params: dict) -> None:
        if self.p.optimizer_state != "per-client":
            return
        ids = plan.clients.to(ctx.device)
        if self.p.momentum:
            for k, b in self._opt.state["buf"].items():
                if b is not None:
                    ctx.state[CLIENT_MOMENTUM][k][ids] = b
        ctx.state[CLIENT_ROUNDS][ids] += 1  # client.train steps its scheduler once per round, data or not

    # ---- the generator's prompts
    def class_text(self, params: dict, cls: torch.Tensor, valid: torch.Tensor | None) -> torch.Tensor:
        """Unit text features ``[n, Kc, D]`` of the classes ``cls  # [n, Kc]`` from the clients' generators, each
        conditioned on its classes' names (``valid  # [n, Kc]``: the real ones; None: all)."""
        c = generate(params, self.name_emb[cls], self.p.depth, self.p.heads, valid)  # [n, n_ctx, W]
        return F.normalize(self.learner.features(c, cls), dim=-1)

    def text_features(self, ctx: Context, params: dict) -> torch.Tensor:
        """Every class's features, the generator conditioned on every class name (TPG's test over a dataset)."""
        c = generate(params, self.name_emb, self.p.depth, self.p.heads)  # [n, n_ctx, W]
        return F.normalize(self.learner.features(c), dim=-1)

    def step_loss(self, ctx: Context, params: dict, batch: Batch, local: dict) -> torch.Tensor:
        n = batch.n
        cls, valid = local["cls"][:n], local["valid"][:n]
        t = self.class_text(params, cls, valid if self.masked else None)  # [n, Kc, D]
        x = batch.x.to(t.dtype) if t.dtype == torch.float16 else batch.x
        logits = ctx.clip_logit_scale * torch.bmm(x, t.to(x.dtype).transpose(1, 2))  # [n, B, Kc]
        if self.masked:
            logits = logits.masked_fill(~valid[:, None, :], float("-inf"))
        y = torch.gather(local["lut"][:n], 1, batch.y)  # [n, B] the labels within each client's list
        B, Kc = logits.shape[1:]
        loss = F.cross_entropy(logits.reshape(n * B, Kc), y.reshape(-1), reduction="none").view(n, B)
        return masked_mean(loss, batch.mask)

    @torch.no_grad()
    def predict_classes(
        self, ctx: Context, glob: dict, x: torch.Tensor, classes: torch.Tensor
    ) -> torch.Tensor:
        """The argmax over ``classes`` of the prompts the generator makes from those classes' names (TPG's test on
        a split: ``server.py:191-196``, the split's class names in, its classes ranked)."""
        P = {k: v.unsqueeze(0) for k, v in glob.items()}
        cls = classes.to(self.cls.device)
        t = self.class_text(P, cls[None], None)[0]  # [Kv, D]
        logits = ctx.clip_logit_scale * x.to(t.dtype) @ t.T
        return classes[logits.argmax(1).to(classes.device)]

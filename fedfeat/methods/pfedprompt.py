"""pFedPrompt (Guo, Guo, Wang, "pFedPrompt: Learning Personalized Prompt for Vision-Language Models in Federated
Learning", WWW 2023, doi 10.1145/3543507.3583518; a baseline of FedCoPL's table).

**Sources.** No public code of the authors exists (the only file named after the method that was found,
``PanBikang/PromptFolio`` ``trainers/__pycache__/pFedPrompt.cpython-38.pyc``, is a third party's stand-in whose
docstring says it does not know how the attention is realised), and the paper's full text could not be read here;
this module follows the paper's abstract -- "learning user consensus from linguistic space and adapting to user
characteristics in visual space in a non-parametric manner" -- and realises the non-parametric visual part as a
key-value attention over the client's few-shot memory in Tip-Adapter's form (Zhang et al., ECCV 2022, the training-
free cache model, ``gaopengcuhk/Tip-Adapter`` ``main.py`` ``run_tip_adapter``). Every choice below that the paper
may settle otherwise is a named switch.

**The model.** A global CoOp context (16 unified tokens, ``fedfeat.encoders.prompt``; the *user consensus*) is
trained by every client and averaged by the server, as PromptFL (the same authors' framework). Each client ``i``
keeps a non-parametric memory of its own (few-shot) training data that never leaves it: keys ``F_i`` = the unit CLIP
image features of its training samples (cached: the image encoder is frozen), values ``L_i`` = their labels
(one-hot; in the unsupervised modes the pseudo-labels, CPL's candidate sets as uniform distributions over the set).
The personalised score of an image ``x`` (unit feature) for class ``k`` is::

    z_k(x) = logit_scale * cos(x, t_k(P))  +  alpha * sum_j A_j(x) L_i[j, k]
    A_j(x) = exp(-beta * (1 - x . F_i[j]))                     (attention = "tip", Tip-Adapter's affinity)
    A(x)   = softmax_j(beta * x . F_i[j])                      (attention = "softmax", normalised attention)

Local training minimises CE of ``z`` (``memory_in_loss``; the memory carries no gradient, the prompt learns what the
memory does not explain) on the client's (pseudo-)labelled data -- or CPL's candidate-set loss ``-log Σ_{j∈S} p_j``
(``pseudo=cpl``, FedCoPL's "pFedPrompt + CPL", ``fedfeat.methods.prompt.pseudo_label``). Each client is evaluated on
its local test split with ``z`` and its own memory (``local_acc``); the global test accuracy uses the global
prompt alone (no client memory: ours).

Defaults (each field names its source): PromptFL's (the same authors' framework; the paper's own values unknown
here), i.e. ``fedfeat.methods.prompt.PromptFLParams``' reading of PromptFL's code -- CoOp's SGD (momentum 0.9,
weight decay 5e-4, batch 32, 5 local epochs), lr 0.001 with Dassl's per-epoch cosine, one optimiser carried from
client to client, the unweighted mean of the clients' contexts, fp16 on CUDA -- each a switch there; ``alpha`` 1
and ``beta`` 1 (Tip-Adapter ``configs/*.yaml``: ``init_beta: 1``, ``init_alpha`` 1.17 (ImageNet) to 2 (DTD));
``attention="tip"``. Switches: ``exclude_self`` (a training sample's own memory entry is left out of its score:
the memory is the training set itself; Tip-Adapter-F trains with it in), ``memory_in_loss`` (False: the prompt is
trained on CLIP's logits alone, the memory added at test time only).
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
    client_weights,
    per_client_scores,
    pseudo_label,
    pseudo_loss,
)


@dataclass(frozen=True)
class PFedPromptParams(PromptFLParams):
    alpha: float = (
        1.0  # Tip-Adapter's residual ratio (configs init_alpha 1.17 ImageNet .. 2 DTD); paper: unknown
    )
    beta: float = 1.0  # Tip-Adapter's sharpness (configs init_beta 1); paper: unknown
    attention: Literal["tip", "softmax"] = (
        "tip"  # tip: exp(-beta (1 - cos)); softmax: normalised over the memory
    )
    exclude_self: bool = False  # True: a training sample's own memory entry is left out of its score
    memory_in_loss: bool = True  # False: train the prompt on CLIP's logits alone (memory only at test time)

    def validate(self) -> None:
        super().validate()
        if self.alpha < 0 or self.beta <= 0:
            raise FedfeatError(
                f"need alpha >= 0 and beta > 0, got {self.alpha} and {self.beta}; e.g. --set alpha=1 beta=1"
            )


def memory_logits(
    x: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    valid: torch.Tensor,
    alpha: float,
    beta: float,
    attention: str = "tip",
    drop: torch.Tensor | None = None,
) -> torch.Tensor:
    """The personalised (memory) part of the score, batched over clients: ``x  # [n, B, D]`` unit queries,
    ``keys  # [n, M, D]`` unit features, ``values  # [n, M, K]``, ``valid  # [n, M]`` real entries,
    ``drop  # [n, B, M]`` entries left out per query (``exclude_self``) -> ``alpha * A @ values  # [n, B, K]``."""
    aff = torch.bmm(x, keys.transpose(1, 2))  # [n, B, M]
    keep = valid.unsqueeze(1) if drop is None else valid.unsqueeze(1) & ~drop
    if attention == "tip":
        A = torch.exp(-beta * (1 - aff)) * keep.to(
            aff.dtype
        )  # Tip-Adapter: ((-1) * (beta - beta * aff)).exp()
    else:
        z = (beta * aff).masked_fill(~keep, -torch.inf)
        A = torch.softmax(z, dim=-1).nan_to_num(0.0)  # a query with no memory entry attends to nothing
    return alpha * torch.bmm(A, values)


@register
class PFedPrompt(PersonalEval, PromptMethod):
    """pFedPrompt (Guo et al. 2023): a global CoOp prompt + attention over each client's own feature memory."""

    name = "pfedprompt"
    dp_client = True  # DP-FedAvg of the global prompt; each client's memory stays with it
    Params = PFedPromptParams
    uses_labels = True

    def __init__(self, params):
        super().__init__(params)
        self.uses_labels = self.p.pseudo == "none"  # the unsupervised modes never see labels

    def setup(self, ctx: Context) -> None:
        super().setup(ctx)
        p = self.p
        if ctx.open_vocab is not None:
            raise FedfeatError(
                "pfedprompt's memory holds the client's own classes; the open-vocabulary setting (--partition "
                "disjoint-classes) is not supported: use a closed partition"
            )
        if p.pseudo != "none":
            pseudo_label(ctx, p.pseudo, p)
        K = ctx.K
        if p.pseudo == "none":
            vals = F.one_hot(ctx.labels.to(ctx.device), K)
        elif "pseudo_labels" in ctx.state:  # FPL / CoPL: hard pseudo-labels
            vals = F.one_hot(ctx.state["pseudo_labels"].to(ctx.device), K)
        else:  # CPL's candidate sets: uniform over the set
            c = ctx.state["pseudo_candidates"].to(ctx.device, ctx.feats.dtype)
            vals = c / c.sum(1, keepdim=True).clamp_min(1)
        sizes = ctx.offsets.diff()
        C, Mmax, D = ctx.n_clients, max(int(sizes.max()) if len(sizes) else 0, 1), ctx.feats.shape[1]
        owner = torch.repeat_interleave(torch.arange(C), sizes)
        slot = torch.arange(len(owner)) - ctx.offsets[owner]
        owner, slot = owner.to(ctx.device), slot.to(ctx.device)
        keys = torch.zeros(C, Mmax, D, dtype=ctx.feats.dtype, device=ctx.device)
        keys[owner, slot] = F.normalize(ctx.feats, dim=-1)
        values = torch.zeros(C, Mmax, K, dtype=ctx.feats.dtype, device=ctx.device)
        values[owner, slot] = vals.to(ctx.feats.dtype)
        valid = torch.zeros(C, Mmax, dtype=torch.bool, device=ctx.device)
        valid[owner, slot] = True
        ctx.cache["memory"] = (keys, values, valid)

    def init_global(self, ctx: Context) -> dict[str, torch.Tensor]:
        p = self.p
        g = rng.generator(ctx.seed, TAG_CTX_INIT)
        return {"ctx": self.learner.init_context(g, csc=p.csc, phrase=p.ctx_init, std=p.ctx_std)}

    def _memories(self, ctx: Context, clients: torch.Tensor) -> tuple:
        """The memories ``(keys, values, valid)`` of ``clients``, each with a leading client axis."""
        keys, values, valid = ctx.cache["memory"]
        c = clients.to(keys.device)
        return keys[c], values[c], valid[c]

    def _memory(self, x: torch.Tensor, mem: tuple, drop=None) -> torch.Tensor:
        p = self.p
        return memory_logits(F.normalize(x, dim=-1), *mem, p.alpha, p.beta, p.attention, drop)

    @staticmethod
    def self_slots(ctx: Context, clients: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """``[n, B]`` memory slots of the samples at client-major positions ``pos  # [n, B]`` of ``clients  # [n]``
        (their own entries: a client's memory holds its training rows in order)."""
        return pos - ctx.offsets.to(pos.device)[clients.to(pos.device)].unsqueeze(1)

    # ------------------------------------------------------------------ local update
    def local_begin(self, ctx: Context, plan: RoundPlan, glob: dict) -> dict:
        c = plan.clients.to(ctx.device)
        return {"clients": c, "memory": self._memories(ctx, c)}  # gathered once per round

    def step_loss(self, ctx: Context, params: dict, batch: Batch, local: dict) -> torch.Tensor:
        p = self.p
        logits = self.logits(ctx, params, batch.x)  # [n, B, K]
        n, B, K = logits.shape
        if p.memory_in_loss:
            clients = local["clients"][:n]
            drop = None
            if p.exclude_self:
                M = ctx.cache["memory"][0].shape[1]
                slot = self.self_slots(ctx, clients, batch.pos).clamp(0, M - 1)
                drop = F.one_hot(slot, M).bool() & batch.mask.unsqueeze(-1)
            mem = tuple(m[:n] for m in local["memory"])
            logits = logits + self._memory(batch.x, mem, drop).to(logits.dtype)
        return pseudo_loss(ctx, logits, batch, p.pseudo)

    def aggregate(self, ctx: Context, plan: RoundPlan, glob: dict, cparams: dict) -> dict:
        w = client_weights(ctx, plan, self.p.aggregation)
        return glob if w is None else fedavg(cparams, w)

    # ------------------------------------------------------------------ evaluation
    @torch.no_grad()
    def local_logits(self, ctx: Context, glob: dict, rows: list) -> list[torch.Tensor]:
        """The personalised logits ``[len(rows[i]), K]`` of client ``i``'s test rows (``ctx.test_x``): the global prompt
        and the client's own memory; all clients at once, ``EVAL_ROWS`` rows per client and pass."""
        t = self.text_features(ctx, {k: v.unsqueeze(0) for k, v in glob.items()})[0]  # [K, D]
        mem = self._memories(ctx, torch.arange(len(rows)))

        def score(x):  # [C, E, D] -> [C, E, K]: the global prompt and each client's own memory
            return ctx.clip_logit_scale * x @ t.to(x.dtype).T + self._memory(x, mem).to(x.dtype)

        return per_client_scores(ctx, rows, score)

"""FST-CBDG (Yan & Guo 2024): federated self-training with class-balanced data generation, label-free.

Each client trains the linear head on its *unlabelled* cached features with (Algorithm 1):

* **self-training** on soft pseudo-labels ``q`` kept per sample across rounds, initialised to the zero-shot
  softmax and updated at every local iteration, before the step, for the samples of that mini-batch:
  ``q <- beta q + (1 - beta) f(x)`` (Eq. 3-4, Algorithm 1 lines 13-15, ``f`` = current head, detached);
  loss = mean over the batch of ``-sum_k q_k log f_k(x)``;
* **class-balanced data generation**: with ``m_k`` = hard pseudo-label counts (argmax q) of the client at the
  start of its local update, ``n_k = (1 + gamma) max_k m_k - m_k`` (Eq. 7) synthetic features per class are
  drawn from ``N(T_k, sigma^2 I)`` (Eq. 5) around the class text prototype, once per local epoch, shuffled
  and spread evenly over the epoch's iterations, with one-hot labels; loss weight ``lam`` (Eq. 8);
* **aggregation**: the plain mean of the sampled clients' heads (``aggregation=mean``, below).

Fidelity switches (issue 16; each a hyperparameter, the earlier behaviour kept as a value):

* ``aggregation`` -- ``mean`` (default): ``W <- E_c[W_c]``, the unweighted mean over the round's sampled clients
  (Algorithm 1 line 22; §3.1: "we adopt the simple average aggregation procedure of FedAvg"); a sampled client
  with no samples trains nothing and is left out of the mean. ``weighted``: FedAvg weighted by client size
  (fedfeat's default before issue 16).
* ``synthetic_loss`` -- ``mean`` (default): each iteration adds ``lam`` * the *mean* CE over that iteration's
  synthetic samples of the client; ``sum``: ``lam`` * their *sum* (Eq. 6 is written
  ``L_tSamp = -sum_k sum_{j <= n_k} 1_k . log f(z_kj)``), i.e. ``mean`` times the iteration's synthetic count.
  Eq. 6 is a sum, but Eq. 3 (``L_iST``) is an expectation over the images and Eq. 8 weighs the two with
  ``lam = 1``: summed literally over ``sum_k n_k`` samples (hundreds to thousands per client under label skew)
  the real-sample term would be negligible, and papers commonly write sums for losses their code averages
  (PyTorch's default reduction). With no code to settle it, ``mean`` stays the default; ``sum`` is the letter
  of Eq. 6.
* ``synthetic_draw`` -- ``epoch`` (default): the ``sum_k n_k`` samples are drawn once per local epoch and spread
  over its iterations (each sample used once per epoch). ``iteration``: Algorithm 1 line 16 ("Sample synthetic
  instances according to Equation (5) and (7)") inside the per-iteration loop, read literally: every iteration
  draws a fresh full class-balanced set, ``n_k`` samples of every class (so ``S`` times as many synthetic samples
  per epoch). Both values have the fused CPU kernel.
* ``n_k`` of Eq. 7 is an integer only when ``gamma max_k m_k`` is; fedfeat takes ``floor((1 + gamma) max_k m_k
  - m_k)`` (``balanced_counts``) where rounding would be as defensible (the paper does not say; with the
  default ``gamma = 0`` every value is an integer and the two agree). No switch.

fedfeat's readings where the paper is silent (reference-notes.md, "fedfeat's reading"): L2-normalised image
and text features, ``W0 = T``, ``b0 = 0``, ``logit_scale = 1`` (Eq. 2 has no temperature; 100 is the switch);
batch size 50 (FedNTD's default); no lr decay; per-iteration loss = mean CE over the real samples +
``lam`` * mean CE over that iteration's synthetic samples. ``sigma`` is ours (the paper gives no value): the
per-dimension standard deviation in units of ``1/sqrt(D)`` (the per-dimension scale of a unit vector), so
``sigma = 1`` puts a synthetic sample as far from its prototype as the prototype is from the origin.

Randomness. A client's synthetic samples are exactly i.i.d. ``N(T_k, sigma^2 I)``; the noise vectors are rows
of a Gaussian bank drawn per (seed, round, epoch, step) in blocks of 64 rows, each client using rows 0..P-1
with an independent random sign per (client, sample), so samples of different clients are uncorrelated but
not independent. This keeps the draw independent of the engine and of which clients train together, without
a random generator per client in the hot loop.

Ablations (Table 3-4): ``self_training=false`` (sampling only: no loss on the real samples; pseudo-labels are
still updated, since they set ``m_k``), ``sampling=false`` (self-training only), ``balance=equal``
(``ceil(n / K)`` synthetic samples for every class, whatever the client's pseudo-label counts).
"""

from __future__ import annotations

import math
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch
import torch.nn.functional as F

from fedfeat.engine import rng
from fedfeat.engine.context import (
    Context,
    RoundPlan,
    fedavg,
    fused_batches,
    make_plan,
    masked_mean,
    plan_rows,
    round_buffer,
)
from fedfeat.errors import FedfeatError
from fedfeat.methods.base import register
from fedfeat.methods.head import LinearHead, LinearHeadParams

BANK_BLOCK = 64  # rows per independently seeded block of the noise bank


def bank_rows(P: int, D: int) -> int:
    """How many rows to draw for rows ``0..P-1`` of a step's bank: whole 64-row blocks, the last one cut to the
    fewest rows ``>=`` what is needed whose ``rows * D`` values are a multiple of 16. torch's CPU Gaussian
    sampler fills 16 values at a time from one uniform stream, so such a cut block's rows equal the first rows
    of the whole block (``tests/test_engine.py`` pins it): the bank's values do not depend on ``P``."""
    if P <= 0:
        return 0
    full, rest = divmod(P, BANK_BLOCK)
    if rest:
        while (rest * D) % 16:
            rest += 1
    return full * BANK_BLOCK + rest


# thread pools (by size) that draw a round's bank steps side by side (torch.randn frees the GIL)
_POOLS: dict[int, ThreadPoolExecutor] = {}


def _pool(threads: int) -> ThreadPoolExecutor:
    if threads not in _POOLS:
        _POOLS[threads] = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="fedfeat-bank")
    return _POOLS[threads]


@dataclass(frozen=True)
class FSTCBDGParams(LinearHeadParams):
    beta: float = 0.9  # paper §4.1: moving-average weight of the soft pseudo-labels (Eq. 4)
    gamma: float = 0.0  # paper §4.1: class-balanced sampling parameter (Eq. 7)
    lam: float = 1.0  # paper §4.1: weight of the synthetic-sample loss (Eq. 8)
    sigma: float = 1.0  # ours (not in the paper): per-dim std of N(T_k, sigma^2 I) in units of 1/sqrt(D)
    self_training: bool = True  # paper Table 3 ablation switch (false = sampling only)
    sampling: bool = True  # paper Table 3 ablation switch (false = self-training only)
    balance: Literal["class", "equal"] = "class"  # paper Table 4: class-balanced (Eq. 7) or equal sampling
    renormalize_synthetic: bool = False  # ours: project synthetic samples back onto the unit sphere
    # Algorithm 1 line 22 (W <- E_c[W_c]) and §3.1 ("the simple average aggregation procedure of FedAvg"): mean;
    # weighted = FedAvg by client size (fedfeat before issue 16)
    aggregation: Literal["mean", "weighted"] = "mean"
    # Eq. 6 sums CE over the synthetic samples (sum); mean = fedfeat's reading, kept (module docstring)
    synthetic_loss: Literal["mean", "sum"] = "mean"
    # Algorithm 1 line 16 draws a full n_k set every iteration (iteration); epoch = fedfeat's reading, kept
    synthetic_draw: Literal["epoch", "iteration"] = "epoch"

    def validate(self) -> None:
        super().validate()
        if not 0 <= self.beta <= 1:
            raise FedfeatError(f"beta must be in [0, 1], got {self.beta}")
        if self.gamma < 0 or self.lam < 0 or self.sigma < 0:
            raise FedfeatError("gamma, lam and sigma must be >= 0")
        if not (self.self_training or self.sampling):
            raise FedfeatError("self_training and sampling cannot both be false (nothing would be trained)")


def balanced_counts(m: torch.Tensor, gamma: float) -> torch.Tensor:
    """Eq. 7: ``n_k = (1 + gamma) max_k m_k - m_k`` per client (``m  # [c, K]`` int) -> ``[c, K]`` int64.

    >>> balanced_counts(torch.tensor([[5, 2, 0]]), 0.0).tolist(), balanced_counts(torch.tensor([[5, 2, 0]]), 1.0).tolist()
    ([[0, 3, 5]], [[5, 8, 10]])
    """
    top = m.max(dim=-1, keepdim=True).values.to(torch.float64)
    return torch.floor((1 + gamma) * top - m.to(torch.float64) + 1e-9).clamp_min(0).to(torch.int64)


def soft_label_update(q: torch.Tensor, f: torch.Tensor, beta: float) -> torch.Tensor:
    """Eq. 4: ``q <- beta q + (1 - beta) f``."""
    return beta * q + (1 - beta) * f


def synthetic_head(W, b, text, cls, sign, WE, sigma, scale, renorm=None) -> torch.Tensor:
    """Logits ``[n, P, K]`` of synthetic samples ``x = T_c + sigma * sign * eps`` from ``WE = W eps^T  # [n, K, P]``:
    ``W x = (W T^T)[:, c] + sigma * sign * WE``, divided by ``||x||`` when ``renorm = (T_c . eps  # [n, P],
    ||eps||^2)``. ``sigma``, ``scale``: one value, or one per client ``[n, 1, 1]`` (stacked runs)."""
    n, K, _ = W.shape
    WT = torch.matmul(W, text.T)  # [n, K, K]: W_j . T_c for every class c
    lin = torch.gather(WT, 2, cls.unsqueeze(1).expand(n, K, cls.shape[1]))  # [n, K, P]
    lin = lin + sigma * sign.unsqueeze(1) * WE
    if renorm is not None:
        tc_e, eps_sq = renorm
        sg = sigma.view(n, 1) if torch.is_tensor(sigma) else sigma
        sq = 1 + 2 * sg * sign * tc_e + sg**2 * eps_sq
        lin = lin / sq.clamp_min(1e-12).sqrt().unsqueeze(1)
    return scale * (lin.transpose(1, 2) + b.unsqueeze(1))  # [n, P, K]


@register
class FSTCBDG(LinearHead):
    """FST-CBDG: label-free self-training + class-balanced Gaussian sampling around text prototypes."""

    name = "fst-cbdg"
    Params = FSTCBDGParams
    state_keys = {
        "q": "per-sample: [N, K] soft pseudo-labels (zero-shot softmax at set-up, updated by local training)",
        "last_clients": "server: list of [m] int64 the last round's participants (for the pseudo-label accuracy)",
        "last_round": "server: int, the round last_clients belongs to",
    }
    uses_labels = False
    stacks = True  # per-run soft labels [R, N, K] and synthetic draws
    dp_client = True  # DP-FedAvg: clients upload their heads only (soft labels stay on the client)

    # ------------------------------------------------------------------ state
    def setup(self, ctx: Context) -> None:
        with torch.no_grad():
            z0 = self.p.logit_scale * (ctx.feats @ ctx.text.T)  # [N, K] zero-shot logits at the head's scale
            ctx.state["q"] = F.softmax(z0, dim=-1)  # per-sample soft pseudo-labels, kept across rounds

    def pseudo_labels(self, ctx: Context) -> torch.Tensor:
        return ctx.state["q"].argmax(1)

    # ------------------------------------------------------------------ server side
    def aggregate(self, ctx: Context, plan: RoundPlan, glob: dict, cparams: dict) -> dict:
        """``aggregation=mean``: ``E_c[W_c]`` over the round's clients that hold samples (Algorithm 1 line 22);
        ``weighted``: FedAvg by client size."""
        if self.p.aggregation == "weighted":
            return super().aggregate(ctx, plan, glob, cparams)
        w = (plan.sizes > 0).to(torch.float64)
        if not bool(w.any()):
            w = torch.ones_like(w)
        return fedavg(cparams, w.to(ctx.device))

    # ------------------------------------------------------------------ local update
    def local_begin(self, ctx: Context, plan: RoundPlan, glob: dict) -> dict:
        m, K = plan.m, ctx.K
        if ctx.device.type == "cpu":  # one compiled pass over the clients' rows (torch's argmax: ~10x slower)
            from fedfeat.engine import kernels

            counts = torch.from_numpy(
                kernels.argmax_counts(
                    ctx.state["q"].numpy(), ctx.offsets[plan.clients].numpy(), plan.sizes.numpy()
                )
            )
        else:
            seg, _, rows = plan_rows(ctx, plan)
            hard = ctx.state["q"][rows.to(ctx.device)].argmax(1).cpu()
            counts = torch.zeros(m, K, dtype=torch.int64).index_put_(
                (seg, hard), torch.ones_like(hard), accumulate=True
            )
        if self.p.balance == "class":
            n_k = balanced_counts(counts, self.p.gamma)  # [m, K]
        else:
            n_k = ((plan.sizes + K - 1) // K).unsqueeze(1).expand(m, K).clone()
        if not self.p.sampling:
            n_k.zero_()
        return {"n_k": n_k, "pl_counts": counts, "syn": None, "rnd": plan.rnd}

    def epoch_begin(self, ctx: Context, plan: RoundPlan, local: dict, epoch: int) -> None:
        """Draw this epoch's synthetic classes and spread them evenly over the client's iterations."""
        n_k = local["n_k"]  # [m, K]
        m, K = n_k.shape
        J = n_k.sum(1)  # [m] synthetic samples per client
        S = plan.steps  # [m] iterations per epoch
        Smax = int(S.max()) if m else 0
        if int(J.sum()) == 0:
            local["syn"] = None
            return
        seg = torch.repeat_interleave(torch.arange(m), J)  # [Jtot] client slot
        cls = torch.repeat_interleave(torch.arange(K).repeat(m), n_k.reshape(-1))  # class-major per client
        j = torch.arange(int(J.sum())) - torch.repeat_interleave(
            torch.cumsum(J, 0) - J, J
        )  # item id in client
        item = plan.clients[seg] * (1 << 30) + j
        key = rng.uniform_keys(rng.stream_key(ctx.seed, plan.rnd, epoch, rng.TAG_SYNTH_ORDER), item)
        o1 = torch.argsort(key, stable=True)
        o2 = torch.argsort(seg[o1], stable=True)
        cls_sorted = cls[o1[o2]]  # grouped by client, shuffled within
        r = j  # rank within client after grouping
        if self.p.synthetic_draw == "iteration":  # every iteration: the whole set, slot = rank
            P = int(J.max())
            base_cls = torch.zeros(m, P, dtype=torch.int64)
            base_mask = torch.zeros(m, P, dtype=torch.bool)
            base_cls[seg, r] = cls_sorted
            base_mask[seg, r] = True
            live = torch.arange(Smax).view(Smax, 1) < S.view(1, m)  # [Smax, m] the client's own iterations
            tab_cls = base_cls.expand(Smax, m, P).clone()
            tab_mask = base_mask.unsqueeze(0) & live.unsqueeze(2)
        else:
            Jc, Sc = J[seg], S[seg]
            step = r * Sc // Jc  # spread evenly: iteration of each sample
            start = (step * Jc + Sc - 1) // Sc  # first rank of that iteration
            slot = r - start
            P = int(slot.max()) + 1
            tab_cls = torch.zeros(Smax, m, P, dtype=torch.int64)
            tab_mask = torch.zeros(Smax, m, P, dtype=torch.bool)
            tab_cls[step, seg, slot] = cls_sorted
            tab_mask[step, seg, slot] = True
        # independent random sign per (client, slot, step): keys from client id, not client slot
        sid = (plan.clients.view(1, m, 1) * (1 << 16) + torch.arange(Smax).view(Smax, 1, 1)) * (
            1 << 20
        ) + torch.arange(P).view(1, 1, P)
        sk = rng.uniform_keys(rng.stream_key(ctx.seed, plan.rnd, epoch, rng.TAG_SYNTH_OFFSET), sid)
        sign = (sk & 1).to(ctx.text.dtype) * 2 - 1  # the run's dtype: a float32 sign would round sigma
        dev = ctx.device
        local["syn"] = {
            "cls": tab_cls.to(dev),
            "mask": tab_mask.to(dev),
            "sign": sign.to(dev),
            "epoch": epoch,
        }

    def _draw(self, ctx: Context, rnd: int, epoch: int, step: int, out: torch.Tensor) -> None:
        """Fill ``out  # [bank_rows(P, D), D]`` (float32, cpu) with this step's Gaussian bank: blocks of 64 rows,
        each seeded on its own."""
        for b in range(math.ceil(out.shape[0] / BANK_BLOCK)):
            g = rng.generator(ctx.seed, rnd, epoch, step, b, rng.TAG_SYNTH_NOISE)
            blk = out[b * BANK_BLOCK : (b + 1) * BANK_BLOCK]
            torch.randn(blk.shape, generator=g, out=blk)

    def _noise(self, ctx: Context, rnd: int, epoch: int, step: int, P: int) -> torch.Tensor:
        """Rows 0..P-1 of this step's Gaussian bank ``[P, D]``."""
        buf = torch.empty(bank_rows(P, ctx.D), ctx.D, dtype=torch.float32)
        self._draw(ctx, rnd, epoch, step, buf)
        return buf[:P].to(device=ctx.device, dtype=ctx.text.dtype)

    def synthetic_logits(
        self, ctx: Context, params: dict, cls: torch.Tensor, sign: torch.Tensor, eps: torch.Tensor
    ) -> torch.Tensor:
        """Logits of the synthetic samples ``x = T_c + sigma * sign * eps`` without forming them.

        By linearity ``W x = (W T^T)[:, c] + sigma * sign * (W eps^T)``: two small matmuls instead of an
        ``[n, P, D]`` tensor (the gradient w.r.t. W is the same, by the chain rule through these products).
        Shapes: ``cls, sign  # [n, P]``, ``eps  # [P, D]`` -> ``[n, P, K]``.
        """
        p = self.p
        W, b = params["W"], params["b"]  # [n, K, D], [n, K]
        n, K, D = W.shape
        WE = torch.matmul(W.reshape(n * K, D), eps.T).view(n, K, -1)  # [n, K, P]
        renorm = None
        if p.renormalize_synthetic:
            te = ctx.text @ eps.T  # [K, P]
            tc_e = torch.gather(te.unsqueeze(0).expand(n, K, -1), 1, cls.unsqueeze(1)).squeeze(1)  # [n, P]
            renorm = (tc_e, (eps * eps).sum(1))
        return synthetic_head(W, b, ctx.text, cls, sign, WE, p.sigma / math.sqrt(D), p.logit_scale, renorm)

    def step_loss(self, ctx, params, batch, local):
        p = self.p
        n = batch.n
        z = self.logits(params, batch.x)  # [n, B, K]
        # Algorithm 1 lines 13-15: update the batch's soft labels before the step, from the current head
        q_all = ctx.state["q"]
        with torch.no_grad():
            f = F.softmax(z.detach(), dim=-1)
            pos = batch.pos[batch.mask]
            q_new = soft_label_update(q_all[pos], f[batch.mask], p.beta)
            q_all[pos] = q_new
        loss = torch.zeros(n, device=batch.x.device, dtype=batch.x.dtype)
        if p.self_training:
            q = q_all[batch.pos]  # [n, B, K] (padding rows read row 0 and are masked out)
            st = -(q * F.log_softmax(z, dim=-1)).sum(-1)  # [n, B]
            loss = loss + masked_mean(st, batch.mask)
        syn = local["syn"]
        if syn is not None and batch.step < syn["cls"].shape[0]:
            cls = syn["cls"][batch.step, :n]  # [n, P]
            smask = syn["mask"][batch.step, :n]
            if bool(smask.any()):
                P = int(smask.sum(1).max())
                cls, smask = cls[:, :P], smask[:, :P]
                sign = syn["sign"][batch.step, :n, :P]
                eps = self._noise(ctx, local["rnd"], batch.epoch, batch.step, P)  # [P, D]
                zs = self.synthetic_logits(ctx, params, cls, sign, eps)  # [n, P, K]
                ce = F.cross_entropy(zs.transpose(1, 2), cls, reduction="none")  # [n, P]
                if p.synthetic_loss == "sum":  # Eq. 6 as written
                    loss = loss + p.lam * (ce * smask.to(ce.dtype)).sum(1)
                else:
                    loss = loss + p.lam * masked_mean(ce, smask)
        return loss

    def fused_loss(self):
        return "fst-cbdg"  # kernels.fst_epoch

    def fused_epoch(self, ctx, plan, glob, local, params, opt, epoch):
        """The epoch in ``fedfeat.engine.kernels.fst_epoch``: the same soft-label updates, self-training loss and
        synthetic samples (classes, order and signs drawn in the kernel from ``epoch_begin``'s keys; the noise
        bank rows of every step drawn here, as ``_noise`` draws them). Replaces ``epoch_begin`` + the steps."""
        from fedfeat.engine import kernels

        p = self.p
        W = params["W"]
        m, D, dt = plan.m, ctx.D, W.numpy().dtype
        bufs = opt.state["fused"]  # momentum buffers (run_local)
        n_k = local["n_k"]
        S = plan.steps
        J = n_k.sum(1)
        if p.synthetic_draw == "iteration":  # every step holds the client's whole set
            P = int(J.max()) if m else 0
        else:  # most synthetic samples of any client's step
            P = int(((J + S - 1) // S).max()) if m else 0
        if P:  # the steps' banks, drawn side by side straight into the kernel's array (memory kept across rounds)
            shape = (int(S.max()), bank_rows(P, D), D)
            like = torch.empty((), dtype=torch.float32)
            bank = round_buffer(ctx, "fst-cbdg bank", math.prod(shape), like).view(shape)
            list(
                _pool(ctx.threads).map(
                    lambda s: self._draw(ctx, plan.rnd, epoch, s, bank[s]), range(bank.shape[0])
                )
            )
            bank = bank.numpy().astype(dt, copy=False)
        else:
            bank = np.zeros((1, 1, D), dt)
        losses = np.zeros((int(S.max()), m), dtype=np.float64)
        kernels.fst_epoch(
            ctx.feats.numpy(), **fused_batches(ctx, plan, epoch), q=ctx.state["q"].numpy(), W=W.numpy(),
            b=params["b"].numpy(), mW=bufs["W"].numpy(), mb=bufs["b"].numpy(), Wg=glob["W"].contiguous().numpy(),
            bg=glob["b"].contiguous().numpy(), text=ctx.text.contiguous().numpy(),
            n_k=n_k.numpy(), cids=plan.clients.numpy(),
            key_order=rng.stream_key(ctx.seed, plan.rnd, epoch, rng.TAG_SYNTH_ORDER),
            key_sign=rng.stream_key(ctx.seed, plan.rnd, epoch, rng.TAG_SYNTH_OFFSET), bank=bank,
            lr=opt.lr, momentum=opt.momentum, weight_decay=opt.weight_decay, logit_scale=p.logit_scale,
            beta=p.beta, lam=p.lam, sigma=p.sigma / math.sqrt(D), self_training=p.self_training,
            renormalize=p.renormalize_synthetic, syn_sum=p.synthetic_loss == "sum",
            syn_every_step=p.synthetic_draw == "iteration", loss_out=losses, threads=ctx.threads, init=epoch == 0,
            one_epoch=plan.epochs == 1,
        )  # fmt: skip
        return losses

    # ------------------------------------------------------------------ metrics
    def round_metrics(self, ctx: Context, data, glob: dict, ev: dict) -> dict:
        """Pseudo-label accuracy over all training samples and over the clients of the last round.

        Only the rows of clients trained since the last call have new soft labels, so their hits are recomputed
        and the rest kept (``ctx.cache``, never checkpointed: a resumed run recomputes all rows once): the cost of a
        round follows its clients' rows, not the training set (at 100,000 clients x 0.1 %, an argmax over every
        row cost more than the round's training). The same values as recomputing every row."""
        cache = ctx.cache
        right = cache.get("pl_right")  # [N] float64: 1 where argmax q == the true label
        if right is None:
            right = (self.pseudo_labels(ctx) == data.train_y).to(torch.float64)
            cache["pl_right"], cache["pl_dirty"] = right, []
        elif cache["pl_dirty"]:
            dirty = np.unique(torch.cat(cache["pl_dirty"]).numpy())
            rows = plan_rows(ctx, make_plan(ctx, 0, dirty, 1, 1))[2].to(right.device)
            right[rows] = (ctx.state["q"][rows].argmax(1) == data.train_y[rows]).to(torch.float64)
            cache["pl_dirty"] = []
        out = {"pseudo_label_acc_all": float(right.mean()) * 100}
        clients = ctx.state.get("last_clients")
        if clients:  # the last round's participants (their rows found here, not in the timed local update)
            plan = make_plan(ctx, 0, torch.cat(clients).numpy(), 1, 1)
            out["pseudo_label_acc"] = float(right[plan_rows(ctx, plan)[2].to(right.device)].mean()) * 100
        else:
            out["pseudo_label_acc"] = None
        return out

    def local_end(self, ctx: Context, plan: RoundPlan, local: dict, params: dict) -> None:
        if ctx.state.get("last_round") != plan.rnd:
            ctx.state["last_clients"] = []
        ctx.state["last_clients"].append(plan.clients)  # the loop engine: one client at a time
        ctx.state["last_round"] = plan.rnd
        if "pl_dirty" in ctx.cache:  # their soft labels changed: round_metrics recomputes their hits
            ctx.cache["pl_dirty"].append(plan.clients)

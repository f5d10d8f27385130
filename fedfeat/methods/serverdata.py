"""The server's own data, and the distillation of a linear head on it: a method *part* shared by FedDF, FedBE
(unlabelled distillation sets) and Ratio Loss (a small labelled, class-balanced auxiliary set).

What the papers' servers hold (and what the numbers of CLIP2FL's Table 1, quoted from CReFF, rest on):

* **FedDF** (Lin et al., NeurIPS 2020; epfml/federated-learning-public-code@44dd555 ``codes/FedDF-code/README.md``):
  unlabelled images of *another* dataset -- CIFAR-100's training split for CIFAR-10, downsampled ImageNet-32 for
  CIFAR-100 (``data_name=cifar100`` / ``imagenet32``) -- plus a *labelled* validation split held out of the training
  set (``--val_data_ratio 0.1``) on which the server's distillation is early-stopped.
* **FedBE** (Chen & Chao, ICLR 2021; hongyouc/FedBE@7eeb965 ``utils/sampling.py:113``): unlabelled images held out
  of the *same* training set: 50,000 - ``num_data`` (40,000) = 10,000 CIFAR-10 training images no client holds.
* **Ratio Loss** (Wang et al., AAAI 2021; balanced-fl/Addressing-Class-Imbalance-FL@cd0e996
  ``FEMNIST-4-Losses/utils/sampling.py:55``): a labelled, class-balanced auxiliary set -- the first 63 training
  images of every class, taken from the same training set the clients' data come from (not held out).
* **CReFF**, whose Table 1 CLIP2FL quotes, publishes no baseline code. Its first author's public FedDF
  (shangxinyi/FedDF-FL-torch@2c058d9 ``main.py``: 20 clients, 8 online, CIFAR-10) distils on CIFAR-100's training
  split; her FEDIC (shangxinyi/FEDIC@76a1d75 ``main.py``) adds a held-out labelled set of 100 CIFAR-10 training
  images per class. Which server data produced CReFF's FedDF / FedBE / Ratio Loss rows is not stated in what could
  be read here.

Sources (a method's ``server_data``-like switch; ``check_source`` validates one):

* ``unassigned``: training rows no client holds (``ctx.store``'s train split minus ``ctx.train_rows``). CLIP2FL's
  long tail keeps 12,406 of CIFAR-10's 50,000 training images (IF 100), so 37,594 are unassigned -- FedBE's
  held-out set, and FedDF's validation split. They are *reverse* long-tailed (the head class keeps every image:
  none of it is unassigned), and a partition that assigns every row (``iid``, ``dirichlet`` without
  ``--imbalance-factor``) leaves none: an empty set is a one-line error naming the fix.
* ``train``: the whole training split, client rows included -- Ratio Loss's auxiliary data (the official code takes
  training images the clients also hold); it runs on any store and any partition.
* ``store:PATH``: the training split of another store of the same backbone, weights and dimension -- FedDF's
  CIFAR-100-for-CIFAR-10 (``fedfeat encode --dataset cifar100 ...`` with the same backbone).

Every draw is seeded (``fedfeat.engine.rng``: the run seed and a tag, never the round), capped at a size (0: all),
and normalised as the method's ``normalize`` says (as ``fedfeat.engine.data.build_context`` does). Rows a store
marks unreadable (label -1) are left out. **Labels** are read only where a method asks for a labelled set: Ratio
Loss's auxiliary set, and FedDF's validation split when it early-stops (``early_stopping=val``); an unlabelled set
reads the label column only for that -1 marker.

The distillation (``distill_head``) trains a linear head ``z = s (x W^T + b)`` on soft targets with hand-written
gradients (one ``[B, K]`` softmax and two products a step, no autograd), as FedDF (Adam, cosine schedule, gradient
clipping, early stopping on the validation split) and FedBE (SGD with momentum, stochastic weight averaging) do.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from fedfeat.engine import rng
from fedfeat.engine.context import Context
from fedfeat.errors import FedfeatError

SOURCES = ("unassigned", "train", "store:PATH")


def check_source(spec: str, field: str) -> None:
    """A one-line ``FedfeatError`` unless ``spec`` is one of ``SOURCES`` (``store:`` with a path)."""
    if spec in ("unassigned", "train") or (spec.startswith("store:") and len(spec) > len("store:")):
        return
    raise FedfeatError(
        f"{field}={spec!r} is not a server data source; choose unassigned, train or store:PATH "
        f"(e.g. --set {field}=unassigned)"
    )


@dataclass
class ServerSet:
    """A server data set: features on the run's device, normalised as the method asked."""

    x: torch.Tensor  # [S, D]
    y: torch.Tensor | None  # [S] labels (labelled sets only)
    source: str  # the spec it was drawn from
    rows: np.ndarray  # [S] rows of the source store's train split

    def __len__(self) -> int:
        return int(self.x.shape[0])


def _fix(field: str) -> str:
    return (
        f"pass --imbalance-factor (CLIP2FL's long tail leaves most training rows unassigned), or "
        f"--set {field}=train (the whole training split) or --set {field}=store:PATH (another store's)"
    )


def source_rows(ctx: Context, spec: str, field: str):
    """``(store, rows, labels)``: the source's store, its candidate train rows (sorted, label != -1) and the label
    column of its train split (read for the -1 marker; a labelled draw reads the classes from it)."""
    check_source(spec, field)
    if spec.startswith("store:"):
        from fedfeat.store.featurestore import FeatureStore

        path = spec[len("store:") :]
        st = FeatureStore.open(path)
        own = ctx.store
        if st.embed_dim != ctx.D:
            raise FedfeatError(
                f"{field}: store {path} has {st.embed_dim}-d features, this run {ctx.D}-d; encode the server's "
                "dataset with the run's backbone"
            )
        if own is not None and (
            st.attrs.get("backbone"),
            st.attrs.get("pretrained"),
        ) != (own.attrs.get("backbone"), own.attrs.get("pretrained")):
            raise FedfeatError(
                f"{field}: store {path} was encoded by {st.attrs.get('backbone')} / {st.attrs.get('pretrained')}, "
                f"this run's by {own.attrs.get('backbone')} / {own.attrs.get('pretrained')}; encode it with the "
                "run's backbone and weights"
            )
        lab = st.labels("train")
        return st, np.flatnonzero(lab >= 0), lab
    st = ctx.store
    if st is None:
        raise FedfeatError(f"{field}={spec} needs the run's store (load the data with load_run_data)")
    lab = st.labels("train")
    keep = lab >= 0
    if spec == "unassigned":
        if ctx.train_rows is None:
            raise FedfeatError(f"{field}=unassigned needs the clients' store rows; {_fix(field)}")
        keep[np.asarray(ctx.train_rows, dtype=np.int64)] = False
    return st, np.flatnonzero(keep), lab


def _load(ctx: Context, st, rows: np.ndarray, normalize: bool) -> torch.Tensor:
    x = torch.from_numpy(st.features_rows("train", rows)).to(device=ctx.device, dtype=ctx.feats.dtype)
    return F.normalize(x, dim=-1) if normalize else x


def draw_set(
    ctx: Context,
    spec: str,
    size: int,
    normalize: bool,
    *,
    tag: int,
    field: str,
    labelled: bool = False,
    exclude: np.ndarray | None = None,
) -> ServerSet:
    """Up to ``size`` rows (0: all) of the source, drawn without replacement by a generator seeded with
    ``(ctx.seed, tag)``, in the drawn order; ``exclude`` rows (another set drawn from the same source) are left
    out. Labels only when ``labelled``. An empty set is a ``FedfeatError`` naming the fix."""
    st, rows, lab = source_rows(ctx, spec, field)
    if exclude is not None and len(exclude):
        rows = np.setdiff1d(rows, exclude, assume_unique=False)
    if not len(rows):
        if exclude is not None and len(exclude):  # the validation split, drawn first, took every row
            raise FedfeatError(
                f"{field}={spec}: the validation split's {len(exclude)} rows leave none for the distillation; pass "
                "a smaller --set val_size=... or --set early_stopping=none"
            )
        raise FedfeatError(
            f"{field}={spec}: the server has no data (no training row is left for it); {_fix(field)}"
        )
    order = rng.numpy_rng(ctx.seed, tag).permutation(len(rows))
    take = rows[order[: size if size > 0 else len(rows)]]
    y = torch.from_numpy(lab[take].astype(np.int64)).to(ctx.device) if labelled else None
    return ServerSet(_load(ctx, st, take, normalize), y, spec, take)


def draw_balanced(
    ctx: Context,
    spec: str,
    per_class: int,
    normalize: bool,
    *,
    tag: int,
    field: str,
    size_field: str,
    order: str = "random",
) -> ServerSet:
    """A labelled, class-balanced set: ``per_class`` rows of every class of the run, class-major. ``order="random"``
    draws them per class by a generator seeded with ``(ctx.seed, tag)``; ``"first"`` takes each class's first
    ``per_class`` rows in the source store's row order (Ratio Loss's code: ``np.where(label_train == c)[0][0:63]``,
    balanced-fl ``FEMNIST-4-Losses/utils/sampling.py:56-61``). A class with fewer rows in the source is a
    ``FedfeatError``."""
    st, rows, lab = source_rows(ctx, spec, field)
    names = list(getattr(st, "class_names", []) or [])
    if spec.startswith("store:") and names != list(ctx.class_names):
        raise FedfeatError(
            f"{field}: store {spec[6:]} has other classes than this run's; a labelled auxiliary set needs the "
            "run's classes"
        )
    ry = lab[rows]
    gen = rng.numpy_rng(ctx.seed, tag)
    take = []
    for c in range(ctx.K):
        rc = rows[ry == c]
        if len(rc) < per_class:
            raise FedfeatError(
                f"{field}={spec}: class {c} ({names[c] if c < len(names) else c}) has {len(rc)} rows for the "
                f"server, {per_class} are asked; use --set {field}=train or a smaller --set {size_field}=..."
            )
        take.append(rc[:per_class] if order == "first" else rc[gen.permutation(len(rc))[:per_class]])
    take = np.concatenate(take)
    y = torch.from_numpy(lab[take].astype(np.int64)).to(ctx.device)
    return ServerSet(_load(ctx, st, take, normalize), y, spec, take)


# ---------------------------------------------------------------------------------------------- teachers
def head_logits(x: torch.Tensor, W: torch.Tensor, b: torch.Tensor, scale: float) -> torch.Tensor:
    """Logits of heads ``W  # [T, K, D]``, ``b  # [T, K]`` on ``x  # [S, D]`` -> ``[T, S, K]``."""
    return scale * (torch.einsum("sd,tkd->tsk", x, W) + b.unsqueeze(1))


def mean_probs(
    x: torch.Tensor,
    W: torch.Tensor,
    b: torch.Tensor,
    scale: float,
    temperature: float = 1.0,
    chunk: int = 8192,
) -> torch.Tensor:
    """The mean over heads of ``softmax(z_t / T)`` on ``x  # [S, D]`` -> ``[S, K]`` (rows in chunks: the
    ``[T, chunk, K]`` logits are the only temporary)."""
    out = torch.empty(x.shape[0], W.shape[1], dtype=x.dtype, device=x.device)
    for i in range(0, x.shape[0], chunk):
        z = head_logits(x[i : i + chunk], W, b, scale)
        out[i : i + chunk] = torch.softmax(z / temperature, -1).mean(0)
    return out


# the ``ctx.state`` keys of a server that distils the averaged head (FedDF, FedBE), which ``distill_metrics`` reads
DISTILL_STATE: dict[str, str] = {
    "fedavg_head": "server: {'W': [K, D], 'b': [K]} the round's FedAvg head before distillation (None before round 1)",
    "info": "server: {figure: number} the round's distillation figures (steps, loss, server rows), for round_metrics",
}


# ---------------------------------------------------------------------------------------------- distillation
@dataclass(frozen=True)
class DistillConfig:
    """One distillation of a linear head (every field set by the calling method, with its source there)."""

    steps: int  # optimizer steps; batches run through shuffled passes over the set (the last batch smaller)
    batch: int
    lr: float
    loss: str = (
        "kl"  # "kl": KL(p || softmax(z / T)) averaged over the batch (FedDF); "kl_mean": / (B K) (FedBE)
    )
    temperature: float = 1.0  # T of "kl"
    optimizer: str = (
        "adam"  # "adam" (torch.optim.Adam's rule) or "sgd" (torch.optim.SGD's, with momentum / decay)
    )
    momentum: float = 0.0
    weight_decay: float = 0.0
    schedule: str = "constant"  # "cosine": CosineAnnealingLR(T_max=steps), stepped after every batch
    clip_norm: float = 0.0  # clip_grad_norm_ over (W, b); 0: none
    eval_every: int = 0  # validation accuracy every this many steps (0: never)
    patience: int = 0  # stop when the best validation is this many steps old (FedDF's early stopping)
    swa_start: int = -1  # SWA: average the iterate after steps c > swa_start with c % swa_freq == 0; -1: none
    swa_freq: int = 1


def distill_head(
    W: torch.Tensor,
    b: torch.Tensor,
    x: torch.Tensor,
    target: torch.Tensor,
    scale: float,
    cfg: DistillConfig,
    gen: torch.Generator,
    val: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """Train the head ``z = scale (x W^T + b)`` (``W  # [K, D]``, ``b  # [K]``, copied) on soft targets
    ``target  # [S, K]`` of ``x  # [S, D]``; returns ``(W, b, info)``.

    Gradients by hand: ``kl`` is ``KL(p || softmax(z / T))`` with ``batchmean`` (``dL/dz = (softmax(z / T) - p) /
    (T B)``), ``kl_mean`` is FedBE's ``(p (log p - log q)).mean()`` over the ``B x K`` entries (``dL/dz = (q - p) /
    (B K)``); then ``dW = scale dz^T x``, ``db = scale sum(dz)``. The returned head: the best on ``val`` (``(x, y)``)
    when ``eval_every`` > 0 (FedDF returns its best-validated student), else the SWA average when one was taken
    (FedBE), else the last iterate.
    """
    W, b = W.detach().clone(), b.detach().clone()
    S, K = target.shape
    dev = x.device
    mW, mb = torch.zeros_like(W), torch.zeros_like(b)  # Adam's first moments / SGD's momentum buffers
    vW, vb = torch.zeros_like(W), torch.zeros_like(b)
    swa = None
    n_swa = 0
    best = (None, -1.0, 0)  # (head, accuracy, step)
    order = torch.empty(0, dtype=torch.int64, device=dev)
    pos = 0
    loss_sum = torch.zeros((), dtype=torch.float64, device=dev)  # summed on the device: no sync per step
    done = 0
    T = cfg.temperature if cfg.loss == "kl" else 1.0
    plogp = torch.xlogy(target, target).sum(
        1
    )  # [S] the targets' negative entropies (the loss's constant part)
    for step in range(cfg.steps):
        if pos >= order.numel():  # a new shuffled pass (DataLoader(shuffle=True, drop_last=False))
            order = torch.randperm(S, generator=gen).to(dev)
            pos = 0
        idx = order[pos : pos + cfg.batch]
        pos += cfg.batch
        xb, pbT = x.index_select(0, idx), target.index_select(0, idx).T  # [B, D], [K, B]
        B = xb.shape[0]
        # class-major [K, B] logits: W @ x^T runs faster than x @ W^T on a CPU thread at small K (synthesis.py)
        zT = torch.addmm(b.unsqueeze(1), W, xb.T).mul_(scale / T)
        logq = torch.log_softmax(zT, 0)
        cross = (pbT * logq).sum()
        dzT = logq.exp_().sub_(pbT)  # softmax - p, [K, B]
        if cfg.loss == "kl":  # batchmean: d/dz = (softmax(z / T) - p) / (T B)
            dzT.div_(T * B)
            loss = (plogp[idx].sum() - cross) / B
        else:  # .mean() over B x K entries: d/dz = (q - p) / (B K)
            dzT.div_(B * K)
            loss = (plogp[idx].sum() - cross) / (B * K)
        gW, gb = dzT @ xb, dzT.sum(1)
        if scale != 1:
            gW, gb = gW.mul_(scale), gb.mul_(scale)
        if cfg.clip_norm > 0:  # torch.nn.utils.clip_grad_norm_: coef = max_norm / (norm + 1e-6), capped at 1
            coef = cfg.clip_norm / (torch.sqrt(gW.square().sum() + gb.square().sum()) + 1e-6)
            coef = coef.clamp(max=1.0)
            gW, gb = gW * coef, gb * coef
        lr = cfg.lr
        if cfg.schedule == "cosine":
            lr = cfg.lr * (1 + math.cos(math.pi * step / cfg.steps)) / 2
        if cfg.optimizer == "adam":  # torch.optim.Adam, betas (0.9, 0.999), eps 1e-8
            t = step + 1
            for p, g, m, v in ((W, gW, mW, vW), (b, gb, mb, vb)):
                m.mul_(0.9).add_(g, alpha=0.1)
                v.mul_(0.999).addcmul_(g, g, value=0.001)
                denom = (v.sqrt() / math.sqrt(1 - 0.999**t)).add_(1e-8)
                p.addcdiv_(m, denom, value=-lr / (1 - 0.9**t))
        else:  # torch.optim.SGD: d = g + wd p; buf = momentum buf + d (buf = d first); p -= lr buf
            for p, g, m in ((W, gW, mW), (b, gb, mb)):
                d = g + cfg.weight_decay * p if cfg.weight_decay else g
                if cfg.momentum:
                    d = m.copy_(d) if step == 0 else m.mul_(cfg.momentum).add_(d)
                p.sub_(d, alpha=lr)
        loss_sum += loss.detach()
        done += 1
        c = step + 1
        if cfg.swa_start >= 0 and c > cfg.swa_start and c % cfg.swa_freq == 0:  # torchcontrib SWA, auto mode
            n_swa += 1
            if swa is None:
                swa = (W.clone(), b.clone())
            else:
                swa[0].add_((W - swa[0]) / n_swa)
                swa[1].add_((b - swa[1]) / n_swa)
        if val is not None and cfg.eval_every > 0 and c % cfg.eval_every == 0:
            acc = float((torch.addmm(b, val[0], W.T).argmax(1) == val[1]).double().mean())
            if acc > best[1]:  # MaxMeter: strictly better
                best = ((W.clone(), b.clone()), acc, c)
            if cfg.patience > 0 and c - best[2] >= cfg.patience:
                break
    info = {"distill_steps": done, "distill_loss": float(loss_sum) / max(done, 1)}
    if best[0] is not None:
        info["distill_val_acc"] = 100 * best[1]
        info["distill_best_step"] = best[2]
        return best[0][0], best[0][1], info
    if swa is not None:
        info["swa_snapshots"] = n_swa
        return swa[0], swa[1], info
    return W, b, info


def server_step_metrics(ctx: Context, data) -> dict:
    """What a distilling server step reports each round: its figures (``ctx.state["info"]``) and the accuracy of the
    FedAvg head it started from (``fedavg_head_acc``, on the test rows: a ``--val-split``'s rows left out)."""
    out = dict(ctx.state.get("info") or {})
    avg = ctx.state.get("fedavg_head")
    if avg is not None:
        pred = (ctx.test_x @ avg["W"].T + avg["b"]).argmax(
            1
        )  # a positive logit scale leaves the argmax alone
        right = pred == data.test_y.to(pred.device)
        vm = getattr(ctx, "val_mask", None)
        if vm is not None:
            right = right[~vm.to(right.device)]
        out["fedavg_head_acc"] = float(right.double().mean()) * 100
    return out


__all__ = [
    "server_step_metrics",
    "SOURCES",
    "DistillConfig",
    "ServerSet",
    "check_source",
    "distill_head",
    "draw_balanced",
    "draw_set",
    "head_logits",
    "mean_probs",
    "source_rows",
]

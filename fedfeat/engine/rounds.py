"""The federated engine: all sampled clients' local updates of a round as one batched tensor program.

Data layout. The split's features are put on the device once, in **client-major order** (client i holds rows
``offsets[i]:offsets[i+1]``), L2-normalised if the method asks. A round:

1. samples ``max(1, int(participation * clients))`` clients (FedNTD's convention) from a stream keyed by
   (seed, round);
2. orders them by descending number of local steps, so that at every step the clients still training are a
   prefix ``[:n]`` of the client axis (no padding for clients that are done; ragged last batches carry a mask);
3. per local epoch, shuffles each client's samples with counter-based keys (``fedfeat.engine.rng``): the order is a
   function of (seed, round, epoch, sample position) only, so it does not depend on the engine or on which
   other clients were sampled;
4. per step, gathers the active clients' mini-batches into a preallocated ``[n, B, D]`` buffer and runs
   the method's loss for all of them at once (per-client weights ``[n, K, D]``, ``bmm``), one autograd call,
   one batched optimizer step;
5. aggregates (FedAvg weighted by client sample counts unless the method says otherwise), applies the
   method's server step, evaluates on the test split.

On CPU, methods with a fused kernel (``fedfeat.engine.kernels``) run steps 3-4 of a whole epoch in one compiled call
instead (``kernel="fused"``, the default there): the same shuffles, batches and updates, each sample read once.

``engine="loop"`` runs the same method one client after another (client axis of size 1, the client's own
steps only), as the papers' code does: it is the oracle the batched engine is tested against.

Methods that never read labels get a ``Batch`` whose ``y`` raises ``LabelAccessError`` (structural, not a
convention): the engine does not even hold the training labels in the method's context.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F

from fedfeat.engine import rng
from fedfeat.errors import FedfeatError


class LabelAccessError(RuntimeError):
    """An unlabelled method tried to read training labels."""


@dataclass
class Batch:
    """One local step's mini-batches of the ``n`` active clients."""

    x: torch.Tensor  # [n, B, D] features (rows past a client's batch are padding)
    mask: torch.Tensor  # [n, B] bool, True for real samples
    pos: torch.Tensor  # [n, B] int64 client-major positions of the samples (padding: 0)
    n: int  # active clients: the first n of the round's client axis
    epoch: int
    step: int
    _y: torch.Tensor | None = None  # [n, B] labels, only for methods that use labels

    @property
    def y(self) -> torch.Tensor:
        if self._y is None:
            raise LabelAccessError("this method is declared label-free and may not read training labels")
        return self._y

    @property
    def count(self) -> torch.Tensor:
        """``[n]`` real samples per client in this batch (as float)."""
        return self.mask.sum(1).to(self.x.dtype)


def masked_mean(v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Per-client mean of ``v  # [n, B]`` over real samples -> ``[n]`` (0 where a client has none)."""
    m = mask.to(v.dtype)
    return (v * m).sum(1) / m.sum(1).clamp_min(1)


@dataclass
class Context:
    """What a method sees of the data. ``labels`` is None for label-free methods."""

    device: torch.device
    feats: torch.Tensor  # [N, D] training features, client-major, normalised as the method asked
    offsets: torch.Tensor  # [clients + 1] int64 (cpu)
    text: torch.Tensor  # [K, D] class text embeddings (normalised, template choice applied)
    text_all: torch.Tensor  # [T, K, D] every template's embeddings (normalised)
    test_x: torch.Tensor  # [N_test, D]
    clip_logit_scale: float  # the encoder's own logit scale (CLIP: 100)
    seed: int
    n_clients: int
    labels: torch.Tensor | None = None  # [N] client-major training labels, None for label-free methods
    train_counts: torch.Tensor | None = None  # [K] training samples per class (labelled methods only)
    state: dict = field(default_factory=dict)  # persistent method state (per-sample / per-client tensors)
    threads: int = 1  # CPU threads of a fused kernel (torch's thread count when the run began)
    open_vocab: object | None = (
        None  # fedfeat.partition.openvocab.OpenVocab (normalised like feats) in that setting
    )
    text_raw: torch.Tensor | None = None  # [K, D] ``text`` before L2 normalisation (Fed-MP's residuals)
    live: object | None = (
        None  # fedfeat.encoders.live.LiveText: the store's frozen text encoder (prompt methods only)
    )
    class_names: list[str] = field(default_factory=list)
    rounds: int = 0  # the run's number of rounds (learning-rate schedules over the run)
    local_test: list | None = None  # per client: int64 rows of test_x (FedCoPL's local test splits), or None
    cache: dict = field(default_factory=dict)  # derived read-only tensors (never checkpointed: not ``state``)
    store: object | None = None  # the FeatureStore (live image methods read its pixels)
    train_rows: np.ndarray | None = None  # [N] store rows of the client-major training samples
    test_rows: np.ndarray | None = None  # [N_test] store rows of test_x

    def test_xT(self) -> torch.Tensor:
        """``test_x`` transposed to ``[D, N_test]``, contiguous, made once: a linear head's test logits as
        ``W @ X^T`` (class-major) ran 1.6x faster than ``X @ W^T`` on a CPU thread (10,000 x 1024, K = 10)."""
        if "test_xT" not in self.cache:
            self.cache["test_xT"] = self.test_x.T.contiguous()
        return self.cache["test_xT"]

    @property
    def K(self) -> int:
        return self.text.shape[0]

    @property
    def D(self) -> int:
        return self.text.shape[1]

    def sizes(self, clients: torch.Tensor) -> torch.Tensor:
        """``[m]`` sample counts of the given clients."""
        o = self.offsets
        return o[clients + 1] - o[clients]


@dataclass
class RoundPlan:
    """The clients of one round in engine order and their step counts."""

    rnd: int
    clients: torch.Tensor  # [m] client ids, ordered by descending steps per epoch
    sizes: torch.Tensor  # [m] samples per client
    steps: torch.Tensor  # [m] local steps per epoch
    batch_size: int
    epochs: int

    @property
    def m(self) -> int:
        return len(self.clients)

    def active(self, step: int) -> int:
        """Clients still training at ``step`` of an epoch (a prefix of the client axis)."""
        return int((self.steps > step).sum())


def sample_clients(seed: int, rnd: int, n_clients: int, participation: float) -> np.ndarray:
    """``max(1, int(participation * n_clients))`` distinct clients, from a stream keyed by (seed, round)."""
    m = max(1, int(participation * n_clients))
    if m >= n_clients:
        return np.arange(n_clients)
    return np.sort(rng.numpy_rng(seed, rnd, rng.TAG_SAMPLE_CLIENTS).choice(n_clients, m, replace=False))


def make_plan(ctx: Context, rnd: int, clients: np.ndarray, batch_size: int, epochs: int) -> RoundPlan:
    c = torch.as_tensor(np.asarray(clients), dtype=torch.int64)
    sizes = ctx.sizes(c)
    steps = (sizes + batch_size - 1) // batch_size
    order = torch.argsort(-steps, stable=True)
    return RoundPlan(rnd, c[order], sizes[order], steps[order], batch_size, epochs)


def plan_rows(ctx: Context, plan: RoundPlan) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The plan's samples, client after client: ``seg  # [M]`` client slot, ``local  # [M]`` index within
    the client, ``pos  # [M]`` client-major position (all int64, cpu)."""
    sizes = plan.sizes
    seg = torch.repeat_interleave(torch.arange(plan.m), sizes)
    local = torch.arange(int(sizes.sum())) - torch.repeat_interleave(torch.cumsum(sizes, 0) - sizes, sizes)
    return seg, local, ctx.offsets[plan.clients][seg] + local


def shuffle_key(ctx: Context, plan: RoundPlan, epoch: int) -> int:
    """The stream key of this round's epoch's shuffles (a sample's key: ``rng.uniform_keys(key, position)``)."""
    return rng.stream_key(ctx.seed, plan.rnd, epoch, rng.TAG_SHUFFLE)


def fused_batches(ctx: Context, plan: RoundPlan, epoch: int) -> dict:
    """What a fused kernel needs to cut the epoch into ``epoch_tables``' mini-batches itself: each client's
    first client-major row and size (numpy int64), the batch size and the shuffle key."""
    return {
        "starts": ctx.offsets[plan.clients].numpy(),
        "sizes": plan.sizes.numpy(),
        "B": plan.batch_size,
        "key": shuffle_key(ctx, plan, epoch),
    }


def epoch_tables(ctx: Context, plan: RoundPlan, epoch: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Shuffled mini-batch positions for one epoch: ``idx  # [S, m, B]`` (int64) and ``mask  # [S, m, B]``.

    Client j's samples are sorted by a counter-based key of (seed, round, epoch, position); its r-th sample
    in that order goes to step ``r // B``, slot ``r % B`` (the last batch is smaller: ``drop_last=False``).
    """
    B = plan.batch_size
    seg, local, pos = plan_rows(ctx, plan)  # [M] client slot, index within client, client-major position
    key = rng.uniform_keys(shuffle_key(ctx, plan, epoch), pos)
    # sort by (segment, key): segment-major composite sort, keys are < 2^62 so sort keys then stable by seg
    o1 = torch.argsort(key, stable=True)
    o2 = torch.argsort(seg[o1], stable=True)
    perm = o1[o2]  # items grouped by client, shuffled within client
    pos_sorted = pos[perm]
    rank = local  # after grouping, the r-th item of segment j sits at offset start_j + r
    S = int(plan.steps.max()) if plan.m else 0
    idx = torch.zeros(S, plan.m, B, dtype=torch.int64)
    mask = torch.zeros(S, plan.m, B, dtype=torch.bool)
    idx[rank // B, seg, rank % B] = pos_sorted
    mask[rank // B, seg, rank % B] = True
    return idx, mask


def run_local(
    method,
    ctx: Context,
    plan: RoundPlan,
    glob: dict[str, torch.Tensor],
    rows: slice | None = None,
    kernel: str = "torch",
) -> tuple[dict[str, torch.Tensor], dict]:
    """Local update of the plan's clients ``rows`` (default all) as one batched program: the torch tensor
    program below (``kernel="torch"``), or the method's fused CPU kernel for a whole epoch (``"fused"``,
    ``fedfeat.engine.kernels``).

    Returns the clients' final parameters ``{name: [m, ...]}`` and a few statistics.
    """
    if rows is not None:
        plan = RoundPlan(
            plan.rnd, plan.clients[rows], plan.sizes[rows], plan.steps[rows], plan.batch_size, plan.epochs
        )
    m = plan.m
    if kernel == "fused":  # the kernel starts each client from glob itself (not a copy of [m, K, D] here)
        params = {k: round_buffer(ctx, k, m, v) for k, v in glob.items()}
    else:
        params = {
            k: v.detach().unsqueeze(0).repeat(m, *([1] * v.dim())).contiguous() for k, v in glob.items()
        }
    # per-client parameters that start fresh every round and are never aggregated (Fed-MP's client residuals)
    params.update(method.local_params(ctx, plan))
    opt = method.make_optimizer(plan.rnd)
    opt.reset(params)
    local = method.local_begin(ctx, plan, glob)
    if kernel == "fused":  # whole epochs (epoch_begin's draws included) in the method's compiled kernel
        opt.state["fused"] = {k: round_buffer(ctx, "momentum " + k, m, v) for k, v in glob.items()}
        loss = sum(
            float(method.fused_epoch(ctx, plan, glob, local, params, opt, e).sum())
            for e in range(plan.epochs)
        )
        method.local_end(ctx, plan, local, params)
        return params, {"loss_sum": loss, "loss_steps": int(plan.steps.sum()) * plan.epochs}
    labels = ctx.labels
    D = ctx.feats.shape[1]
    xbuf = torch.empty(m * plan.batch_size, D, dtype=ctx.feats.dtype, device=ctx.device)
    loss_sum = torch.zeros(
        (), dtype=torch.float64, device=ctx.device
    )  # summed on the device: no sync per step
    loss_n = 0
    for epoch in range(plan.epochs):
        idx, mask = epoch_tables(ctx, plan, epoch)
        # batch width per step: B, or less when every active client is on a smaller (last) batch -- clients
        # with fewer samples than B cost their samples, not B padded rows
        widths = mask.sum(-1).amax(-1).tolist()  # [S]
        idx, mask = idx.to(ctx.device), mask.to(ctx.device)
        method.epoch_begin(ctx, plan, local, epoch)
        for s in range(idx.shape[0]):
            n = plan.active(s)
            B = int(widths[s])
            ib = idx[s, :n, :B]  # [n, B]
            x = torch.index_select(ctx.feats, 0, ib.reshape(-1), out=xbuf[: n * B]).view(n, B, D)
            batch = Batch(x, mask[s, :n, :B], ib, n, epoch, s, labels[ib] if labels is not None else None)
            p = {k: v[:n].detach().requires_grad_(True) for k, v in params.items()}
            loss = method.step_loss(ctx, p, batch, local)  # [n]
            names = list(p)
            grads = torch.autograd.grad(loss.sum(), [p[k] for k in names])
            opt.step(params, dict(zip(names, grads)), n)
            loss_sum += loss.detach().double().sum()
            loss_n += n
    method.local_end(ctx, plan, local, params)
    return params, {"loss_sum": float(loss_sum), "loss_steps": loss_n}


def round_buffer(ctx: Context, name: str, m: int, like: torch.Tensor) -> torch.Tensor:
    """An uninitialised ``[m, *like.shape]`` tensor for the fused kernels' per-client state (and FST-CBDG's noise
    bank), the same memory from round to round (a fresh one would be new pages, which the OS zeroes on first
    touch: at 10,000 clients ~1 GB a round and most of its time). Valid until the next round's local update."""
    pool = ctx.state.setdefault("round_buffers", {})
    t = pool.get(name)
    if t is None or t.shape[0] < m or t.shape[1:] != like.shape or t.dtype != like.dtype:
        t = pool[name] = torch.empty((m, *like.shape), dtype=like.dtype, device=like.device)
    return t[:m]


def fedavg(params: dict[str, torch.Tensor], weights: torch.Tensor) -> dict[str, torch.Tensor]:
    """Weighted average over the client axis (``weights  # [m]``, normalised here)."""
    w = weights.to(next(iter(params.values())).dtype)
    w = w / w.sum()
    return {k: torch.tensordot(w, v, dims=1) for k, v in params.items()}


def param_bytes(params: dict[str, torch.Tensor]) -> int:
    return int(sum(v.numel() * v.element_size() for v in params.values()))


@dataclass
class RunData:
    """Everything a run reads from the store, loaded once."""

    train_x: torch.Tensor  # [N, D] client-major (float32, on device)
    train_y: torch.Tensor  # [N] client-major labels (kept by the engine; handed only to labelled methods)
    offsets: torch.Tensor  # [clients+1]
    test_x: torch.Tensor  # [Nt, D]
    test_y: torch.Tensor  # [Nt]
    text_all: torch.Tensor  # [T, K, D] raw
    clip_logit_scale: float
    class_names: list[str]
    train_counts: torch.Tensor  # [K] counts over the partition's samples
    open_vocab: object | None = (
        None  # fedfeat.partition.openvocab.OpenVocab; test_x/test_y are then the query set
    )
    live: object | None = (
        None  # fedfeat.encoders.live.LiveText (``needs_live_text`` methods; set by the caller)
    )
    memo: dict | None = None  # a sweep's shared RunData keeps its normalised copies here (``build_context``)
    local_test: list | None = None  # per client: int64 rows of test_x (``local_test="proportional"``)
    store: object | None = None  # the FeatureStore it was read from
    rows: np.ndarray | None = None  # [N] store rows of train_x (client-major)
    test_rows: np.ndarray | None = None  # [N_test] store rows of test_x (closed runs)


def _normalize(x: torch.Tensor) -> torch.Tensor:
    return F.normalize(x, dim=-1)


def build_context(data: RunData, method, seed: int, device: torch.device) -> Context:
    p = method.p
    norm = getattr(p, "normalize", True)
    memo = data.memo

    def _normalize(x: torch.Tensor, name: str = "") -> torch.Tensor:
        """L2-normalised rows; a sweep's shared data normalises each array once (the copies are never written:
        methods replace context tensors, they do not modify them in place)."""
        if memo is None or not name:
            return F.normalize(x, dim=-1)
        if name not in memo:
            memo[name] = F.normalize(x, dim=-1)
        return memo[name]

    text_all = _normalize(data.text_all.to(data.train_x.dtype))
    tmpl = getattr(p, "templates", "first")
    if tmpl == "first":
        text = text_all[0]
    elif tmpl == "ensemble":
        text = _normalize(text_all.mean(0))
    else:
        raise FedfeatError(f"templates must be 'first' or 'ensemble', got {tmpl!r}")
    ctx = Context(
        device=device,
        feats=_normalize(data.train_x, "train_x") if norm else data.train_x,
        offsets=data.offsets,
        text=text.to(device),
        text_all=text_all.to(device),
        test_x=_normalize(data.test_x, "test_x") if norm else data.test_x,
        clip_logit_scale=data.clip_logit_scale,
        seed=seed,
        n_clients=len(data.offsets) - 1,
        labels=data.train_y if method.uses_labels else None,
        train_counts=data.train_counts if method.uses_labels else None,
        text_raw=(data.text_all[0].to(text.dtype) if tmpl == "first" else text_all.mean(0)).to(device),
        live=data.live,
        class_names=list(data.class_names),
        local_test=data.local_test,
        store=data.store,
        train_rows=data.rows,
        test_rows=data.test_rows,
    )
    if getattr(method, "needs_live_text", False) and data.live is None:
        raise FedfeatError(
            f"method {method.name} trains prompts and needs the store's live text encoder (fedfeat.encoders.live)"
        )
    ov = data.open_vocab
    if ov is not None:
        f = _normalize if norm else (lambda x: x)
        ctx.open_vocab = dataclasses.replace(
            ov, val_x=f(ov.val_x), query_x=f(ov.query_x), qval_x=f(ov.qval_x), base_x=f(ov.base_x)
        )
    return ctx


@torch.no_grad()
def evaluate(method, ctx: Context, glob: dict, test_y: torch.Tensor, n_classes: int) -> dict:
    if getattr(ctx, "open_vocab", None) is not None:
        return evaluate_open_vocab(method, ctx, glob, test_y, n_classes)
    logits = method.predict(ctx, glob, ctx.test_x)
    # a class-major head's logits come as a transposed view: argmax over the classes of a contiguous copy is ~3x
    # faster than the strided reduction (10,000 x 10: 0.45 vs 1.44 ms on one thread), and gives the same indices
    pred = logits.contiguous().argmax(1)
    correct = (pred == test_y).to(torch.float64)
    per_class = torch.zeros(n_classes, dtype=torch.float64, device=test_y.device).index_add_(
        0, test_y, correct
    )
    cnt = torch.bincount(test_y, minlength=n_classes).to(torch.float64)
    pc = (per_class / cnt.clamp_min(1)).tolist()
    out = {"acc": float(correct.mean()) * 100, "per_class_acc": [100 * v for v in pc], "pred": pred}
    if getattr(ctx, "local_test", None) is not None:
        out["extra"] = local_accuracy(method, ctx, glob, correct, test_y)
    return out


def local_accuracy(method, ctx: Context, glob: dict, correct: torch.Tensor, test_y: torch.Tensor) -> dict:
    """FedCoPL's metric: the unweighted mean over clients of each client's accuracy on its local test split
    (clients with an empty split left out), with its standard deviation over clients. The methods here have one
    global model, so a client's accuracy is that of the global predictions on its rows; a method with per-client
    models gives its own (``local_accuracies``)."""
    if hasattr(method, "local_accuracies"):  # per-client models (FedCoPL's local text prompts)
        accs = method.local_accuracies(ctx, glob, test_y)
    else:
        accs = [float(correct[r.to(correct.device)].mean()) * 100 for r in ctx.local_test if len(r)]
    a = np.asarray(accs)
    return {
        "local_acc": float(a.mean()) if len(a) else None,
        "local_acc_std": float(a.std(ddof=1)) if len(a) > 1 else None,
        "local_clients": len(a),
    }


@torch.no_grad()
def evaluate_open_vocab(method, ctx: Context, glob: dict, test_y: torch.Tensor, n_classes: int) -> dict:
    """Novel accuracy over the novel vocabulary (the query set ``ctx.test_x``), macro P/R/F1 over the novel
    classes, base accuracy over the base vocabulary and their harmonic mean (``fedfeat.partition.openvocab``)."""
    from fedfeat.partition.openvocab import harmonic_mean, macro_prf

    ov = ctx.open_vocab
    novel = ov.novel.to(test_y.device)
    pred = method.predict_classes(ctx, glob, ctx.test_x, novel)  # [Nq] class ids
    correct = (pred == test_y).to(torch.float64)
    hits = torch.zeros(n_classes, dtype=torch.float64, device=test_y.device).index_add_(0, test_y, correct)
    cnt = torch.bincount(test_y, minlength=n_classes).to(torch.float64)
    precision, recall, f1 = macro_prf(pred, test_y, novel)
    acc = float(correct.mean()) * 100 if len(correct) else 0.0
    base_acc = None
    if len(ov.base_y):
        by = ov.base_y.to(test_y.device)
        bpred = method.predict_classes(ctx, glob, ov.base_x, ov.base.to(test_y.device))
        bc = (bpred == by).to(torch.float64)
        base_acc = float(bc.mean()) * 100
        hits.index_add_(0, by, bc)
        cnt += torch.bincount(by, minlength=n_classes).to(torch.float64)
    extra = {
        "novel_precision": 100 * precision,
        "novel_recall": 100 * recall,
        "novel_f1": 100 * f1,
        "base_acc": base_acc,
        "hm": harmonic_mean(acc, base_acc),
    }
    pc = (hits / cnt.clamp_min(1)).tolist()
    return {"acc": acc, "per_class_acc": [100 * v for v in pc], "pred": pred, "extra": extra}


KERNELS = ("auto", "fused", "torch")


def resolve_kernel(kernel: str, method, engine: str, device: torch.device) -> str:
    """``auto`` -> ``fused`` where it applies (batched engine, CPU, a method with a fused kernel), else
    ``torch``; an explicit ``fused`` where it does not apply is an error naming why."""
    if kernel not in KERNELS:
        raise FedfeatError(f"unknown kernel '{kernel}'; choose {', '.join(KERNELS)}")
    if kernel == "torch":
        return kernel
    why = None
    if engine != "batched":
        why = "the loop engine is the per-client torch reference (fused kernels run with --engine batched)"
    elif device.type != "cpu":
        why = f"fused kernels are CPU kernels (device {device}); on a GPU the torch program is the fast one"
    elif not method.has_fused():
        why = f"method {method.name} has no fused kernel"
    else:
        from fedfeat.engine import kernels  # noqa: F401  (numba: a dependency)
    if why is None:
        return "fused"
    if kernel == "fused":
        raise FedfeatError(f"--kernel fused: {why}; use --kernel auto or torch")
    return "torch"


def run_federated(
    method,
    data: RunData,
    *,
    rounds: int,
    participation: float,
    seed: int,
    engine: str = "batched",
    device: torch.device | str = "cpu",
    kernel: str = "auto",
    on_round: Callable[[dict], None] | None = None,
    on_checkpoint: Callable[[int, dict, dict], None] | None = None,
    checkpoint_every: int = 0,
    resume: tuple[int, dict, dict] | None = None,
    eval_every: int = 1,
) -> tuple[dict[str, torch.Tensor], list[dict]]:
    """Run ``rounds`` federated rounds of ``method``; returns the final weights (``method.final_weights``:
    the global parameters unless the method adds more) and the per-round metrics (round 0 is the evaluation
    before any training).

    ``on_checkpoint(rnd, glob, state)`` is called after every ``checkpoint_every``-th round (not the last) with
    everything that persists across rounds (``fedfeat.engine.checkpoint``); ``resume=(rnd, glob, state)`` continues a
    run from such a checkpoint: rounds ``rnd + 1 ..`` give exactly what the uninterrupted run gave (the random
    streams are counter-based), and only their metrics are returned.

    A round whose training loss, global weights or evaluated weights are not finite stops the run with a
    ``FedfeatError`` naming the round and the method.

    ``eval_every`` N: the test evaluation runs at round 0, every N-th round and the last; the other rounds' rows
    have ``test_acc`` None (their training metrics are kept)."""
    if engine not in ("batched", "loop"):
        raise FedfeatError(f"unknown engine '{engine}'; choose batched or loop")
    if not 0 < participation <= 1:
        raise FedfeatError(f"--participation must be in (0, 1], got {participation}")
    if eval_every < 1:
        raise FedfeatError(f"--eval-every must be >= 1, got {eval_every}")
    device = torch.device(device)
    kernel = resolve_kernel(kernel, method, engine, device)
    threads = torch.get_num_threads()
    if kernel == "fused":
        # the compiled kernels own the cores: torch's few small ops of a round (aggregation, evaluation) run on
        # one thread, so that torch's OpenMP workers, which spin for milliseconds after each parallel op, do not
        # compete with the kernel's threads (they cost ~15 % of a round on 2 cores)
        torch.set_num_threads(1)
    try:
        return _run(
            method, data, rounds, participation, seed, engine, device, kernel, threads, on_round,
            on_checkpoint, checkpoint_every, resume, eval_every,
        )  # fmt: skip
    finally:
        torch.set_num_threads(threads)


def dist_info() -> tuple[int, int]:
    """``(rank, world size)`` of a running torch.distributed job (torchrun), else ``(0, 1)``."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def sharded_local(method, ctx: Context, plan: RoundPlan, glob: dict, kernel: str, rank: int, world: int):
    """The round's local updates sharded across a torchrun job: rank ``r`` trains the plan's clients ``r, r + world,
    ...`` (the plan orders clients by steps, so every rank gets a similar share), then every rank all-gathers the
    clients' parameters in plan order and runs the method's own aggregation on all of them -- the same server step
    as one process (an all-gather rather than an all-reduce of weighted sums, so that every method's aggregation,
    adaptive weights and personal parts included, stays exact)."""
    import torch.distributed as dist

    mine = slice(rank, plan.m, world)
    if len(range(*mine.indices(plan.m))):
        cp, st = run_local(method, ctx, plan, glob, rows=mine, kernel=kernel)
    else:
        cp, st = {}, {"loss_sum": 0.0, "loss_steps": 0}
    parts: list = [None] * world
    dist.all_gather_object(parts, ({k: v.detach().cpu() for k, v in cp.items()}, st))
    first = next(p[0] for p in parts if p[0])
    cparams = {}
    for k, v in first.items():
        full = torch.empty((plan.m, *v.shape[1:]), dtype=v.dtype)
        for r, (cp_r, _) in enumerate(parts):
            if cp_r:
                full[r::world] = cp_r[k]
        cparams[k] = full.to(ctx.device)
    stats = {
        "loss_sum": sum(p[1]["loss_sum"] for p in parts),
        "loss_steps": sum(p[1]["loss_steps"] for p in parts),
    }
    return cparams, stats


def check_finite(method, ctx: Context, rnd: int, glob: dict, loss: float | None) -> None:
    """Stop a run whose loss or weights became NaN or inf (a run that looks finished must not hold them)."""
    what = [] if loss is None or np.isfinite(loss) else ["training loss"]
    for label, params in (("global", glob), ("evaluated", method.final_weights(ctx, glob))):
        what += [f"{label} {k}" for k, v in params.items() if not bool(torch.isfinite(v).all())]
    if what:
        raise FedfeatError(
            f"round {rnd} of {method.name}: {', '.join(dict.fromkeys(what))} became non-finite (NaN or inf); "
            "the run is stopped -- lower the learning rate (--set lr=...) or check the store with "
            "`fedfeat info --verify`"
        )


def _run(
    method, data, rounds, participation, seed, engine, device, kernel, threads, on_round,
    on_checkpoint=None, checkpoint_every=0, resume=None, eval_every=1,
):  # fmt: skip
    ctx = build_context(data, method, seed, device)
    ctx.threads = threads
    ctx.rounds = rounds
    rank, world = dist_info()
    if world > 1 and not type(method).__dict__.get("shardable", False):
        raise FedfeatError(
            f"method {method.name} cannot be sharded across processes (it keeps per-sample state that local "
            "training updates, or has no sharded form yet); run it in one process"
        )
    if world > 1 and engine != "batched":
        raise FedfeatError("torchrun shards the batched engine's clients; use --engine batched")
    K = len(data.class_names)
    method.setup(ctx)
    glob = method.init_global(ctx)
    metrics: list[dict] = []
    first = 1
    if resume is not None:  # the checkpoint replaces what setup and init_global made
        done, glob, state = resume
        ctx.state.update(state)
        first = done + 1

    total_rounds = rounds if method.federated else 0

    def record(rnd: int, t0: float, extra: dict) -> None:
        if rnd % eval_every and rnd not in (0, total_rounds):  # --eval-every: a round without evaluation
            row = {"round": rnd, "test_acc": None, **extra}
        else:
            ev = evaluate(method, ctx, glob, data.test_y, K)
            row = {
                "round": rnd,
                "test_acc": ev["acc"],
                "per_class_acc": ev["per_class_acc"],
                **ev.get("extra", {}),
            }
            row.update(extra)
            row.update(method.round_metrics(ctx, data, glob, ev))
        row["seconds"] = time.perf_counter() - t0
        metrics.append(row)
        if on_round:
            on_round(row)

    if resume is None:
        record(0, time.perf_counter(), {"clients": [], "train_loss": None, "bytes_up": 0, "bytes_down": 0})
        check_finite(method, ctx, 0, glob, None)
    for rnd in range(first, total_rounds + 1):
        t0 = time.perf_counter()
        method.round_begin(ctx, rnd, glob)
        clients = method.sample(ctx, rnd, participation)
        plan = make_plan(ctx, rnd, clients, method.p.batch_size, method.p.local_epochs)
        if engine == "batched" and world > 1:
            cparams, st = sharded_local(method, ctx, plan, glob, kernel, rank, world)
        elif engine == "batched":
            cparams, st = run_local(method, ctx, plan, glob, kernel=kernel)
        else:
            outs = [run_local(method, ctx, plan, glob, rows=slice(j, j + 1)) for j in range(plan.m)]
            cparams = {k: torch.cat([o[0][k] for o in outs]) for k in outs[0][0]}
            st = {
                "loss_sum": sum(o[1]["loss_sum"] for o in outs),
                "loss_steps": sum(o[1]["loss_steps"] for o in outs),
            }
        new = method.aggregate(ctx, plan, glob, cparams)
        glob = method.server_update(ctx, plan, glob, new)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        train_seconds = time.perf_counter() - t0  # local updates + aggregation + server step (no evaluation)
        loss = st["loss_sum"] / max(st["loss_steps"], 1)
        check_finite(method, ctx, rnd, glob, loss)
        up = method.upload_bytes(ctx, plan, cparams)
        down = plan.m * param_bytes(method.broadcast(ctx, glob))
        record(
            rnd,
            t0,
            {
                "clients": plan.clients.sort().values.tolist(),
                "train_loss": loss,
                "bytes_up": up,
                "bytes_down": down,
                "train_seconds": train_seconds,
            },
        )
        if (
            on_checkpoint is not None
            and checkpoint_every > 0
            and rnd % checkpoint_every == 0
            and rnd < total_rounds
        ):
            on_checkpoint(rnd, glob, ctx.state)
    return method.final_weights(ctx, glob), metrics


def check_labels(store) -> None:
    """Every train and test label is a class id of the store or -1 (a skipped image)."""
    K = store.n_classes
    for split in ("train", "test"):
        lab = store.labels(split)
        bad = np.flatnonzero((lab < -1) | (lab >= K))
        if len(bad):
            raise FedfeatError(
                f"store {store.path}: {split} label {int(lab[bad[0]])} at row {int(bad[0])} is not a class id "
                f"(the store has {K} classes, 0..{K - 1}; -1 marks a skipped image); rebuild the store"
            )


def load_run_data(
    store,
    partition,
    *,
    device="cpu",
    centralized: bool = False,
    dtype=torch.float32,
    local_val: str = "paper",
    query_val: str = "paper",
    query_seed: int = 0,
    local_test: str = "none",
) -> RunData:
    """Load a store's train (in the partition's client-major order) and test splits onto ``device``.

    ``dtype`` float32 by default (stored float16 is upcast: never compute in float16 on a CPU); float64 is
    for exactness checks (the engines agree to ~1e-12 there). A ``disjoint-classes`` partition makes the run
    open-vocabulary (``fedfeat.partition.openvocab``: ``local_val`` and ``query_val`` say how the clients' shots and the
    query set are split; the query set, not the whole test split, is then ``test_x`` / ``test_y``)."""
    check_labels(store)
    labels = store.labels("train")
    ov_parts = None
    if partition.scheme == "disjoint-classes":
        from fedfeat.partition import openvocab
        from fedfeat.partition.schemes import Partition

        openvocab.check_modes(local_val, query_val)
        train_pos, val_pos = openvocab.local_split(partition.clients, labels, local_val)
        ov_parts = (partition.clients, train_pos, val_pos)
        partition = Partition(partition.scheme, partition.params, train_pos)
    order, offsets = partition.order_and_offsets()
    if centralized:
        offsets = np.array([0, len(order)], dtype=np.int64)
    feats = store.features("train")
    K = store.n_classes
    x = torch.from_numpy(feats[order]).to(device=device, dtype=dtype)
    y = torch.from_numpy(labels[order]).to(device)
    has_test = "test" in store.splits
    tx_np = store.features("test") if has_test else feats
    ty_np = store.labels("test") if has_test else labels
    keep = ty_np >= 0
    ov = None
    if ov_parts is not None:
        ov, keep = _open_vocab(
            ov_parts, labels, feats, tx_np, ty_np, has_test, K, query_val, query_seed, device, dtype
        )
    tx = torch.from_numpy(tx_np[keep]).to(device=device, dtype=dtype)
    lt = None
    if local_test != "none":
        from fedfeat.partition.schemes import LOCAL_TEST, local_test_split

        if local_test not in LOCAL_TEST:
            raise FedfeatError(f"--local-test must be one of {', '.join(LOCAL_TEST)}, got {local_test!r}")
        if ov is not None or not has_test:
            raise FedfeatError(
                "--local-test splits a store's test split among the clients of a closed partition; this run "
                + ("is open-vocabulary (disjoint-classes)" if ov is not None else "has no test split")
                + ": drop --local-test"
            )
        if local_test == "joint":  # the test positions drawn with the train split (dirichlet-joint, FedCoPL)
            tc = partition.params.get("test_clients")
            if tc is None:
                raise FedfeatError(
                    "--local-test joint takes the test split drawn with the partition: use --partition "
                    "dirichlet-joint (FedCoPL), or --local-test proportional for another partition"
                )
            split = [np.asarray(t, dtype=np.int64) for t in tc]
        else:
            split = local_test_split(partition, labels, ty_np[keep], K, seed=query_seed)
        lt = [torch.from_numpy(r) for r in split]
    return RunData(
        train_x=x,
        train_y=y,
        offsets=torch.from_numpy(offsets.astype(np.int64)),
        test_x=tx,
        test_y=torch.from_numpy(ty_np[keep]).to(device),
        text_all=torch.from_numpy(store.text_features()).to(device=device, dtype=dtype),
        clip_logit_scale=store.logit_scale,
        class_names=store.class_names,
        train_counts=torch.bincount(y.cpu(), minlength=K),
        open_vocab=ov,
        local_test=lt,
        store=store,
        rows=order,
        test_rows=np.flatnonzero(keep) if ov is None and has_test else None,
    )


def _open_vocab(parts, labels, feats, tx_np, ty_np, has_test, K, query_val, query_seed, device, dtype):
    """The ``OpenVocab`` of a disjoint-classes partition, and the query set's test rows (``keep``)."""
    from fedfeat.partition import openvocab

    clients, train_pos, val_pos = parts
    lists = openvocab.class_lists(clients, labels)
    base = np.unique(np.concatenate(lists)) if lists else np.zeros(0, dtype=np.int64)
    novel = np.setdiff1d(np.arange(K), base)
    local = []  # per training row: its class's index in its client's list (Fed-MP's residual rows)
    for c, p in zip(lists, train_pos):
        lookup = np.full(K, -1, dtype=np.int64)
        lookup[c] = np.arange(len(c))
        local.append(lookup[labels[p]])
    used = np.zeros(len(labels), dtype=bool)
    used[np.concatenate(clients)] = True
    avail = (ty_np >= 0) if has_test else ((labels >= 0) & ~used)  # no test split: the images clients lack
    q_rows = np.flatnonzero(avail & np.isin(ty_np, novel))
    qv, qt = openvocab.query_split(ty_np[q_rows], query_val, query_seed)
    b_rows = np.flatnonzero(avail & np.isin(ty_np, base))
    vorder = np.concatenate(val_pos) if val_pos else np.zeros(0, dtype=np.int64)
    voffs = np.concatenate([[0], np.cumsum([len(v) for v in val_pos])]).astype(np.int64)

    def t(a, dt=dtype):
        return torch.from_numpy(np.ascontiguousarray(a)).to(device=device, dtype=dt)

    ov = openvocab.OpenVocab(
        base=t(base, torch.int64),
        novel=t(novel, torch.int64),
        client_classes=[t(c, torch.int64) for c in lists],
        local_index=t(np.concatenate(local) if local else np.zeros(0), torch.int64),
        val_x=t(feats[vorder]),
        val_y=t(labels[vorder], torch.int64),
        val_offsets=torch.from_numpy(voffs),
        query_x=t(tx_np[q_rows[qt]]),
        query_y=t(ty_np[q_rows[qt]], torch.int64),
        qval_x=t(tx_np[q_rows[qv]]),
        qval_y=t(ty_np[q_rows[qv]], torch.int64),
        base_x=t(tx_np[b_rows]),
        base_y=t(ty_np[b_rows], torch.int64),
    )
    keep = np.zeros(len(ty_np), dtype=bool)
    keep[q_rows[qt]] = True
    return ov, keep


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise FedfeatError("--device cuda asked for, but torch sees no CUDA device; use --device cpu or auto")
    if name not in ("cpu", "cuda") and not name.startswith("cuda:"):
        raise FedfeatError(f"unknown device '{name}'; choose auto, cpu or cuda")
    return torch.device(name)


__all__ = [
    "Batch",
    "Context",
    "LabelAccessError",
    "RoundPlan",
    "RunData",
    "fedavg",
    "load_run_data",
    "masked_mean",
    "run_federated",
]

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

Host syncs (what a GPU waits for). Inside a round's local updates the torch program keeps everything on the
device: its step tables are made on the host before they are copied over, and the loss is summed on the device.
A round then syncs where its metrics row needs numbers: the summed training loss (``run_local``'s one ``float``),
the finite check of the loss and weights (one transfer for all tensors, ``check_finite``) and, in an evaluated
round, the evaluation's counts (one transfer, ``evaluate``). Methods sync where their algorithm needs a host
decision: FedCoPL's and FPL's per-class selections, CCVR / FedDF / FedBE's server steps, a carried optimiser's
client order; the torchrun path all-gathers the clients' parameters through the host (``sharded_local``).

Methods that never read labels get a ``Batch`` whose ``y`` raises ``LabelAccessError`` (structural, not a
convention): the engine does not even hold the training labels in the method's context.
"""

from __future__ import annotations

import numbers
import time
from collections.abc import Callable

import numpy as np
import torch

from fedfeat.engine.context import (
    Batch,
    Context,
    LabelAccessError,
    RoundPlan,
    epoch_tables,
    fedavg,
    make_plan,
    masked_mean,
    param_bytes,
    round_buffer,
)
from fedfeat.engine.data import RunData, build_context, load_run_data
from fedfeat.errors import FedfeatError


def run_local(
    method,
    ctx: Context,
    plan: RoundPlan,
    glob: dict[str, torch.Tensor],
    rows: slice | None = None,
    kernel: str = "torch",
    carried: dict | None = None,
) -> tuple[dict[str, torch.Tensor], dict]:
    """Local update of the plan's clients ``rows`` (default all) as one batched program: the torch tensor
    program below (``kernel="torch"``), or the method's fused CPU kernel for a whole epoch (``"fused"``,
    ``fedfeat.engine.kernels``).

    ``carried``: the optimiser state of a method whose optimiser lives across clients and rounds
    (``Method.carries_optimizer``; one client at a time): the update starts from ``carried["state"]`` (when there is
    one) instead of fresh state, and leaves its final state there.

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
    ctx.lr_round = opt.lr  # the round's learning rate, for the hooks (Method: "What the engine used")
    opt.reset(params)
    if carried is not None and carried.get("state"):  # the reference codes' one optimiser for every client
        opt.state = carried["state"]
    local = method.local_begin(ctx, plan, glob)
    if kernel == "fused":  # whole epochs (epoch_begin's draws included) in the method's compiled kernel
        opt.state["fused"] = {k: round_buffer(ctx, "momentum " + k, m, v) for k, v in glob.items()}
        loss = sum(
            float(method.fused_epoch(ctx, plan, glob, local, params, opt, e).sum())
            for e in range(plan.epochs)
        )
        method.local_end(ctx, plan, local, params)
        return params, {"loss_sum": loss, "loss_steps": int(plan.steps.sum()) * plan.epochs}
    prog = TorchLocal(method, ctx, plan, params, opt, local)
    private = ctx.dp is not None and ctx.dp.mode == "sample"
    for epoch in range(plan.epochs):
        for s in range(prog.begin_epoch(epoch)):
            if private:  # DP-SGD: clipped per-sample gradients plus noise (fedfeat.engine.privacy)
                prog.dp_step(s)
                continue
            p, loss = prog.loss(s)
            prog.step(p, loss, torch.autograd.grad(loss.sum(), list(p.values())))
    method.local_end(ctx, plan, local, params)
    if carried is not None:
        carried["state"] = opt.state
    return params, {"loss_sum": float(prog.loss_sum), "loss_steps": prog.loss_n}


class TorchLocal:
    """One run's torch local update (``run_local``'s program), a step at a time: ``run_local`` drives one,
    ``engine.stacked`` several runs in lockstep (one ``autograd.grad`` for all of them). Per epoch ``begin_epoch``
    (its step tables and the method's ``epoch_begin``; returns the epoch's number of steps), then per step ``loss``
    (the method's own ``step_loss`` on the active clients' batch) and ``step`` (the method's optimiser)."""

    def __init__(self, method, ctx: Context, plan: RoundPlan, params: dict, opt, local: dict):
        self.method, self.ctx, self.plan, self.local = method, ctx, plan, local
        self.params, self.opt = params, opt
        self.D = ctx.feats.shape[1]
        self.xbuf = torch.empty(plan.m * plan.batch_size, self.D, dtype=ctx.feats.dtype, device=ctx.device)
        # summed on the device: no sync per step
        self.loss_sum = torch.zeros((), dtype=torch.float64, device=ctx.device)
        self.loss_n = 0

    def begin_epoch(self, epoch: int) -> int:
        ctx, plan = self.ctx, self.plan
        idx, mask = epoch_tables(ctx, plan, epoch)
        # batch width per step: B, or less when every active client is on a smaller (last) batch -- clients
        # with fewer samples than B cost their samples, not B padded rows
        self.widths = mask.sum(-1).amax(-1).tolist()  # [S]
        self.idx, self.mask = idx.to(ctx.device), mask.to(ctx.device)
        self.epoch = epoch
        self.method.epoch_begin(ctx, plan, self.local, epoch)
        return idx.shape[0]

    def batch(self, s: int) -> Batch:
        """The active clients' mini-batch of step ``s``."""
        ctx, labels, D = self.ctx, self.ctx.labels, self.D
        n = self.plan.active(s)
        B = int(self.widths[s])
        ib = self.idx[s, :n, :B]  # [n, B]
        x = torch.index_select(ctx.feats, 0, ib.reshape(-1), out=self.xbuf[: n * B]).view(n, B, D)
        return Batch(
            x, self.mask[s, :n, :B], ib, n, self.epoch, s, labels[ib] if labels is not None else None
        )

    def loss(self, s: int) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        """``(the active clients' parameters as autograd leaves, their losses [n])`` of step ``s``."""
        batch = self.batch(s)
        n = batch.n
        p = {k: v[:n].detach().requires_grad_(True) for k, v in self.params.items()}
        self.n = n
        loss = self.method.step_loss(self.ctx, p, batch, self.local)  # [n]
        if self.loss_n == 0:  # the update's first step: the hook's shape, checked once (not per step)
            check_loss(self.method, loss, n)
        return p, loss

    def dp_step(self, s: int) -> None:
        """Step ``s`` of DP-SGD (``fedfeat.engine.privacy``): each active client's clipped per-sample gradients
        summed (``method.dp_clipped_sums``), Gaussian noise added per client, divided by the batch size, the exact
        gradient of a data-independent regulariser added; then the method's optimiser."""
        from fedfeat.engine.privacy import sample_noise

        method, ctx, plan = self.method, self.ctx, self.plan
        batch = self.batch(s)
        n = batch.n
        p = {k: v[:n].detach() for k, v in self.params.items()}
        loss, sums = method.dp_clipped_sums(ctx, p, batch, self.local, float(ctx.state["dp"]["clip"]))
        grads = sample_noise(ctx, plan, sums, plan.clients[:n], self.epoch, s, plan.batch_size)
        leaves = {k: v.requires_grad_(True) for k, v in {k: v.clone() for k, v in p.items()}.items()}
        with torch.enable_grad():
            reg = method.dp_regularizer(ctx, leaves, self.local)
            if reg is not None:
                loss = loss + reg.detach()
                extra = torch.autograd.grad(reg.sum(), list(leaves.values()), allow_unused=True)
                grads = {k: grads[k] + (0 if e is None else e) for k, e in zip(leaves, extra)}
        self.n = n
        self.opt.step(self.params, {k: grads[k] for k in self.params}, n)
        self.loss_sum += loss.detach().double().sum()
        self.loss_n += n

    def step(self, p: dict, loss: torch.Tensor, grads) -> None:
        """The optimiser's step with ``grads`` (of ``p``'s tensors, in its order) and the loss counted."""
        self.opt.step(self.params, dict(zip(list(p), grads)), self.n)
        self.loss_sum += loss.detach().double().sum()
        self.loss_n += self.n


def run_carried(method, ctx: Context, plan: RoundPlan, glob: dict) -> tuple[dict[str, torch.Tensor], dict]:
    """The local updates of a method whose optimiser state carries from client to client and round to round
    (``Method.carries_optimizer``: the reference codes of PromptFL and FedCoPL make their SGD once and never reset
    it, so momentum leaks across clients): the plan's clients one after another in ascending client id, each
    starting from the state the previous one left (kept in ``ctx.state["carried_optimizer"]``, checkpointed with the
    run). Inherently sequential: both engines run it so, and give the same result."""
    holder = ctx.state.setdefault("carried_optimizer", {})
    outs: list = [None] * plan.m
    for j in torch.argsort(plan.clients).tolist():
        outs[j] = run_local(method, ctx, plan, glob, rows=slice(j, j + 1), carried=holder)
    params = {k: torch.cat([o[0][k] for o in outs]) for k in outs[0][0]}
    st = {k: sum(o[1][k] for o in outs) for k in ("loss_sum", "loss_steps")}
    return params, st


def evaluate(method, ctx: Context, glob: dict, test_y: torch.Tensor, n_classes: int) -> dict:
    if getattr(ctx, "open_vocab", None) is not None:
        return evaluate_open_vocab(method, ctx, glob, test_y, n_classes)
    logits = method.predict(ctx, glob, ctx.test_x)
    check_logits(method, logits, test_y.shape[0], n_classes)  # [N, K]: shapes only, no sync
    # a class-major head's logits come as a transposed view: argmax over the classes of a contiguous copy is ~3x
    # faster than the strided reduction (10,000 x 10: 0.45 vs 1.44 ms on one thread), and gives the same indices
    logits = logits.contiguous()
    vocab = _domain_vocab(ctx, n_classes, logits.device)
    if vocab is not None:  # a combined store: each test row predicted over its own dataset's classes
        logits = logits.masked_fill(~vocab[ctx.test_domains], -torch.inf)
    pred = logits.argmax(1)
    correct = (pred == test_y).to(torch.float64)
    dev = test_y.device
    # every count the metrics need, summed on the device and brought to the host in one transfer (the round's one
    # sync for its evaluation; on a GPU nothing else of the evaluation waits): per class hits and images of the
    # test rows, the validation rows' hits and count, each client's local hits and rows
    vm = getattr(ctx, "val_mask", None)
    test_rows = ~vm if vm is not None else None
    ty, tc = (
        (test_y, correct) if test_rows is None else (test_y[test_rows], correct[test_rows])
    )  # test rows only
    parts = [
        torch.zeros(n_classes, dtype=torch.float64, device=dev).index_add_(0, ty, tc),
        torch.bincount(ty, minlength=n_classes).to(torch.float64),
    ]
    if vm is not None:  # --val-split: one prediction pass, the held-out rows scored apart
        parts.append(torch.stack([correct[vm].sum(), vm.sum().to(torch.float64)]))
    doms = getattr(ctx, "test_domains", None)
    if doms is not None:  # each domain's test rows: hits and count (validation rows left out)
        nd = len(ctx.domain_names)
        dd, dc = (doms, correct) if test_rows is None else (doms[test_rows], correct[test_rows])
        parts.append(torch.zeros(nd, dtype=torch.float64, device=dev).index_add_(0, dd, dc))
        parts.append(torch.bincount(dd, minlength=nd).to(torch.float64))
    local = getattr(ctx, "local_test", None)
    # per-client models score themselves (a Method declares local_accuracies None; a bare predictor has none)
    own = local is not None and getattr(method, "local_accuracies", None) is not None
    if local is not None and not own:  # its rows are test rows (validation rows left out)
        client_of, rows = _local_rows(ctx, dev)
        C = len(local)
        parts.append(torch.zeros(C, dtype=torch.float64, device=dev).index_add_(0, client_of, correct[rows]))
    host = torch.cat(parts).tolist()  # the one host transfer
    hits, cnt = host[:n_classes], host[n_classes : 2 * n_classes]
    o = 2 * n_classes
    extra = {}
    if doms is not None:  # taken out of host so that the offsets below are as without domains
        nd = len(ctx.domain_names)
        at = o + 2 * (vm is not None)
        dh, dn = host[at : at + nd], host[at + nd : at + 2 * nd]
        del host[at : at + 2 * nd]
        extra["domain_acc"] = {n: (100 * h / c if c else None) for n, h, c in zip(ctx.domain_names, dh, dn)}
    if local is not None:
        if own:
            accs = method.local_accuracies(ctx, glob, test_y)
        else:
            accs = [100 * (h / len(r)) for h, r in zip(host[o + 2 * (vm is not None) :], local) if len(r)]
        extra.update(local_summary(accs, local))
    if vm is not None:
        extra["val_acc"] = 100 * (host[o] / host[o + 1])
    if test_rows is not None:
        pred = pred[test_rows]
    n = sum(cnt)
    out = {
        "acc": 100 * (sum(hits) / n) if n else float("nan"),
        "per_class_acc": [100 * (h / max(c, 1.0)) for h, c in zip(hits, cnt)],
        "pred": pred,
    }
    if extra:
        out["extra"] = extra
    return out


def _domain_vocab(ctx: Context, n_classes: int, dev) -> torch.Tensor | None:
    """``[domains, K]`` bool: each domain's classes (a combined store's ``domain_classes``), made once per run."""
    if getattr(ctx, "domain_classes", None) is None or getattr(ctx, "test_domains", None) is None:
        return None
    if "domain_vocab" not in ctx.cache:
        m = torch.zeros(len(ctx.domain_classes), n_classes, dtype=torch.bool)
        for d, cs in enumerate(ctx.domain_classes):
            m[d, cs] = True
        ctx.cache["domain_vocab"] = m.to(dev)
    return ctx.cache["domain_vocab"]


def _local_rows(ctx: Context, dev) -> tuple[torch.Tensor, torch.Tensor]:
    """``(client of each entry, test row of each entry)``: the clients' local test rows concatenated (made once per
    run: a client's accuracy is then one ``index_add`` for all clients, not a loop)."""
    if "local_rows" not in ctx.cache:
        local = ctx.local_test
        rows = torch.cat([r.to(torch.int64) for r in local]) if local else torch.zeros(0, dtype=torch.int64)
        sizes = torch.tensor([len(r) for r in local], dtype=torch.int64)
        client_of = torch.repeat_interleave(torch.arange(len(local)), sizes)
        ctx.cache["local_rows"] = (client_of.to(dev), rows.to(dev))
    return ctx.cache["local_rows"]


def local_summary(accs: list[float], local: list) -> dict:
    """FedCoPL's metric: the unweighted mean over clients of each client's accuracy on its local test split
    (``accs``, one per client with a non-empty split, in client order; clients with an empty split left out), with
    its standard deviation over clients. The methods here have one global model, so a client's accuracy is that of
    the global predictions on its rows; a method with per-client models gives its own (``local_accuracies``)."""
    a = np.asarray(accs)
    # every client's accuracy in client order (None: no local test rows), for RUN/results.npz's client_acc
    it = iter(accs)
    per_client = [float(next(it)) if len(r) else None for r in local]
    return {
        "local_acc": float(a.mean()) if len(a) else None,
        "local_acc_std": float(a.std(ddof=1)) if len(a) > 1 else None,
        "local_clients": len(a),
        "client_acc": per_client,
    }


@torch.no_grad()
def evaluate_open_vocab(method, ctx: Context, glob: dict, test_y: torch.Tensor, n_classes: int) -> dict:
    """Novel accuracy over the novel vocabulary (the query set ``ctx.test_x``), macro P/R/F1 over the novel
    classes, base accuracy over the base vocabulary and their harmonic mean (``fedfeat.partition.openvocab``)."""
    from fedfeat.partition.openvocab import harmonic_mean, macro_prf

    ov = ctx.open_vocab
    if (
        getattr(ctx, "domain_classes", None) is not None
    ):  # a combined store: each dataset over its own classes
        return _open_vocab_by_domain(method, ctx, glob, test_y, n_classes)
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
    val_acc = None
    if len(ov.qval_y):  # the query set's validation part (query_val="paper"): Fed-MP's 20 %
        qy = ov.qval_y.to(test_y.device)
        val_acc = float((method.predict_classes(ctx, glob, ov.qval_x, novel) == qy).double().mean()) * 100
    extra = {
        "val_acc": val_acc,
        "novel_precision": 100 * precision,
        "novel_recall": 100 * recall,
        "novel_f1": 100 * f1,
        "base_acc": base_acc,
        "hm": harmonic_mean(acc, base_acc),
    }
    pc = (hits / cnt.clamp_min(1)).tolist()
    return {"acc": acc, "per_class_acc": [100 * v for v in pc], "pred": pred, "extra": extra}


def _open_vocab_by_domain(method, ctx: Context, glob: dict, test_y: torch.Tensor, n_classes: int) -> dict:
    """Base-to-novel on a combined store (FedTPG's cross-dataset evaluation, ``dm_federated.py`` ``TestDataManager``):
    each dataset's novel test images over its novel classes, its base ones over its base classes (one prediction per
    dataset and split: a loop over the datasets, not the clients); ``acc`` / ``base_acc`` over all images, and per
    dataset ``domain_novel_acc`` / ``domain_base_acc`` / ``domain_hm``."""
    from fedfeat.partition.openvocab import harmonic_mean, macro_prf

    ov, dev = ctx.open_vocab, test_y.device
    novel, base = set(ov.novel.tolist()), set(ov.base.tolist())
    by = ov.base_y.to(dev)
    pred, bpred = torch.full_like(test_y, -1), torch.full_like(by, -1)
    per: dict[str, dict] = {"domain_novel_acc": {}, "domain_base_acc": {}, "domain_hm": {}}
    for name, cls in zip(ctx.domain_names, ctx.domain_classes):
        out = {}
        for key, keep, y, x, p in (
            ("novel", novel, test_y, ctx.test_x, pred),
            ("base", base, by, ov.base_x, bpred),
        ):
            vocab = torch.tensor([c for c in cls if c in keep], dtype=torch.int64, device=dev)
            rows = torch.isin(y, vocab) if len(vocab) else torch.zeros_like(y, dtype=torch.bool)
            if rows.any():
                p[rows] = method.predict_classes(ctx, glob, x[rows], vocab)
                out[key] = float((p[rows] == y[rows]).double().mean()) * 100
        per["domain_novel_acc"][name] = out.get("novel")
        per["domain_base_acc"][name] = out.get("base")
        per["domain_hm"][name] = harmonic_mean(out.get("novel"), out.get("base"))
    correct = (pred == test_y).to(torch.float64)
    hits = torch.zeros(n_classes, dtype=torch.float64, device=dev).index_add_(0, test_y, correct)
    cnt = torch.bincount(test_y, minlength=n_classes).to(torch.float64)
    precision, recall, f1 = macro_prf(pred, test_y, ov.novel.to(dev))
    acc = float(correct.mean()) * 100 if len(correct) else 0.0
    base_acc = None
    if len(by):
        bc = (bpred == by).to(torch.float64)
        base_acc = float(bc.mean()) * 100
        hits.index_add_(0, by, bc)
        cnt += torch.bincount(by, minlength=n_classes).to(torch.float64)
    extra = {"novel_precision": 100 * precision, "novel_recall": 100 * recall, "novel_f1": 100 * f1,
             "base_acc": base_acc, "hm": harmonic_mean(acc, base_acc), **per}  # fmt: skip
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
        why = f"method {method.name} has no fused kernel: {method.no_fused_reason()}"
    elif method.carries_optimizer():
        why = f"method {method.name} carries its optimiser from client to client (one client at a time)"
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
    dp=None,
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
    have ``test_acc`` None (their training metrics are kept).

    ``dp``: a ``fedfeat.engine.privacy.DPConfig`` (client-level DP-FedAvg or sample-level DP-SGD); its noise
    multiplier is calibrated to its ``epsilon`` when it has none, and every round's row gets ``epsilon`` (spent so
    far, at ``dp.delta``) and the round's clipping figures."""
    INT, REAL = (
        numbers.Integral,
        numbers.Real,
    )  # the types of the CLI's flags (numpy numbers count, bools do not)
    for name, v, kind in (("rounds", rounds, INT), ("seed", seed, INT), ("eval_every", eval_every, INT),
                          ("participation", participation, REAL)):  # fmt: skip
        if isinstance(v, bool) or not isinstance(v, kind):
            word = "an integer" if kind is INT else "a number"
            raise FedfeatError(f"{name} must be {word}, got {v!r:.60} ({type(v).__name__})")
    rounds, seed, eval_every, participation = int(rounds), int(seed), int(eval_every), float(participation)
    if engine not in ("batched", "loop"):
        raise FedfeatError(f"unknown engine '{engine}'; choose batched or loop")
    if not 0 < participation <= 1:
        raise FedfeatError(f"--participation must be in (0, 1], got {participation}")
    if eval_every < 1:
        raise FedfeatError(f"--eval-every must be >= 1, got {eval_every}")
    device = torch.device(device)
    if dp is not None:
        from fedfeat.engine.privacy import check_method

        check_method(method, dp)
        if dp.mode == "sample" and kernel == "fused":
            raise FedfeatError(
                "--dp sample clips per-sample gradients in the torch program; use --kernel torch"
            )
        if dp.mode == "sample":
            kernel = "torch"
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
            on_checkpoint, checkpoint_every, resume, eval_every, dp,
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
    else:  # no client here: the round's learning rate for the hooks all the same (run_local sets it)
        ctx.lr_round = method.make_optimizer(plan.rnd).lr
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


def _shape(v) -> str:
    """A hook's output in words: a tensor's shape ``[4, 10]``, else its type."""
    if isinstance(v, torch.Tensor):
        return "a tensor [" + ", ".join(map(str, v.shape)) + "]"
    return f"{type(v).__name__} {v!r:.40}"


def check_loss(method, loss, n: int) -> None:
    """``step_loss`` returns one loss per active client, ``[n]``: a scalar (a mean over clients) would scale every
    client's gradient by 1/n, a ``[n, B]`` would be summed into the loss unnoticed. A one-line ``FedfeatError``."""
    if not isinstance(loss, torch.Tensor) or loss.shape != (n,):
        raise FedfeatError(
            f"method {method.name}: step_loss returned {_shape(loss)}, expected a tensor [{n}] (one loss per active "
            "client: reduce over each client's batch, not over clients)"
        )


def check_logits(method, logits, n: int, k: int) -> None:
    """``predict`` returns ``[N, K]`` logits: one row per evaluated sample, one column per class."""
    if not isinstance(logits, torch.Tensor) or logits.shape != (n, k):
        raise FedfeatError(
            f"method {method.name}: predict returned {_shape(logits)}, expected a tensor [{n}, {k}] (one row per "
            "sample of x, one column per class)"
        )


def check_params(method, hook: str, out, old: dict | None = None) -> dict:
    """``init_global`` returns ``{name: tensor}``; ``server_update`` the same names and shapes as the global
    parameters it was given (``old``). Returns ``out``; a violation is one ``FedfeatError`` line naming the hook,
    the parameter, what was expected and what came back. Host metadata only (no sync), once per round."""
    if not isinstance(out, dict):
        raise FedfeatError(
            f"method {method.name}: {hook} returned {_shape(out)}, expected a dict {{name: tensor}} of the global "
            "parameters"
        )
    for k, v in out.items():
        if not isinstance(k, str) or not isinstance(v, torch.Tensor):
            raise FedfeatError(
                f"method {method.name}: {hook} returned {{{k!r:.40}: {_shape(v)}}}, expected a dict of named tensors"
            )
    if old is not None:
        if out.keys() != old.keys():
            raise FedfeatError(
                f"method {method.name}: {hook} returned the parameters {sorted(out)}, expected the same names as the "
                f"global parameters it was given, {sorted(old)}"
            )
        for k, v in out.items():
            if v.shape != old[k].shape:
                raise FedfeatError(
                    f"method {method.name}: {hook} returned {k} as {_shape(v)}, expected the shape of the global "
                    f"{k}, {_shape(old[k])}"
                )
    return out


def check_finite(method, ctx: Context, rnd: int, glob: dict, loss: float | None) -> None:
    """Stop a run whose loss or weights became NaN or inf (a run that looks finished must not hold them)."""
    what = [] if loss is None or np.isfinite(loss) else ["training loss"]
    names, flags = [], []
    for label, params in (("global", glob), ("evaluated", method.final_weights(ctx, glob))):
        for k, v in params.items():
            names.append(f"{label} {k}")
            flags.append(torch.isfinite(v).all())
    if flags:  # one host transfer for all of them (a round's one sync for this check)
        what += [n for n, ok in zip(names, torch.stack(flags).tolist()) if not ok]
    if what:
        raise FedfeatError(
            f"round {rnd} of {method.name}: {', '.join(dict.fromkeys(what))} became non-finite (NaN or inf); "
            "the run is stopped -- lower the learning rate (--set lr=...) or check the store with "
            "`fedfeat info --verify`"
        )


def _run(
    method, data, rounds, participation, seed, engine, device, kernel, threads, on_round,
    on_checkpoint=None, checkpoint_every=0, resume=None, eval_every=1, dp=None,
):  # fmt: skip
    ctx = build_context(data, method, seed, device)
    accounting = None
    if dp is not None:
        from fedfeat.engine import privacy

        if dist_info()[1] > 1:
            raise FedfeatError("differentially private runs are made in one process; drop torchrun")
        dp, accounting = privacy.prepare(dp, privacy.client_sizes(ctx), method, participation, rounds)
        ctx.dp = dp
    ctx.threads = threads
    ctx.rounds = rounds
    rank, world = dist_info()
    if world > 1 and not method.shardable:  # not inherited: a promise of the class's own local training
        raise FedfeatError(
            f"method {method.name} cannot be sharded across processes (it keeps per-sample state that local "
            "training updates, or has no sharded form yet); run it in one process"
        )
    if world > 1 and method.carries_optimizer():
        raise FedfeatError(
            f"method {method.name} carries its optimiser state from client to client (the reference code's "
            "one optimiser): its clients run one after another; run it in one process, or give it fresh "
            "per-client optimisers (its optimizer_state=fresh switch)"
        )
    if world > 1 and engine != "batched":
        raise FedfeatError("torchrun shards the batched engine's clients; use --engine batched")
    K = len(data.class_names)
    method.setup(ctx)
    glob = method.init_global(ctx)
    check_params(method, "init_global", glob)
    metrics: list[dict] = []
    first = 1
    if dp is not None:
        ctx.state["dp"] = {"clip": float(dp.clip_norm), "round": {}}
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
        if method.carries_optimizer() and plan.m:
            cparams, st = run_carried(method, ctx, plan, glob)
        elif engine == "batched" and world > 1:
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
        if dp is not None and dp.mode == "client":  # DP-FedAvg: clipped, uniform, noised (engine.privacy)
            new = privacy.aggregate(method, ctx, plan, glob, cparams)
        else:
            new = method.aggregate(ctx, plan, glob, cparams)
        glob = check_params(method, "server_update", method.server_update(ctx, plan, glob, new), glob)
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
                "images": plan.images,
                "trainable_params": method.trainable_count(ctx, plan, cparams)
                if method.trains_clients
                else 0,
                **({} if accounting is None else privacy.round_row(ctx, accounting, rnd)),
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


def resolve_device(name: str) -> torch.device:
    """``--device``: auto, cpu, cuda or cuda:N, checked against this machine (one line naming the devices it has:
    ``fedfeat.encoders.openclip.resolve_device``)."""
    from fedfeat.encoders.openclip import resolve_device as resolve

    return resolve(name)


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

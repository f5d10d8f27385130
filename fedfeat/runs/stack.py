"""Stacked runs: several runs of one linear-head method as one batched program along a run axis.

A sweep's runs that read the same data (same store, partition, ``normalize`` / ``templates`` and batch
geometry: ``batch_size``, ``local_epochs``, ``rounds``) but differ in their seed (client sampling, shuffles, the
method's own draws), participation or hyperparameters are made together: every run's round plan (its sampled
clients, their shuffled mini-batches, FST-CBDG's synthetic tables and noise) is exactly the one its own run would
make, and the ``R`` runs' clients become ``R x m`` *virtual clients* of one round program -- one gather, one
batched product, one optimizer step per local step for all runs, one evaluation product per round for all runs.
What differs between runs rides along as per-virtual-client tensors (learning rate, momentum, weight decay,
logit scale, FedProx's / FedNova's ``mu``, FedNTD's ``tau`` / ``beta``, Fed-Focal's ``gamma``, Ratio Loss's class
weights, CLIP2FL's ``kd_alpha`` / ``kd_temperature`` / teacher logits, FST-CBDG's ``beta`` / ``lam`` / ``sigma`` /
``self_training``); per-sample state (FST-CBDG's soft labels) gets a run axis ``[R, N, K]``. Everything else a run
does is its own method's hook, called per run with its own context (state, cache, seed) as alone: ``round_begin``,
``local_begin`` / ``local_end``, ``aggregate``, ``server_update``, ``round_metrics``, ``final_weights``; a method
with its own ``predict`` (tau-norm's normalised head, CCVR's calibrated one, CReFF's re-trained one) is evaluated
per run, the plain linear heads in one product.

Stacked results equal the runs made one by one (``tests/test_stack.py``: bit for bit with the fused CPU kernels;
weights and metrics <= 1e-5 with the torch program). Each run's ``train_seconds`` is the stacked round's time
divided by ``R``.

Which methods stack: each method declares it (``Method.stack_loss``, the local loss this program runs for it, or
``Method.no_stack_reason``; ``fedfeat methods`` shows both). BENCHMARKS.md "Stacked runs" measures each:

| method | stacks | what is stacked / why not |
|---|---|---|
| ``fedavg``, ``fedprox``, ``fedavgm``, ``fednova``, ``fedavg-tau-norm``, ``fedntd``, ``fst-cbdg`` | yes, fused + torch | the whole round but the per-run server step (server momentum, FedNova's normalised weights, tau-norm's head: a few ``[K, D]`` operations) |
| ``fed-focal``, ``ratio-loss`` | yes, torch | the local step with per-run ``gamma`` / class weights; Ratio Loss's monitor (K head copies on its auxiliary set) per run |
| ``ccvr``, ``feddf``, ``fedbe`` | yes, fused + torch | FedAvg's local step only; the calibration / distillation is a per-run optimisation loop over the run's own (seeded) server set, made as alone. CCVR gains ~nothing (1.02x, BENCHMARKS.md): every client's class covariances (``[K, D, D]``, ~30 s a run at D = 1024) are computed per run, though only the virtual draw depends on the seed -- sharing them is ``ccvr.py``'s to split |
| ``creff``, ``clip2fl`` | yes, torch | the local step only (CLIP2FL: + its distillation loss); the feature synthesis and classifier re-training per run (100 matching steps, 300 re-training epochs: ~1 s a round at the defaults, BENCHMARKS.md "Cross-device scale") |
| ``zeroshot`` | no | no training: a run is one evaluation, nothing per round to share |
| ``centralized`` | no | one client holding the whole split (``train`` loads other data than the sweep's partition); its round is all arithmetic, which stacking does not remove |
| ``copl-linear`` | no | it trains on its own pseudo-labels, which replace the context's labels and client layout per run (``apply_selection``); the stacked program and the fused kernels read one label array for all runs |
| ``fedclip``, ``fed-mp`` | no | an adapter MLP, not a ``{W, b}`` head; Fed-MP keeps per-client residuals and a keep-if-better local validation; their hooks read hyperparameters as scalars (``self.p``), so the generic route (the method's own batched ``step_loss`` over virtual clients) would need per-client hyperparameter tensors in ``fedmp.py`` |
| ``promptfl``, ``fedtpg``, ``pfedprompt``, ``fedopt``, ``fedcopl`` | no | live encoders: a step is the text / image encoder's forward per run's prompts; stacking would be a larger encoder batch, not less overhead (and the prompt modules are their own) |

Runs that differ in what shapes the data (``Method.stack_shape``) or in any run setting the run specification does
not declare ``per_run`` (``fedfeat.spec.stack_key``), and the methods above that do not stack, are made one
by one (``fedfeat.runs.sweep`` groups them).
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable

import numpy as np
import torch
import torch.nn.functional as F

from fedfeat.engine.context import epoch_tables, make_plan, masked_mean, param_bytes
from fedfeat.engine.data import RunData, build_context
from fedfeat.engine.rounds import check_finite, resolve_kernel
from fedfeat.errors import FedfeatError
from fedfeat.methods.fst_cbdg import synthetic_head
from fedfeat.methods.base import stackable
from fedfeat.methods.head import batched_linear
from fedfeat.methods.linear import ntd_loss

def stack_key(method, extra: tuple = ()) -> tuple | None:
    """Runs with equal keys can be stacked (None: this method cannot)."""
    if method.stack_loss is None:
        return None
    return (method.name, *(getattr(method.p, k, None) for k in method.stack_shape), *extra)


def _per_run(ms, name: str, default: float = 0.0) -> torch.Tensor:
    return torch.tensor([float(getattr(m.p, name, default)) for m in ms], dtype=torch.float64)


@dataclasses.dataclass
class _Round:
    """The virtual clients of one round: run ``vrun``, slot ``vslot`` in that run's plan, client ``vclient``."""

    plans: list
    vrun: torch.Tensor  # [V]
    vslot: torch.Tensor  # [V]
    steps: torch.Tensor  # [V] descending
    where: list  # per run: [m_r] virtual index of each of its plan slots

    def active(self, s: int) -> int:
        return int((self.steps > s).sum())


def _virtual(plans) -> _Round:
    vrun = torch.cat([torch.full((p.m,), r, dtype=torch.int64) for r, p in enumerate(plans)])
    vslot = torch.cat([torch.arange(p.m) for p in plans])
    steps = torch.cat([p.steps for p in plans])
    order = torch.argsort(-steps, stable=True)
    inv = torch.empty_like(order)
    inv[order] = torch.arange(len(order))
    where, o = [], 0
    for p in plans:
        where.append(inv[o : o + p.m])
        o += p.m
    return _Round(plans, vrun[order], vslot[order], steps[order], where)


def run_stacked(
    methods: list,
    data: RunData,
    *,
    rounds: int,
    participation: float | list[float],
    seeds: list[int],
    device: torch.device | str = "cpu",
    eval_every: int = 1,
    on_round: Callable[[int, dict], None] | None = None,
    kernel: str = "auto",
) -> list[tuple[dict, list[dict]] | FedfeatError]:
    """Make ``len(methods)`` runs (``methods[r]`` with ``seeds[r]``) as one program; returns per run ``(final
    weights, metric rows)`` as ``engine.run_federated`` would, or the ``FedfeatError`` that stopped that run (a
    run whose weights became non-finite; the others go on). ``on_round(r, row)`` sees each run's rows.
    ``kernel``: ``auto`` (the fused CPU kernels on a CPU, else torch), ``fused`` or ``torch``, as ``train``."""
    R = len(methods)
    if R == 0:
        return []
    if len(seeds) != R:
        raise FedfeatError("run_stacked: one seed per method")
    keys = {stack_key(m) for m in methods}
    if None in keys or len(keys) != 1:
        raise FedfeatError(
            f"runs cannot be stacked: methods {sorted({m.name for m in methods})} must be one of "
            f"{', '.join(stackable())} with equal {', '.join(methods[0].stack_shape)}"
        )
    parts = participation if isinstance(participation, list) else [participation] * R
    if eval_every < 1:
        raise FedfeatError(f"--eval-every must be >= 1, got {eval_every}")
    device = torch.device(device)
    kernel = resolve_kernel(kernel, methods[0], "batched", device)
    threads = torch.get_num_threads()
    if (
        kernel == "fused"
    ):  # as engine.run_federated: the kernel owns the cores, torch's few ops run on one thread
        torch.set_num_threads(1)
    try:
        return _stacked(methods, data, rounds, parts, seeds, device, eval_every, on_round, kernel, threads)
    finally:
        torch.set_num_threads(threads)


def _stacked(methods, data, rounds, parts, seeds, device, eval_every, on_round, kernel, threads):
    R = len(methods)
    name = methods[0].name
    fst = name == "fst-cbdg"
    p0 = methods[0].p
    ctx0 = build_context(data, methods[0], seeds[0], device)
    ctx0.threads = threads
    ctx0.test_xT()  # made once; each run's own cache starts with it (a method's cache, e.g. ratio-loss's seeded
    # auxiliary set, is the run's own as it is alone)
    ctxs = [
        dataclasses.replace(ctx0, seed=int(s), state={}, cache=dict(ctx0.cache), rounds=rounds) for s in seeds
    ]
    N, D, K = ctx0.feats.shape[0], ctx0.D, ctx0.K  # K: the soft labels' width
    for m, c in zip(methods, ctxs):
        m.setup(c)
    if fst:  # the soft labels with a run axis; each run's context sees its own slice (a view)
        Q = torch.stack([c.state["q"] for c in ctxs])  # [R, N, K]
        for r, c in enumerate(ctxs):
            c.state["q"] = Q[r]
        Qflat = Q.view(R * N, K)
    globs = [m.init_global(c) for m, c in zip(methods, ctxs)]
    dt = ctx0.feats.dtype
    hp = {
        k: _per_run(methods, k).to(device=device, dtype=dt)
        for k in (
            "momentum",
            "weight_decay",
            "logit_scale",
            "mu",
            "tau",
            "beta",
            "lam",
            "sigma",
            "gamma",
            "kd_alpha",
            "kd_temperature",
            "teacher_logit_scale",
        )  # fmt: skip
    }
    hp["self_training"] = torch.tensor([float(getattr(m.p, "self_training", True)) for m in methods])
    hp["self_training"] = hp["self_training"].to(device=device, dtype=dt)
    syn_sum = torch.tensor([getattr(m.p, "synthetic_loss", "mean") == "sum" for m in methods], device=device)
    results: list = [None] * R
    rows: list[list[dict]] = [[] for _ in range(R)]
    alive = [True] * R
    test_y = data.test_y

    def record(rnd, runs, extra, t0=None):
        _record(methods, ctxs, data, globs, rows, on_round, rnd, runs, extra, eval_every, rounds, test_y, t0)

    ok = [r for r in range(R) if _check(methods, ctxs, globs, 0, None, r, alive, results)]
    record(0, ok, {r: _row0() for r in ok})
    for rnd in range(1, rounds + 1):
        t0 = time.perf_counter()
        live = [r for r in range(R) if alive[r]]
        if not live:
            break
        plans = {}
        for r in live:
            m, c = methods[r], ctxs[r]
            m.round_begin(c, rnd, globs[r])
            plans[r] = make_plan(c, rnd, m.sample(c, rnd, parts[r]), p0.batch_size, p0.local_epochs)
        if kernel == "fused":
            cparams, loss_sum, loss_n = _local_fused(
                methods, ctxs, live, plans, globs, rnd, threads, fst, Q if fst else None
            )
        else:
            cparams, loss_sum, loss_n = _local(
                methods,
                ctxs,
                live,
                plans,
                globs,
                hp,
                syn_sum,
                fst,
                Qflat if fst else None,
                N,
                D,
                rnd,
                device,
            )
        for r in live:
            new = methods[r].aggregate(ctxs[r], plans[r], globs[r], cparams[r])
            globs[r] = methods[r].server_update(ctxs[r], plans[r], globs[r], new)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        train_seconds = (time.perf_counter() - t0) / len(live)
        extra = {}
        for r in live:
            loss = loss_sum[r] / max(loss_n[r], 1)
            if not _check(methods, ctxs, globs, rnd, loss, r, alive, results):
                continue
            extra[r] = {
                "clients": plans[r].clients.sort().values.tolist(),
                "train_loss": loss,
                "bytes_up": methods[r].upload_bytes(ctxs[r], plans[r], cparams[r]),
                "bytes_down": plans[r].m * param_bytes(methods[r].broadcast(ctxs[r], globs[r])),
                "train_seconds": train_seconds,
            }
        record(rnd, list(extra), extra, t0)
    for r in range(R):
        if results[r] is None:
            results[r] = (methods[r].final_weights(ctxs[r], globs[r]), rows[r])
    return results


def _row0() -> dict:
    return {"clients": [], "train_loss": None, "bytes_up": 0, "bytes_down": 0}


def _check(methods, ctxs, globs, rnd, loss, r, alive, results) -> bool:
    try:
        check_finite(methods[r], ctxs[r], rnd, globs[r], loss)
    except FedfeatError as e:
        alive[r] = False
        results[r] = e
        return False
    return True


@torch.no_grad()
def _record(
    methods, ctxs, data, globs, rows, on_round, rnd, runs, extra, eval_every, rounds, test_y, t0=None
):
    """The runs' metric rows of round ``rnd``: one evaluation product for all of them (the heads stacked)."""
    if not runs:
        return
    t0 = time.perf_counter() if t0 is None else t0
    skip = bool(rnd % eval_every) and rnd not in (0, rounds)
    if not skip:
        c0 = ctxs[runs[0]]
        K = c0.K
        from fedfeat.methods.head import LinearHead

        plain = all(type(methods[r]).predict is LinearHead.predict for r in runs)  # else: its own predict
        if plain and c0.local_test is None and c0.open_vocab is None and c0.val_mask is None:
            W = torch.stack([globs[r]["W"] for r in runs])  # [r, K, D]
            b = torch.stack([globs[r]["b"] for r in runs])
            scale = torch.tensor([methods[r].p.logit_scale for r in runs], dtype=W.dtype, device=W.device)
            # one product for all runs' heads: the test features are read once per round, not once per run; at
            # R x K rows it is compute-bound, so it gets the run's threads (torch runs on one beside fused kernels)
            one = torch.get_num_threads()
            torch.set_num_threads(max(one, c0.threads))
            try:
                z = torch.addmm(b.reshape(-1, 1), W.reshape(-1, W.shape[2]), c0.test_xT()).view(
                    len(runs), K, -1
                )
            finally:
                torch.set_num_threads(max(one, c0.threads))
            pred = (
                (scale.view(-1, 1, 1) * z).transpose(1, 2).contiguous().argmax(-1)
            )  # [r, Nt] (engine.evaluate)
            correct = (pred == test_y.unsqueeze(0)).to(torch.float64)
            per = torch.zeros(len(runs), K, dtype=torch.float64, device=test_y.device).index_add_(
                1, test_y, correct
            )
            cnt = torch.bincount(test_y, minlength=K).to(torch.float64).clamp_min(1)
            evs = [
                {
                    "acc": float(correct[i].mean()) * 100,
                    "per_class_acc": [100 * v for v in (per[i] / cnt).tolist()],
                    "pred": pred[i],
                }
                for i in range(len(runs))
            ]
        else:  # local test splits / open vocabulary / a method's own predict: each run's own evaluation
            from fedfeat.engine.rounds import evaluate

            evs = [evaluate(methods[r], ctxs[r], globs[r], test_y, K) for r in runs]
    for i, r in enumerate(runs):
        if skip:
            row = {"round": rnd, "test_acc": None, **extra[r]}
        else:
            ev = evs[i]
            row = {
                "round": rnd,
                "test_acc": ev["acc"],
                "per_class_acc": ev["per_class_acc"],
                **ev.get("extra", {}),
            }
            row.update(extra[r])
            row.update(methods[r].round_metrics(ctxs[r], data, globs[r], ev))
        row["seconds"] = time.perf_counter() - t0
        rows[r].append(row)
        if on_round:
            on_round(r, row)


def _local(methods, ctxs, live, plans, globs, hp, syn_sum, fst, Qflat, N, D, rnd, device):
    """Every live run's local update as one program over the virtual clients; returns per run its clients'
    parameters in its plan's order, and its loss sum and step count."""
    rr = _virtual([plans[r] for r in live])
    runs = torch.as_tensor(live, dtype=torch.int64)[rr.vrun]  # [V] run of each virtual client
    V = len(runs)
    p0, kind = methods[live[0]].p, methods[live[0]].stack_loss
    B, E = p0.batch_size, p0.local_epochs
    G = {k: torch.stack([globs[r][k] for r in range(len(globs))]) for k in ("W", "b")}  # [R, ...]
    params = {k: G[k][runs].clone() for k in G}  # [V, ...]
    opts = [methods[r].make_optimizer(rnd) for r in range(len(methods))]
    dt, dev = params["W"].dtype, params["W"].device
    lr = torch.tensor([o.lr for o in opts], dtype=dt, device=dev)[runs]
    mom, wd = hp["momentum"][runs], hp["weight_decay"][runs]
    scale, mu = hp["logit_scale"][runs], hp["mu"][runs]
    bufs = {k: torch.zeros_like(v) for k, v in params.items()}
    for r in live:  # the rate this round, as the engine gives it to a run made alone (Context.lr_round)
        ctxs[r].lr_round = opts[r].lr
    locs = {r: methods[r].local_begin(ctxs[r], plans[r], globs[r]) for r in live}
    vruns = runs.to(dev)
    prox = kind == "ce" and bool(hp["mu"][torch.as_tensor(live, device=hp["mu"].device)].any())
    cw = zclip = None
    if kind == "kd" and all(ctxs[r].state.get("z_clip") is not None for r in live):
        zclip = torch.stack([ctxs[r].state["z_clip"] if r in locs else ctxs[live[0]].state["z_clip"]
                             for r in range(len(methods))])  # fmt: skip
    if (
        kind == "weighted"
    ):  # [R, K] the class weights each run's clients train with this round (local_begin's)
        cw = torch.stack([locs[r]["w"] if r in locs else locs[live[0]]["w"] for r in range(len(methods))])
    loss_acc = torch.zeros(V, dtype=torch.float64, device=dev)
    steps_acc = torch.zeros(V, dtype=torch.int64)
    xbuf = torch.empty(V * B, D, dtype=ctxs[0].feats.dtype, device=dev)
    feats = ctxs[0].feats
    for epoch in range(E):
        S = int(rr.steps.max()) if V else 0
        idx = torch.zeros(S, V, B, dtype=torch.int64)
        mask = torch.zeros(S, V, B, dtype=torch.bool)
        for j, r in enumerate(live):
            i_r, m_r = epoch_tables(ctxs[r], plans[r], epoch)
            idx[: i_r.shape[0], rr.where[j]] = i_r
            mask[: i_r.shape[0], rr.where[j]] = m_r
        widths = mask.sum(-1).amax(-1).tolist()
        idx, mask = idx.to(dev), mask.to(dev)
        syn = _syn_tables(methods, ctxs, live, plans, locs, rr, S, epoch, dev) if fst else None
        for s in range(S):
            n, Bw = rr.active(s), int(widths[s])
            ib, mb = idx[s, :n, :Bw], mask[s, :n, :Bw]
            x = torch.index_select(feats, 0, ib.reshape(-1), out=xbuf[: n * Bw]).view(n, Bw, D)
            p = {k: v[:n].detach().requires_grad_(True) for k, v in params.items()}
            z = scale[:n].view(n, 1, 1) * batched_linear(x, p["W"], p["b"])  # [n, B, K]
            if fst:
                loss = _fst_loss(
                    methods,
                    ctxs,
                    live,
                    z,
                    p,
                    ib,
                    mb,
                    vruns[:n],
                    syn,
                    hp,
                    syn_sum,
                    Qflat,
                    N,
                    s,
                    epoch,
                    rnd,
                )
            elif kind == "ntd":  # linear.ntd_loss, per-run tau and beta
                with torch.no_grad():
                    g = {k: G[k][runs[:n]] for k in G}
                    zg = scale[:n].view(n, 1, 1) * (
                        torch.bmm(x, g["W"].transpose(1, 2)) + g["b"].unsqueeze(1)
                    )
                loss = ntd_loss(z, zg, ctxs[0].labels[ib], mb, hp["tau"][vruns[:n]], hp["beta"][vruns[:n]])
            elif kind == "kd":  # synthesis.CLIP2FL.step_loss: CE + kd_alpha KD(z, CLIP's logits), per run
                ce = masked_mean(F.cross_entropy(z.transpose(1, 2), ctxs[0].labels[ib], reduction="none"), mb)
                vr = vruns[:n]
                if zclip is not None:  # each run's teacher table (clip2fl's setup), [R, N, K]
                    zt = zclip[vr.view(n, 1), ib]
                else:
                    with torch.no_grad():
                        zt = hp["teacher_logit_scale"][vr].view(n, 1, 1) * torch.matmul(x, ctxs[0].text.T)
                loss = ce + hp["kd_alpha"][vr] * _kd(z, zt, hp["kd_temperature"][vr], mb)
            elif kind == "focal":  # focal.focal_loss, per-run gamma
                loss = masked_mean(_focal(z, ctxs[0].labels[ib], hp["gamma"][vruns[:n]]), mb)
            else:
                y = ctxs[0].labels[ib]
                ce = F.cross_entropy(z.transpose(1, 2), y, reduction="none")
                if (
                    kind == "weighted"
                ):  # ratio_loss: (alpha + beta Ra_y) CE, each run's class weights of the round
                    ce = torch.gather(cw[vruns[:n]], 1, y) * ce
                loss = masked_mean(ce, mb)
                if prox:
                    g = {k: G[k][runs[:n]] for k in G}
                    loss = loss + 0.5 * mu[:n] * sum(((p[k] - g[k]) ** 2).flatten(1).sum(1) for k in p)
            grads = torch.autograd.grad(loss.sum(), [p["W"], p["b"]])
            _sgd(params, dict(zip(("W", "b"), grads)), bufs, n, lr, mom, wd, first=(epoch == 0 and s == 0))
            loss_acc[:n] += loss.detach().double()
            steps_acc[:n] += 1
    out, lsum, lcount = {}, {}, {}
    loss_acc, steps_acc = loss_acc.cpu(), steps_acc
    for j, r in enumerate(live):
        w = rr.where[j]
        out[r] = {k: v[w.to(dev)] for k, v in params.items()}
        lsum[r] = float(loss_acc[w].sum())
        lcount[r] = int(steps_acc[w].sum())
        methods[r].local_end(ctxs[r], plans[r], locs[r], out[r])
    return out, lsum, lcount


@torch.no_grad()
def _local_fused(methods, ctxs, live, plans, globs, rnd, threads, fst, Q):
    """``_local`` in the methods' compiled CPU kernels (``kernels.stacked_epoch``): every virtual client runs the
    very code of its run's own fused kernel, so a stacked run equals its one-by-one fused run bit for bit."""
    from fedfeat.engine import kernels, rng
    from fedfeat.engine.context import round_buffer, shuffle_key
    from fedfeat.methods.fst_cbdg import _pool, bank_rows

    R = len(methods)
    rr = _virtual([plans[r] for r in live])
    vrun = np.asarray(live, np.int64)[rr.vrun.numpy()]  # the run of each virtual client
    V = len(vrun)
    ctx0 = ctxs[live[0]]
    B, E = methods[live[0]].p.batch_size, methods[live[0]].p.local_epochs
    K, D = ctx0.K, ctx0.D
    slots = list(zip(rr.vrun.tolist(), rr.vslot.tolist()))
    clients = np.array([int(plans[live[v]].clients[j]) for v, j in slots], np.int64)
    sizes = np.array([int(plans[live[v]].sizes[j]) for v, j in slots], np.int64)
    starts = ctx0.offsets.numpy()[clients] if V else clients
    Wgs = torch.stack([g["W"] for g in globs]).contiguous().numpy()  # every run's (a stopped one is not used)
    bgs = torch.stack([g["b"] for g in globs]).contiguous().numpy()
    W = np.empty((V, K, D), Wgs.dtype)
    b = np.empty((V, K), Wgs.dtype)
    mW, mb = np.empty_like(W), np.empty_like(b)
    opts = [m.make_optimizer(rnd) for m in methods]
    steps = rr.steps.numpy()
    S = int(steps.max()) if V else 0
    lsum, lcount = {}, {}
    for r in live:  # the rate this round, as the engine gives it to a run made alone (Context.lr_round)
        ctxs[r].lr_round = opts[r].lr
    locs = {r: methods[r].local_begin(ctxs[r], plans[r], globs[r]) for r in live}
    seeds = [c.seed for c in ctxs]
    if fst:
        n_k = np.zeros((V, K), np.int64)
        for j, r in enumerate(live):
            n_k[rr.where[j].numpy()] = locs[r]["n_k"].numpy()
        J = n_k.sum(1)
        every = np.array([m.p.synthetic_draw == "iteration" for m in methods])[vrun]
        per = np.where(every, J, (J + steps - 1) // np.maximum(steps, 1))
        P = int(per.max()) if V else 0
        hps = np.array(
            [[o.lr, o.momentum, o.weight_decay, m.p.logit_scale, m.p.beta, m.p.lam, m.p.sigma / math.sqrt(D),
              float(m.p.self_training), float(m.p.renormalize_synthetic), 0.0, float(m.p.synthetic_loss == "sum"),
              float(m.p.synthetic_draw == "iteration")] for m, o in zip(methods, opts)],
            Wgs.dtype,
        )  # fmt: skip
        useeds = list(dict.fromkeys(seeds[r] for r in live))  # a bank per seed, drawn with its first live run
        first_of = [live[[seeds[r] for r in live].index(sd)] for sd in useeds]
        bank_of = np.array([useeds.index(sd) if sd in useeds else 0 for sd in seeds], np.int64)
    else:
        modes = {methods[r].fused_loss()[0] for r in live}
        if len(modes) != 1:
            raise FedfeatError("stacked runs must share one loss kernel")
        hps = np.array(
            [[o.lr, o.momentum, o.weight_decay, m.p.logit_scale, *m.fused_loss()[1:], 0.0] for m, o in zip(methods, opts)],
            Wgs.dtype,
        )  # fmt: skip
    for epoch in range(E):
        keys = np.zeros(R, np.uint64)
        for r in live:
            keys[r] = shuffle_key(ctxs[r], plans[r], epoch)
        loss_out = np.zeros((S, V), np.float64)
        common = dict(feats=ctx0.feats.numpy(), starts=starts, sizes=sizes, B=B, keys=keys[vrun], runs=vrun, W=W,
                      b=b, mW=mW, mb=mb, Wgs=Wgs, bgs=bgs, hps=hps, loss_out=loss_out, init=epoch == 0,
                      one_epoch=E == 1)  # fmt: skip
        if fst:
            rows = bank_rows(P, D) if P else 1
            # each seed's Gaussian bank of every step, as the run's own fused epoch draws it (float32, side by side
            # on the kernel's threads; the memory kept from round to round, as engine.round_buffer does)
            shape = (len(useeds), max(S, 1), rows, D)
            like = torch.empty((), dtype=torch.float32)
            bank32 = round_buffer(ctx0, "stacked bank", math.prod(shape), like).view(shape)
            if (
                P
            ):  # per seed only the steps and rows its runs read (a bank's values do not depend on its size)
                vseed = np.array([useeds.index(seeds[r]) for r in vrun], np.int64)
                jobs = []
                for u in range(len(useeds)):
                    on = vseed == u
                    P_u, S_u = int(per[on].max()), int(steps[on].max())
                    jobs += [(u, first_of[u], st, bank_rows(P_u, D)) for st in range(S_u)] if P_u else []

                def draw(job, e=epoch, bank=bank32):
                    u, r, st, n = job
                    methods[r]._draw(ctxs[r], rnd, e, st, bank[u, st, :n])

                list(_pool(threads).map(draw, jobs))
            banks = bank32.numpy().astype(Wgs.dtype, copy=False)
            order = np.array([rng.stream_key(sd, rnd, epoch, rng.TAG_SYNTH_ORDER) for sd in seeds], np.uint64)
            sign = np.array([rng.stream_key(sd, rnd, epoch, rng.TAG_SYNTH_OFFSET) for sd in seeds], np.uint64)
            kernels.stacked_epoch(
                "fst", threads, **common, qs=Q.numpy(), text=ctx0.text.contiguous().numpy(), n_k=n_k, cids=clients,
                key_orders=order, key_signs=sign, banks=banks, bank_of=bank_of,
            )  # fmt: skip
        else:
            kernels.stacked_epoch(
                "linear", threads, **common, labels=ctx0.labels.numpy(), mode=next(iter(modes))
            )
        for j, r in enumerate(live):  # summed as the run's own fused update sums its [S, m] losses
            S_r = int(plans[r].steps.max()) if plans[r].m else 0
            lsum[r] = lsum.get(r, 0) + float(np.ascontiguousarray(loss_out[:S_r, rr.where[j].numpy()]).sum())
    out = {}
    Wt, bt = torch.from_numpy(W), torch.from_numpy(b)
    for j, r in enumerate(live):
        w = rr.where[j]
        out[r] = {"W": Wt[w], "b": bt[w]}
        lcount[r] = int(steps[w.numpy()].sum()) * E
        methods[r].local_end(ctxs[r], plans[r], locs[r], out[r])
    return out, lsum, lcount


def _kd(z: torch.Tensor, zt: torch.Tensor, T: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``synthesis.kd_loss`` with one temperature per client (``[n]``) -> ``[n]``."""
    t = T.view(-1, 1, 1)
    lt = F.log_softmax(zt / t, -1)
    kl = (lt.exp() * (lt - F.log_softmax(z / t, -1))).sum(-1)  # [n, B]
    return T * T * masked_mean(kl, mask)


def _focal(z: torch.Tensor, y: torch.Tensor, gamma: torch.Tensor) -> torch.Tensor:
    """``focal.focal_loss`` with one ``gamma`` per client (``[n]``) -> ``[n, B]``."""
    logpt = F.log_softmax(z, dim=-1).gather(-1, y.unsqueeze(-1)).squeeze(-1)
    mod = (1 - logpt.exp()).clamp_min(torch.finfo(z.dtype).tiny) ** gamma.view(-1, 1)
    return torch.where(gamma.view(-1, 1) == 0, -logpt, -mod * logpt)


@torch.no_grad()
def _sgd(params, grads, bufs, n, lr, mom, wd, first):
    """``torch.optim.SGD`` per virtual client (``optim.BatchedSGD``'s rule) with per-client lr / momentum / wd."""
    for k, g in grads.items():
        p = params[k][:n]
        shape = (n, *([1] * (g.dim() - 1)))
        d = g.contiguous() + wd[:n].view(shape) * p
        if first:
            bufs[k][:n] = d
        else:
            bufs[k][:n] = mom[:n].view(shape) * bufs[k][:n] + d
        p.sub_(lr[:n].view(shape) * bufs[k][:n])


def _syn_tables(methods, ctxs, live, plans, locs, rr, S, epoch, dev):
    """Each run's synthetic tables of this epoch (``FSTCBDG.epoch_begin``) on the virtual client axis."""
    tabs = []
    for r in live:
        methods[r].epoch_begin(ctxs[r], plans[r], locs[r], epoch)
        tabs.append(locs[r]["syn"])
    P = max((t["cls"].shape[2] for t in tabs if t is not None), default=0)
    if P == 0:
        return None
    V = len(rr.vrun)
    cls = torch.zeros(S, V, P, dtype=torch.int64, device=dev)
    msk = torch.zeros(S, V, P, dtype=torch.bool, device=dev)
    sign = torch.zeros(S, V, P, dtype=ctxs[0].text.dtype, device=dev)
    for j, t in enumerate(tabs):
        if t is None:
            continue
        s_r, _, p_r = t["cls"].shape
        w = rr.where[j].to(dev)
        cls[:s_r, w, :p_r] = t["cls"]
        msk[:s_r, w, :p_r] = t["mask"]
        sign[:s_r, w, :p_r] = t["sign"]
    return {"cls": cls, "mask": msk, "sign": sign}


def _fst_loss(methods, ctxs, live, z, p, ib, mb, vr, syn, hp, syn_sum, Qflat, N, s, epoch, rnd):
    """FST-CBDG's step loss (``FSTCBDG.step_loss``) over virtual clients with per-run soft labels and draws."""
    n = z.shape[0]
    gpos = vr.view(n, 1) * N + ib  # rows of the stacked soft labels
    beta = hp["beta"][vr]
    with torch.no_grad():
        f = F.softmax(z.detach(), dim=-1)
        bm = beta.view(n, 1).expand_as(mb)[mb].unsqueeze(1)
        rows = gpos[mb]
        Qflat[rows] = bm * Qflat[rows] + (1 - bm) * f[mb]
    q = Qflat[gpos]
    st = masked_mean(-(q * F.log_softmax(z, dim=-1)).sum(-1), mb)
    loss = hp["self_training"][vr] * st
    if syn is None or s >= syn["cls"].shape[0]:
        return loss
    smask = syn["mask"][s, :n]
    if not bool(smask.any()):
        return loss
    P = int(smask.sum(1).max())
    cls, smask, sign = syn["cls"][s, :n, :P], smask[:, :P], syn["sign"][s, :n, :P]
    # each run's noise bank of this step (runs with one seed share it); W eps^T per bank, over its clients only
    W, b = p["W"], p["b"]
    K, D = W.shape[1], W.shape[2]
    seeds = torch.tensor([ctxs[r].seed for r in live])
    run_pos = torch.empty(max(live) + 1, dtype=torch.int64)
    run_pos[torch.as_tensor(live)] = torch.arange(len(live))
    vseed = seeds[run_pos[vr.cpu()]]  # [n]
    WE = W.new_empty(n, K, P)
    ev = W.new_empty(n, P, D) if methods[live[0]].p.renormalize_synthetic else None
    for sd in vseed.unique().tolist():
        r = live[int((seeds == sd).nonzero()[0, 0])]
        eps = methods[r]._noise(ctxs[r], rnd, epoch, s, P)  # [P, D]
        sel = (vseed == sd).nonzero().squeeze(1).to(W.device)
        Ws = W.index_select(0, sel)
        WE.index_copy_(0, sel, torch.matmul(Ws.reshape(-1, D), eps.T).view(len(sel), K, P))
        if ev is not None:
            ev.index_copy_(0, sel, eps.expand(len(sel), P, D))
    renorm = None
    if ev is not None:
        te = torch.bmm(ctxs[0].text.unsqueeze(0).expand(n, -1, -1), ev.transpose(1, 2))  # [n, K, P]
        renorm = (torch.gather(te, 1, cls.unsqueeze(1)).squeeze(1), (ev * ev).sum(2))
    sigma = (hp["sigma"][vr] / math.sqrt(D)).view(n, 1, 1)
    zs = synthetic_head(W, b, ctxs[0].text, cls, sign, WE, sigma, hp["logit_scale"][vr].view(n, 1, 1), renorm)
    ce = F.cross_entropy(zs.transpose(1, 2), cls, reduction="none")  # [n, P]
    summed = (ce * smask.to(ce.dtype)).sum(1)
    mean = masked_mean(ce, smask)
    return loss + hp["lam"][vr] * torch.where(syn_sum[vr], summed, mean)


__all__ = ["run_stacked", "stack_key"]

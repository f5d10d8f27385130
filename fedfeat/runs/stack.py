"""Stacked runs: several runs of one linear-head method as one batched program along a run axis.

A sweep's runs that read the same data (same store, partition, ``normalize`` / ``templates`` and batch
geometry: ``batch_size``, ``local_epochs``, ``rounds``) but differ in their seed (client sampling, shuffles, the
method's own draws), participation or hyperparameters are made together. The round program is the engine's
(``fedfeat.engine.stacked``): every run keeps its own method and context, its round plan is exactly the one its own
run would make, and its own hooks run on its clients -- ``step_loss`` included, so no method's local loss is
written twice. This module groups: which runs stack (``stack_key``), and for the fused CPU kernels
(``kernel="fused"``) the one compiled call per epoch over all runs' ``R x m`` virtual clients
(``kernels.stacked_epoch``, each method's own fused kernel; FST-CBDG's soft labels get a run axis ``[R, N, K]``).
A method with its own ``predict`` (tau-norm's normalised head, CCVR's calibrated one, CReFF's re-trained one) is
evaluated per run, the plain linear heads in one product.

Stacked results equal the runs made one by one (``tests/test_stack.py``: bit for bit with the fused CPU kernels
and with the torch program, which runs each run's own ``step_loss`` and optimiser in lockstep). Each run's ``train_seconds`` is the stacked round's time
divided by ``R``.

Which methods stack: each method declares it (``Method.stacks``, or ``Method.no_stack_reason``; ``fedfeat methods`` shows both). BENCHMARKS.md "Stacked runs" measures each:

| method | stacks | what is stacked / why not |
|---|---|---|
| ``fedavg``, ``fedprox``, ``fedavgm``, ``fednova``, ``fedavg-tau-norm``, ``fedntd``, ``fst-cbdg`` | yes, fused + torch | the whole round but the per-run server step (server momentum, FedNova's normalised weights, tau-norm's head: a few ``[K, D]`` operations) |
| ``fedadam``, ``fedyogi``, ``fedadagrad`` | yes, fused + torch | the whole round but the per-run adaptive server step (its ``m`` / ``v``: ``[K, D]`` operations) |
| ``scaffold``, ``feddyn`` | yes, torch | the local step with each run's own control variates / duals (per-client state of the clients sampled so far, per run); the server step per run |
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

import math
from collections.abc import Callable

import numpy as np
import torch

from fedfeat.engine.data import RunData
from fedfeat.engine.rounds import resolve_kernel
from fedfeat.engine.stacked import run_stacked_rounds, virtual_clients
from fedfeat.errors import FedfeatError
from fedfeat.methods.base import stackable
from fedfeat.methods.head import LinearHead


def stack_key(method, extra: tuple = ()) -> tuple | None:
    """Runs with equal keys can be stacked (None: this method cannot)."""
    if not method.stacks:
        return None
    return (method.name, *(getattr(method.p, k, None) for k in method.stack_shape), *extra)


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
    dps: list | None = None,
) -> list[tuple[dict, list[dict]] | FedfeatError]:
    """Make ``len(methods)`` runs (``methods[r]`` with ``seeds[r]``) as one program; returns per run ``(final
    weights, metric rows)`` as ``engine.run_federated`` would, or the ``FedfeatError`` that stopped that run (a
    run whose weights became non-finite; the others go on). ``on_round(r, row)`` sees each run's rows.
    ``kernel``: ``auto`` (the fused CPU kernels on a CPU, else torch), ``fused`` or ``torch``, as ``train``.
    ``dps``: per run a client-level DP configuration or None (``engine.stacked.run_stacked_rounds``)."""
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
    fused = kernel == "fused"
    if fused:  # as engine.run_federated: the kernel owns the cores, torch's few ops run on one thread
        torch.set_num_threads(1)
    try:
        return run_stacked_rounds(
            methods, data, rounds=rounds, participation=parts, seeds=seeds, device=device, eval_every=eval_every,
            on_round=on_round, threads=threads, local=_local_fused if fused else None,
            setup=_stack_soft_labels if fused else None, plain_head=_plain_head, dps=dps,
        )  # fmt: skip
    finally:
        torch.set_num_threads(threads)


def _plain_head(method) -> bool:
    """The linear head's own ``predict``: evaluated in the stacked runs' one product."""
    return type(method).predict is LinearHead.predict


def _stack_soft_labels(methods, ctxs) -> None:
    """FST-CBDG's soft labels with a run axis ``[R, N, K]`` for its fused kernel; each run's context sees its own
    slice (a view)."""
    if methods[0].name != "fst-cbdg":
        return
    Q = torch.stack([c.state["q"] for c in ctxs])
    for r, c in enumerate(ctxs):
        c.state["q"] = Q[r]
        c.cache["stacked soft labels"] = Q


@torch.no_grad()
def _local_fused(methods, ctxs, live, plans, globs, rnd, threads):
    """The live runs' local updates in the methods' compiled CPU kernels (``kernels.stacked_epoch``; the engine's
    ``stacked.torch_local`` otherwise): every virtual client runs the very code of its run's own fused kernel, so a
    stacked run equals its one-by-one fused run bit for bit."""
    fst = methods[0].name == "fst-cbdg"
    Q = ctxs[0].cache["stacked soft labels"] if fst else None  # [R, N, K] (_stack_soft_labels)
    from fedfeat.engine import kernels, rng
    from fedfeat.engine.context import round_buffer, shuffle_key
    from fedfeat.methods.fst_cbdg import _pool, bank_rows

    R = len(methods)
    rr = virtual_clients([plans[r] for r in live])
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


__all__ = ["run_stacked", "stack_key"]

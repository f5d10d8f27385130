"""Stacked runs in the engine: several runs of one method as one round program along a run axis.

The ``R`` runs' sampled clients become ``R x m`` *virtual clients*. Every run keeps its own method object and
context (seed, state, cache): its round plan (sampled clients, shuffles, the method's own draws) is exactly the one
its own run would make, and every hook is the run's own -- ``round_begin``, ``sample``, ``local_begin`` /
``epoch_begin`` / ``step_loss`` / ``local_end``, ``aggregate``, ``server_update``, ``round_metrics``,
``final_weights``. No method's loss is written here: what differs between runs (hyperparameters, soft labels,
class weights, teacher tables) is read by the run's own ``step_loss`` from its own method and context.

The local update (``torch_local``): the runs' torch programs (``rounds.TorchLocal``, ``run_local``'s) in lockstep --
at each local step every run's own ``step_loss`` on its active clients, one ``autograd.grad`` for all runs, then
each run's own optimiser step. A stacked run equals its run made alone step for step (the gradient of a sum of the
runs' losses is each run's own gradient). A caller may give another local update (``local=``): ``runs.stack`` gives
the methods' fused CPU kernels over all virtual clients at once (``kernels.stacked_epoch``; ``virtual_clients``
orders them).

The evaluation: heads a caller marks as plain (``plain_head``: the linear head's own ``predict``) are evaluated in
one product for all runs; the others each with its run's own ``evaluate``. Each run's ``train_seconds`` is the
stacked round's time divided by the number of live runs.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable

import torch

from fedfeat.engine.context import make_plan, param_bytes, state_for
from fedfeat.engine.data import RunData, build_context
from fedfeat.engine.rounds import TorchLocal, check_finite, evaluate
from fedfeat.errors import FedfeatError


@dataclasses.dataclass
class VirtualClients:
    """The virtual clients of one round, ordered by descending steps (the active ones are a prefix): run
    ``vrun`` (index into the live runs), slot ``vslot`` in that run's plan."""

    plans: list
    vrun: torch.Tensor  # [V]
    vslot: torch.Tensor  # [V]
    steps: torch.Tensor  # [V] descending
    where: list  # per live run: [m_r] virtual index of each of its plan slots

    def active(self, s: int) -> int:
        return int((self.steps > s).sum())


def virtual_clients(plans: list) -> VirtualClients:
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
    return VirtualClients(plans, vrun[order], vslot[order], steps[order], where)


def torch_local(methods, ctxs, live, plans, globs, rnd, threads=1):
    """Every live run's local update (``run_local``'s torch program, its own ``step_loss`` and optimiser) in
    lockstep: one ``autograd.grad`` per local step for all runs. Returns per run its clients' parameters in its
    plan's order, its loss sum and its step count."""
    progs = {}
    for r in live:  # as run_local, per run
        method, ctx, plan, glob = methods[r], ctxs[r], plans[r], globs[r]
        params = {
            k: v.detach().unsqueeze(0).repeat(plan.m, *([1] * v.dim())).contiguous() for k, v in glob.items()
        }
        params.update(method.local_params(ctx, plan))
        opt = method.make_optimizer(rnd)
        ctx.lr_round = opt.lr
        opt.reset(params)
        progs[r] = TorchLocal(method, ctx, plan, params, opt, method.local_begin(ctx, plan, glob))
    for epoch in range(max((plans[r].epochs for r in live), default=0)):
        steps = {r: progs[r].begin_epoch(epoch) for r in live if epoch < plans[r].epochs}
        for s in range(max(steps.values(), default=0)):
            outs = [(progs[r], *progs[r].loss(s)) for r, S in steps.items() if s < S]
            leaves = [t for _, p, _ in outs for t in p.values()]
            total = outs[0][2].sum()
            for _, _, loss in outs[1:]:
                total = total + loss.sum()
            grads = torch.autograd.grad(total, leaves)
            i = 0
            for prog, p, loss in outs:
                prog.step(p, loss, grads[i : i + len(p)])
                i += len(p)
    sums = torch.stack([progs[r].loss_sum for r in live]).tolist() if live else []  # one host transfer
    out, lsum, lcount = {}, {}, {}
    for r, total in zip(live, sums):
        prog = progs[r]
        methods[r].local_end(ctxs[r], plans[r], prog.local, prog.params)
        out[r], lsum[r], lcount[r] = prog.params, total, prog.loss_n
    return out, lsum, lcount


def run_stacked_rounds(
    methods: list,
    data: RunData,
    *,
    rounds: int,
    participation: list[float],
    seeds: list[int],
    device: torch.device,
    eval_every: int = 1,
    on_round: Callable[[int, dict], None] | None = None,
    threads: int = 1,
    local: Callable | None = None,
    setup: Callable | None = None,
    plain_head: Callable | None = None,
    dps: list | None = None,
) -> list:
    """``len(methods)`` runs (``methods[r]`` with ``seeds[r]``, ``participation[r]``) as one round program over
    one ``RunData``; returns per run ``(final weights, metric rows)`` as ``run_federated`` would, or the
    ``FedfeatError`` that stopped that run (non-finite weights or loss; the others go on).

    ``local(methods, ctxs, live, plans, globs, rnd, threads) -> (params, loss sums, step counts)`` per live run:
    the local update (default ``torch_local``); ``setup(methods, ctxs)`` runs after the methods' own ``setup``
    (e.g. to lay out per-sample state for a fused kernel); ``plain_head(method)``: its head is evaluated in the
    one shared product. ``dps``: per run a client-level ``privacy.DPConfig`` or None (as ``run_federated``'s ``dp``:
    its clipping, noise and accounting are the run's own; sample-level DP runs are made one by one)."""
    local = torch_local if local is None else local
    R = len(methods)
    dps = list(dps) if dps is not None else [None] * R
    if any(d is not None and d.mode != "client" for d in dps):
        raise FedfeatError("stacked runs take client-level DP only; sample-level DP runs are made one by one")
    ctx0 = build_context(data, methods[0], seeds[0], device)
    ctx0.threads = threads
    ctx0.test_xT()  # made once; each run's own cache starts with it (a method's cache, e.g. ratio-loss's seeded
    # auxiliary set, is the run's own as it is alone)
    ctxs = [  # each run's own seed, declared state (Method.state_keys) and cache
        dataclasses.replace(ctx0, seed=int(s), state=state_for(m), cache=dict(ctx0.cache), rounds=rounds)
        for m, s in zip(methods, seeds)
    ]
    accounting: list = [None] * R
    for r, (m, c) in enumerate(zip(methods, ctxs)):  # each run's privacy as run_federated prepares it
        if dps[r] is not None:
            from fedfeat.engine import privacy

            privacy.check_method(m, dps[r])
            c.dp, accounting[r] = privacy.prepare(
                dps[r], privacy.client_sizes(c), m, participation[r], rounds
            )
    for m, c in zip(methods, ctxs):
        m.setup(c)
    if setup is not None:
        setup(methods, ctxs)
    globs = [m.init_global(c) for m, c in zip(methods, ctxs)]
    for c in ctxs:
        if c.dp is not None:
            c.state["dp"] = {"clip": float(c.dp.clip_norm), "round": {}}
    results: list = [None] * R
    rows: list[list[dict]] = [[] for _ in range(R)]
    alive = [True] * R

    def record(rnd, runs, extra, t0=None):
        _record(
            methods, ctxs, data, globs, rows, on_round, rnd, runs, extra, eval_every, rounds, plain_head, t0
        )

    ok = [r for r in range(R) if _check(methods, ctxs, globs, 0, None, r, alive, results)]
    record(0, ok, {r: {"clients": [], "train_loss": None, "bytes_up": 0, "bytes_down": 0} for r in ok})
    for rnd in range(1, rounds + 1):
        t0 = time.perf_counter()
        live = [r for r in range(R) if alive[r]]
        if not live:
            break
        plans = {}
        for r in live:
            m, c = methods[r], ctxs[r]
            m.round_begin(c, rnd, globs[r])
            plans[r] = make_plan(c, rnd, m.sample(c, rnd, participation[r]), m.p.batch_size, m.p.local_epochs)
        cparams, loss_sum, loss_n = local(methods, ctxs, live, plans, globs, rnd, threads)
        for r in live:
            if ctxs[r].dp is not None:  # DP-FedAvg: the run's own clipping, noise and clip state
                from fedfeat.engine import privacy

                new = privacy.aggregate(methods[r], ctxs[r], plans[r], globs[r], cparams[r])
            else:
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
                "images": plans[r].images,
                "trainable_params": methods[r].trainable_count(ctxs[r], plans[r], cparams[r])
                if methods[r].trains_clients
                else 0,
            }
            if accounting[r] is not None:  # as run_federated's rows
                from fedfeat.engine import privacy

                extra[r].update(privacy.round_row(ctxs[r], accounting[r], rnd))
        record(rnd, list(extra), extra, t0)
    for r in range(R):
        if results[r] is None:
            results[r] = (methods[r].final_weights(ctxs[r], globs[r]), rows[r])
    return results


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
    methods, ctxs, data, globs, rows, on_round, rnd, runs, extra, eval_every, rounds, plain_head, t0=None
):
    """The runs' metric rows of round ``rnd``: one evaluation product for all of them (the heads stacked)."""
    if not runs:
        return
    t0 = time.perf_counter() if t0 is None else t0
    skip = bool(rnd % eval_every) and rnd not in (0, rounds)
    if not skip:
        c0 = ctxs[runs[0]]
        K, test_y = c0.K, data.test_y
        plain = plain_head is not None and all(plain_head(methods[r]) for r in runs)  # else: its own predict
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


__all__ = ["VirtualClients", "run_stacked_rounds", "torch_local", "virtual_clients"]

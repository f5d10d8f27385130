"""SCAFFOLD (Karimireddy, Kale, Mohri, Reddi, Stich, Suresh, ICML 2020): local SGD corrected by control variates.

Here as a linear head ``logits = s * (x W^T + b)`` on cached CLIP features (``LinearHead``). The server keeps a
control variate ``c`` (one per head tensor) and every client ``i`` of all ``N`` its own ``c_i``, zero until the client
is first sampled (``ctx.state``, checkpointed with the run; stored for the clients sampled so far, so the state grows
with the clients seen, not with the run's client count). A round, as the paper's Algorithm 1 with option II and as the public
reference FL-bench (``KarhouTam/FL-bench@06e658bca5af6ce732e25bb7c0f8be321e14a85e``, ``src/client/scaffold.py``
and ``src/server/scaffold.py``; ``client:L`` / ``server:L`` below are lines there)::

    client i, each of its K_i local steps:   y_i <- y_i - lr (g_i(y_i) + c - c_i)           (client:61-69)
    after local training:                    c_i+ = c_i - c + (x - y_i) / (K_i lr)         (client:34-45)
    server:  x <- x + global_lr * mean_i (y_i - x);   c <- c + (1 / N) sum_i (c_i+ - c_i)      (server:41-51)

where the means and sums run over the round's sampled clients ``S`` (so ``c`` moves by ``|S| / N`` times their mean
change, the paper's Alg. 1 line 17) and the server step is the *unweighted* mean (Alg. 1 line 16 and server:41: not
FedAvg's sample weights).

Batched over clients. The correction ``c - c_i`` is the gradient of a loss term ``<c - c_i, theta>`` (summed over
``W`` and ``b``), so the local step is ``step_loss`` on the ``[n, B, D]`` batches of all active clients like any
other linear head: the engine's gradient is ``g + c - c_i``, and the optimiser then adds weight decay and momentum
to it exactly as ``torch.optim.SGD`` does to FL-bench's ``param.grad += c - c_i`` (client:64-69: the correction is
added to ``.grad`` before ``optimizer.step()``, so it passes through weight decay and momentum the same way). The
term's value is subtracted again (``t - t.detach()``): it steers the gradient and adds nothing to the loss, so a
run's ``train_loss`` is the cross-entropy, comparable with FedAvg's. The server step updates every sampled client's
``c_i`` from its returned head in ``aggregate`` (``[m, K, D]`` at once). The fused CPU kernels
(``fedfeat.engine.kernels``) compute the linear heads' cross-entropy losses (with FedProx's proximal term, FedNTD's
distillation), not a linear term, so SCAFFOLD runs the torch program on every device (``--kernel fused`` says so).

``K_i`` is the number of optimiser steps client ``i`` took in the round (``plan.local_steps``: ``local_epochs``
times ``ceil(n_i / batch_size)``), the paper's ``K``; FL-bench's client takes one mini-batch per "local epoch"
(client:58-59) and divides by ``local_epoch`` (client:38), the same count. ``lr`` is the round's learning rate
(``ctx.lr_round``; FL-bench divides by the configured ``optimizer.lr``, equal unless ``lr_decay`` < 1). A client
with no samples takes no step and keeps its ``c_i``.

Where fedfeat differs from FL-bench (no switch: none changes a linear head's arithmetic): FL-bench skips
mini-batches of one sample (client:77-78, for BatchNorm), fedfeat trains on them; FL-bench sends ``c_i`` from server
to client (a simulation's bookkeeping), fedfeat counts what the paper transmits (``x`` and ``c`` down, ``y_i - x``
and ``c_i+ - c_i`` up: ``bytes_down`` and ``bytes_up`` are twice FedAvg's).

Defaults and their sources. ``global_lr = 1`` (server:21, the paper's experiments' ``eta_g = 1``). Local SGD is
FL-bench's default optimiser, plain SGD: ``momentum = 0`` and ``weight_decay = 0`` (FL-bench
``config/defaults.yaml`` ``optimizer``; the paper's Alg. 1 is plain SGD), not the linear heads' 0.9 / 1e-5: option
II's ``(x - y_i) / (K_i lr)`` is the client's mean gradient only under plain SGD; with momentum 0.9 over a round's
~10 steps the displacement is ~4x larger and ``c_i`` overshoots by as much (at the defaults below but momentum 0.9:
61.6 % at round 10, one seed at 43.9 %, against 87.7 %). The head runs at CLIP's logit scale, ``logit_scale = 100``
(the encoder's own; ``LinearHeadParams`` keeps 1), with ``lr = 1e-4``, FL-bench's 0.01 divided by 100 (the same
weight step, as ``fedfeat.runs.divergence.hint`` advises every head at scale 1): ours, measured. On the default
synthetic store (``fedfeat synth``; Dirichlet 0.1, 100 clients, 10 % participation, 10 rounds, seeds 0-2; zero-shot
71.9 %) the linear heads' scale 1 with FL-bench's lr 0.01 falls below zero-shot and stays there (51.2 % at round
10, 45.1 % at round 100, seed 0; lr 0.001 holds 72.1 %, seeds 0-4); these defaults give 87.7 % (87.6-87.8; lowest
round 76.8 %), 89.1 % at round 100, and 87.9 % with 2 shards per client (FedAvg's defaults but scale 100 and lr
1e-4: 79.5 % and 86.8 %). Batch and epochs are the linear heads' (FST-CBDG's protocol; FL-bench: batch 32, 5
steps). ``fedfeat sweep --method fedavg,scaffold`` at defaults therefore compares different heads; set
``logit_scale`` and ``lr`` alike to compare the algorithms.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fedfeat.engine.context import Context, RoundPlan, param_bytes
from fedfeat.errors import FedfeatError
from fedfeat.methods.base import register
from fedfeat.methods.head import LinearHead, LinearHeadParams, client_rows, client_table, store_client_rows


@dataclass(frozen=True)
class ScaffoldParams(LinearHeadParams):
    lr: float = 1e-4  # ours, measured (module doc): FL-bench's 0.01 (config/defaults.yaml) / logit_scale
    momentum: float = 0.0  # FL-bench config/defaults.yaml optimizer.momentum; paper Alg. 1: plain SGD
    weight_decay: float = 0.0  # FL-bench config/defaults.yaml optimizer.weight_decay
    logit_scale: float = 100.0  # CLIP's own (module doc: the linear heads' 1 falls below zero-shot)
    global_lr: float = 1.0  # eta_g: FL-bench src/server/scaffold.py:21 (--global_lr); the paper's experiments

    def validate(self) -> None:
        super().validate()
        if self.global_lr <= 0:
            raise FedfeatError(f"scaffold needs global_lr > 0, got {self.global_lr}; e.g. --set global_lr=1")


@register
class Scaffold(LinearHead):
    """SCAFFOLD (Karimireddy et al. 2020): local SGD corrected by server and client control variates (option II)."""

    name = "scaffold"
    Params = ScaffoldParams
    state_keys = {
        "c": "server: {W: [K, D], b: [K]} the server control variate c (zeros at the start)",
        "c_local": "per-client: {ids: [V] sorted client ids, W: [V, K, D], b: [V, K]} c_i of the V clients sampled "
        "so far (every other client's c_i is zero)",
    }
    divergence_hint = (
        "plain SGD at CLIP's logit scale, scaffold's defaults: --set momentum=0 --set logit_scale=100 --set lr=1e-4 "
        "(its docstring: option II assumes plain SGD)"
    )
    shardable = True  # aggregate sees every sampled client and updates the state identically on every rank
    stacks = True  # its own step_loss / aggregate per run (engine.stacked); the state is each run's ctx.state

    def setup(self, ctx: Context) -> None:
        ctx.state["c"] = {
            "W": torch.zeros_like(ctx.text),
            "b": torch.zeros(ctx.K, device=ctx.device, dtype=ctx.text.dtype),
        }
        ctx.state["c_local"] = client_table(ctx)

    def local_begin(self, ctx: Context, plan: RoundPlan, glob: dict) -> dict:
        """``{"corr": {name: [m, ...]}}``: ``c - c_i`` of the plan's clients, the gradient correction."""
        c, ci = ctx.state["c"], client_rows(ctx.state["c_local"], plan.clients)
        return {"corr": {k: c[k] - ci[k] for k in c}}

    def step_loss(self, ctx: Context, params: dict, batch, local: dict) -> torch.Tensor:
        """``CE + <c - c_i, theta>``, the inner product's value taken out again (its gradient stays) -> ``[n]``."""
        corr = local["corr"]
        t = sum((params[k] * corr[k][: batch.n]).flatten(1).sum(1) for k in params)  # [n]
        return self.ce(params, batch)[0] + (t - t.detach())

    def aggregate(self, ctx: Context, plan: RoundPlan, glob: dict, cparams: dict) -> dict:
        """The server step and the clients' new ``c_i`` (module doc): ``x + global_lr * mean_i (y_i - x)``;
        ``c_i+ = c_i - c - (y_i - x) / (K_i lr)``; ``c += sum_i (c_i+ - c_i) / N``."""
        c, old = ctx.state["c"], client_rows(ctx.state["c_local"], plan.clients)  # old: [m, ...] c_i
        steps = plan.local_steps.to(torch.float64)  # [m] K_i
        coef = torch.where(steps > 0, 1.0 / (steps.clamp_min(1) * ctx.lr_round), torch.zeros_like(steps))
        out, new = {}, {}
        for k, x in glob.items():
            dy = cparams[k] - x  # [m, ...] y_i - x
            out[k] = x + self.p.global_lr * dy.mean(0)
            ck = coef.to(device=x.device, dtype=x.dtype).view(-1, *([1] * x.dim()))
            # option II; a client without steps (no samples) keeps its c_i
            new[k] = torch.where(ck > 0, old[k] - c[k] - ck * dy, old[k])
            c[k] = c[k] + (new[k] - old[k]).sum(0) / ctx.n_clients
        store_client_rows(ctx.state["c_local"], plan.clients, new)
        return out

    def broadcast(self, ctx: Context, glob: dict) -> dict:
        """The head and the server control variate ``c`` (Alg. 1 line 5)."""
        return {**glob, **{f"c_{k}": v for k, v in ctx.state["c"].items()}}

    def upload_bytes(self, ctx: Context, plan: RoundPlan, cparams: dict) -> int:
        """Per client ``y_i - x`` and ``c_i+ - c_i`` (Alg. 1 line 13): twice the head."""
        return 2 * param_bytes(cparams)


__all__ = ["Scaffold", "ScaffoldParams"]

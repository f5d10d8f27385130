"""Server optimisers: FedAdagrad, FedAdam, FedYogi (Reddi et al., "Adaptive Federated Optimization", ICLR 2021).

Clients run FedAvg's local round (SGD on cross-entropy from the global head; LinearHead's protocol, so the round is
batched and, on a CPU, in the fused kernel); the server treats the averaged update as a pseudo-gradient and steps an
adaptive optimiser on it. Transcribed from Flower's strategies, ``adap/flower`` at
fdef7afb1dca3030553be302366cfd285ed6632c, ``framework/py/flwr/serverapp/strategy/`` (``fedopt.py``,
``fedadagrad.py``, ``fedadam.py``, ``fedyogi.py``; the legacy ``framework/py/flwr/server/strategy/`` ones compute the
same, with ``tau = 1e-9`` for FedAdam and FedAdagrad). Per round ``t`` (Flower's ``server_round``, fedfeat's round,
both from 1), on every tensor of the head, element-wise::

    delta = sum_i w_i x_i - x                     # FedAvg of the clients' heads minus the global head
    m     = beta_1 m + (1 - beta_1) delta         # m starts at 0
    v     = v + delta^2                                         FedAdagrad
            beta_2 v + (1 - beta_2) delta^2                     FedAdam
            v - (1 - beta_2) delta^2 sign(v - delta^2)          FedYogi      (v starts at 0)
    x     = x + eta_t m / (sqrt(v) + tau)

with ``w_i = n_i / sum n_j`` (Flower's FedAvg weights by ``num-examples``) and ``eta_t = eta`` except FedAdam's
``eta_t = eta sqrt(1 - beta_2^(t+1)) / (1 - beta_1^(t+1))`` (fedadam.py:163-167, Kingma & Ba's step size with the
round shifted by one). Flower's FedAdagrad fixes ``beta_1 = 0`` (fedadagrad.py:115): no server momentum.

Where Flower and the paper differ, Flower is the default and the paper's reading a named switch:

* ``aggregation``: ``"size"`` (Flower: weighted by client sample counts) or ``"uniform"`` (Algorithm 2:
  ``delta = (1/|S|) sum_i delta_i``).
* ``v_init``: ``"zero"`` (Flower; also the authors' code, ``google-research/federated``
  ``optimization/docs/hyperparameters.md``: initial accumulator 0) or ``"tau2"`` (Algorithm 2's ``v_{-1} >= tau^2``,
  taken at equality).
* FedAdam's ``bias_correction``: ``"flower"`` (exponent ``t + 1``, as above), ``"adam"`` (exponent ``t``, Kingma &
  Ba; the authors' code runs Keras's Adam) or ``"none"`` (Algorithm 2 as printed).
* FedAdagrad's ``beta_1`` may be set (Algorithm 2 keeps ``m`` for all three variants).

Defaults. ``beta_1 = 0.9``, ``beta_2 = 0.99`` and ``tau = 1e-3`` are Flower's (fedadam.py:104-106,
fedyogi.py:104-106, fedadagrad.py:100); ``tau = 1e-3`` is also the authors' recommended epsilon
(hyperparameters.md). The server learning rate ``eta`` is **not** Flower's (0.1 for FedAdam and FedAdagrad, 0.01 for
FedYogi): an adaptive step moves every weight by about ``eta`` a round (``m / sqrt(v) ~ sign(delta)`` once ``|delta|
>> tau``) whatever the size of the update, and the head's weights are text features of size ``1/sqrt(D) ~ 0.03``
(D = 1024), so Flower's ``eta`` replaces the zero-shot head within a round or two. On the default synthetic store
(``fedfeat synth``; ``train``'s defaults: Dirichlet 0.1, 100 clients, 10 % a round, 10 rounds; zero-shot 71.9 %),
the final accuracy for ``eta`` in Reddi et al.'s half-decade grid (their tuning grid, hyperparameters.md)::

    eta          0.1    0.01   3e-3   1e-3   3e-4   1e-4        (fedavg: 12.1)
    fedadam      22.1   30.3   41.7   61.6   75.5   -
    fedyogi      31.5   28.3   33.1   45.6   71.7   74.9
    fedadagrad   70.6   50.3   56.2   71.3   76.5   -

The default ``eta`` is the largest of that grid that stays above zero-shot for the 10 rounds: 3e-4 for FedAdam and
FedAdagrad, 1e-4 for FedYogi (whose ``v`` grows additively and so takes larger steps than Adam's early on, as Flower's
10x smaller FedYogi ``eta`` also reflects). At those values the three also stay above zero-shot under 2 shards per
client and Dirichlet 1.0 (10 rounds) and for 30 rounds of the default (FedAdam 74.6, FedYogi 74.7, FedAdagrad
75.6 %), where FedAvg falls to 16.8 / 35.7 / 24.3 %. Reddi et al. tune ``eta`` per task (best values 10^-2.5 ..
10^1) rather than recommend one; a larger ``eta`` learns faster on milder partitions (FedAdagrad 1e-3: 79.0 % at
Dirichlet 1.0). The clients' learning rate is LinearHead's (``lr`` = 0.01, FST-CBDG's protocol, as every linear head
here): Flower's ``eta_l`` is only stored by the strategy, the client sets its own.

The server state (``m``, ``v``) is per run, so runs stack (``fedfeat.runs.stack``: the clients' rounds of all runs
in one program, each run's ``server_update`` on its own state), and the state is checkpointed with the run.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from fedfeat.engine.context import Context, RoundPlan, fedavg
from fedfeat.errors import FedfeatError
from fedfeat.methods.base import register
from fedfeat.methods.head import LinearHead, LinearHeadParams

FLOWER_COMMIT = "fdef7afb1dca3030553be302366cfd285ed6632c"  # adap/flower, the strategies transcribed here


@dataclass(frozen=True)
class ServerOptParams(LinearHeadParams):
    # ours: the largest of Reddi et al.'s half-decade grid that keeps above zero-shot on the default synthetic store
    # (module docstring, "Defaults"); Flower's fedadam.py:102 / fedadagrad.py:98 0.1 falls to chance there
    eta: float = 3e-4
    beta_1: float = (
        0.9  # Flower serverapp/strategy/fedadam.py:104, fedyogi.py:104 (fedadagrad: 0, its subclass)
    )
    tau: float = (
        1e-3  # Flower fedadam.py:106, fedyogi.py:106, fedadagrad.py:100; the authors' hyperparameters.md
    )
    aggregation: Literal["size", "uniform"] = "size"  # Flower's FedAvg by num-examples; uniform: Algorithm 2
    v_init: Literal["zero", "tau2"] = (
        "zero"  # Flower fedopt.py (zeros_like); tau2: Algorithm 2's v_{-1} = tau^2
    )

    def validate(self) -> None:
        super().validate()
        if self.eta <= 0 or self.tau < 0:
            raise FedfeatError(
                f"eta must be > 0 and tau >= 0, got {self.eta} and {self.tau}; e.g. --set eta=0.001"
            )
        if not 0 <= self.beta_1 < 1 or not 0 <= getattr(self, "beta_2", 0.0) < 1:
            raise FedfeatError(
                f"beta_1 and beta_2 must be in [0, 1), got {self.beta_1} and {getattr(self, 'beta_2', None)}; "
                "e.g. --set beta_1=0.9"
            )
        if self.tau == 0 and self.v_init == "zero":
            raise FedfeatError(
                "tau = 0 with v_init=zero divides by zero where a weight's update is 0; set tau > 0 "
                "(e.g. --set tau=0.001)"
            )


@dataclass(frozen=True)
class FedAdagradParams(ServerOptParams):
    beta_1: float = 0.0  # Flower serverapp/strategy/fedadagrad.py:115 (beta_1=0.0); Algorithm 2 allows > 0


@dataclass(frozen=True)
class FedAdamParams(ServerOptParams):
    beta_2: float = 0.99  # Flower serverapp/strategy/fedadam.py:105
    # flower: eta sqrt(1 - b2^(t+1)) / (1 - b1^(t+1)) (fedadam.py:163-167); adam: exponent t (Kingma & Ba, the
    # authors' Keras Adam); none: Algorithm 2 as printed
    bias_correction: Literal["flower", "adam", "none"] = "flower"


@dataclass(frozen=True)
class FedYogiParams(ServerOptParams):
    eta: float = 1e-4  # ours, as ServerOptParams.eta (Flower's fedyogi.py:102 0.01 falls to chance there)
    beta_2: float = 0.99  # Flower serverapp/strategy/fedyogi.py:105


class ServerOpt(LinearHead):
    """FedAvg's clients; the server steps an adaptive optimiser on the averaged update (not registered)."""

    state_keys = {
        "m": "server: {name: tensor like the head} first moment of the averaged update (None before round 1)",
        "v": "server: {name: tensor like the head} second moment of the averaged update (None before round 1)",
    }
    Params = ServerOptParams

    def setup(self, ctx: Context) -> None:
        ctx.state["m"] = None
        ctx.state["v"] = None

    def aggregate(self, ctx: Context, plan: RoundPlan, glob: dict, cparams: dict) -> dict:
        """FedAvg by client sample counts (Flower), or the plain mean of Algorithm 2 (``aggregation=uniform``)."""
        if self.p.aggregation == "uniform":
            return fedavg(cparams, torch.ones(plan.m, device=ctx.device))
        return super().aggregate(ctx, plan, glob, cparams)

    def second_moment(self, v: torch.Tensor, d2: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def step_size(self, rnd: int) -> float:
        return self.p.eta

    def server_update(self, ctx: Context, plan: RoundPlan, old: dict, new: dict) -> dict:
        """One adaptive step (the module docstring's update) from ``old`` along ``delta = new - old``."""
        b1 = self.p.beta_1
        delta = {k: new[k] - old[k] for k in old}
        m, v = ctx.state["m"], ctx.state["v"]
        if m is None:
            m = {k: torch.zeros_like(d) for k, d in delta.items()}
        if v is None:
            v0 = self.p.tau**2 if self.p.v_init == "tau2" else 0.0
            v = {k: torch.full_like(d, v0) for k, d in delta.items()}
        m = {k: b1 * m[k] + (1 - b1) * delta[k] for k in delta}
        v = {k: self.second_moment(v[k], delta[k] * delta[k]) for k in delta}
        ctx.state["m"], ctx.state["v"] = m, v
        eta = self.step_size(plan.rnd)
        return {k: old[k] + eta * m[k] / (torch.sqrt(v[k]) + self.p.tau) for k in old}


@register
class FedAdagrad(ServerOpt):
    """FedAdagrad (Reddi et al. 2021): FedAvg's clients, Adagrad on the server (Flower's strategy)."""

    name = "fedadagrad"
    shardable = True  # no per-sample state: torchrun may shard its clients (engine.sharded_local)
    stacks = True  # FedAvg's round; the server step per run
    dp_client = True  # DP-FedAvg: the server step runs on the noised mean of the clipped updates
    dp_sample = "head"  # DP-SGD in the local steps (LinearHead.dp_clipped_sums)
    Params = FedAdagradParams

    def second_moment(self, v, d2):
        return v + d2  # fedadagrad.py:148


@register
class FedAdam(ServerOpt):
    """FedAdam (Reddi et al. 2021): FedAvg's clients, Adam on the server (Flower's strategy)."""

    name = "fedadam"
    shardable = True
    stacks = True
    dp_client = True  # DP-FedAvg: the server step runs on the noised mean of the clipped updates
    dp_sample = "head"
    Params = FedAdamParams

    def second_moment(self, v, d2):
        return self.p.beta_2 * v + (1 - self.p.beta_2) * d2  # fedadam.py:154-157

    def step_size(self, rnd: int) -> float:
        p = self.p
        if p.bias_correction == "none":
            return p.eta
        t = rnd + 1.0 if p.bias_correction == "flower" else float(rnd)
        return p.eta * (1 - p.beta_2**t) ** 0.5 / (1 - p.beta_1**t)


@register
class FedYogi(ServerOpt):
    """FedYogi (Reddi et al. 2021): FedAvg's clients, Yogi on the server (Flower's strategy)."""

    name = "fedyogi"
    shardable = True
    stacks = True
    dp_client = True  # DP-FedAvg: the server step runs on the noised mean of the clipped updates
    dp_sample = "head"
    Params = FedYogiParams

    def second_moment(self, v, d2):
        return v - (1 - self.p.beta_2) * d2 * torch.sign(v - d2)  # fedyogi.py:154-157


__all__ = [
    "FLOWER_COMMIT",
    "FedAdagrad",
    "FedAdagradParams",
    "FedAdam",
    "FedAdamParams",
    "FedYogi",
    "FedYogiParams",
    "ServerOpt",
    "ServerOptParams",
]

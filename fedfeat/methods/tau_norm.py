"""FedAvg + tau-norm (Kang et al., "Decoupling Representation and Classifier for Long-Tailed Recognition", ICLR 2020).

CLIP2FL's Table 1 baseline, here as a linear head ``logits = s * (x W^T + b)`` on cached CLIP features (LinearHead):
training is FedAvg's (local SGD on cross-entropy, sample-weighted averaging); at evaluation the classifier's rows are
rescaled ``w_c / ||w_c||^tau`` (Kang et al. §4, the tau-normalised classifier; ``tau = 1`` is L2 normalisation,
``tau = 0`` the plain head). The method runs batched over clients: local training is the engine's batched tensor
program (or FedAvg's fused CPU kernel, which it shares: the local loss is FedAvg's), and the normalisation is one
``[K, D]`` operation on the global head before the test logits.

Code: ``facebookresearch/classifier-balancing@f162ade`` ``tau_norm.py``: ``pnorm`` (tau_norm.py:102-107) divides
each row by ``||w_c||_2^p`` and the logits are ``feat @ ws.T`` (``dotproduct_similarity``, tau_norm.py:82-100): the
bias is loaded (tau_norm.py:56) and never used -- dropped. fedfeat's default drops it too (switch ``bias``).

``tau``: Kang et al. select it on a validation set (§4) and their code prints the accuracy of every
``p in np.linspace(0, 2, 21)`` on the split it is given (tau_norm.py:110-114); neither fixes one value, and a
federated server holds no validation split. The default 1 is the parameter-free special case (L2-normalised rows, a
cosine classifier up to the feature norm); to select tau as Kang does, train with ``--val-split`` over
``--set tau=...`` and pick with ``fedfeat report --best`` (on ``val_acc``).

``predict`` applies the normalisation; ``round_metrics`` adds ``fedavg_head_acc``, the un-normalised FedAvg head's
test accuracy (the same training); ``final_weights`` saves both heads: ``W``, ``b`` (trained, what clients
receive) and ``W_tau``, ``b_tau`` (the evaluated head: ``logits = s (x W_tau^T + b_tau)``; ``b_tau`` is zero when
the bias is dropped). Other hyperparameters are LinearHead's (CLIP2FL's table sets lr / epochs / batch per row).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from fedfeat.engine.context import Context
from fedfeat.errors import FedfeatError
from fedfeat.methods.base import register
from fedfeat.methods.head import LinearHead, LinearHeadParams


@dataclass(frozen=True)
class TauNormParams(LinearHeadParams):
    tau: float = (
        1.0  # Kang et al. §4 w_c / ||w_c||^tau; 1 = L2 normalisation; they select tau on validation (doc)
    )
    # drop: logits x . w~_c only (code: tau_norm.py:82-100 never uses the bias it loads at :56);
    # keep (ours): the trained bias is added unchanged
    bias: Literal["drop", "keep"] = "drop"

    def validate(self) -> None:
        super().validate()
        if self.tau < 0:
            raise FedfeatError(
                f"fedavg-tau-norm needs tau >= 0 (0 = the plain head), got {self.tau}; e.g. --set tau=1"
            )


def tau_normalize(W: torch.Tensor, tau: float) -> torch.Tensor:
    """``w_c / ||w_c||_2^tau`` for every row of ``W  # [K, D]`` (Kang et al.'s ``pnorm``); a zero row stays zero."""
    norms = torch.linalg.vector_norm(W, dim=-1, keepdim=True)  # [K, 1]
    return W / norms.clamp_min(torch.finfo(W.dtype).tiny).pow(tau)


@register
class FedAvgTauNorm(LinearHead):
    """FedAvg + tau-norm (Kang et al. 2020): FedAvg, rows of the head rescaled w_c / ||w_c||^tau at evaluation."""

    name = "fedavg-tau-norm"
    shardable = True  # no per-sample state: torchrun may shard its clients (engine.sharded_local)
    stacks = True  # FedAvg's training; the tau-normalised head evaluated per run (its predict)
    dp_client = True  # DP-FedAvg: the server step runs on the noised mean of the clipped updates
    dp_sample = "head"
    Params = TauNormParams

    def normalized(self, glob: dict) -> dict[str, torch.Tensor]:
        """The evaluated head ``{W_tau [K, D], b_tau [K]}``."""
        b = glob["b"] if self.p.bias == "keep" else torch.zeros_like(glob["b"])
        return {"W_tau": tau_normalize(glob["W"], self.p.tau), "b_tau": b}

    def predict(self, ctx: Context, glob: dict, x: torch.Tensor) -> torch.Tensor:
        h = self.normalized(glob)
        return super().predict(ctx, {"W": h["W_tau"], "b": h["b_tau"]}, x)

    def round_metrics(self, ctx: Context, data, glob: dict, ev: dict) -> dict:
        """``fedavg_head_acc``: the test accuracy of the trained head without the normalisation (closed runs)."""
        if getattr(ctx, "open_vocab", None) is not None:
            return {}
        pred = super().predict(ctx, glob, ctx.test_x).contiguous().argmax(1)
        y = data.test_y
        vm = getattr(ctx, "val_mask", None)
        if vm is not None:  # --val-split: the held-out rows are not test rows
            pred, y = pred[~vm], y[~vm]
        return {"fedavg_head_acc": float((pred == y).double().mean()) * 100}

    def final_weights(self, ctx: Context, glob: dict) -> dict[str, torch.Tensor]:
        return {**glob, **self.normalized(glob)}


__all__ = ["FedAvgTauNorm", "TauNormParams", "tau_normalize"]

"""The training-free family: classifiers in closed form from statistics the clients upload once -- FedNCM (nearest
class means) and Fed3R (federated recursive ridge regression) -- on the cached (frozen) features.

**FedNCM** (Legate, Bernier, Caccia, Oyallon, Belilovsky, "Guiding The Last Layer in Federated Learning with
Pre-Trained Models", NeurIPS 2023; code ``GwenLegate/GuidingLastLayerFLPretrain@54b5d1ee24601281a080128ec390afa7aaca1d06``,
``src/federated_main.py:101-120``, below ``ncm:L``). Every client sends, per class, the sum of its features and its
count (``K D + K`` numbers); the server divides the summed sums by the summed counts, L2-normalises each class mean
(``ncm:118``, ``F.normalize(class_means)``) and uses the normalised means as the weights of the last layer:
``logits = x W^T + b``, ``W = [mu_c / ||mu_c||]``. Per sample the argmax is the cosine to the class means (``||x||``
is one number per sample); ``normalize=True`` makes the logits the cosines themselves.

**Fed3R** (Fanì, Camoriano, Caputo, Ciccone, "Accelerating Heterogeneous Federated Learning with Closed-form
Classifiers", ICML 2024; code ``Erosinho13/Fed3R@c2a8e5de59e4b86efaa351c241a4a3357bcdab34``, ``src/fed3r.py``, below
``r3:L``). Every client sends ``G_k = X_k^T X_k`` and ``B_k = X_k^T Y_k`` (``Y_k`` one-hot; ``r3:50-60``), with
``X_k`` its features and a column of ones for the bias (``r3:50``), so ``(D + 1)^2 + (D + 1) K`` numbers; the
server solves the ridge regression ``W = (sum_k G_k + lambda I)^{-1} sum_k B_k`` (``r3:23-27``, ``lambda I`` on the
bias coordinate too: ``r3:402``), splits off the bias row and divides each class's column (and its bias) by the
column's norm (``normalize_W``, ``r3:30-38``: a zero norm becomes 1e-6) before using it as the last layer
(``r3:418-421``: ``logits = x W + b``). ``lambda = 0.01`` (``configs/fed3r_gld.yml:9``; every config in the repository
says 0.01). The paper's random-features variant (Fed3R-RF) is not in the public code and is not implemented here.

Features. Both reference codes read the backbone's raw pooled features (``ncm:108-111``; ``r3:47`` through
``models/mobilenetv2.py:124-126``, the network without its classifier): neither L2-normalises them, so
``normalize = False`` is the default of both methods here (the cached features as stored; ``normalize=True`` is
fedfeat's CLIP convention, a switch).

Rounds. A round's new clients -- sampled ones that have not uploaded yet -- upload their statistics; a client
sampled again uploads nothing new (its statistics of frozen features never change). The server's statistics
accumulate in ``ctx.state`` (checkpointed) and the head is re-solved from them after every round, so after enough
rounds every client has contributed and the head is the centralized one: the class means of all training data
(FedNCM) or the ridge solution on all of it (Fed3R) -- exactly, whatever the order or partition of the uploads
(``tests/test_closedform.py``). This is Fed3R's own protocol (``r3:405-430``: the clients, shuffled, each upload
once, ``clients_per_round`` at a time, the head re-solved and tested after each round's clients); FedNCM's
reference computes the means once over the pooled training set (``ncm:96-116``), which the sums make the same.

How it fits the engine: no local training. ``local_epochs`` is 0 (a class constant, not a hyperparameter), so the
engine's local update runs no step (``train_loss`` is 0, ``images`` 0) and returns the global head unchanged; the
statistics of the round's new clients are computed in ``aggregate`` from their rows of ``ctx.feats`` /
``ctx.labels`` -- one batched ``index_add`` (FedNCM) or one ``X^T X`` (Fed3R) over all of them, no loop over
clients, the same in both engines. Accumulated in float64 (the reference codes sum in float32).

Costs. ``bytes_up`` counts what the round's new clients send, in the features' precision: ``K D + K`` numbers each
for FedNCM, ``(D + 1)^2 + (D + 1) K`` for Fed3R (``D^2 + D K`` with ``bias=False``; the full ``G_k`` as the
reference sends it, not its symmetric half). ``bytes_down`` is 0: computing the statistics needs nothing from the
server (the frozen encoder is the clients' already), and no head is sent during the rounds.

Where fedfeat differs from the reference codes (no switch): a class no uploaded sample holds has a zero weight row
(logit 0 plus its bias), where FedNCM's reference divides 0 by 0 (NaN means); FedNCM's bias is 0, where the
reference leaves the re-initialised ``nn.Linear``'s random bias in place (``ncm:66``, never set after ``ncm:118``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F

from fedfeat.engine.context import Context, RoundPlan
from fedfeat.engine.optim import BatchedSGD
from fedfeat.methods.base import Method, register

NCM_REF = "GwenLegate/GuidingLastLayerFLPretrain@54b5d1ee24601281a080128ec390afa7aaca1d06"
FED3R_REF = "Erosinho13/Fed3R@c2a8e5de59e4b86efaa351c241a4a3357bcdab34"


# ---------------------------------------------------------------------------------------------- pure pieces
def rows_of_clients(offsets: torch.Tensor, clients: torch.Tensor) -> torch.Tensor:
    """The client-major rows of ``clients  # [m]`` (ids; ``offsets  # [C + 1]`` as ``Context.offsets``), client after
    client -> ``[M]`` int64 (cpu)."""
    clients = clients.to(torch.int64).cpu()
    starts, sizes = offsets[clients], offsets[clients + 1] - offsets[clients]
    first = torch.repeat_interleave(starts - (torch.cumsum(sizes, 0) - sizes), sizes)
    return torch.arange(int(sizes.sum()), dtype=torch.int64) + first


def class_sums(x: torch.Tensor, y: torch.Tensor, K: int) -> tuple[torch.Tensor, torch.Tensor]:
    """FedNCM's upload (``ncm:103-115``): ``x  # [N, D]``, ``y  # [N]`` -> ``(sums  # [K, D], counts  # [K])`` in
    float64: the features summed per class and the samples per class."""
    x = x.to(torch.float64)
    sums = torch.zeros(K, x.shape[1], dtype=x.dtype, device=x.device).index_add_(0, y, x)
    return sums, torch.bincount(y, minlength=K).to(x.dtype)


def ncm_head(sums: torch.Tensor, counts: torch.Tensor, normalize_means: bool = True) -> torch.Tensor:
    """FedNCM's weights ``[K, D]`` from summed class sums and counts: the class means (``ncm:116``), each
    L2-normalised (``ncm:118``) if ``normalize_means``; a class without samples: a zero row."""
    means = sums / counts.clamp_min(1).unsqueeze(1)
    return F.normalize(means, dim=1) if normalize_means else means


def with_bias(x: torch.Tensor) -> torch.Tensor:
    """``[N, D]`` -> ``[N, D + 1]`` with a column of ones (``r3:50``)."""
    return torch.cat([x, x.new_ones(x.shape[0], 1)], dim=1)


def ridge_stats(
    x: torch.Tensor, y: torch.Tensor, K: int, bias: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """Fed3R's upload (``r3:41-62``): ``x  # [N, D]``, ``y  # [N]`` -> ``(G = X^T X  # [D', D'], B = X^T Y  # [D', K])``
    in float64, ``X`` with a ones column if ``bias`` (``D' = D + 1``), ``Y`` one-hot. ``B`` as the class sums of
    ``X`` (transposed): one ``index_add``, no ``[N, K]`` one-hot matrix."""
    x = x.to(torch.float64)
    if bias:
        x = with_bias(x)
    G = x.T @ x
    B = torch.zeros(K, x.shape[1], dtype=x.dtype, device=x.device).index_add_(0, y, x).T
    return G, B


def ridge_head(
    G: torch.Tensor, B: torch.Tensor, lam: float, bias: bool = True, normalize_weights: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """Fed3R's classifier from the summed statistics: ``W = (G + lambda I)^{-1} B`` (``r3:23-27``, ``r3:402``), the
    bias its last row if ``bias``, then (``normalize_weights``) every class column and its bias divided by the
    column's norm, a zero norm taken as 1e-6 (``normalize_W``, ``r3:30-38``) -> ``(W  # [K, D], b  # [K])``."""
    A = G + lam * torch.eye(G.shape[0], dtype=G.dtype, device=G.device)
    W = torch.linalg.solve(A, B)  # [D', K]
    if bias:
        W, b = W[:-1], W[-1]
    else:
        b = W.new_zeros(W.shape[1])
    if normalize_weights:
        norm = W.norm(dim=0)
        norm = torch.where(norm == 0, torch.full_like(norm, 1e-6), norm)
        W, b = W / norm, b / norm
    return W.T, b


# ---------------------------------------------------------------------------------------------- the methods
class ClosedForm(Method):
    """A head solved in closed form from statistics each client uploads once (not registered: FedNCM, Fed3R)."""

    state_keys = {
        "uploaded": "per-client: [clients] bool (cpu), True once the client uploaded its statistics (once each)",
        "new_uploads": "server: int, the clients that uploaded in the latest round (its bytes_up)",
    }
    no_stack_reason = (
        "training-free: a round is one statistics pass over its new clients and a solve, nothing to share"
    )

    def setup(self, ctx: Context) -> None:
        ctx.state["uploaded"] = torch.zeros(ctx.n_clients, dtype=torch.bool)
        ctx.state["new_uploads"] = 0
        self.init_stats(ctx)

    # ---- what a subclass writes
    def init_stats(self, ctx: Context) -> None:
        raise NotImplementedError

    def accumulate(self, ctx: Context, x: torch.Tensor, y: torch.Tensor) -> None:
        """Add the statistics of the samples ``x  # [M, D]``, ``y  # [M]`` (the round's new clients') to the state."""
        raise NotImplementedError

    def head(self, ctx: Context) -> tuple[torch.Tensor, torch.Tensor]:
        """``(W  # [K, D], b  # [K])`` from the statistics uploaded so far."""
        raise NotImplementedError

    def upload_numbers(self, ctx: Context) -> int:
        """The numbers one client uploads."""
        raise NotImplementedError

    # ---- the hooks
    def _glob(self, ctx: Context) -> dict[str, torch.Tensor]:
        W, b = self.head(ctx)
        dt = ctx.feats.dtype
        return {"W": W.to(device=ctx.device, dtype=dt).contiguous(), "b": b.to(device=ctx.device, dtype=dt)}

    def init_global(self, ctx: Context) -> dict[str, torch.Tensor]:
        return self._glob(ctx)  # no statistics yet: a zero head

    def aggregate(self, ctx: Context, plan: RoundPlan, glob: dict, cparams: dict) -> dict:
        """The round's new clients upload their statistics (all of them in one batched pass); the head is re-solved
        from everything uploaded so far. ``cparams`` is the unchanged global head (no local training)."""
        uploaded = ctx.state["uploaded"].cpu().clone()  # a host decision: which clients are new
        clients = plan.clients.cpu()
        new = torch.sort(clients[~uploaded[clients]]).values
        if len(new):
            rows = rows_of_clients(ctx.offsets, new).to(ctx.feats.device)
            self.accumulate(ctx, ctx.feats[rows], ctx.labels[rows])
            uploaded[new] = True
            ctx.state["uploaded"] = uploaded
        ctx.state["new_uploads"] = len(new)
        return self._glob(ctx)

    def make_optimizer(self, rnd: int) -> BatchedSGD:
        """No optimiser steps (``local_epochs`` 0): a learning rate of 0 for the engine's bookkeeping."""
        return BatchedSGD(lr=0.0)

    def broadcast(self, ctx: Context, glob: dict) -> dict:
        """Nothing: a client's statistics need only its data and the frozen encoder it already holds."""
        return {}

    def upload_bytes(self, ctx: Context, plan: RoundPlan, cparams: dict) -> int:
        """The statistics of the round's new clients, in the features' precision."""
        return int(ctx.state["new_uploads"]) * self.upload_numbers(ctx) * ctx.feats.element_size()

    def predict(self, ctx: Context, glob: dict, x: torch.Tensor) -> torch.Tensor:
        return self.p.logit_scale * torch.addmm(glob["b"], x, glob["W"].T)


@dataclass(frozen=True)
class FedNCMParams:
    # the reference reads the backbone's raw pooled features (ncm:108-111: no F.normalize of the features); True:
    # fedfeat's CLIP convention (unit features: the logits are the cosines to the class means)
    normalize: bool = False
    # ncm:118: the weights are F.normalize(class_means) (each class mean to unit L2 norm); False: the raw means
    normalize_means: bool = True
    # ncm:118 puts the means into the model's nn.Linear (logits = x W^T + b, no temperature): 1
    logit_scale: float = 1.0
    local_epochs: ClassVar[int] = (
        0  # training-free: the engine's local update runs no step (not a hyperparameter)
    )
    batch_size: ClassVar[int] = 1  # unused (no local step)

    RANGES = {"logit_scale": "> 0"}


@register
class FedNCM(ClosedForm):
    """FedNCM (Legate et al. 2023): the nearest-class-mean head from the clients' class sums and counts, no training."""

    name = "fedncm"
    trains_clients = False  # clients upload statistics, no parameters are trained
    Params = FedNCMParams
    state_keys = {
        "class_sums": "server: [K, D] float64, the uploaded features summed per class",
        "class_counts": "server: [K] float64, the uploaded samples per class",
    }

    def init_stats(self, ctx: Context) -> None:
        kw = {"dtype": torch.float64, "device": ctx.device}
        ctx.state["class_sums"] = torch.zeros(ctx.K, ctx.D, **kw)
        ctx.state["class_counts"] = torch.zeros(ctx.K, **kw)

    def accumulate(self, ctx: Context, x: torch.Tensor, y: torch.Tensor) -> None:
        sums, counts = class_sums(x, y, ctx.K)
        ctx.state["class_sums"] = ctx.state["class_sums"] + sums
        ctx.state["class_counts"] = ctx.state["class_counts"] + counts

    def head(self, ctx: Context) -> tuple[torch.Tensor, torch.Tensor]:
        W = ncm_head(ctx.state["class_sums"], ctx.state["class_counts"], self.p.normalize_means)
        return W, W.new_zeros(ctx.K)

    def upload_numbers(self, ctx: Context) -> int:
        return ctx.K * ctx.D + ctx.K  # the class sums [K, D] and counts [K]


@dataclass(frozen=True)
class Fed3RParams:
    # r3:47 reads the backbone's raw pooled features (models/mobilenetv2.py:124-126: the network without its
    # classifier, no normalisation); True: fedfeat's CLIP convention (unit features)
    normalize: bool = False
    lam: float = (
        0.01  # ridge lambda: configs/fed3r_gld.yml:9 lambda_ (every config of the repository: 0.01); r3:402
    )
    bias: bool = True  # r3:50: a column of ones appended to the features (its weight row is the bias, r3:25)
    normalize_weights: bool = True  # r3:418 normalize_W (r3:30-38): each class column over its norm, bias too
    # r3:420-421 put W, bias into the model's nn.Linear (logits = x W + b, no temperature): 1
    logit_scale: float = 1.0
    local_epochs: ClassVar[int] = (
        0  # training-free: the engine's local update runs no step (not a hyperparameter)
    )
    batch_size: ClassVar[int] = 1  # unused (no local step)

    RANGES = {"lam": "> 0", "logit_scale": "> 0"}


@register
class Fed3R(ClosedForm):
    """Fed3R (Fanì et al. 2024): the ridge-regression head from the clients' X^T X and X^T Y, no training."""

    name = "fed3r"
    trains_clients = False  # clients upload statistics, no parameters are trained
    Params = Fed3RParams
    state_keys = {
        "gram": "server: [D', D'] float64, the uploaded X_k^T X_k summed (D' = D + 1 with the bias column)",
        "xty": "server: [D', K] float64, the uploaded X_k^T Y_k summed (Y one-hot)",
    }

    def _dim(self, ctx: Context) -> int:
        return ctx.D + int(self.p.bias)

    def init_stats(self, ctx: Context) -> None:
        kw = {"dtype": torch.float64, "device": ctx.device}
        d = self._dim(ctx)
        ctx.state["gram"] = torch.zeros(d, d, **kw)
        ctx.state["xty"] = torch.zeros(d, ctx.K, **kw)

    def accumulate(self, ctx: Context, x: torch.Tensor, y: torch.Tensor) -> None:
        G, B = ridge_stats(x, y, ctx.K, self.p.bias)
        ctx.state["gram"] = ctx.state["gram"] + G
        ctx.state["xty"] = ctx.state["xty"] + B

    def head(self, ctx: Context) -> tuple[torch.Tensor, torch.Tensor]:
        p = self.p
        return ridge_head(ctx.state["gram"], ctx.state["xty"], p.lam, p.bias, p.normalize_weights)

    def upload_numbers(self, ctx: Context) -> int:
        d = self._dim(ctx)
        return d * d + d * ctx.K  # G_k [D', D'] and B_k [D', K]


__all__ = [
    "ClosedForm",
    "FED3R_REF",
    "Fed3R",
    "Fed3RParams",
    "FedNCM",
    "FedNCMParams",
    "NCM_REF",
    "class_sums",
    "ncm_head",
    "ridge_head",
    "ridge_stats",
    "rows_of_clients",
    "with_bias",
]

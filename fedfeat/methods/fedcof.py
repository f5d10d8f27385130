"""FedCOF (Goswami et al., "Covariances for Free: Exploiting Mean Distributions for Training-free Federated
Learning", NeurIPS 2025; code github.com/dipamgoswami/FedCOF @ c2e9296d7c695a47c3781494cb686cfc6ec3c3a0, cited below
as ``FedCOF@c2e9296``): a training-free classifier from the clients' class means alone.

The method, as the authors' training-free script builds it (``server_aggregate.py`` with ``federate_classes.py``'s
``FedCOFClient`` / ``FedCOFServer``):

1. **Clients** (``federate_classes.py:234-267``) upload, for every class c they hold, the mean ``mu_{k,c}`` of their
   (frozen) features and the count ``n_{k,c}``. Nothing else: no covariance, no Gram matrix.
2. **Server: class covariances from the spread of the client means** (``federate_classes.py:130-147``; the paper's
   unbiased estimator). With ``N_c = sum_k n_{k,c}``, ``mu_c = sum_k n_{k,c} mu_{k,c} / N_c`` and ``K_c`` the number
   of clients holding class c::

       Sigma_c = 1 / (K_c - 1) sum_k n_{k,c} (mu_{k,c} - mu_c)(mu_{k,c} - mu_c)^T      (K_c = 1: divided by 1)

   For features i.i.d. within a class, ``mu_{k,c}`` has covariance ``Sigma / n_{k,c}``, so the sum has expectation
   ``(K_c - 1) Sigma``: unbiased (``tests/test_fedcof.py`` checks the expectation exactly). Each is shrunk:
   ``Sigma_c + gamma I`` (``shrink``).
3. **Server: the classifier** (``federate_classes.py:150-168``): ridge regression on an *estimated* Gram matrix
   that keeps only the within-class scatter (the paper: dropping the between-class scatter gives a better
   classifier)::

       G = sum_{c held} (N_c - 1)(Sigma_c + gamma I) + N g g^T        g = sum_c N_c mu_c / N (the global mean)
       W_c = pinv(G) S_c,   S_c = N_c mu_c (the class sums)

   and the head is ``normalize(W)`` row-wise, bias-free: ``logits = x W^T`` (``federate_classes.py:95-97``,
   ``server_aggregate.py:352``). A class no client has uploaded has ``S_c = 0``: a zero row (never predicted above
   a positive score). No random projection and no feature normalisation in the authors' code: the backbone's raw
   features go in (``client_accumulate.py``), hence ``normalize=False`` by default here.

**Rounds, partial participation.** The authors' fine-tuning code (``Init_FT_LP/federated_main_round.py:224-301``)
samples clients round after round and accumulates every client's means once; here too: a round's sampled clients
that have not uploaded yet upload (``bytes_up``: ``K*D`` means and ``K`` counts each), the server keeps every
upload (``ctx.state``, in client order, so the classifier does not depend on the order clients arrived in) and
re-solves the classifier from all of them. A client sampled again sends nothing. There is no local training: the
engine's local pass is a no-op (zero loss, learning rate 0) over one large batch per client, and the statistics
are computed in ``aggregate`` from the round's new clients' rows with one ``index_add`` (no loop over clients).
Everything the server computes is float64; the head is cast to the run's dtype.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from fedfeat.engine.context import Context, RoundPlan, plan_rows
from fedfeat.engine.optim import BatchedSGD
from fedfeat.methods.base import Method, check_ranges, register

REF = "FedCOF@c2e9296"  # github.com/dipamgoswami/FedCOF @ c2e9296d7c695a47c3781494cb686cfc6ec3c3a0


@dataclass(frozen=True)
class FedCOFParams:
    # gamma: Sigma_c + gamma I (FedCOF@c2e9296 server_aggregate.py:95 --gamma_shrink default 1; the ViT runs
    # bash_for_testmethods/test_vit.sh pass 1.0; README.md's MobileNet example and Init_FT_LP/federated_main_round.py:106
    # use 0.1 for MobileNet)
    shrink: float = 1.0
    # an extra gamma' I on the estimated Gram before pinv: 0 in the training-free script (FedCOF@c2e9296
    # federate_classes.py:161-162, the shrunk line commented out); Init_FT_LP/federated_main_round.py:349 adds the same
    # gamma again (a reading: --set gram_shrink=1)
    gram_shrink: float = 0.0
    # False: the Gram keeps only within-class scatter + N g g^T (FedCOF@c2e9296 federate_classes.py:153-159; the paper's
    # choice); True: + sum_c N_c (mu_c - g)(mu_c - g)^T, the full Gram (Init_FT_LP/federated_main_round.py:318-320,
    # commented out there; the paper's ablation)
    between_class: bool = False
    # False: the backbone's raw features (FedCOF@c2e9296 client_accumulate.py: no normalisation); True: L2-normalised
    # (the CLIP convention of fedfeat's linear heads)
    normalize: bool = False
    # logits = s * x normalize(W)^T: 1 = the authors' bias-free nn.Linear head (server_aggregate.py:352, 365);
    # a scale changes no prediction, only the logits' temperature
    logit_scale: float = 1.0
    # the engine's local pass (a no-op here: lr 0, zero loss): one batch covers a client of up to batch_size samples
    batch_size: int = 256  # ours: no local training in FedCOF
    local_epochs: int = 1  # ours: no local training in FedCOF

    RANGES = {"shrink": ">= 0", "gram_shrink": ">= 0", "logit_scale": "> 0", "local_epochs": "[1, 1]"}

    def validate(self) -> None:
        check_ranges(self)


# ---------------------------------------------------------------------------------------------- pure pieces
def client_class_means(
    x: torch.Tensor, y: torch.Tensor, seg: torch.Tensor, m: int, K: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The uploads of ``m`` clients at once (``federate_classes.py:234-261``): rows ``x  # [M, D]`` with labels
    ``y  # [M]`` of client slot ``seg  # [M]`` -> ``(slot  # [P], cls  # [P], n  # [P] int64, mean  # [P, D]
    float64)`` for every (client, class) pair held, ordered by (slot, class)."""
    key = seg * K + y
    n = torch.bincount(key, minlength=m * K)
    sums = torch.zeros(m * K, x.shape[1], dtype=torch.float64, device=x.device).index_add_(
        0, key, x.to(torch.float64)
    )
    held = torch.nonzero(n > 0).squeeze(1)
    return held // K, held % K, n[held], sums[held] / n[held].unsqueeze(1).to(torch.float64)


def class_covariances(cls: torch.Tensor, n: torch.Tensor, mean: torch.Tensor, K: int):
    """The server's estimates from the uploaded pairs ``(cls  # [P], n  # [P], mean  # [P, D])``
    (``federate_classes.py:113-146``, without the shrinkage): ``(N  # [K], S  # [K, D] class sums, Kc  # [K] clients
    per class, Sigma  # [K, D, D])`` with ``Sigma_c = sum_k n_k (mu_k - mu_c)(mu_k - mu_c)^T / max(K_c - 1, 1)`` (zero
    for classes nobody holds). ``K x D x D``: for tests and small cases; ``fedcof_classifier`` never forms it."""
    N, S, Kc = _class_sums(cls, n, mean, K)
    Z = (mean - S[cls] / N[cls].unsqueeze(1)) * n.to(mean.dtype).sqrt().unsqueeze(1)  # [P, D]
    outer = Z.unsqueeze(2) * Z.unsqueeze(1)  # [P, D, D]
    Sigma = torch.zeros(K, *outer.shape[1:], dtype=mean.dtype, device=mean.device).index_add_(0, cls, outer)
    return N, S, Kc, Sigma / (Kc - 1).clamp_min(1).to(mean.dtype).view(-1, 1, 1)


def _class_sums(cls, n, mean, K):
    nf = n.to(mean.dtype)
    N = torch.zeros(K, dtype=mean.dtype, device=mean.device).index_add_(0, cls, nf)
    S = torch.zeros(K, mean.shape[1], dtype=mean.dtype, device=mean.device).index_add_(
        0, cls, nf.unsqueeze(1) * mean
    )
    Kc = torch.bincount(cls, minlength=K)
    return N, S, Kc


def fedcof_classifier(
    cls: torch.Tensor,
    n: torch.Tensor,
    mean: torch.Tensor,
    K: int,
    shrink: float = 1.0,
    gram_shrink: float = 0.0,
    between_class: bool = False,
) -> torch.Tensor:
    """FedCOF's head ``[K, D]`` from the uploaded pairs ``(cls  # [P], n  # [P], mean  # [P, D])``
    (``federate_classes.py:102-168`` and ``95-97``)::

        G = sum_{c: N_c > 0} (N_c - 1)(Sigma_c + shrink I) + N g g^T (+ gram_shrink I)
        W = normalize_rows((pinv(G) S^T)^T)

    ``sum_c (N_c - 1) Sigma_c`` is one product ``A^T A`` of the pairs' centred means scaled by ``sqrt(n_k (N_c - 1) /
    max(K_c - 1, 1))`` (no ``K x D x D`` tensor). ``between_class`` adds ``sum_c N_c (mu_c - g)(mu_c - g)^T``."""
    dt = mean.dtype
    D = mean.shape[1]
    N, S, Kc = _class_sums(cls, n, mean, K)
    held = N > 0
    Nc = N[cls]
    w = n.to(dt) * (Nc - 1) / (Kc[cls] - 1).clamp_min(1).to(dt)  # [P]
    A = (mean - S[cls] / Nc.unsqueeze(1)) * w.sqrt().unsqueeze(1)  # [P, D]
    total = N.sum()
    g = S.sum(0) / total  # the global mean
    eye = torch.eye(D, dtype=dt, device=mean.device)
    G = A.T @ A + (shrink * (N[held] - 1).sum()) * eye + total * torch.outer(g, g)
    if between_class:
        B = (S[held] / N[held].unsqueeze(1) - g) * N[held].sqrt().unsqueeze(1)
        G = G + B.T @ B
    if gram_shrink:
        G = G + gram_shrink * eye
    W = (torch.linalg.pinv(G) @ S.T).T
    return F.normalize(W, dim=1)


# ---------------------------------------------------------------------------------------------- the method
@register
class FedCOF(Method):
    """FedCOF: clients upload class means and counts once; the server estimates class covariances from the spread
    of the means and solves a ridge classifier on the estimated within-class Gram matrix. No training."""

    name = "fedcof"
    trains_clients = False  # clients upload statistics, no parameters are trained
    Params = FedCOFParams
    state_keys = {
        "uploaded": "server: [clients] bool (cpu), the clients whose class means the server holds",
        "cls": "server: [P] int64, the class of each uploaded (client, class) mean, ordered by (client, class)",
        "owner": "server: [P] int64, the client of each uploaded mean",
        "count": "server: [P] int64, n_{k,c}: the samples behind each uploaded mean",
        "mean": "server: [P, D] float64, the uploaded class means mu_{k,c}",
        "new_clients": "server: int, clients that uploaded in the latest round (bytes_up)",
    }
    shardable = False  # the statistics are computed on the server's full feature table (aggregate)
    no_stack_reason = "no local training to share: its round is one server-side solve"

    def setup(self, ctx: Context) -> None:
        dev = ctx.device
        ctx.state["uploaded"] = torch.zeros(ctx.n_clients, dtype=torch.bool)
        ctx.state["cls"] = torch.zeros(0, dtype=torch.int64, device=dev)
        ctx.state["owner"] = torch.zeros(0, dtype=torch.int64, device=dev)
        ctx.state["count"] = torch.zeros(0, dtype=torch.int64, device=dev)
        ctx.state["mean"] = torch.zeros(0, ctx.feats.shape[1], dtype=torch.float64, device=dev)
        ctx.state["new_clients"] = 0

    def init_global(self, ctx: Context) -> dict[str, torch.Tensor]:
        """Nothing uploaded yet: a zero head (FedCOF's rows of classes without statistics)."""
        return {"W": torch.zeros(ctx.K, ctx.feats.shape[1], dtype=ctx.feats.dtype, device=ctx.device)}

    # ---- the engine's local pass: a no-op (FedCOF trains nothing)
    def make_optimizer(self, rnd: int):
        return BatchedSGD(lr=0.0)

    def step_loss(self, ctx: Context, params: dict, batch, local: dict) -> torch.Tensor:
        return params["W"][:, 0, 0] * 0.0  # [n] zeros: the step changes nothing

    # ---- the server
    def aggregate(self, ctx: Context, plan: RoundPlan, glob: dict, cparams: dict) -> dict:
        """The round's clients that have not uploaded yet compute and send their class means and counts; the
        server adds them to what it holds (kept sorted by (client, class))."""
        st = ctx.state
        uploaded = st["uploaded"]
        new = ~uploaded[plan.clients]
        st["new_clients"] = int(new.sum())
        if not st["new_clients"]:
            return glob
        seg, _, pos = plan_rows(ctx, plan)
        keep = new[seg]
        seg, pos = seg[keep].to(ctx.device), pos[keep].to(ctx.device)
        slot, cls, n, mean = client_class_means(ctx.feats[pos], ctx.labels[pos], seg, plan.m, ctx.K)
        owner = torch.cat([st["owner"], plan.clients.to(ctx.device)[slot]])
        cls = torch.cat([st["cls"], cls])
        order = torch.argsort(owner * ctx.K + cls)
        st["owner"], st["cls"] = owner[order], cls[order]
        st["count"] = torch.cat([st["count"], n])[order]
        st["mean"] = torch.cat([st["mean"], mean])[order]
        uploaded = uploaded.clone()
        uploaded[plan.clients[new]] = True
        st["uploaded"] = uploaded
        return {"W": self.classifier(ctx).to(glob["W"].dtype)}

    def classifier(self, ctx: Context) -> torch.Tensor:
        """The head ``[K, D]`` (float64) from every upload the server holds."""
        st, p = ctx.state, self.p
        return fedcof_classifier(
            st["cls"], st["count"], st["mean"], ctx.K, p.shrink, p.gram_shrink, p.between_class
        )

    def upload_bytes(self, ctx: Context, plan: RoundPlan, cparams: dict) -> int:
        """Each new client's ``K`` class means ``[K, D]`` and ``K`` counts; a client sampled again sends nothing."""
        return int(ctx.state["new_clients"]) * ctx.K * (ctx.feats.shape[1] + 1) * ctx.feats.element_size()

    def predict(self, ctx: Context, glob: dict, x: torch.Tensor) -> torch.Tensor:
        return self.p.logit_scale * (x @ glob["W"].T)

    def round_metrics(self, ctx: Context, data, glob: dict, ev: dict) -> dict:
        return {
            "clients_uploaded": int(ctx.state["uploaded"].sum()),
            "means_held": int(ctx.state["cls"].numel()),
        }


__all__ = ["FedCOF", "FedCOFParams", "class_covariances", "client_class_means", "fedcof_classifier"]

"""FedCoPL's cooperative pseudo-labelling (CoPL), the third pseudo-labeller beside FPL and CPL
(``fedfeat.methods.pseudolabel``), with the same interface: ``CoPL()(probs, segments) -> Selection``.

Guo et al., "Cooperative Pseudo Labeling for Unsupervised Federated Classification", ICCV 2025; reference code
``krumpguo/FedCoPL`` (HEAD ed7e0e0). Citations below are ``file:line`` in that repository:
``fedcopl.py`` = ``methods/unsupervised_learning_new/fedcopl.py``, ``main_UL.py`` = ``methods/main_UL.py``,
``clip_pseudolabels.py`` = ``utils/clip_pseudolabels.py``, ``utils.py`` = ``utils/utils.py``.

At every refresh round (``round % Q == 0``, Q = ``num_repesudo_round`` = 5; ``main_UL.py:418``), over client-major
``probs  # [N, K]`` (client ``i`` owns rows ``segments[i]:segments[i + 1]``):

1. ``copl_filter`` -- each client keeps the samples with ``max p > median(max p)`` and ``entropy < median(entropy)``
   over its own samples (``fedcopl.py:417-427``);
2. ``copl_counts`` -- each client uploads, per class, the number of kept samples predicted as that class
   (and their feature sum, unused downstream; ``fedcopl.py:429-437``);
3. ``copl_budget`` -- the server turns the counts into per-client, per-class quotas (``main_UL.py:461-491``);
4. ``copl_select`` -- each client takes, per class, its quota of most confident samples predicted as that class,
   out of *all* its samples, with one-hot hard labels (``fedcopl.py:474-497``, ``clip_pseudolabels.py:326-436``).

``CoPL`` chains the four. Everything is segment-vectorised (no Python loop over samples or clients).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fedfeat.errors import FedfeatError
from fedfeat.methods.pseudolabel import (
    EPS,
    Selection,
    _check_probs,
    _check_segments,
    _group_rank,
    _owner,
    _selection,
    segment_quantile,
)

CONF_QUANTILE = (
    50.0  # CONF_QUANTILE_CONFIDENCE, reference run script (reference-notes "4. FedCoPL", defaults)
)
ENT_QUANTILE = 50.0  # CONF_QUANTILE_ENTROPY, same source; the entropy threshold is its (1 - q/100) quantile
Q = 5  # num_repesudo_round: pseudo-labels are refreshed every Q rounds (main_UL.py:418); round_index = round // Q


def _float(probs: torch.Tensor) -> torch.Tensor:
    # the code's probs / logits are float32 (clip_pseudolabels.py:173-179, ``.float()``); keep float64 as given
    return probs if probs.dtype in (torch.float32, torch.float64) else probs.float()


def copl_entropy(probs: torch.Tensor) -> torch.Tensor:
    """Shannon entropy in nats, ``-Σ_c p_c ln p_c`` per row: ``[N, K] -> [N]``.

    The code (``fedcopl.py:421``) computes ``-(logits.softmax(1) * logits.log_softmax(1)).sum(1)`` from the logits
    (natural log; ``probs = softmax(logits / 1.0)``, TEMPERATURE 1, so the same distribution). Here only ``probs`` is
    given: ``xlogy(p, p)`` (0 where ``p = 0``, as ``softmax · log_softmax`` is where the softmax underflows); it can
    differ from the logit form in the last float bits.

    >>> round(float(copl_entropy(torch.full((1, 3), 1 / 3))[0]), 4)  # ln 3
    1.0986
    """
    _check_probs(probs)
    return -torch.special.xlogy(probs, probs).sum(1)


def _check_quantile(name: str, q) -> float:
    if isinstance(q, bool) or not isinstance(q, (int, float)) or not 0 <= q <= 100:
        raise FedfeatError(
            f"{name} must be a percentage in [0, 100], got {q!r}; FedCoPL uses 50 (the median)"
        )
    return float(q)


def copl_filter(
    probs: torch.Tensor,
    segments=None,
    *,
    conf_quantile: float = CONF_QUANTILE,
    ent_quantile: float = ENT_QUANTILE,
    confidence: bool = True,
    entropy: bool = True,
) -> torch.Tensor:
    """CoPL's estimation set, ``keep  # [N]`` bool: per client, the samples with

        ``max_c p > quantile(max_c p, conf_quantile / 100)`` **and** ``entropy < quantile(entropy, 1 - ent_quantile / 100)``

    (both strict; both quantiles over the client's own samples, ``torch.quantile``'s linear interpolation; entropy
    in nats, ``copl_entropy``). Defaults 50 / 50: both medians, so a sample *at* a median is dropped.

    Reference: ``fedcopl.py:417-427`` (``_create_training_dataset_pre``; ``conf_thr`` line 423, ``conf_thr_1`` line
    425, the ``&`` of the strict comparisons line 427), run once per client (``main_UL.py:436-448``).
    Deviations: the thresholds are computed for all clients at once (``segment_quantile``, the same numbers); the
    code crashes for a client that keeps no sample (``acc = correct / 0``, ``fedcopl.py:445``) or exactly one
    (``.squeeze()`` makes the index 0-d, ``len()`` fails at line 434) -- here such a client simply keeps 0 / 1.
    A client with no rows keeps nothing.

    ``confidence`` / ``entropy`` = False drop that condition (the paper's ablation, its "Confidence Filtering" /
    "Entropy Filtering" columns; the released code has no such switch): with both off every sample is kept.

    >>> p = torch.tensor([[.9, .1], [.6, .4], [.7, .3]])
    >>> copl_filter(p).tolist()  # medians: max p 0.7, entropy H(.7, .3)
    [True, False, False]
    """
    _check_probs(probs)
    cq = _check_quantile("conf_quantile", conf_quantile)
    eq = _check_quantile("ent_quantile", ent_quantile)
    seg = _check_segments(segments, probs.shape[0])
    p = _float(probs)
    mx = p.max(1).values  # [N]
    ent = copl_entropy(p)  # [N]
    owner = _owner(seg, p.device)
    conf_thr = segment_quantile(mx.unsqueeze(1), seg, cq / 100)[:, 0]  # [clients]
    ent_thr = segment_quantile(ent.unsqueeze(1), seg, 1 - eq / 100)[:, 0]  # [clients]
    keep = torch.ones_like(mx, dtype=torch.bool)
    if confidence:
        keep &= mx > conf_thr[owner]
    if entropy:
        keep &= ent < ent_thr[owner]
    return keep


def copl_counts(
    probs: torch.Tensor, keep: torch.Tensor, segments=None, *, features: torch.Tensor | None = None
):
    """What each client uploads: ``n  # [clients, K]`` int64, per client and class the number of kept samples
    (``keep``, from ``copl_filter``) whose ``argmax p`` is the class. With ``features  # [N, D]`` (the samples'
    normalised image features) returns ``(n, sums  # [clients, K, D])``, the per-class sums of the kept samples'
    features.

    Reference: ``fedcopl.py:429-437`` (``data_distribution[label] += 1``, ``local_feature[label] +=
    selected_features[i]``; float32 there, exact int64 counts here). The server turns the sums into global
    prototypes (``main_UL.py:461-475``, empty classes filled with zero-shot text features) but then passes
    ``global_prototype=None`` downstream (``main_UL.py:503``): the sums are unused in the released code, and only
    ``n`` feeds ``copl_budget``.

    >>> p = torch.tensor([[.9, .1], [.2, .8], [.7, .3]])
    >>> copl_counts(p, torch.tensor([True, True, False]), [0, 2, 3]).tolist()
    [[1, 1], [0, 0]]
    """
    _check_probs(probs)
    N, K = probs.shape
    seg = _check_segments(segments, N)
    if not isinstance(keep, torch.Tensor) or keep.dtype != torch.bool or keep.shape != (N,):
        shape = tuple(keep.shape) if isinstance(keep, torch.Tensor) else type(keep).__name__
        raise FedfeatError(
            f"keep must be a bool tensor [{N}] (one flag per sample), got {shape}; pass copl_filter(...)"
        )
    G = len(seg) - 1
    group = (_owner(seg, probs.device) * K + probs.argmax(1))[
        keep.to(probs.device)
    ]  # [kept] client·K + class
    n = torch.bincount(group, minlength=G * K).view(G, K).to(torch.int64)
    if features is None:
        return n
    if not isinstance(features, torch.Tensor) or features.dim() != 2 or features.shape[0] != N:
        shape = tuple(features.shape) if isinstance(features, torch.Tensor) else type(features).__name__
        raise FedfeatError(f"features must be a tensor [{N}, D] (one row per sample), got {shape}")
    f = features.to(probs.device)[keep.to(probs.device)]
    sums = torch.zeros(G * K, features.shape[1], dtype=f.dtype, device=f.device).index_add_(0, group, f)
    return n, sums.view(G, K, -1)


def _check_int(name: str, v, low: int) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or v < low:
        raise FedfeatError(f"{name} must be an integer >= {low}, got {v!r}")
    return v


def _check_count_matrix(name: str, t, shape=None) -> torch.Tensor:
    if not isinstance(t, torch.Tensor) or t.dim() != 2 or t.is_floating_point() or t.dtype == torch.bool:
        desc = f"{tuple(t.shape)} {t.dtype}" if isinstance(t, torch.Tensor) else type(t).__name__
        raise FedfeatError(f"{name} must be an integer tensor [clients, classes], got {desc}")
    if shape is not None and tuple(t.shape) != tuple(shape):
        raise FedfeatError(f"{name} has shape {tuple(t.shape)}, expected [clients, classes] = {tuple(shape)}")
    if bool((t < 0).any()):
        raise FedfeatError(f"{name} must be >= 0, got a minimum of {int(t.min())}")
    return t.to(torch.int64)


def copl_budget(
    n: torch.Tensor, n_total_train: int, round_index: int = 0, n_clients: int | None = None
) -> torch.Tensor:
    """The server's global assignment: per-client, per-class quotas ``K  # [clients, K]`` int64 from the uploaded
    counts ``n  # [clients, K]`` (``copl_counts``). With ``C`` classes, ``N_c = Σ_k n_{k,c}``:

    * ``M = ceil(Σ_c N_c / C)``, the same global budget for every class;
    * a class with ``N_c > 0``: ``K_{k,c} = ceil(n_{k,c} / N_c · M)`` -- 0 for a client with ``n_{k,c} = 0``;
    * a class nobody kept (``N_c = 0``): every client gets
      ``ceil(n_total_train / C / 4 · (round_index + 1) / n_clients)``.

    ``n_total_train`` is the code's ``len(train_dataset)``, the size of the *whole* (centralised) training set, i.e.
    of the union of all clients' train splits (``main_UL.py:343-350``), not a client's size; ``round_index`` is the
    code's ``int(round / num_repesudo_round)``, the index of the pseudo-label refresh (0 at round 0, 1 at round 5,
    ...; pass ``round // Q``), not the communication round; ``n_clients`` is ``obj_conf.client_num`` (default
    ``n.shape[0]``).

    Reference: ``main_UL.py:461-462`` (``N_c``), ``485`` (``M``), ``490`` (``K``). Deviation: the code does this
    in float32 (``n / N_c * M``, then ``ceil``) and Python floats for the fallback; here it is exact integer
    arithmetic (``(n·M + N_c - 1) // N_c``), which can be one lower where float rounding puts an exact integer a
    hair above itself. The code casts to int32 (``.int()``); here int64.

    >>> copl_budget(torch.tensor([[1, 0, 0], [3, 1, 0]]), n_total_train=96, round_index=0)
    tensor([[1, 0, 4],
            [2, 2, 4]])
    """
    n = _check_count_matrix("n (counts)", n)
    n_total_train = _check_int("n_total_train", n_total_train, 0)
    round_index = _check_int("round_index (the refresh index, round // Q)", round_index, 0)
    n_clients = n.shape[0] if n_clients is None else _check_int("n_clients", n_clients, 1)
    C = n.shape[1]
    if C == 0:
        raise FedfeatError("n (counts) has no classes; pass [clients, classes] with classes >= 1")
    N = n.sum(0)  # [C]
    M = -(-int(N.sum()) // C)  # ceil(Σ N_c / C)
    quota = -torch.div(-n * M, N.clamp(min=1), rounding_mode="floor")  # ceil(n_{k,c} M / N_c)
    fallback = -(
        -n_total_train * (round_index + 1) // (C * 4 * n_clients)
    )  # ceil(|D| / C / 4 · (it+1) / clients)
    return torch.where(N > 0, quota, torch.full_like(quota, fallback))


def copl_select(probs: torch.Tensor, segments=None, budget: torch.Tensor | None = None) -> Selection:
    """CoPL's local selection over **all** of a client's samples (not only ``copl_filter``'s): hard label
    ``argmax p``; per client ``k`` and class ``c``, the ``budget[k, c]`` samples predicted as ``c`` with the highest
    ``p_c`` (all of them if fewer; none for a quota of 0). Returns a ``Selection``: sorted rows, per-client offsets,
    one-hot ``candidates``, ``labels = argmax``.

    Reference: ``fedcopl.py:474-497`` (one-hot ``labels = eye(C)[argmax]``, ``select_topk_for_eachcls(...,
    K_max=quotas, multi_k=True)``); ``clip_pseudolabels.py:326-341`` (uncertainty ``1 - softmax``), ``344-376`` (a
    sample with ``p < 1e-7`` gets ``inf`` and is never taken), ``412`` (pool capacities = the quotas); pools filled
    by ``ClassPool.update`` (``utils.py:513-547``): each sample is offered once, to its argmax class's pool.
    Ranking is by ``1 - p_c`` ascending, as the code's; ties go to the lower row. Deviations: the code streams the
    samples through the pool and, once full, replaces the slot ``torch.max`` reports for the largest uncertainty, so
    which of several samples tied at the cut-off stays depends on slot order; and a pool of capacity 0 offered a
    sample with ``p_c = 1.0`` exactly (uncertainty 0 < the empty pool's ``unc_max`` 1e-10) raises ``AttributeError``
    there (``utils.py:533-545``, no ``unc_max_idx`` yet) -- here it is simply not selected.

    >>> p = torch.tensor([[.9, .1], [.6, .4], [.3, .7], [.2, .8]])
    >>> copl_select(p, [0, 4], torch.tensor([[1, 1]])).rows.tolist()
    [0, 3]
    """
    _check_probs(probs)
    N, K = probs.shape
    seg = _check_segments(segments, N)
    budget = _check_count_matrix("budget", budget, (len(seg) - 1, K))
    p = _float(probs)
    rows = torch.arange(N, device=p.device)
    pred = p.argmax(1)  # [N]
    pmax = p[rows, pred]
    unc = 1 - pmax  # the code's uncertainty (float32 there), lower is better
    group = _owner(seg, p.device) * K + pred  # [N] client·K + class
    o, rank = _group_rank([unc, rows], group)
    cap = budget.to(p.device).reshape(-1)[group[o]]  # quota of each sorted item's (client, class)
    take = o[(rank < cap) & (pmax[o] >= EPS)]
    sel = torch.zeros(N, dtype=torch.bool, device=p.device)
    sel[take] = True
    kept = sel.nonzero(as_tuple=True)[0]  # sorted rows
    labels = pred[kept]
    cand = torch.zeros(len(kept), K, dtype=torch.bool, device=p.device)
    cand[torch.arange(len(kept), device=p.device), labels] = True
    return _selection(kept, seg, cand, labels)


@dataclass(frozen=True)
class CoPL:
    """CoPL as a ``PseudoLabeller``: ``copl_filter`` -> ``copl_counts`` -> ``copl_budget`` -> ``copl_select``.

    Hold one per refresh: ``CoPL(round_index=round // Q, n_total_train=...)``; the call sees every client's probs at
    once, which is the server's view of the uploaded counts (only ``n`` crosses the wire in the federated protocol).

    >>> p = torch.tensor([[.9, .1], [.6, .4], [.7, .3], [.2, .8]])
    >>> CoPL()(p).rows.tolist()
    [0, 3]
    """

    round_index: int = 0  # refresh index int(round / num_repesudo_round), reference code main_UL.py:490
    n_total_train: int | None = (
        None  # len(train_dataset), all clients' train data (main_UL.py:490); None: len(probs)
    )
    n_clients: int | None = None  # obj_conf.client_num (main_UL.py:490); None: the number of segments
    conf_quantile: float = CONF_QUANTILE  # CONF_QUANTILE_CONFIDENCE, reference script (fedcopl.py:417)
    ent_quantile: float = ENT_QUANTILE  # CONF_QUANTILE_ENTROPY, reference script (fedcopl.py:418)
    # the paper's ablation (../shared/papers/003_*, "Ablation Study": its "Confidence Filtering", "Entropy
    # Filtering" and "Global Assignment" columns; the released code has none of the three switches). Off:
    # confidence_filtering / entropy_filtering drop that condition of copl_filter (fedcopl.py:427's ``&``);
    # global_assignment skips the server (copl_budget, main_UL.py:461-491): each client's quota is its own count
    # n_{k,c} (its uploaded estimate, not reassigned; our reading: the paper leaves the un-assigned quota unstated)
    confidence_filtering: bool = True
    entropy_filtering: bool = True
    global_assignment: bool = True
    name = "copl"

    def __call__(self, probs: torch.Tensor, segments=None) -> Selection:
        keep = copl_filter(
            probs,
            segments,
            conf_quantile=self.conf_quantile,
            ent_quantile=self.ent_quantile,
            confidence=self.confidence_filtering,
            entropy=self.entropy_filtering,
        )
        n = copl_counts(probs, keep, segments)
        if not self.global_assignment:
            return copl_select(probs, segments, n)
        total = probs.shape[0] if self.n_total_train is None else self.n_total_train
        budget = copl_budget(n, total, self.round_index, self.n_clients)
        return copl_select(probs, segments, budget)


# Registered lazily in ``pseudolabel.LAZY_LABELLERS`` (``make_pseudo_labeller("copl", ...)``): this module imports
# pseudolabel, so pseudolabel cannot import it at load time.

__all__ = [
    "CONF_QUANTILE",
    "ENT_QUANTILE",
    "Q",
    "CoPL",
    "copl_budget",
    "copl_counts",
    "copl_entropy",
    "copl_filter",
    "copl_select",
]

"""Pseudo-labellers for unsupervised prompt learning, reusable by any method (``promptfl --set pseudo=fpl|cpl``;
FedCoPL's CoPL is to be the third).

A pseudo-labeller maps zero-shot (or current-model) class probabilities ``probs  # [N, K]`` of client-major samples
(client ``i`` owns rows ``segments[i]:segments[i + 1]``) to a training set: the rows kept, and for each a hard
label (FPL) or a candidate set (CPL). Selection is per client -- a federated client sees only its own data.

* **FPL** (Menghini et al., "Enhancing CLIP with CLIP: Exploring Pseudolabeling for Limited-Label Prompt Tuning",
  NeurIPS 2023; its definition as ``vanillaer/CPL-ICML2024`` re-implements it): hard zero-shot labels
  ``argmax p``; per class ``c`` the ``k`` samples predicted as ``c`` with the highest ``p_c`` (all of them if
  fewer; ``N_PSEUDOSHOTS`` = 16). Ties go to the lower row.
* **CPL** (Zhang et al., "Candidate Pseudolabel Learning", ICML 2024; ``vanillaer/CPL-ICML2024``
  ``utils/clip_pseudolabels.py``): the candidate set of a sample is the intersection of
    - *intra-instance* (``detect_candidate_bycum``): classes in decreasing ``p`` until the cumulative sum first
      exceeds ``thr`` (that class included), where ``thr = quantile(max_c p, CONF_QUANTILE / 100)`` over the
      samples (``get_partialY_byAutoThr``; ``CONF_QUANTILE`` 0 means the mean of the maxima);
    - *inter-instance* (``detect_candidate_bycls_thr``): for each class, the samples whose ``p_c`` is at or above
      the class's ``REGULAR_THRESHOLD`` quantile over the samples;
  samples whose intersection is empty are dropped (``gererate_partialY``'s ``zero_row_mask``). Quantiles are taken
  over each client's own samples here (the code is centralised: over the whole set). The code then fills per-class
  pools of ``N_PSEUDOSHOTS`` samples (``InstanceSelector`` / ``PoolsAggregation``); ``cpl_select`` keeps, per class
  and client, the ``k`` candidates of that class with the highest ``p_c``, a sample staying when it is in any
  class's pool -- our reading of the pools, which the code builds with a more elaborate per-round bookkeeping.
  The loss is ``cc``: ``-log Σ_{j∈S} softmax(z)_j``.

Per-dataset CPL thresholds (``CPL_DEFAULTS``) are the UL-setting values of the notes (``../shared/reference-notes.md``
"FPL / CPL baselines").
"""

from __future__ import annotations

import math

import torch

from fedfeat.errors import FedfeatError

# (CONF_QUANTILE, REGULAR_THRESHOLD) of CPL's unsupervised setting, per dataset (reference-notes, CPL scripts)
CPL_DEFAULTS = {
    "eurosat": (75.0, 0.80),
    "flowers102": (60.0, 0.99),
    "fgvc-aircraft": (90.0, 0.97),
    "cub": (75.0, 0.99),
    "dtd": (75.0, 0.95),
    "resisc45": (90.0, 0.97),
}
N_PSEUDOSHOTS = 16


def _check(probs: torch.Tensor, segments: torch.Tensor | None) -> torch.Tensor:
    if probs.dim() != 2:
        raise FedfeatError(f"probs must be [samples, classes], got shape {tuple(probs.shape)}")
    if segments is None:
        return torch.tensor([0, probs.shape[0]], dtype=torch.int64)
    seg = torch.as_tensor(segments, dtype=torch.int64).cpu()
    if (
        seg.dim() != 1
        or len(seg) < 1
        or int(seg[0]) != 0
        or int(seg[-1]) != probs.shape[0]
        or bool((seg.diff() < 0).any())
    ):
        raise FedfeatError(
            f"segments must rise from 0 to the number of samples ({probs.shape[0]}); got {seg.tolist()[:8]}"
        )
    return seg


def _owner(seg: torch.Tensor, n: int, device) -> torch.Tensor:
    """``[n]`` client of each client-major row."""
    return torch.repeat_interleave(torch.arange(len(seg) - 1), seg.diff()).to(device)


def _topk_per_client_class(
    score: torch.Tensor, eligible: torch.Tensor, seg: torch.Tensor, k: int
) -> torch.Tensor:
    """``[N, K]`` bool: per (client, class), the ``k`` eligible rows with the highest ``score`` (ties: lower row).
    One sort over (client, class, -score, row) keys; no loop over samples."""
    N, K = score.shape
    owner = _owner(seg, N, score.device)
    r, c = eligible.nonzero(as_tuple=True)  # candidate (row, class) pairs
    if len(r) == 0:
        return torch.zeros_like(eligible)
    s = score[r, c].double()
    # order: by group (client, class) then score descending then row ascending (stable sorts, last key first)
    o = torch.argsort(r, stable=True)
    o = o[torch.argsort(-s[o], stable=True)]
    grp = owner[r] * K + c
    o = o[torch.argsort(grp[o], stable=True)]
    g = grp[o]
    start = torch.ones_like(g, dtype=torch.bool)
    start[1:] = g[1:] != g[:-1]
    first = torch.cummax(torch.where(start, torch.arange(len(g), device=g.device), 0), 0).values
    rank = torch.arange(len(g), device=g.device) - first
    keep = o[rank < k]
    out = torch.zeros_like(eligible)
    out[r[keep], c[keep]] = True
    return out


def fpl_select(
    probs: torch.Tensor, segments=None, k: int = N_PSEUDOSHOTS
) -> tuple[torch.Tensor, torch.Tensor]:
    """FPL: ``(rows, labels)`` -- the kept rows (sorted, int64) and their hard labels (argmax), the top ``k`` per
    (client, predicted class) by confidence."""
    if k < 1:
        raise FedfeatError(f"k (pseudo_k) must be >= 1, got {k}; e.g. --set pseudo_k=16")
    seg = _check(probs, segments)
    pred = probs.argmax(1)
    eligible = torch.zeros_like(probs, dtype=torch.bool)
    eligible[torch.arange(len(pred)), pred] = True
    chosen = _topk_per_client_class(probs, eligible, seg, k)
    rows = chosen.any(1).nonzero(as_tuple=True)[0]
    return rows, pred[rows]


def _quantile(x: torch.Tensor, q: float) -> torch.Tensor:
    return torch.quantile(x.double(), q, dim=0)  # torch.quantile's linear interpolation, as the code


def intra_instance(probs: torch.Tensor, thr: torch.Tensor) -> torch.Tensor:
    """``detect_candidate_bycum``: per row, the classes in decreasing ``p`` until the cumulative sum first exceeds
    the row's ``thr`` (``[N]``), that class included; the top class always."""
    sp, idx = torch.sort(probs, dim=-1, descending=True)
    cum = torch.cumsum(sp, dim=-1)
    t = thr.to(cum.dtype).unsqueeze(1)
    exceeds = cum > t
    shifted = torch.cat([torch.zeros_like(exceeds[:, :1]), exceeds[:, :-1]], dim=1)
    mask = (cum <= t) | (exceeds & ~shifted)
    mask[:, 0] = (
        True  # the code: `exceeds & first_elem_mask`, and cum <= thr covers the rest of the first column
    )
    return torch.zeros_like(mask).scatter(1, idx, mask)


def cpl_candidates(
    probs: torch.Tensor, conf_quantile: float, regular_threshold: float, segments=None
) -> torch.Tensor:
    """CPL's candidate sets ``[N, K]`` bool (module docstring); quantiles over each client's samples. A row with
    an empty set is all False (the code drops it)."""
    if not 0 <= conf_quantile <= 100:
        raise FedfeatError(
            f"conf_quantile must be in [0, 100], got {conf_quantile}; e.g. --set conf_quantile=75"
        )
    if not 0 <= regular_threshold <= 1:
        raise FedfeatError(
            f"regular_threshold must be in [0, 1], got {regular_threshold}; e.g. --set regular_threshold=0.95"
        )
    seg = _check(probs, segments)
    out = torch.zeros_like(probs, dtype=torch.bool)
    for a, b in zip(seg[:-1].tolist(), seg[1:].tolist()):  # per client: its own quantiles
        if a == b:
            continue
        p = probs[a:b]
        mx = p.max(1).values
        thr = mx.double().mean() if conf_quantile == 0 else _quantile(mx, conf_quantile / 100)
        intra = intra_instance(p, thr.expand(len(p)))
        inter = p.double() >= _quantile(p, regular_threshold).unsqueeze(0)  # [K] per-class thresholds
        out[a:b] = intra & inter
    return out


def cpl_select(
    cand: torch.Tensor, probs: torch.Tensor, segments=None, k: int = N_PSEUDOSHOTS
) -> torch.Tensor:
    """The rows kept by per-class pools: per (client, class), the ``k`` rows whose candidate set holds the class with
    the highest ``p_c``; sorted int64 rows."""
    if k < 1:
        raise FedfeatError(f"k (pseudo_k) must be >= 1, got {k}; e.g. --set pseudo_k=16")
    if cand.shape != probs.shape:
        raise FedfeatError(
            f"candidate mask {tuple(cand.shape)} and probs {tuple(probs.shape)} differ in shape"
        )
    seg = _check(probs, segments)
    return _topk_per_client_class(probs, cand, seg, k).any(1).nonzero(as_tuple=True)[0]


def cc_loss(logits: torch.Tensor, cand: torch.Tensor) -> torch.Tensor:
    """CPL's ``cc`` loss per sample: ``-log Σ_{j∈S} softmax(z)_j = logsumexp(z) - logsumexp(z[S])``, for
    ``logits  # [..., K]`` and ``cand  # [..., K]`` bool (a sample's set must not be empty)."""
    if cand.shape != logits.shape:
        raise FedfeatError(
            f"candidate mask {tuple(cand.shape)} and logits {tuple(logits.shape)} differ in shape"
        )
    masked = logits.masked_fill(~cand, -math.inf)
    return torch.logsumexp(logits, -1) - torch.logsumexp(masked, -1)


__all__ = [
    "CPL_DEFAULTS",
    "N_PSEUDOSHOTS",
    "fpl_select",
    "cpl_candidates",
    "cpl_select",
    "cc_loss",
    "intra_instance",
]

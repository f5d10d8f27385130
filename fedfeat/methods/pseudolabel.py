"""Pseudo-labellers for unsupervised prompt learning, reusable by any method (``promptfl --set pseudo=fpl|cpl``;
FedCoPL's CoPL is to be the third).

(Over ~600 lines on purpose: FPL's stream and CPL's pools share the ``Selection`` type and the segment-vectorised
statistics below; one module keeps the two readings side by side.)

A pseudo-labeller maps class probabilities ``probs  # [N, K]`` (zero-shot or current model) of client-major samples
(client ``i`` owns rows ``segments[i]:segments[i + 1]``) to a training set, a ``Selection``: the rows kept and, per
row, a candidate set ``[M, K]`` bool (FPL: the one-element set of its hard label; FPL's stream may keep a row
several times, once per class board it is in, each time with that class). Every statistic (top-k, quantile)
is taken over each client's own samples -- a federated client sees only its data; ``segments=None`` is one client,
i.e. the centralised reference. All of it is segment-vectorised: no Python loop over samples or clients (CPL's pool
filling loops over proposal rounds, each a batched sort; FPL's stream over stream positions, all clients at once).

* **FPL** (Menghini et al., "Enhancing CLIP with CLIP: Exploring Pseudolabeling for Limited-Label Prompt Tuning",
  NeurIPS 2023; ``BatsResearch/menghini-neurips23-code@b387624`` ``utils/clip_pseudolabels.py:48-109``
  ``compute_pseudo_labels``): hard zero-shot labels ``argmax p``, ``k`` = ``N_PSEUDOSHOTS`` = 16 per class
  (``methods_config/textual_fpl_config.yml``). Switch ``select`` (methods: ``fpl_select``): ``"stream"`` (default)
  is the code's per-class leaderboards fed one sample at a time (``fpl_stream``: a sample that misses its predicted
  class's full board is offered to every other class, and ``board[-1]`` is the last appended entry until the
  board is first sorted), ``"topk"`` the exact per-class top-k of the paper's wording (``fpl_topk``; what CPL's
  ``InstanceSelector`` pools give with one hard candidate per sample). The stream keeps a client's samples in their
  client-major order, which is the reference's (``fpl_stream``).
* **CPL** (Zhang et al., "Candidate Pseudolabel Learning", ICML 2024; ``vanillaer/CPL-ICML2024``
  ``utils/clip_pseudolabels.py``): candidate sets = intra-instance (cumulative-probability) ∩ inter-instance
  (class-wise quantile) selections, rows with an empty set dropped (``cpl_candidates``); then per-class pools of
  ``N_PSEUDOSHOTS`` samples filled by ``InstanceSelector`` (``cpl_select``); loss ``'cc'`` (``cc_loss``).

``Selection`` / ``PseudoLabeller`` / ``PSEUDO_LABELLERS`` are the common interface; a third labeller (CoPL) is a
frozen dataclass with a ``__call__(probs, segments) -> Selection`` and one registry entry.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Protocol

import torch

from fedfeat.errors import FedfeatError

N_PSEUDOSHOTS = 16  # FPL / CPL default samples per class (both repos' methods_config/*fpl*.yml)
EPS = 1e-7  # CPL's candidate threshold on normalised probabilities (gererate_partialY, InstanceSelector eps)

# (CONF_QUANTILE, REGULAR_THRESHOLD) of CPL's unsupervised ("ul") setting, per dataset:
# vanillaer/CPL-ICML2024 scripts/run-textPT_ALL.sh (the same in run-visualPT_ALL.sh); = reference-notes "FPL / CPL".
CPL_DEFAULTS: dict[str, tuple[float, float]] = {
    "eurosat": (75.0, 0.80),
    "flowers102": (60.0, 0.99),
    "fgvc-aircraft": (90.0, 0.97),
    "cub": (75.0, 0.99),
    "dtd": (75.0, 0.95),
    "resisc45": (90.0, 0.97),
}
# Any other dataset: the config file's own values (methods_config/textual_fpl_config_PLL.yml, PartialY_CFG:
# CONF_QUANTILE 60, REGULAR_THRESHOLD 0.9) -- the scripts override them for the six datasets above.
CPL_GENERAL = (60.0, 0.90)
PRESETS = CPL_DEFAULTS  # alias
_ALIASES = {  # normalised spellings (lowercase, alphanumerics only) -> CPL_DEFAULTS key
    "eurosat": "eurosat",
    "flowers102": "flowers102",
    "oxfordflowers": "flowers102",
    "flowers": "flowers102",
    "fgvcaircraft": "fgvc-aircraft",
    "fgvc": "fgvc-aircraft",
    "cub": "cub",
    "cub200": "cub",
    "cub2002011": "cub",
    "dtd": "dtd",
    "resisc45": "resisc45",
    "resics45": "resisc45",  # the CPL / FedCoPL scripts' spelling
}


def cpl_preset(dataset: str | None) -> tuple[float, float]:
    """``(conf_quantile, regular_threshold)`` for a dataset name in any common spelling (``"FGVCAircraft"``,
    ``"fgvc-aircraft"``, ``"RESICS45"``); ``CPL_GENERAL`` for one CPL has no value for.

    >>> cpl_preset("EuroSAT"), cpl_preset("cifar10")
    ((75.0, 0.8), (60.0, 0.9))
    """
    key = _ALIASES.get(re.sub(r"[^a-z0-9]", "", (dataset or "").lower()))
    return CPL_DEFAULTS[key] if key else CPL_GENERAL


# --------------------------------------------------------------------------------------------------- validation
def _check_probs(probs: torch.Tensor) -> None:
    if not isinstance(probs, torch.Tensor) or probs.dim() != 2 or not probs.is_floating_point():
        shape = tuple(probs.shape) if isinstance(probs, torch.Tensor) else type(probs).__name__
        raise FedfeatError(
            f"probs must be a float tensor [samples, classes], got {shape}; pass softmax(logits)"
        )
    if not bool(torch.isfinite(probs).all()):
        raise FedfeatError("probs contain NaN or inf; pass finite softmax probabilities")


def _check_segments(segments, n: int) -> torch.Tensor:
    """``[clients + 1]`` int64 offsets on the CPU; ``None`` is one client holding all ``n`` rows."""
    if segments is None:
        return torch.tensor([0, n], dtype=torch.int64)
    seg = torch.as_tensor(segments)
    if seg.is_floating_point() or seg.dtype == torch.bool:
        raise FedfeatError(f"segments must be integer offsets, got dtype {seg.dtype}; pass an int64 tensor")
    seg = seg.to(torch.int64).cpu()
    if (
        seg.dim() != 1
        or len(seg) < 2
        or int(seg[0]) != 0
        or int(seg[-1]) != n
        or bool((seg.diff() < 0).any())
    ):
        raise FedfeatError(
            f"segments must rise from 0 to the number of samples ({n}), got {seg.tolist()[:8]}; "
            "pass the clients' offsets [0, n_0, n_0 + n_1, ...]"
        )
    return seg


def _check_k(k) -> int:
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise FedfeatError(f"k (pseudo_k) must be an integer >= 1, got {k!r}; e.g. --set pseudo_k=16")
    return k


def _check_cpl(conf_quantile, regular_threshold) -> None:
    if not 0 <= conf_quantile <= 100:
        raise FedfeatError(
            f"conf_quantile must be in [0, 100], got {conf_quantile}; e.g. --set conf_quantile=75"
        )
    if not 0 <= regular_threshold <= 1:
        raise FedfeatError(
            f"regular_threshold must be in [0, 1], got {regular_threshold}; e.g. --set regular_threshold=0.95"
        )


def _owner(seg: torch.Tensor, device) -> torch.Tensor:
    """``[N]`` client of each client-major row."""
    return torch.repeat_interleave(torch.arange(len(seg) - 1), seg.diff()).to(device)


# ------------------------------------------------------------------------------------------------ segment ops
def _group_rank(keys: list[torch.Tensor], group: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Order of the items sorted by ``group`` then ``keys`` (most significant first, all ascending, stable), and
    each item's rank inside its group in that order. ``keys``/``group``: ``[M]``. Returns ``(order, rank)``."""
    o = torch.arange(len(group), device=group.device)
    for key in reversed([group, *keys]):  # stable sorts, least significant key first
        o = o[torch.argsort(key[o], stable=True)]
    g = group[o]
    start = torch.ones_like(g, dtype=torch.bool)
    start[1:] = g[1:] != g[:-1]
    pos = torch.arange(len(g), device=g.device)
    first = torch.cummax(torch.where(start, pos, 0), 0).values
    return o, pos - first


def segment_quantile(values: torch.Tensor, seg: torch.Tensor, q: float) -> torch.Tensor:
    """Per client and column, ``torch.quantile(values[a:b], q, dim=0)`` (linear interpolation, ranks computed in the
    values' dtype as torch does) for all clients at once: ``values  # [N, C]`` -> ``[clients, C]`` (NaN for a
    client with no rows). One sort per column, no loop over clients, and no ``torch.quantile`` size limit."""
    owner = _owner(seg, values.device)
    v, i = values.T.contiguous().sort(1)  # [C, N] ascending per column (rows contiguous: faster than dim 0)
    j = torch.argsort(owner[i], dim=1, stable=True)  # regroup client-major, still ascending inside a client
    v = v.gather(1, j).T  # [N, C]
    n = seg.diff().to(values.device)  # [G]
    ranks = torch.tensor(q, dtype=values.dtype, device=values.device) * (n - 1).clamp(min=0).to(values.dtype)
    lo, hi = ranks.long(), ranks.ceil().long()
    start = seg[:-1].to(values.device)
    last = (start + n - 1).clamp(min=0, max=max(len(values) - 1, 0))
    below = v[torch.minimum(start + lo, last)]  # [G, C]
    above = v[torch.minimum(start + hi, last)]
    out = torch.lerp(below, above, (ranks - lo.to(values.dtype)).unsqueeze(1))
    return out.masked_fill((n == 0).unsqueeze(1), math.nan)


def _segment_mean(x: torch.Tensor, seg: torch.Tensor) -> torch.Tensor:
    """``x  # [N]`` -> ``[clients]`` means (NaN for an empty client)."""
    s = torch.zeros(len(seg) - 1, dtype=x.dtype, device=x.device).index_add_(0, _owner(seg, x.device), x)
    return s / seg.diff().to(x.device, x.dtype)


def _topk_per_client_class(
    score: torch.Tensor, eligible: torch.Tensor, seg: torch.Tensor, k: int
) -> torch.Tensor:
    """``[N, K]`` bool: per (client, class), the ``k`` eligible rows with the highest ``score`` (ties: lower row)."""
    K = score.shape[1]
    r, c = eligible.nonzero(as_tuple=True)  # eligible (row, class) pairs
    out = torch.zeros_like(eligible)
    if len(r) == 0:
        return out
    group = _owner(seg, score.device)[r] * K + c
    o, rank = _group_rank([-score[r, c].double(), r], group)
    keep = o[rank < k]
    out[r[keep], c[keep]] = True
    return out


# ------------------------------------------------------------------------------------------------------- FPL
# fpl_select readings: the FPL code's streaming leaderboards (fpl_stream) / the exact per-class top-k (fpl_topk)
FPL_SELECT = ("stream", "topk")


def _check_select(select) -> str:
    if select not in FPL_SELECT:
        raise FedfeatError(
            f"fpl_select must be 'stream' (the FPL code's leaderboards) or 'topk' (the exact per-class top-k), "
            f"got {select!r}; e.g. --set fpl_select=topk"
        )
    return select


def fpl_topk(probs: torch.Tensor, segments=None, k: int = N_PSEUDOSHOTS) -> tuple[torch.Tensor, torch.Tensor]:
    """FPL as its paper states it (``fpl_select="topk"``): per client and class ``c``, the ``k`` rows predicted as
    ``c`` (``argmax``, ties to the lower class as torch's) with the highest ``p_c`` -- all of them if fewer; ties go
    to the lower row. Each row at most once. The same set as CPL's ``InstanceSelector`` pools fed one hard candidate
    per sample (FedCoPL's ``copl_select`` with a uniform quota), ties aside. Returns ``(rows, labels)``, int64.

    >>> p = torch.tensor([[.7, .3], [.8, .2], [.4, .6]])
    >>> fpl_topk(p, [0, 3], k=1)
    (tensor([1, 2]), tensor([0, 1]))
    """
    _check_probs(probs)
    k = _check_k(k)
    seg = _check_segments(segments, probs.shape[0])
    pred = probs.argmax(1)  # [N]
    eligible = torch.zeros_like(probs, dtype=torch.bool)
    eligible[torch.arange(len(pred), device=pred.device), pred] = True
    rows = _topk_per_client_class(probs, eligible, seg, k).any(1).nonzero(as_tuple=True)[0]
    return rows, pred[rows]


@torch.no_grad()
def fpl_stream(
    probs: torch.Tensor, segments=None, k: int = N_PSEUDOSHOTS
) -> tuple[torch.Tensor, torch.Tensor]:
    """FPL's selection as its reference code makes it (``fpl_select="stream"``, the default):
    ``BatsResearch/menghini-neurips23-code@b387624`` ``utils/clip_pseudolabels.py:48-109`` (``compute_pseudo_labels``;
    the same rule in ``methods/unsupervised_learning/textual_fpl.py:171-240``, ``assign_pseudo_labels``). Each class
    has a leaderboard of at most ``k`` (score, sample) entries, and the samples arrive one at a time, in the data
    set's order (``dataset.filepaths``, line 55), each with its ``argmax`` class ``c``:

    1. the board of ``c`` is not full: the sample joins it with score ``p_c`` (line 73-74, appended unsorted);
    2. it is full and ``board[-1].score < p_c`` (strict): the sample joins, the board is sorted by decreasing score
       and cut to ``k`` (lines 75-82). ``board[-1]`` is the *last appended* entry until the board is first sorted,
       the weakest one after;
    3. otherwise the sample is offered to **every** other class ``j`` (no ``break``, lines 83-101): it joins ``j``'s
       board with score ``p_j`` and label ``j`` by the same two rules. So a sample can sit in several boards, each
       with another label, and the boards of rarely predicted classes fill with samples predicted as something else.

    The result: one ``(row, label)`` pair per board entry -- ``rows`` sorted (a row repeated once per board it is in,
    by label), ``labels`` the boards' classes. Per client (``segments``), each client's rows streamed in their
    client-major order: the code's order is its file list (centralised: the split file's, FPL ``methods/main_UL.py:114``;
    FedCoPL's federated split shuffles each client's list once, ``krumpguo/FedCoPL`` ``methods/main_UL.py:247``, and
    pseudo-labels with ``shuffle=False``), which the partition keeps (``dirichlet-joint`` is FedCoPL's split, its
    shuffled order included).

    Ties: the code sorts (score, file path) tuples, so equal scores rank by the path (descending); a cached store has
    no paths, so here the later row ranks higher (the lower row is dropped first) -- the same when paths rise with
    the rows. Inherently sequential in the stream: vectorised over clients and classes (each client's boards are its
    own), looping over stream positions only (on the CPU: small tensor ops per position).

    >>> p = torch.tensor([[.6, .4], [.55, .45]])  # row 1 misses class 0's full board, joins class 1's
    >>> fpl_stream(p, None, k=1)
    (tensor([0, 1]), tensor([0, 1]))
    """
    _check_probs(probs)
    k = _check_k(k)
    seg = _check_segments(segments, probs.shape[0])
    dev = probs.device
    p = probs.detach().cpu()
    N, K = p.shape
    G = len(seg) - 1
    sizes, start = seg.diff(), seg[:-1]
    pred = p.argmax(1)  # [N] the code's argmax (ties to the lower class)
    by_size = torch.argsort(-sizes, stable=True)  # clients still streaming at position t: a prefix of by_size
    active = torch.searchsorted(-sizes[by_size], -torch.arange(int(sizes.max()) if G else 0), right=False)
    score = torch.zeros(G, K, k, dtype=p.dtype)  # [G, K, k] board entries' scores
    row = torch.full((G, K, k), -1, dtype=torch.int64)  # their rows
    cnt = torch.zeros(G, K, dtype=torch.int64)  # entries per board
    last = torch.zeros(G, K, dtype=p.dtype)  # board[-1].score once the board is full (the code's comparison)
    for t, A in enumerate(active.tolist()):
        g = by_size[:A]
        i = start[g] + t  # [A] the sample each streaming client offers now
        s = p[i]  # [A, K]
        c = pred[i]
        ar = torch.arange(A)
        ok = (cnt[g, c] < k) | (last[g, c] < s[ar, c])  # rules 1-2 at the predicted class
        offer = torch.zeros(A, K, dtype=torch.bool)
        offer[ar, c] = True
        offer[~ok] = ~offer[~ok]  # rule 3: every other class instead
        aa, jj = offer.nonzero(as_tuple=True)
        gg, ss, rr = g[aa], s[aa, jj], i[aa]
        n = cnt[gg, jj]
        app = n < k  # rule 1: append (unsorted)
        ga, ja = gg[app], jj[app]
        score[ga, ja, n[app]] = ss[app]
        row[ga, ja, n[app]] = rr[app]
        cnt[ga, ja] += 1
        full = app & (n == k - 1)  # the k-th entry is board[-1] until the first sort
        last[gg[full], jj[full]] = ss[full]
        rep = ~app & (last[gg, jj] < ss)  # rule 2: sorted insert, cut to k = drop the weakest entry
        if bool(rep.any()):
            gb, jb = gg[rep], jj[rep]
            bs, br = score[gb, jb], row[gb, jb]  # [R, k]
            weakest = bs == bs.min(1, keepdim=True).values
            slot = torch.where(weakest, br, N).argmin(1)  # among the lowest scores, the lowest row goes
            score[gb, jb, slot] = ss[rep]
            row[gb, jb, slot] = rr[rep]
            last[gb, jb] = score[gb, jb].min(1).values  # sorted now: board[-1] is the weakest
    keep = torch.arange(k) < cnt.unsqueeze(-1)  # [G, K, k]
    rows = row[keep]
    labels = torch.arange(K).view(1, K, 1).expand(G, K, k)[keep]
    o = torch.argsort(rows * K + labels)
    return rows[o].to(dev), labels[o].to(dev)


def fpl_select(
    probs: torch.Tensor, segments=None, k: int = N_PSEUDOSHOTS, select: str = "stream"
) -> tuple[torch.Tensor, torch.Tensor]:
    """FPL's pseudo-labels: ``(rows, labels)``, int64, ``rows`` sorted; ``select="stream"`` (default) is the FPL
    code's leaderboards (``fpl_stream``; a row may repeat, once per class board it is in), ``"topk"`` the exact
    per-class top-k of the paper's wording (``fpl_topk``; each row once). The CPL repo has no hard-label FPL: its
    ``textual_fpl`` trains on CPL candidate sets (``vanillaer/CPL-ICML2024``
    ``methods/unsupervised_learning_new/textual_PL.py:112-144``).

    >>> p = torch.tensor([[.9, .1], [.6, .4], [.7, .3], [.65, .35], [.2, .8], [.3, .7]])
    >>> fpl_select(p, k=2)  # row 3 misses class 0's board and takes class 1's second place from row 5
    (tensor([0, 2, 3, 4]), tensor([0, 0, 1, 1]))
    >>> fpl_select(p, k=2, select="topk")
    (tensor([0, 2, 4, 5]), tensor([0, 0, 1, 1]))
    """
    return (fpl_stream if _check_select(select) == "stream" else fpl_topk)(probs, segments, k)


# ------------------------------------------------------------------------------------------------------- CPL
def intra_instance(probs: torch.Tensor, thr: torch.Tensor) -> torch.Tensor:
    """``detect_candidate_bycum`` (CPL ``utils/clip_pseudolabels.py`` lines 19-57) with a per-row threshold
    ``thr  # [N]``: sort ``p`` descending, keep the classes whose cumulative sum is ``<= thr`` plus the first one
    whose cumulative sum is ``> thr``; the top class is always kept. ``[N, K]`` bool in class order."""
    sp, idx = torch.sort(probs, dim=-1, descending=True)
    cum = torch.cumsum(sp, dim=-1)  # [N, K]
    exceeds = cum > thr.to(cum.dtype).unsqueeze(1)
    shifted = torch.cat([torch.zeros_like(exceeds[:, :1]), exceeds[:, :-1]], dim=1)
    mask = ~exceeds | (
        exceeds & ~shifted
    )  # cum <= thr, or the first to exceed (column 0 always: shifted is 0)
    return torch.zeros_like(mask).scatter(1, idx, mask)


def inter_instance(probs: torch.Tensor, thr: torch.Tensor) -> torch.Tensor:
    """``detect_candidate_bycls_thr`` (lines 86-111) with per-row class thresholds ``thr  # [N, K]``: class ``c`` is a
    candidate of sample ``i`` iff ``p_ic >= thr_ic`` (the code: ``cls_output >= torch.quantile(cls_output, thr)``)."""
    return probs >= thr


def _normalised_support(mask: torch.Tensor, probs: torch.Tensor) -> torch.Tensor:
    """``get_partialY_byThr``'s ``PL = mask·p / Σ mask·p`` then ``gererate_partialY``'s ``PL > 1e-7`` (line 227):
    a member class whose share of the set's probability is ``<= 1e-7`` is dropped; an all-zero row stays empty."""
    pl = mask.to(probs.dtype) * probs
    return pl / pl.sum(1, keepdim=True) > EPS  # 0/0 = NaN compares False


def cpl_candidates(
    probs: torch.Tensor,
    conf_quantile: float,
    regular_threshold: float,
    segments=None,
    *,
    return_kept: bool = False,
):
    """CPL's candidate sets ``[N, K]`` bool, as ``gererate_partialY`` (``vanillaer/CPL-ICML2024``
    ``utils/clip_pseudolabels.py`` lines 199-242, with ``get_partialY_byAutoThr`` 245-275) computes them:

    1. intra-instance: ``thr = torch.quantile(max_c p, conf_quantile / 100)`` -- the quantile of the samples'
       *maximum* probabilities (their mean when ``conf_quantile == 0``, line 262) -- then ``intra_instance``: classes
       in decreasing ``p`` while the cumulative sum is ``<= thr``, plus the first class that takes it ``> thr``; so
       the top class is always in;
    2. inter-instance: per class ``c``, ``p_ic >= torch.quantile(p_:c, regular_threshold)`` -- the quantile of the
       class's *column* of probabilities (note ``>=``; ``regular_threshold`` is a fraction, not a percentage);
    3. each set is renormalised and classes with share ``<= 1e-7`` dropped (line 227, ``_normalised_support``),
       then intersected. The top class can fall out in the intersection, and a set can be empty: the code drops
       those rows (``~zero_row_mask``, the ``mask_idxs`` its callers index with).

    The code is centralised; here both quantiles are taken over each client's own rows (``segments``), over all rows
    when ``segments`` is None. Rows with an empty set are all False; ``return_kept=True`` returns
    ``(mask, kept  # [N] bool)`` with ``kept = mask.any(1)``, the code's ``~zero_row_mask``.

    >>> p = torch.tensor([[.6, .3, .1], [.5, .4, .1], [.2, .7, .1], [.1, .2, .7]])
    >>> cpl_candidates(p, 50, 0.5).int().tolist()
    [[1, 0, 0], [1, 1, 0], [0, 1, 0], [0, 0, 1]]
    """
    _check_probs(probs)
    _check_cpl(conf_quantile, regular_threshold)
    seg = _check_segments(segments, probs.shape[0])
    p = probs if probs.dtype in (torch.float32, torch.float64) else probs.float()  # the code: .float()
    owner = _owner(seg, p.device)
    mx = p.max(1).values.unsqueeze(1)  # [N, 1]
    if conf_quantile == 0:
        thr_client = _segment_mean(mx[:, 0], seg)  # [G]
    else:
        thr_client = segment_quantile(mx, seg, conf_quantile / 100)[:, 0]  # [G]
    intra = _normalised_support(intra_instance(p, thr_client[owner]), p)  # [N, K]
    cls_thr = segment_quantile(p, seg, regular_threshold)  # [G, K]
    inter = _normalised_support(inter_instance(p, cls_thr[owner]), p)  # [N, K]
    mask = intra & inter
    return (mask, mask.any(1)) if return_kept else mask


def cpl_pools(
    cand: torch.Tensor, probs: torch.Tensor, segments=None, k: int = N_PSEUDOSHOTS
) -> tuple[torch.Tensor, torch.Tensor]:
    """CPL's per-class pools (``InstanceSelector.select_topk_for_eachcls`` / ``_fill_pools``, CPL
    ``utils/clip_pseudolabels.py`` lines 279-483, with ``ClassPool.update`` in ``utils/utils.py`` lines 541-582), per
    client: ``(rows, pool_class)``, the sorted int64 rows that end in a pool and the class of the pool each is in.

    The code fills the pools by deferred acceptance: every sample not in a pool proposes to its next candidate
    class, in decreasing ``p_c`` (``_prepare_items_attrs``, uncertainty ``1 - p_c``); a pool of capacity ``k``
    (``N_PSEUDOSHOTS``) keeps its ``k`` most confident proposers and evicts the rest, who then propose to their next
    candidate, until every sample is in a pool or has tried its whole set. So a sample is in at most one pool and
    each pool holds at most ``k`` samples; a confident sample can push a less confident one to its second choice.
    Candidates with ``p_c < 1e-7`` are never accepted (the code's ``max_val < eps`` -> ``inf`` uncertainty). Ties:
    the code keeps the incumbent and, within a round, the lower index; here the earlier arrival then the lower row.
    The loop runs over proposal rounds (each a batched sort over all clients and classes), never over samples.
    """
    _check_probs(probs)
    k = _check_k(k)
    if cand.shape != probs.shape or cand.dtype != torch.bool:
        raise FedfeatError(
            f"candidate mask {tuple(cand.shape)} {cand.dtype} must be bool with the shape of probs "
            f"{tuple(probs.shape)}; pass cpl_candidates(probs, ...)"
        )
    seg = _check_segments(segments, probs.shape[0])
    N, K = probs.shape
    dev = probs.device
    score = probs.double().masked_fill(~(cand & (probs >= EPS)), -math.inf)  # [N, K] proposable candidates
    n_prop = torch.isfinite(score).sum(1)  # [N]
    pref = torch.argsort(-score, dim=1, stable=True)  # [N, K] classes in decreasing p_c (ties: lower class)
    group_of = _owner(seg, dev) * K  # [N] + class = pool id
    ptr = torch.zeros(
        N, dtype=torch.int64, device=dev
    )  # next preference to propose to (the code's quary_num)
    pool = torch.full((N,), -1, dtype=torch.int64, device=dev)  # class of the pool a row is in, -1 none
    arrival = torch.zeros(N, dtype=torch.int64, device=dev)
    rows_all = torch.arange(N, device=dev)
    rnd = 0
    while True:
        prop = ((pool < 0) & (ptr < n_prop)).nonzero(as_tuple=True)[0]  # [P] rows proposing this round
        if len(prop) == 0:
            break
        rnd += 1
        pool[prop] = pref[prop, ptr[prop]]
        arrival[prop] = rnd
        ptr[prop] += 1
        r = (pool >= 0).nonzero(as_tuple=True)[0]  # incumbents + proposers
        c = pool[r]
        o, rank = _group_rank([-score[r, c], arrival[r], rows_all[r]], group_of[r] + c)
        pool[r[o[rank >= k]]] = -1  # evicted or rejected: propose again next round
    rows = (pool >= 0).nonzero(as_tuple=True)[0]
    return rows, pool[rows]


def cpl_select(
    cand: torch.Tensor, probs: torch.Tensor, segments=None, k: int = N_PSEUDOSHOTS
) -> torch.Tensor:
    """CPL's selected rows (sorted int64): the union of the per-class pools of ``cpl_pools``. The code trains on
    their whole candidate sets (``PL_labels[selected_idxs] > 1e-7``, ``USE_SOFT_PARTIAL: False``), not on the pool
    class: ``cand[rows]`` is the training target."""
    return cpl_pools(cand, probs, segments, k)[0]


# ------------------------------------------------------------------------------------------------------ loss
def cc_loss(logits: torch.Tensor, cand: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
    """CPL's ``'cc'`` loss per sample (``utils/loss.py`` ``forward_cc``: ``-log(Σ softmax(x) · y)``), computed stably
    as ``logsumexp(z) - logsumexp(z[S])``: ``logits  # [..., B, K]``, ``cand  # [..., B, K]`` bool (broadcastable)
    -> ``[..., B]``. With one class in ``S`` it is the cross-entropy. ``mask  # [..., B]`` bool marks real samples:
    the others (padding) get loss 0 and no gradient, whatever their set. A real sample with an empty set gets
    ``+inf``, as ``-log 0`` in the code; CPL drops such rows before training.

    >>> cc_loss(torch.tensor([[0.0, 0.0]]), torch.tensor([[True, False]]))
    tensor([0.6931])
    """
    try:
        shape = torch.broadcast_shapes(cand.shape, logits.shape)
    except RuntimeError:
        shape = None
    if shape != logits.shape or cand.dtype != torch.bool:
        raise FedfeatError(
            f"candidate mask {tuple(cand.shape)} {cand.dtype} must be bool and match logits {tuple(logits.shape)}; "
            "pass one bool row of K classes per sample"
        )
    if mask is not None:
        if mask.shape != logits.shape[:-1]:
            raise FedfeatError(
                f"sample mask {tuple(mask.shape)} must match logits {tuple(logits.shape)} without the class dim"
            )
        cand = cand | ~mask.bool().unsqueeze(-1)  # padding: any non-empty set, so nothing is -inf - -inf
    picked = logits.masked_fill(~cand, -math.inf)
    loss = torch.logsumexp(logits, -1) - torch.logsumexp(picked, -1)
    return loss if mask is None else loss.masked_fill(~mask.bool(), 0.0)


# --------------------------------------------------------------------------------------------- common interface
@dataclass(frozen=True)
class Selection:
    """A pseudo-labelled training set: the kept rows of the input, client-major (sorted), and their targets."""

    rows: (
        torch.Tensor
    )  # [M] int64, sorted rows of probs (FPL's stream repeats a row once per class board it is in)
    offsets: torch.Tensor  # [clients + 1] int64 offsets of the kept rows
    candidates: torch.Tensor  # [M, K] bool target set per row (FPL: one-hot of the label); loss: cc_loss
    labels: torch.Tensor | None = (
        None  # [M] int64 hard labels, where the labeller has them (FPL; CPL: pool class)
    )


class PseudoLabeller(Protocol):
    name: str

    def __call__(self, probs: torch.Tensor, segments=None) -> Selection: ...


def _selection(rows: torch.Tensor, seg: torch.Tensor, cand: torch.Tensor, labels) -> Selection:
    counts = torch.bincount(_owner(seg, "cpu")[rows.cpu()], minlength=len(seg) - 1)
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), torch.cumsum(counts, 0)])
    return Selection(rows=rows, offsets=offsets, candidates=cand, labels=labels)


@dataclass(frozen=True)
class FPL:
    """FPL (``fpl_select``) as a ``PseudoLabeller``; ``FPL(k, select="stream" | "topk")``."""

    k: int = N_PSEUDOSHOTS  # N_PSEUDOSHOTS, reference code (methods_config/textual_fpl_config.yml)
    # "stream": the FPL code's leaderboards (menghini-neurips23-code utils/clip_pseudolabels.py:48-109), the default;
    # "topk": the exact per-class top-k (the paper's "top-K most confident per class"); see fpl_select
    select: str = "stream"
    name = "fpl"

    def __post_init__(self) -> None:
        _check_select(self.select)

    def __call__(self, probs: torch.Tensor, segments=None) -> Selection:
        rows, labels = fpl_select(probs, segments, self.k, self.select)
        cand = torch.zeros(len(rows), probs.shape[1], dtype=torch.bool, device=probs.device)
        cand[torch.arange(len(rows), device=probs.device), labels] = True
        return _selection(rows, _check_segments(segments, probs.shape[0]), cand, labels)


@dataclass(frozen=True)
class CPL:
    """CPL (``cpl_candidates`` then ``cpl_pools``) as a ``PseudoLabeller``; ``CPL(*cpl_preset(name))``."""

    conf_quantile: float = CPL_GENERAL[0]  # CONF_QUANTILE (alpha · 100 in the paper), reference scripts
    regular_threshold: float = CPL_GENERAL[1]  # REGULAR_THRESHOLD (beta in the paper), reference scripts
    k: int = N_PSEUDOSHOTS  # pool capacity N_PSEUDOSHOTS, reference config
    name = "cpl"

    def __call__(self, probs: torch.Tensor, segments=None) -> Selection:
        cand = cpl_candidates(probs, self.conf_quantile, self.regular_threshold, segments)
        rows, pool = cpl_pools(cand, probs, segments, self.k)
        return _selection(rows, _check_segments(segments, probs.shape[0]), cand[rows], pool)


PSEUDO_LABELLERS: dict[str, type] = {"fpl": FPL, "cpl": CPL}
LAZY_LABELLERS = {
    "copl": ("fedfeat.methods.copl", "CoPL")
}  # imported on first use: fedfeat.methods.copl imports this module


def make_pseudo_labeller(name: str, **params) -> PseudoLabeller:
    """``make_pseudo_labeller("cpl", conf_quantile=75, regular_threshold=0.95, k=16)``; ``"copl"`` gives
    ``fedfeat.methods.copl.CoPL(**params)`` (FedCoPL's cooperative pseudo-labels)."""
    if name in LAZY_LABELLERS and name not in PSEUDO_LABELLERS:
        import importlib

        mod, attr = LAZY_LABELLERS[name]
        PSEUDO_LABELLERS[name] = getattr(importlib.import_module(mod), attr)
    if name not in PSEUDO_LABELLERS:
        known = sorted({*PSEUDO_LABELLERS, *LAZY_LABELLERS})
        raise FedfeatError(f"unknown pseudo-labeller {name!r}; known: {', '.join(known)}")
    return PSEUDO_LABELLERS[name](**params)


__all__ = [
    "CPL",
    "CPL_DEFAULTS",
    "CPL_GENERAL",
    "FPL",
    "FPL_SELECT",
    "N_PSEUDOSHOTS",
    "PRESETS",
    "PSEUDO_LABELLERS",
    "PseudoLabeller",
    "Selection",
    "cc_loss",
    "cpl_candidates",
    "cpl_pools",
    "cpl_preset",
    "cpl_select",
    "fpl_select",
    "fpl_stream",
    "fpl_topk",
    "inter_instance",
    "intra_instance",
    "make_pseudo_labeller",
    "segment_quantile",
]

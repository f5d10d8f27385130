"""Pseudo-labellers (``fedfeat.methods.pseudolabel``) on hand examples: FPL's per-client top-k, CPL's candidate sets (the
intra-instance cumulative rule, the inter-instance class quantiles, the 1e-7 share rule, their intersection), CPL's
pools (deferred acceptance, checked against a line-by-line port of the reference code) and the ``cc`` loss."""

from __future__ import annotations

import math

import pytest
import torch

from fedfeat.errors import FedfeatError
from fedfeat.methods import pseudolabel as pl

T, F = True, False

# 3 classes, 2 clients with different data (client 0: rows 0-4, client 1: rows 5-7)
P = torch.tensor(
    [
        [0.7, 0.2, 0.1],  # client 0: row 0 -> class 0 (0.7)
        [0.6, 0.3, 0.1],  # row 1 -> 0 (0.6)
        [0.8, 0.1, 0.1],  # row 2 -> 0 (0.8)
        [0.2, 0.5, 0.3],  # row 3 -> 1 (0.5)
        [0.1, 0.1, 0.8],  # row 4 -> 2 (0.8)
        [0.9, 0.05, 0.05],  # client 1: row 5 -> 0 (0.9)
        [0.3, 0.4, 0.3],  # row 6 -> 1 (0.4)
        [0.3, 0.6, 0.1],  # row 7 -> 1 (0.6)
    ],
    dtype=torch.float64,
)
SEG = torch.tensor([0, 5, 8])


def test_fpl_keeps_the_top_k_per_client_and_predicted_class():
    """k = 2. Client 0: class 0 -> rows 2, 0 (0.8, 0.7; row 1's 0.6 is third), class 1 -> row 3, class 2 -> row 4.
    Client 1: class 0 -> row 5, class 1 -> rows 7, 6."""
    rows, y = pl.fpl_select(P, SEG, k=2)
    assert rows.dtype == torch.int64 and y.dtype == torch.int64
    assert rows.tolist() == [0, 2, 3, 4, 5, 6, 7]
    assert y.tolist() == [0, 0, 1, 2, 0, 1, 1]


def test_fpl_per_client_differs_from_global():
    """One pool for everyone: class 0 -> rows 5, 2 (0.9, 0.8); class 1 -> rows 7, 3 (0.6, 0.5); class 2 -> row 4.
    Rows 0 and 6, kept per client, lose to the other client's samples."""
    rows_g, y_g = pl.fpl_select(P, None, k=2)
    assert rows_g.tolist() == [2, 3, 4, 5, 7] and y_g.tolist() == [0, 1, 2, 0, 1]
    assert rows_g.tolist() != pl.fpl_select(P, SEG, k=2)[0].tolist()


def test_fpl_ties_go_to_the_lower_row():
    """k = 1, rows 0 and 1 both 0.7 for class 0 -> row 0; row 2 now predicts class 2 at 0.7 and loses to row 4's
    0.8. A large k keeps every row."""
    tie = P.clone()
    tie[1] = torch.tensor([0.7, 0.2, 0.1], dtype=torch.float64)
    tie[2] = torch.tensor([0.1, 0.2, 0.7], dtype=torch.float64)
    assert pl.fpl_select(tie, SEG, k=1)[0].tolist() == [0, 3, 4, 5, 7]
    assert pl.fpl_select(tie, SEG, k=100)[0].tolist() == list(range(8))


C = torch.tensor([[0.6, 0.3, 0.1], [0.5, 0.4, 0.1], [0.2, 0.7, 0.1], [0.1, 0.2, 0.7]], dtype=torch.float64)


def test_cpl_intra_instance_keeps_classes_up_to_the_first_that_exceeds():
    """thr 0.65: a 0.6 <= thr, then 0.9 > thr is the first to exceed (kept) -> {0, 1}; b 0.5, 0.9 -> {0, 1};
    c 0.7 > thr at once -> {1} (the top class is always in); d -> {2}."""
    intra = pl.intra_instance(C, torch.full((4,), 0.65, dtype=torch.float64))
    assert intra.tolist() == [[T, T, F], [T, T, F], [F, T, F], [F, F, T]]


def test_cpl_candidate_sets_by_hand():
    """conf 50, regular 0.5, one client. thr = median of the maxima (0.5, 0.6, 0.7, 0.7) = 0.6 + 0.5 (0.7 - 0.6)
    = 0.65 -> intra a {0, 1}, b {0, 1}, c {1}, d {2}. Inter, the median of each column: class 0 (.1 .2 .5 .6) 0.35
    -> a, b; class 1 (.2 .3 .4 .7) 0.35 -> b, c; class 2 (.1 .1 .1 .7) 0.1 -> all (>=). Intersection below."""
    got, kept = pl.cpl_candidates(C, 50, 0.5, return_kept=True)
    assert got.tolist() == [[T, F, F], [T, T, F], [F, T, F], [F, F, T]]
    assert kept.tolist() == [T, T, T, T]
    assert torch.equal(pl.cpl_candidates(C, 50, 0.5), got)


def test_cpl_empty_sets_are_reported_as_dropped():
    """regular 0.99: class 0's quantile 0.5 + 0.97 * 0.1 = 0.597 -> a; class 1 0.4 + 0.97 * 0.3 = 0.691 -> c;
    class 2 0.1 + 0.97 * 0.6 = 0.682 -> d. b's intersection {0, 1} ∩ {} is empty: the code drops row b."""
    got, kept = pl.cpl_candidates(C, 50, 0.99, return_kept=True)
    assert got.tolist() == [[T, F, F], [F, F, F], [F, T, F], [F, F, T]]
    assert kept.tolist() == [T, F, T, T]


def test_cpl_quantiles_are_per_client():
    """Clients {a, b} and {c, d}. Client 0: thr = median(0.6, 0.5) = 0.55 -> intra a {0}, b {0, 1}; column medians
    0.55, 0.35, 0.1 -> inter a {0, 2}, b {1, 2} -> a {0}, b {1}. Client 1: thr = 0.7 -> c: 0.7 <= 0.7, then 0.9
    -> {0, 1}; d {2, 1}; column medians 0.15, 0.45, 0.4 -> inter c {0, 1}, d {2} -> c {0, 1}, d {2}."""
    per = pl.cpl_candidates(C, 50, 0.5, torch.tensor([0, 2, 4]))
    assert per.tolist() == [[T, F, F], [F, T, F], [T, T, F], [F, F, T]]
    assert per.tolist() != pl.cpl_candidates(C, 50, 0.5).tolist()


def test_cpl_conf_quantile_zero_is_the_mean_and_tiny_shares_drop_out():
    """conf 0 is the mean of the maxima (0.625), not their minimum (0.5): a keeps {0, 1} (0.6 <= 0.625), where the
    minimum would give {0}. regular 0 keeps every class (>= the column minimum).
    The share rule: with thr 1.0 (conf 100 over maxima 0.6, 1.0) row 0's intra set is all three classes, but class 2
    holds 1e-8 of its mass (<= 1e-7) and drops out; row 1 keeps only its class with non-zero probability."""
    assert pl.cpl_candidates(C, 0, 0.0)[0].tolist() == [T, T, F]
    tiny = torch.tensor([[0.6, 0.4 - 1e-8, 1e-8], [0.0, 0.0, 1.0]], dtype=torch.float64)
    assert pl.cpl_candidates(tiny, 100, 0.0).tolist() == [[T, T, F], [F, F, T]]


def test_segment_quantile_equals_torch_quantile_per_client():
    g = torch.Generator().manual_seed(0)
    for dtype in (torch.float32, torch.float64):
        x = torch.rand(23, 4, generator=g, dtype=dtype)
        seg = torch.tensor([0, 7, 7, 8, 23])  # an empty client and a one-row client
        for q in (0.0, 0.3, 0.5, 0.97, 1.0):
            got = pl.segment_quantile(x, seg, q)
            for i in (0, 2, 3):
                want = torch.quantile(x[seg[i] : seg[i + 1]], q, dim=0)
                torch.testing.assert_close(got[i], want, rtol=0, atol=0)
            assert torch.isnan(got[1]).all()


# CPL pools, k = 1. Client 0 (rows 0, 1): row 0 {0, 1} proposes to 0, row 1 {1} to 1 -> both kept (a "top-1 per
# class, union" reading would put row 0 in both pools and drop row 1). Client 1 (rows 2-4): round 1 row 2 -> 0
# (0.5), row 3 -> 1 (0.3), row 4 -> 0 (0.6): pool 0 keeps row 4; round 2 row 2 -> 1 (0.4) evicts row 3 (0.3), whose
# set is spent -> rows 2 (pool 1) and 4 (pool 0).
PP = torch.tensor(
    [[0.5, 0.4, 0.1], [0.2, 0.3, 0.5], [0.5, 0.4, 0.1], [0.2, 0.3, 0.5], [0.6, 0.3, 0.1]], dtype=torch.float64
)
CC = torch.tensor([[T, T, F], [F, T, F], [T, T, F], [F, T, F], [T, F, F]])


def test_cpl_pools_by_hand():
    rows, pool = pl.cpl_pools(CC, PP, torch.tensor([0, 2, 5]), k=1)
    assert rows.tolist() == [0, 1, 2, 4] and pool.tolist() == [0, 1, 1, 0]
    assert pl.cpl_select(CC, PP, torch.tensor([0, 2, 5]), k=1).tolist() == [0, 1, 2, 4]
    # one client: pool 0 keeps row 4; pool 1: rows 1, 3 tie at 0.3 -> row 1, then rows 0, 2 (0.4, tie -> row 0)
    # evict it -> rows 0 (pool 1) and 4 (pool 0)
    rows_g, pool_g = pl.cpl_pools(CC, PP, None, k=1)
    assert rows_g.tolist() == [0, 4] and pool_g.tolist() == [1, 0]
    # k = 2: no competition left for pool 1's two seats in client 1 -> everyone with a candidate fits
    assert pl.cpl_select(CC, PP, torch.tensor([0, 2, 5]), k=2).tolist() == [0, 1, 2, 3, 4]
    # a candidate with p < 1e-7 is never accepted: row 0 loses pool 0 to row 1 and cannot go to pool 1
    tiny = torch.tensor([[1 - 1e-9, 1e-9, 0.0], [1.0, 0.0, 0.0]], dtype=torch.float64)
    assert pl.cpl_select(torch.tensor([[T, T, F], [T, F, F]]), tiny, None, k=1).tolist() == [1]


def _reference_fill_pools(cand: torch.Tensor, probs: torch.Tensor, k: int) -> list[int]:
    """A line-by-line port of CPL's ``InstanceSelector._fill_pools`` / ``ClassPool.update`` (one client)."""
    n = len(probs)
    prefs = []
    for i in range(n):  # _prepare_items_attrs: candidates by decreasing conf; conf < eps -> uncertainty inf
        conf = (probs[i] * cand[i]).tolist()
        order = sorted(range(len(conf)), key=lambda c: -conf[c])[: int(cand[i].sum())]
        prefs.append([(c, 1 - conf[c] if conf[c] >= pl.EPS else math.inf) for c in order])
    pools: dict[int, list[tuple[int, float]]] = {}
    quary = [0] * n
    in_pool: set[int] = set()
    while True:
        loop = [i for i in range(n) if i not in in_pool and quary[i] < len(prefs[i])]
        if not loop:
            break
        props = [(prefs[i][quary[i]], i) for i in loop]
        for i in loop:
            quary[i] += 1
        for c in sorted({p[0][0] for p in props}):  # batch_fill_assigned_pool: pool by pool, rows ascending
            pool = pools.setdefault(c, [])
            for (_, unc), i in [p for p in props if p[0][0] == c]:
                if len(pool) < k:
                    if unc < 1e4:
                        pool.append((i, unc))
                else:
                    j = max(range(len(pool)), key=lambda t: pool[t][1])
                    if pool[j][1] > unc:
                        pool[j] = (i, unc)
        in_pool = {i for pool in pools.values() for i, _ in pool}
    return sorted(in_pool)


def _union_of_top_k(cand: torch.Tensor, probs: torch.Tensor, k: int) -> list[int]:
    """The naive reading: per class the k candidates with the highest p_c, a row kept if in any (one client)."""
    score = probs.masked_fill(~cand, -1.0)
    top = score.topk(min(k, len(probs)), dim=0).indices  # [k, K]
    ok = score.gather(0, top) >= 0
    return sorted(set(top[ok].tolist()))


def test_cpl_pools_match_the_reference_code_on_random_data():
    """Small, ambiguous draws (sets of 2-3 classes, pools of 3 that fill up), so that samples compete for seats; the
    trials where deferred acceptance differs from the naive union of per-class top-k are counted and must occur."""
    g = torch.Generator().manual_seed(1)
    differs = 0
    for _ in range(8):
        probs = torch.softmax(0.7 * torch.randn(30, 6, generator=g, dtype=torch.float64), -1)
        cand = pl.cpl_candidates(probs, 95, 0.2)
        want = _reference_fill_pools(cand, probs, k=3)
        assert pl.cpl_select(cand, probs, None, k=3).tolist() == want
        differs += want != _union_of_top_k(cand, probs, 3)
        seg = torch.tensor([0, 12, 30])  # per client = the reference on each client's rows
        cand_c = pl.cpl_candidates(probs, 90, 0.3, seg)
        want_c = _reference_fill_pools(cand_c[:12], probs[:12], 3) + [
            12 + i for i in _reference_fill_pools(cand_c[12:], probs[12:], 3)
        ]
        assert pl.cpl_select(cand_c, probs, seg, k=3).tolist() == want_c
    assert differs >= 3


def test_labellers_share_one_interface():
    sel = pl.make_pseudo_labeller("fpl", k=2)(P, SEG)
    assert sel.rows.tolist() == [0, 2, 3, 4, 5, 6, 7] and sel.offsets.tolist() == [0, 4, 7]
    assert (
        sel.candidates.sum(1).tolist() == [1] * 7
        and sel.candidates.long().argmax(1).tolist() == sel.labels.tolist()
    )
    cpl = pl.make_pseudo_labeller("cpl", conf_quantile=50, regular_threshold=0.5, k=16)(C, None)
    assert cpl.rows.tolist() == [0, 1, 2, 3] and torch.equal(cpl.candidates, pl.cpl_candidates(C, 50, 0.5))
    assert pl.cpl_preset("FGVCAircraft") == (90.0, 0.97) and pl.cpl_preset("RESICS45") == (90.0, 0.97)
    assert pl.cpl_preset("EuroSAT") == (75.0, 0.80) and pl.cpl_preset("oxford_flowers") == (60.0, 0.99)
    assert pl.cpl_preset("cifar10") == pl.CPL_GENERAL == (60.0, 0.90)
    with pytest.raises(FedfeatError, match="unknown pseudo-labeller 'xpl'; known: copl, cpl, fpl"):
        pl.make_pseudo_labeller("xpl")
    from fedfeat.methods.copl import CoPL

    copl = pl.make_pseudo_labeller("copl", round_index=0)  # the third labeller, same interface
    assert isinstance(copl, CoPL) and torch.equal(copl(P, SEG).rows, CoPL(round_index=0)(P, SEG).rows)


def test_cc_loss_by_hand():
    """z = (0, 1, 2): p = e^z / (1 + e + e^2); S = {0, 1} -> -log(p0 + p1) = log(1 + e + e^2) - log(1 + e)."""
    z = torch.tensor([[0.0, 1.0, 2.0]], dtype=torch.float64)
    got = pl.cc_loss(z, torch.tensor([[T, T, F]]))
    e = math.e
    assert float(got) == pytest.approx(math.log(1 + e + e * e) - math.log(1 + e), rel=1e-12)
    one = pl.cc_loss(z, torch.tensor([[F, F, T]]))  # one class: cross-entropy
    assert float(one) == pytest.approx(
        float(torch.nn.functional.cross_entropy(z, torch.tensor([2]))), rel=1e-12
    )
    assert float(pl.cc_loss(z, torch.tensor([[T, T, T]]))) == 0.0


def test_cc_loss_is_finite_with_huge_logits_and_batched():
    big = torch.tensor([[1000.0, -1000.0, 0.0]], requires_grad=True)
    loss = pl.cc_loss(big, torch.tensor([[F, T, T]]))
    assert float(loss.detach()) == pytest.approx(1000.0) and torch.isfinite(loss).all()  # -log(e^0 / e^1000)
    loss.sum().backward()
    assert torch.isfinite(big.grad).all()
    z = torch.randn(2, 3, 4, generator=torch.Generator().manual_seed(0))
    cand = torch.tensor([T, F, T, F])  # one set for every sample: broadcast
    out = pl.cc_loss(z, cand)
    assert out.shape == (2, 3)
    want = -torch.log(torch.softmax(z, -1)[..., [0, 2]].sum(-1))
    torch.testing.assert_close(out, want)


def test_cc_loss_mask_zeroes_padding_even_with_empty_sets():
    z = torch.tensor([[[0.0, 1.0, 2.0], [5.0, 5.0, 5.0]]], requires_grad=True)  # [1, 2, 3]
    cand = torch.tensor([[[T, F, F], [F, F, F]]])  # the padding row has an empty set
    out = pl.cc_loss(z, cand, mask=torch.tensor([[T, F]]))
    assert out[0, 1] == 0 and torch.isfinite(out).all()
    out.sum().backward()
    assert torch.isfinite(z.grad).all() and (z.grad[0, 1] == 0).all()


def test_bad_inputs_are_one_line_errors():
    cases = [
        (lambda: pl.fpl_select(P, SEG, k=0), r"k \(pseudo_k\) must be an integer >= 1"),
        (lambda: pl.cpl_select(CC, PP, None, k=0), r"k \(pseudo_k\) must be an integer >= 1"),
        (lambda: pl.cpl_candidates(C, 150, 0.5), r"conf_quantile must be in \[0, 100\], got 150"),
        (lambda: pl.cpl_candidates(C, -1, 0.5), r"conf_quantile must be in \[0, 100\]"),
        (lambda: pl.cpl_candidates(C, 50, 1.5), r"regular_threshold must be in \[0, 1\], got 1.5"),
        (
            lambda: pl.fpl_select(P, torch.tensor([0, 3]), k=1),
            "segments must rise from 0 to the number of samples",
        ),
        (lambda: pl.fpl_select(P, torch.tensor([0, 6, 5, 8]), k=1), "segments must rise"),
        (lambda: pl.fpl_select(P[0], None), r"probs must be a float tensor \[samples, classes\]"),
        (lambda: pl.fpl_select(torch.full((2, 3), math.nan), None), "NaN or inf"),
        (lambda: pl.cpl_select(CC[:, :2], PP, None), "must be bool with the shape of probs"),
        (
            lambda: pl.cc_loss(torch.zeros(2, 3), torch.ones(2, 4, dtype=torch.bool)),
            "must be bool and match logits",
        ),
        (lambda: pl.cc_loss(torch.zeros(2, 3), torch.ones(2, 3)), "must be bool"),
        (
            lambda: pl.cc_loss(torch.zeros(2, 3), torch.ones(2, 3, dtype=torch.bool), torch.ones(3).bool()),
            "mask",
        ),
    ]
    for call, msg in cases:
        with pytest.raises(FedfeatError, match=msg) as e:
            call()
        assert "\n" not in str(e.value)

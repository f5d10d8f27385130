"""FedCoPL's cooperative pseudo-labelling (``fedfeat.methods.copl``) on a hand example: 3 clients, 3 classes, 14 samples.
The median filters (with ties at the median, to show the strict inequalities), the uploaded counts, the server's
budget (``M``, the proportional quotas, the fallback for a class nobody kept), the per-client selection, ``CoPL``
end to end, a line-by-line loop port of the reference code on random data, and bad inputs."""

from __future__ import annotations

import math

import pytest
import torch

from fedfeat.errors import FedfeatError
from fedfeat.methods import copl
from fedfeat.methods.pseudolabel import Selection

# entropies (nats) in the comments: -Σ p ln p
P = torch.tensor(
    [
        # client 0, rows 0-4.  max p sorted .40 .50 .70 .75 .95 -> median .70 (row 2)
        #                      entropy sorted .232 .655 .731 .943 1.081 -> median .731 (row 1)
        [0.95, 0.03, 0.02],  # 0: class 0, max .95 > .70, H .232 < .731 -> kept
        [0.10, 0.75, 0.15],  # 1: class 1, max .75 > .70, H .731 = median -> dropped (strict <)
        [0.70, 0.29, 0.01],  # 2: class 0, max .70 = median -> dropped (strict >), H .655 < .731
        [0.40, 0.35, 0.25],  # 3: class 0, max .40, H 1.081 -> dropped
        [0.50, 0.10, 0.40],  # 4: class 0, max .50, H .943 -> dropped
        # client 1, rows 5-9.  max p sorted .40 .60 .75 .85 .90 -> median .75 (row 9)
        #                      entropy sorted .394 .518 .731 .950 1.089 -> median .731 (row 9)
        [0.05, 0.90, 0.05],  # 5: class 1, max .90, H .394 -> kept
        [0.85, 0.10, 0.05],  # 6: class 0, max .85, H .518 -> kept
        [0.20, 0.20, 0.60],  # 7: class 2, max .60, H .950 -> dropped
        [0.30, 0.30, 0.40],  # 8: class 2, max .40, H 1.089 -> dropped
        [0.10, 0.15, 0.75],  # 9: class 2, max .75 = median, H .731 = median -> dropped
        # client 2, rows 10-13 (even: the medians interpolate).
        #   max p sorted .34 .60 .70 .80 -> median (.60 + .70) / 2 = .65
        #   entropy sorted .639 .746 .898 1.099 -> median (.746 + .898) / 2 = .822
        [0.80, 0.10, 0.10],  # 10: class 0, max .80, H .639 -> kept
        [0.10, 0.60, 0.30],  # 11: class 1, max .60 < .65 -> dropped
        [0.70, 0.05, 0.25],  # 12: class 0, max .70, H .746 -> kept
        [0.33, 0.33, 0.34],  # 13: class 2, max .34, H 1.099 -> dropped
    ]
)
SEG = torch.tensor([0, 5, 10, 14])
KEEP = [0, 5, 6, 10, 12]
# kept argmax: client 0 -> {0}, client 1 -> {1, 0}, client 2 -> {0, 0}; class 2 is kept by nobody
N_COUNTS = [[1, 0, 0], [1, 1, 0], [2, 0, 0]]
# N_c = [4, 1, 0], Σ = 5, C = 3 -> M = ceil(5 / 3) = 2
# class 0: ceil(1/4 · 2) = ceil(.5) = 1, ceil(1/4 · 2) = 1, ceil(2/4 · 2) = 1
# class 1: client 1 ceil(1/1 · 2) = 2; clients 0 and 2 have n = 0 -> 0
# class 2 (N_c = 0): ceil(14 / 3 / 4 · (0 + 1) / 3) = ceil(0.389) = 1 for everyone
BUDGET = [[1, 0, 1], [1, 2, 1], [1, 0, 1]]


def test_entropy_is_in_nats():
    """The code's ``-(softmax · log_softmax).sum(1)``: natural log, so uniform over 3 classes is ln 3; a one-hot
    row (with exact zeros) is 0, not NaN."""
    h = copl.copl_entropy(torch.tensor([[1 / 3, 1 / 3, 1 / 3], [1.0, 0.0, 0.0]], dtype=torch.float64))
    assert h[0].item() == pytest.approx(math.log(3), abs=1e-12)
    assert h[1].item() == 0.0


def test_filter_keeps_above_median_confidence_and_below_median_entropy():
    """See the comments at ``P``: rows 0, 5, 6, 10, 12. Row 1 passes confidence but sits exactly at the entropy
    median, row 2 has a low entropy but sits exactly at the confidence median: both dropped (strict)."""
    keep = copl.copl_filter(P, SEG)
    assert keep.dtype == torch.bool and keep.shape == (14,)
    assert keep.nonzero().flatten().tolist() == KEEP


def test_filter_thresholds_are_per_client():
    """One client holding all 14 rows: the max-p median is (.70 + .70)/2 = .70 (7th and 8th of 14: rows 2, 12) and
    the entropy median (.731 + .746)/2 = .738. Rows 1 and 9 (max .75, H .731), dropped per client, now pass; row 12
    (max .70) now fails -> rows 0, 1, 5, 6, 9, 10, not the per-client rows."""
    assert copl.copl_filter(P).nonzero().flatten().tolist() == [0, 1, 5, 6, 9, 10]
    assert copl.copl_filter(P, [0, 14]).tolist() == copl.copl_filter(P).tolist()


def test_filter_quantile_levels():
    """conf_quantile = 0 -> the threshold is each client's minimum max-p (strictly above it); ent_quantile = 0 ->
    the entropy threshold is each client's maximum (strictly below it). Client 0: drop row 3 (min max p, also max
    entropy); client 1: drop row 8 (both); client 2: drop row 13 (both)."""
    keep = copl.copl_filter(P, SEG, conf_quantile=0, ent_quantile=0)
    assert keep.nonzero().flatten().tolist() == [0, 1, 2, 4, 5, 6, 7, 9, 10, 11, 12]


def test_counts():
    keep = copl.copl_filter(P, SEG)
    n = copl.copl_counts(P, keep, SEG)
    assert n.dtype == torch.int64 and n.tolist() == N_COUNTS


def test_counts_with_feature_sums():
    """Feature of row i = [i, 1]: client 0 class 0 sums row 0 -> [0, 1]; client 1 class 0 row 6 -> [6, 1], class 1
    row 5 -> [5, 1]; client 2 class 0 rows 10 + 12 -> [22, 2]; everything else 0."""
    feats = torch.stack([torch.arange(14.0), torch.ones(14)], 1)
    n, sums = copl.copl_counts(P, copl.copl_filter(P, SEG), SEG, features=feats)
    assert n.tolist() == N_COUNTS
    expect = torch.zeros(3, 3, 2)
    expect[0, 0] = torch.tensor([0.0, 1.0])
    expect[1, 0] = torch.tensor([6.0, 1.0])
    expect[1, 1] = torch.tensor([5.0, 1.0])
    expect[2, 0] = torch.tensor([22.0, 2.0])
    assert torch.equal(sums, expect)


def test_budget_hand_example():
    b = copl.copl_budget(torch.tensor(N_COUNTS), 14, 0, 3)
    assert b.dtype == torch.int64 and b.tolist() == BUDGET


def test_budget_proportional_quotas_and_fallback():
    """n = [[3, 0, 0], [1, 2, 0], [0, 5, 0]]: N_c = [4, 7, 0], Σ = 11, M = ceil(11/3) = 4.
    class 0: ceil(3·4/4) = 3, ceil(1·4/4) = 1, 0; class 1: 0, ceil(2·4/7) = ceil(1.14) = 2, ceil(5·4/7) = ceil(2.86)
    = 3; class 2 (nobody kept it): ceil(100 / 3 / 4 · (2 + 1) / 3) = ceil(8.33) = 9. With round_index 0 the
    fallback is ceil(100/36) = 3; with 5 clients declared, ceil(300/60) = 5 exactly (no rounding up)."""
    n = torch.tensor([[3, 0, 0], [1, 2, 0], [0, 5, 0]])
    assert copl.copl_budget(n, 100, 2, 3).tolist() == [[3, 0, 9], [1, 2, 9], [0, 3, 9]]
    assert copl.copl_budget(n, 100, 0, 3)[:, 2].tolist() == [3, 3, 3]
    assert copl.copl_budget(n, 100, 2, 5)[:, 2].tolist() == [5, 5, 5]
    assert copl.copl_budget(n, 100, 2).tolist() == copl.copl_budget(n, 100, 2, 3).tolist()  # n_clients = rows


def test_select_hand_example():
    """Over all samples. Client 0: class 0 (rows 0 .95, 2 .70, 4 .50, 3 .40) quota 1 -> row 0; class 1 (row 1)
    quota 0 -> none, though predicted. Client 1: class 0 -> row 6; class 1 quota 2 but only row 5 -> row 5; class 2
    (rows 9 .75, 7 .60, 8 .40) quota 1 -> row 9, which the filter had dropped. Client 2: class 0 (10 .80, 12 .70)
    -> row 10; class 1 quota 0; class 2 -> row 13."""
    s = copl.copl_select(P, SEG, torch.tensor(BUDGET))
    assert isinstance(s, Selection)
    assert s.rows.tolist() == [0, 5, 6, 9, 10, 13]
    assert s.offsets.tolist() == [0, 1, 4, 6]
    assert s.labels.tolist() == [0, 1, 0, 2, 0, 2]
    assert s.candidates.dtype == torch.bool
    assert s.candidates.int().tolist() == [[1, 0, 0], [0, 1, 0], [1, 0, 0], [0, 0, 1], [1, 0, 0], [0, 0, 1]]


def test_select_ranks_by_confidence_not_row_and_ties_go_to_the_lower_row():
    """Quota 2 everywhere. Client 0 class 0: rows 0 (.95), 2 (.70) over 4 (.50) and 3 (.40); class 1: row 1.
    Client 1: 6; 5; class 2 rows 9 (.75), 7 (.60). Client 2: 10, 12; 11; 13.
    Then a tie: rows 2 and 4 of client 0 both at .70 for class 0 with quota 2 -> rows 0 and 2 (lower row)."""
    two = torch.full((3, 3), 2)
    assert copl.copl_select(P, SEG, two).rows.tolist() == [0, 1, 2, 5, 6, 7, 9, 10, 11, 12, 13]
    tie = P.clone()
    tie[4] = torch.tensor([0.70, 0.29, 0.01])
    assert copl.copl_select(tie, SEG, two).rows.tolist() == [0, 1, 2, 5, 6, 7, 9, 10, 11, 12, 13]  # not row 4


def test_copl_end_to_end_equals_the_chain():
    keep = copl.copl_filter(P, SEG)
    budget = copl.copl_budget(copl.copl_counts(P, keep, SEG), 14, 0, 3)
    chained = copl.copl_select(P, SEG, budget)
    s = copl.CoPL()(P, SEG)
    for a, b in ((s.rows, chained.rows), (s.offsets, chained.offsets), (s.candidates, chained.candidates)):
        assert torch.equal(a, b)
    assert torch.equal(s.labels, chained.labels)
    assert s.rows.tolist() == [0, 5, 6, 9, 10, 13]
    # a later refresh with the full train size: class 2's fallback ceil(100 / 3 / 4 · 3 / 3) = 9 -> all class-2 rows
    late = copl.CoPL(round_index=2, n_total_train=100)(P, SEG)
    assert late.rows.tolist() == [0, 5, 6, 7, 8, 9, 10, 13]
    assert copl.CoPL.name == "copl"


# ------------------------------------------------------------------------------------------ reference port
def _reference(probs, seg, n_total, iter_num):
    """A line-by-line loop port of the code: fedcopl.py:417-437 per client, main_UL.py:461-490 on the server (in
    float32, as the code), then per client the pools of clip_pseudolabels.py / utils.py ClassPool.update
    (streaming, replace the worst when strictly better)."""
    G, K = len(seg) - 1, probs.shape[1]
    dists = []
    for g in range(G):
        p = probs[seg[g] : seg[g + 1]]
        ent = -(p * p.log()).sum(1)
        conf_thr = torch.quantile(p.max(1).values, 0.5).item()
        ent_thr = torch.quantile(ent, 1 - 0.5).item()
        mv, mi = p.max(1)
        idx = torch.nonzero((mv > conf_thr) & (ent < ent_thr)).flatten()
        d = torch.zeros(K)
        for i in idx.tolist():
            d[mi[i]] += 1
        dists.append(d)
    total = torch.stack(dists).sum(0)
    mask = total != 0
    m = torch.ceil(total.sum() / len(total))
    rows = []
    for g in range(G):
        quota = torch.ceil(
            torch.where(mask, dists[g] / total * m, n_total / K / 4 * (iter_num + 1) / G)
        ).int()
        p = probs[seg[g] : seg[g + 1]]
        pred = p.argmax(1)
        unc = 1 - p.max(1).values
        for c in range(K):
            pool_i, pool_u = [], []
            for i in range(len(p)):
                if pred[i] != c:
                    continue
                if len(pool_i) < quota[c]:
                    pool_i.append(i)
                    pool_u.append(unc[i].item())
                elif pool_i and max(pool_u) > unc[i].item():
                    j = pool_u.index(max(pool_u))
                    pool_i[j], pool_u[j] = i, unc[i].item()
            rows += [int(seg[g]) + i for i in pool_i]
    return sorted(rows)


def test_matches_a_loop_port_of_the_reference_code():
    """Random Dirichlet-ish probabilities (no ties), 4 clients of uneven size, 6 classes, a skewed logit bias so
    some class is kept by nobody in some draws; the selected rows equal the port's for several refresh indices."""
    g = torch.Generator().manual_seed(0)
    seg = torch.tensor([0, 7, 30, 31, 60])
    fallback_seen = False
    for trial in range(6):
        logits = torch.randn(60, 6, generator=g) * 2 + torch.tensor([3.0, 2.0, 0.0, 0.0, -3.0, -6.0])
        probs = logits.softmax(1)
        keep = copl.copl_filter(probs, seg)
        fallback_seen |= bool((copl.copl_counts(probs, keep, seg).sum(0) == 0).any())
        ours = copl.CoPL(round_index=trial % 3, n_total_train=60)(probs, seg).rows.tolist()
        assert ours == _reference(probs, seg, 60, trial % 3)
    assert fallback_seen


# ---------------------------------------------------------------------------------------------- bad inputs
def _one_line(exc):
    assert "\n" not in str(exc.value)


@pytest.mark.parametrize(
    "call",
    [
        lambda: copl.copl_filter(torch.ones(3), None),  # 1-D probs
        lambda: copl.copl_filter(P, torch.tensor([0, 5, 13])),  # segments do not end at N
        lambda: copl.copl_filter(P, SEG, conf_quantile=150),
        lambda: copl.copl_counts(P, torch.ones(13, dtype=torch.bool), SEG),  # keep too short
        lambda: copl.copl_counts(P, torch.ones(14), SEG),  # keep not bool
        lambda: copl.copl_counts(P, torch.ones(14, dtype=torch.bool), SEG, features=torch.ones(13, 2)),
        lambda: copl.copl_budget(torch.tensor([[1, -1, 0]]), 10, 0, 1),  # negative count
        lambda: copl.copl_budget(torch.tensor([1, 2, 3]), 10, 0, 1),  # 1-D counts
        lambda: copl.copl_budget(torch.tensor([[1.0, 2.0]]), 10, 0, 1),  # float counts
        lambda: copl.copl_budget(torch.tensor([[1, 2]]), 10, -1, 1),  # negative round index
        lambda: copl.copl_budget(torch.tensor([[1, 2]]), 10, 0, 0),  # no clients
        lambda: copl.copl_budget(torch.tensor([[1, 2]]), -5, 0, 1),  # negative train size
        lambda: copl.copl_select(P, SEG, torch.tensor([[1, 0, -1], [1, 2, 1], [1, 0, 1]])),  # negative budget
        lambda: copl.copl_select(P, SEG, torch.ones(2, 3, dtype=torch.int64)),  # wrong number of clients
        lambda: copl.copl_select(P, SEG, torch.ones(3, 3)),  # float budget
        lambda: copl.copl_select(P, SEG, None),
        lambda: copl.CoPL(round_index=-1)(P, SEG),
    ],
)
def test_bad_inputs_raise_one_line_errors(call):
    with pytest.raises(FedfeatError) as exc:
        call()
    _one_line(exc)

"""FedCoPL's filtering / assignment ablation switches (issue 37; the paper's "Ablation Study", columns Confidence
Filtering / Entropy Filtering / Global Assignment): each changes CoPL's pseudo-labels as it says on a hand case, and
the defaults give exactly the pseudo-labels of the unswitched chain."""

from __future__ import annotations

import torch

from fedfeat.methods import pseudolabel as pl
from fedfeat.methods.copl import CoPL, copl_budget, copl_counts, copl_filter, copl_select
from fedfeat.methods.fedcopl import FedCoPLParams

# 3 classes; over all 5 rows max p has median .55 and entropy median .819 (row 2's), so the confidence condition keeps
# rows 0 and 2 and the entropy condition rows 0 and 4: the two conditions keep different rows
P = torch.tensor(
    [
        [0.60, 0.40, 0.00],  # conf .60 > .5, H .673
        [0.50, 0.25, 0.25],  # conf .50 (the median: dropped by confidence), H 1.040
        [0.70, 0.15, 0.15],  # conf .70, H .819
        [0.40, 0.30, 0.30],  # conf .40, H 1.089
        [0.00, 0.45, 0.55],  # conf .55, H .688 -> class 2
    ]
)


def _ent(p):
    return -torch.special.xlogy(p, p).sum(1)


def test_filter_switches_drop_their_condition():
    conf = P.max(1).values > P.max(1).values.median()
    ent = _ent(P) < _ent(P).median()
    assert conf.tolist() != ent.tolist()  # the hand case separates the two conditions
    assert copl_filter(P).tolist() == (conf & ent).tolist()
    assert copl_filter(P, entropy=False).tolist() == conf.tolist()
    assert copl_filter(P, confidence=False).tolist() == ent.tolist()
    assert copl_filter(P, confidence=False, entropy=False).all()


def _chain(p, seg, round_index=0):
    """The pre-switch CoPL pipeline, spelled out."""
    keep = copl_filter(p, seg)
    n = copl_counts(p, keep, seg)
    return copl_select(p, seg, copl_budget(n, p.shape[0], round_index, len(seg) - 1))


def test_defaults_reproduce_the_chain_exactly():
    g = torch.Generator().manual_seed(0)
    p = torch.softmax(3 * torch.randn(200, 7, generator=g), 1)
    seg = [0, 30, 90, 90, 200]
    for r in (0, 2):
        a, b = CoPL(round_index=r)(p, seg), _chain(p, seg, r)
        assert torch.equal(a.rows, b.rows) and torch.equal(a.offsets, b.offsets)
        assert torch.equal(a.labels, b.labels) and torch.equal(a.candidates, b.candidates)
        c = pl.make_pseudo_labeller(
            "copl", round_index=r, confidence_filtering=True, entropy_filtering=True, global_assignment=True
        )(p, seg)
        assert torch.equal(c.rows, a.rows) and torch.equal(c.labels, a.labels)
    q = FedCoPLParams()
    assert (q.confidence_filtering, q.entropy_filtering, q.global_assignment) == (True, True, True)


def test_filtering_off_counts_every_sample():
    # two clients: without filtering every sample counts, so the global budget grows (M = ceil(N / C))
    seg = [0, 3, 5]
    on, off = CoPL()(P, seg), CoPL(confidence_filtering=False, entropy_filtering=False)(P, seg)
    keep_off = copl_filter(P, seg, confidence=False, entropy=False)
    assert keep_off.all()
    n_off = copl_counts(P, keep_off, seg)
    assert off.rows.tolist() == copl_select(P, seg, copl_budget(n_off, 5, 0, 2)).rows.tolist()
    assert len(off.rows) >= len(on.rows)
    # n = [[3, 0, 0], [1, 0, 1]], M = ceil(5 / 3) = 2: client 0's class-0 quota ceil(3 * 2 / 4) = 2 (rows 2 and 0,
    # its most confident; row 1 dropped), client 1's ceil(1 * 2 / 4) = 1 (row 3) and class 2's 2 (row 4)
    assert n_off.tolist() == [[3, 0, 0], [1, 0, 1]]
    assert off.rows.tolist() == [0, 2, 3, 4]


def test_global_assignment_off_takes_each_clients_own_counts():
    seg = [0, 3, 5]
    keep = copl_filter(P, seg)
    n = copl_counts(P, keep, seg)
    local = CoPL(global_assignment=False)(P, seg)
    assert local.rows.tolist() == copl_select(P, seg, n).rows.tolist()
    # each client keeps per class exactly its filtered count: its most confident samples of that class
    assert local.offsets.diff().tolist() == n.sum(1).tolist()
    # the server's assignment fills classes nobody kept (the fallback quota) -- the local quotas do not
    glob = CoPL()(P, seg)
    assert len(glob.rows) > len(local.rows)
    # all three off: every sample, labelled argmax
    every = CoPL(confidence_filtering=False, entropy_filtering=False, global_assignment=False)(P, seg)
    assert every.rows.tolist() == [0, 1, 2, 3, 4] and every.labels.tolist() == P.argmax(1).tolist()

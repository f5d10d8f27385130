"""Pseudo-labellers (``fedfeat.pseudolabel``) on hand examples: FPL's per-client top-k, CPL's candidate sets (the
intra-instance cumulative rule, the inter-instance class quantiles, their intersection) and the ``cc`` loss."""

from __future__ import annotations

import math

import pytest
import torch

from fedfeat import pseudolabel as pl
from fedfeat.errors import FedfeatError

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
    rows, y = pl.fpl_select(P, SEG, k=2)
    # client 0: class 0 -> rows 2, 0 (0.8, 0.7; row 1 is third); class 1 -> row 3; class 2 -> row 4
    # client 1: class 0 -> row 5; class 1 -> rows 7, 6
    assert rows.tolist() == [0, 2, 3, 4, 5, 6, 7]
    assert y.tolist() == [0, 0, 1, 2, 0, 1, 1]
    # one pool for everyone (no client split): class 0 -> 5, 2; class 1 -> 7, 3; class 2 -> 4
    rows_g, _ = pl.fpl_select(P, None, k=2)
    assert rows_g.tolist() == [2, 3, 4, 5, 7]
    # k = 1 and a tie (rows 0 and 1 both 0.7 for class 0): the lower row wins; row 2 now predicts class 2 at 0.7,
    # which loses to row 4's 0.8
    tie = P.clone()
    tie[1] = torch.tensor([0.7, 0.2, 0.1], dtype=torch.float64)
    tie[2] = torch.tensor([0.1, 0.2, 0.7], dtype=torch.float64)
    assert pl.fpl_select(tie, SEG, k=1)[0].tolist() == [0, 3, 4, 5, 7]


C = torch.tensor([[0.6, 0.3, 0.1], [0.5, 0.4, 0.1], [0.2, 0.7, 0.1], [0.1, 0.2, 0.7]], dtype=torch.float64)


def test_cpl_candidate_sets_by_hand():
    """thr = median of the maxima (0.6, 0.5, 0.7, 0.7) = 0.65. Intra: a {0, 1} (0.6, then 0.9 > thr included),
    b {0, 1}, c {1}, d {2}. Inter at the 0.5 quantile: class 0 >= 0.35 -> a, b; class 1 >= 0.35 -> b, c;
    class 2 >= 0.1 -> all. Intersection: a {0}, b {0, 1}, c {1}, d {2}."""
    intra = pl.intra_instance(C, torch.full((4,), 0.65, dtype=torch.float64))
    assert intra.tolist() == [
        [True, True, False],
        [True, True, False],
        [False, True, False],
        [False, False, True],
    ]
    got = pl.cpl_candidates(C, 50, 0.5)
    assert got.tolist() == [
        [True, False, False],
        [True, True, False],
        [False, True, False],
        [False, False, True],
    ]
    # a stricter inter-instance threshold (0.99 quantile): b's set becomes empty (the code drops the row)
    strict = pl.cpl_candidates(C, 50, 0.99)
    assert strict[1].tolist() == [False, False, False] and strict[0].tolist() == [True, False, False]
    # quantiles are per client: the same rows as two clients of two give other thresholds
    per = pl.cpl_candidates(C, 50, 0.5, torch.tensor([0, 2, 4]))
    assert per.tolist() != got.tolist()
    # pools: per class the top-1 candidate by p_c -> class 0: a (0.6), class 1: c (0.7), class 2: d
    assert pl.cpl_select(got, C, None, k=1).tolist() == [0, 2, 3]


def test_cc_loss_by_hand():
    z = torch.tensor([[0.0, 1.0, 2.0]])
    p = torch.softmax(z, -1)[0]
    got = pl.cc_loss(z, torch.tensor([[True, True, False]]))
    assert float(got) == pytest.approx(-math.log(float(p[0] + p[1])), rel=1e-6)
    one = pl.cc_loss(z, torch.tensor([[False, False, True]]))
    assert float(one) == pytest.approx(
        float(torch.nn.functional.cross_entropy(z, torch.tensor([2]))), rel=1e-6
    )
    big = pl.cc_loss(torch.tensor([[1000.0, -1000.0, 0.0]]), torch.tensor([[False, True, False]]))
    assert float(big) == pytest.approx(2000.0) and torch.isfinite(big).all()
    batched = pl.cc_loss(z.expand(2, 3, 3), torch.tensor([True, True, False]).expand(2, 3, 3))
    assert batched.shape == (2, 3)


def test_bad_inputs_are_one_line_errors():
    with pytest.raises(FedfeatError, match="pseudo_k.*>= 1"):
        pl.fpl_select(P, SEG, k=0)
    with pytest.raises(FedfeatError, match=r"conf_quantile must be in \[0, 100\]"):
        pl.cpl_candidates(C, 150, 0.5)
    with pytest.raises(FedfeatError, match=r"regular_threshold must be in \[0, 1\]"):
        pl.cpl_candidates(C, 50, 1.5)
    with pytest.raises(FedfeatError, match="segments must rise from 0 to the number of samples"):
        pl.fpl_select(P, torch.tensor([0, 3]), k=1)
    with pytest.raises(FedfeatError, match="differ in shape"):
        pl.cc_loss(torch.zeros(2, 3), torch.ones(2, 4, dtype=torch.bool))

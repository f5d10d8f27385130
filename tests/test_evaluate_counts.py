"""The evaluation's counts (one host transfer per evaluated round) equal the plain per-row / per-client definitions:
accuracy, per-class accuracy, the validation rows' accuracy and each client's local accuracy (clients with overlapping
and empty local splits), exactly (the same float64 divisions)."""

from __future__ import annotations

import numpy as np
import torch

from fedfeat.engine.rounds import evaluate


class _Fixed:
    """A method whose predictions are given."""

    def __init__(self, pred: torch.Tensor, K: int):
        self.logits = torch.nn.functional.one_hot(pred, K).double()

    def predict(self, ctx, glob, x):
        return self.logits


class _Ctx:
    def __init__(self, **kw):
        self.test_x = None
        self.cache = {}
        self.val_mask = None
        self.local_test = None
        self.__dict__.update(kw)


def _plain(pred, y, K, vm, local):
    """The definitions, row by row and client by client, in Python."""
    test = [i for i in range(len(y)) if vm is None or not vm[i]]
    right = [int(pred[i] == y[i]) for i in range(len(y))]
    per_class = []
    for k in range(K):
        rows = [i for i in test if y[i] == k]
        per_class.append(100 * (sum(right[i] for i in rows) / max(len(rows), 1)))
    out = {"acc": 100 * (sum(right[i] for i in test) / len(test)), "per_class_acc": per_class}
    if vm is not None:
        val = [i for i in range(len(y)) if vm[i]]
        out["val_acc"] = 100 * (sum(right[i] for i in val) / len(val))
    if local is not None:
        accs = [100 * (sum(right[i] for i in r.tolist()) / len(r)) for r in local if len(r)]
        out["client_acc"] = [
            100 * (sum(right[i] for i in r.tolist()) / len(r)) if len(r) else None for r in local
        ]
        out["local_acc"] = float(np.mean(accs))
        out["local_acc_std"] = float(np.std(accs, ddof=1))
    return out


def test_counts_equal_the_plain_definitions():
    g = torch.Generator().manual_seed(3)
    K, N = 7, 301
    y = torch.randint(0, K, (N,), generator=g)
    y[y == 6] = 5  # class 6 has no test image: its accuracy is 0 (0 / max(0, 1))
    pred = torch.where(torch.rand(N, generator=g) < 0.6, y, torch.randint(0, K, (N,), generator=g))
    vm = torch.rand(N, generator=g) < 0.2
    rows = torch.arange(N)[~vm]
    local = [
        rows[:40],
        rows[30:90],
        torch.zeros(0, dtype=torch.int64),
        rows[90:91],
        rows[100:],
    ]  # overlap, empty
    for v, lt in (
        (None, None),
        (vm, None),
        (None, [torch.arange(N)[: N // 2], torch.arange(N)[N // 2 :]]),
        (vm, local),
    ):
        ctx = _Ctx(val_mask=v, local_test=lt)
        ev = evaluate(_Fixed(pred, K), ctx, {}, y, K)
        want = _plain(pred.tolist(), y.tolist(), K, None if v is None else v.tolist(), lt)
        assert ev["acc"] == want["acc"]
        assert ev["per_class_acc"] == want["per_class_acc"]
        assert ev["per_class_acc"][6] == 0.0
        extra = ev.get("extra", {})
        if v is not None:
            assert extra["val_acc"] == want["val_acc"]
            assert torch.equal(ev["pred"], pred[~v])
        if lt is not None:
            assert extra["client_acc"] == want["client_acc"]
            assert extra["local_acc"] == want["local_acc"]
            assert extra["local_acc_std"] == want["local_acc_std"]
            assert extra["local_clients"] == sum(1 for r in lt if len(r))

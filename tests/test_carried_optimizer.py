"""One optimiser for every client (PromptFL's and FedCoPL's reference codes): momentum carries from client to client
and round to round (``fedfeat.engine.rounds.run_carried``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import pytest
import torch
import torch.nn.functional as F

from fedfeat.engine.data import RunData
from fedfeat.engine.rounds import resolve_kernel, run_federated
from fedfeat.methods.base import REGISTRY, register
from fedfeat.methods.head import LinearHead, LinearHeadParams


@dataclass(frozen=True)
class _P(LinearHeadParams):
    batch_size: int = 1
    lr: float = 0.5
    momentum: float = 0.9
    weight_decay: float = 0.0
    logit_scale: float = 3.0
    optimizer_state: Literal["fresh", "carried"] = "carried"


@pytest.fixture(scope="module")
def head():
    @register
    class Carried(LinearHead):
        name = "test-carried"
        Params = _P

    yield Carried
    REGISTRY.pop("test-carried", None)


def _data() -> RunData:
    g = torch.Generator().manual_seed(0)
    x = F.normalize(torch.randn(2, 4, generator=g), dim=-1)  # client 0: row 0, client 1: row 1
    text = F.normalize(torch.randn(1, 3, 4, generator=g), dim=-1)
    return RunData(
        train_x=x, train_y=torch.tensor([2, 0]), offsets=torch.tensor([0, 1, 2]), test_x=x, test_y=torch.tensor([2, 0]),
        text_all=text, clip_logit_scale=100.0, class_names=["a", "b", "c"], train_counts=torch.tensor([1, 0, 1]),
    )  # fmt: skip


def _grad(W, b, x, y, s):
    W, b = W.clone().requires_grad_(True), b.clone().requires_grad_(True)
    F.cross_entropy(s * (x @ W.T + b).unsqueeze(0), torch.tensor([y])).backward()
    return W.grad, b.grad


def test_momentum_carries_from_client_to_client_by_hand(head):
    """Two clients of one sample, one step each, SGD lr 0.5 / momentum 0.9: client 0 steps with buf = g0; client 1
    (next, same optimiser) with buf = 0.9 g0 + g1, both gradients at the global head; FedAvg averages them."""
    data = _data()
    G = F.normalize(data.text_all[0], dim=-1)
    g0 = _grad(G, torch.zeros(3), data.train_x[0], 2, 3.0)
    g1 = _grad(G, torch.zeros(3), data.train_x[1], 0, 3.0)
    want_W = G - 0.5 * (g0[0] + (0.9 * g0[0] + g1[0])) / 2
    want_b = -0.5 * (g0[1] + (0.9 * g0[1] + g1[1])) / 2
    for engine in ("batched", "loop"):
        m = head(head.Params())
        assert resolve_kernel("auto", m, engine, torch.device("cpu")) == "torch"
        glob, _ = run_federated(m, data, rounds=1, participation=1.0, seed=0, engine=engine)
        torch.testing.assert_close(glob["W"], want_W, atol=1e-6, rtol=0)
        torch.testing.assert_close(glob["b"], want_b, atol=1e-6, rtol=0)
    fresh, _ = run_federated(head(_P(optimizer_state="fresh")), data, rounds=1, participation=1.0, seed=0)
    torch.testing.assert_close(fresh["W"], G - 0.5 * (g0[0] + g1[0]) / 2, atol=1e-6, rtol=0)


def test_momentum_carries_across_rounds(head):
    """Round 2's first client starts from the buffer that round 1's last client left: a second round differs from
    the same round run with fresh state (and equal without momentum)."""
    data = _data()
    runs = {
        (st, mom): run_federated(head(_P(optimizer_state=st, momentum=mom)), data, rounds=2, participation=1.0,
                                 seed=0)[0]["W"]
        for st in ("fresh", "carried") for mom in (0.0, 0.9)
    }  # fmt: skip
    torch.testing.assert_close(runs[("fresh", 0.0)], runs[("carried", 0.0)], atol=1e-6, rtol=0)
    assert (runs[("fresh", 0.9)] - runs[("carried", 0.9)]).abs().max() > 1e-3

"""Server optimisers (``fedfeat.methods.serveropt``): FedAdagrad, FedAdam, FedYogi (Reddi et al. 2021).

Hand-computed two-round cases of each variant's server step; a line-by-line numpy transcription of Flower's
``aggregate_train`` (adap/flower ``framework/py/flwr/serverapp/strategy/``, commit in ``serveropt.FLOWER_COMMIT``)
replayed on a real run's client heads; the batched engine (torch program and fused CPU kernel) against the loop
engine; stacked runs against the same runs made alone."""

from __future__ import annotations

import dataclasses
import math
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from fedfeat.engine.data import load_run_data
from fedfeat.engine.rounds import run_federated
from fedfeat.errors import FedfeatError
from fedfeat.methods import REGISTRY, get_method
from fedfeat.methods.serveropt import FLOWER_COMMIT
from fedfeat.partition.make import make_partition
from fedfeat.runs.stack import run_stacked
from fedfeat.store.synth import SynthParams, write_synthetic_store

METHODS = ("fedadagrad", "fedadam", "fedyogi")
F64 = torch.float64


# ---------------------------------------------------------------------------------------------- hand cases
def _two_rounds(name: str, params: dict, d1, d2):
    """The server step alone: ``x0 = (W = [1, 2], b = 0.5)``, the averaged head moves ``W`` by ``d1`` in round 1
    and by ``d2`` in round 2 and leaves ``b``; returns ``(x1, x2)``."""
    m = get_method(name, params)
    ctx = SimpleNamespace(state={})
    m.setup(ctx)
    x0 = {"W": torch.tensor([[1.0, 2.0]], dtype=F64), "b": torch.tensor([0.5], dtype=F64)}
    outs, x = [], x0
    for rnd, d in ((1, d1), (2, d2)):
        new = {"W": x["W"] + torch.tensor([d], dtype=F64), "b": x["b"].clone()}
        x = m.server_update(ctx, SimpleNamespace(rnd=rnd), x, new)
        outs.append(x)
    return outs


def _check(x, W, b=0.5):
    np.testing.assert_allclose(x["W"].numpy(), [W], rtol=0, atol=1e-12)
    np.testing.assert_allclose(x["b"].numpy(), [b], rtol=0, atol=1e-15)  # delta 0: m = v = 0, no move


def test_fedadagrad_two_rounds_by_hand():
    """beta_1 = 0 (Flower's FedAdagrad), eta = 1, tau = 0.5, v0 = 0. Round 1: d = (0.3, -0.4), v = (0.09, 0.16),
    sqrt v = (0.3, 0.4): W = (1 + 0.3 / 0.8, 2 - 0.4 / 0.9) = (1.375, 14/9). Round 2: d = (0.4, 0.3), v = (0.25,
    0.25), sqrt v = 0.5: W += (0.4 / 1.0, 0.3 / 1.0) = (1.775, 14/9 + 0.3). The bias never moves (its delta is 0:
    0 / (0 + tau))."""
    x1, x2 = _two_rounds("fedadagrad", {"eta": 1.0, "tau": 0.5}, [0.3, -0.4], [0.4, 0.3])
    _check(x1, [1.375, 14 / 9])
    _check(x2, [1.775, 14 / 9 + 0.3])
    # Algorithm 2's v_{-1} = tau^2: round 1's v = 0.25 + 0.09 = 0.34
    (y1, _) = _two_rounds("fedadagrad", {"eta": 1.0, "tau": 0.5, "v_init": "tau2"}, [0.3, -0.4], [0.4, 0.3])
    _check(y1, [1 + 0.3 / (math.sqrt(0.34) + 0.5), 2 - 0.4 / (math.sqrt(0.41) + 0.5)])


# beta_1 = 0.5, beta_2 = 0.6, tau = 0.1, eta = 1; d1 = (0.3, -0.4), d2 = (0.1, 0.4):
# m1 = 0.5 d1 = (0.15, -0.2); m2 = 0.5 m1 + 0.5 d2 = (0.125, 0.1); v1 = 0.4 d1^2 = (0.036, 0.064) for Adam and Yogi
ADAMISH = {"eta": 1.0, "beta_1": 0.5, "beta_2": 0.6, "tau": 0.1}
D1, D2 = [0.3, -0.4], [0.1, 0.4]
STEP1 = [0.15 / (math.sqrt(0.036) + 0.1), -0.2 / (math.sqrt(0.064) + 0.1)]


def test_fedadam_two_rounds_by_hand():
    """Adam's v2 = 0.6 v1 + 0.4 d2^2 = (0.0216 + 0.004, 0.0384 + 0.064) = (0.0256, 0.1024), sqrt = (0.16, 0.32):
    round 2 adds (0.125 / 0.26, 0.1 / 0.42). Flower's bias correction scales round t's step by
    sqrt(1 - 0.6^(t+1)) / (1 - 0.5^(t+1)): 0.8 / 0.75 in round 1, sqrt(0.784) / 0.875 in round 2."""
    x1, x2 = _two_rounds("fedadam", {**ADAMISH, "bias_correction": "none"}, D1, D2)
    W1 = [1 + STEP1[0], 2 + STEP1[1]]
    _check(x1, W1)
    _check(x2, [W1[0] + 0.125 / 0.26, W1[1] + 0.1 / 0.42])
    x1, x2 = _two_rounds("fedadam", ADAMISH, D1, D2)  # bias_correction = "flower" (the default)
    c1, c2 = 0.8 / 0.75, math.sqrt(0.784) / 0.875
    W1 = [1 + c1 * STEP1[0], 2 + c1 * STEP1[1]]
    _check(x1, W1)
    _check(x2, [W1[0] + c2 * 0.125 / 0.26, W1[1] + c2 * 0.1 / 0.42])
    m = get_method("fedadam", {**ADAMISH, "bias_correction": "adam"})  # Kingma & Ba: exponent t
    assert m.step_size(1) == pytest.approx(math.sqrt(0.4) / 0.5, abs=1e-15)
    assert m.step_size(2) == pytest.approx(0.8 / 0.75, abs=1e-15)


def test_fedyogi_two_rounds_by_hand():
    """Yogi's v1 = 0 - 0.4 d1^2 sign(0 - d1^2) = (0.036, 0.064), as Adam's. Round 2: v1 - d2^2 = (0.026, -0.096), so
    the sign is (+1, -1): v2 = (0.036 - 0.4 * 0.01, 0.064 + 0.4 * 0.16) = (0.032, 0.128) -- the first coordinate
    shrinks, the second grows (Adam's: 0.0256 and 0.1024)."""
    x1, x2 = _two_rounds("fedyogi", ADAMISH, D1, D2)
    W1 = [1 + STEP1[0], 2 + STEP1[1]]
    _check(x1, W1)
    _check(x2, [W1[0] + 0.125 / (math.sqrt(0.032) + 0.1), W1[1] + 0.1 / (math.sqrt(0.128) + 0.1)])


def test_aggregation_by_size_or_uniform():
    """Two clients holding 1 and 3 samples, heads W = 0 and W = 4: by size (Flower) (0 + 3 * 4) / 4 = 3; uniform
    (Algorithm 2's mean) 2."""
    cparams = {"W": torch.tensor([[[0.0]], [[4.0]]], dtype=F64), "b": torch.tensor([[0.0], [8.0]], dtype=F64)}
    plan = SimpleNamespace(sizes=torch.tensor([1, 3]), m=2)
    ctx = SimpleNamespace(device=torch.device("cpu"))
    for name in METHODS:
        by_size = get_method(name).aggregate(ctx, plan, None, cparams)
        uniform = get_method(name, {"aggregation": "uniform"}).aggregate(ctx, plan, None, cparams)
        assert float(by_size["W"]) == 3.0 and float(by_size["b"]) == 6.0
        assert float(uniform["W"]) == 2.0 and float(uniform["b"]) == 4.0


def test_defaults_and_validation():
    """Flower's beta_1 / beta_2 / tau; FedAdagrad's beta_1 = 0; eta ours (serveropt's docstring); bad values are
    one-line errors."""
    p = {n: get_method(n).p for n in METHODS}
    assert (p["fedadam"].beta_1, p["fedadam"].beta_2, p["fedadam"].tau) == (0.9, 0.99, 1e-3)
    assert (p["fedyogi"].beta_1, p["fedyogi"].beta_2, p["fedyogi"].tau) == (0.9, 0.99, 1e-3)
    assert (p["fedadagrad"].beta_1, p["fedadagrad"].tau) == (0.0, 1e-3) and not hasattr(
        p["fedadagrad"], "beta_2"
    )
    assert (p["fedadam"].eta, p["fedadagrad"].eta, p["fedyogi"].eta) == (3e-4, 3e-4, 1e-4)
    assert p["fedadam"].bias_correction == "flower" and p["fedadam"].aggregation == "size"
    assert len(FLOWER_COMMIT) == 40
    for bad in ({"eta": 0.0}, {"beta_1": 1.0}, {"beta_2": -0.1}, {"tau": 0.0}, {"tau": -1.0}):
        with pytest.raises(FedfeatError) as e:
            get_method("fedadam", bad)
        assert "\n" not in str(e.value)
    get_method(
        "fedadam", {"tau": 0.0, "v_init": "tau2"}
    )  # v >= tau^2 = 0 ... allowed only with a start value
    for name in METHODS:
        cls = REGISTRY[name]
        assert cls.stacks and cls.shardable and set(cls.declared_state()) == {"m", "v"}


# ---------------------------------------------------------------------------------------------- Flower
class FlowerFedOpt:
    """adap/flower ``framework/py/flwr/serverapp/strategy/`` at ``FLOWER_COMMIT``, line by line in numpy:
    ``strategy_utils.aggregate_arrayrecords`` (FedAvg weighted by ``num-examples``, lines 87-101),
    ``fedopt.FedOpt._compute_deltat_and_mt`` (lines 205-215) and ``aggregate_train`` of ``fedadam.py`` (lines
    152-171), ``fedyogi.py`` (lines 152-162), ``fedadagrad.py`` (lines 146-152). ``current_arrays`` is what
    ``configure_train`` sent (fedopt.py:163)."""

    def __init__(self, variant, initial, eta, beta_1, beta_2, tau):
        self.variant = variant
        self.current_arrays = {k: v.copy() for k, v in initial.items()}
        self.eta, self.beta_1, self.beta_2, self.tau = eta, beta_1, beta_2, tau
        self.m_t = None
        self.v_t = None

    def aggregate_train(self, server_round, replies):  # replies: [({key: array}, num_examples)]
        weights = [float(n) for _, n in replies]
        total_weight = sum(weights)
        weight_factors = [w / total_weight for w in weights]
        aggregated_np_arrays = {}
        for (record, _), weight in zip(replies, weight_factors, strict=True):
            for key, value in record.items():
                if key not in aggregated_np_arrays:
                    aggregated_np_arrays[key] = value * weight
                else:
                    aggregated_np_arrays[key] += value * weight
        aggregated_ndarrays = aggregated_np_arrays
        delta_t = {k: x - self.current_arrays[k] for k, x in aggregated_ndarrays.items()}
        if not self.m_t:
            self.m_t = {k: np.zeros_like(v) for k, v in aggregated_ndarrays.items()}
        self.m_t = {k: self.beta_1 * v + (1 - self.beta_1) * delta_t[k] for k, v in self.m_t.items()}
        m_t = self.m_t
        if not self.v_t:
            self.v_t = {k: np.zeros_like(v) for k, v in aggregated_ndarrays.items()}
        if self.variant == "fedadam":
            self.v_t = {
                k: self.beta_2 * v + (1 - self.beta_2) * (delta_t[k] ** 2) for k, v in self.v_t.items()
            }
            eta_norm = (
                self.eta
                * np.sqrt(1 - np.power(self.beta_2, server_round + 1.0))
                / (1 - np.power(self.beta_1, server_round + 1.0))
            )
            new_arrays = {
                k: x + eta_norm * m_t[k] / (np.sqrt(self.v_t[k]) + self.tau)
                for k, x in self.current_arrays.items()
            }
        elif self.variant == "fedyogi":
            self.v_t = {
                k: v - (1.0 - self.beta_2) * (delta_t[k] ** 2) * np.sign(v - delta_t[k] ** 2)
                for k, v in self.v_t.items()
            }
            new_arrays = {
                k: x + self.eta * m_t[k] / (np.sqrt(self.v_t[k]) + self.tau)
                for k, x in self.current_arrays.items()
            }
        else:
            self.v_t = {k: v + (delta_t[k] ** 2) for k, v in self.v_t.items()}
            new_arrays = {
                k: x + self.eta * m_t[k] / (np.sqrt(self.v_t[k]) + self.tau)
                for k, x in self.current_arrays.items()
            }
        self.current_arrays = new_arrays  # the next configure_train sends these
        return new_arrays


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    """10 classes x 100 train, D = 32; Dirichlet 0.1 over 20 ragged clients (as tests/test_engine.py)."""
    p = SynthParams(classes=10, dim=32, train_per_class=100, test_per_class=20, templates=2)
    st = write_synthetic_store(tmp_path_factory.mktemp("so") / "s.zarr", p, stats=False, log=lambda *_: None)
    part = make_partition(st.labels("train"), "dirichlet", clients=20, alpha=0.1, seed=1)
    return st, part


def _recorded_run(method, data, rounds=4):
    """Run ``method`` (batched, torch) and record each round's client heads, sizes, and the global head before and
    after the server step."""
    rec = []
    agg, step = method.aggregate, method.server_update

    def aggregate(ctx, plan, glob, cparams):
        rec.append({"sizes": plan.sizes.tolist(), "glob": {k: v.clone() for k, v in glob.items()},
                    "clients": {k: v.clone() for k, v in cparams.items()}})  # fmt: skip
        return agg(ctx, plan, glob, cparams)

    def server_update(ctx, plan, old, new):
        out = step(ctx, plan, old, new)
        rec[-1]["out"] = {k: v.clone() for k, v in out.items()}
        return out

    method.aggregate, method.server_update = aggregate, server_update
    run_federated(method, data, rounds=rounds, participation=0.5, seed=3, engine="batched", kernel="torch")
    return rec


FLOWER_CASES = [
    ("fedadam", {"eta": 0.01}),
    ("fedadam", {"eta": 0.003, "beta_1": 0.5, "beta_2": 0.9, "tau": 1e-4}),
    ("fedyogi", {"eta": 0.01}),
    ("fedyogi", {"eta": 0.003, "beta_1": 0.5, "beta_2": 0.9, "tau": 1e-2}),
    ("fedadagrad", {"eta": 0.01}),
]


@pytest.mark.parametrize(
    "name, sets", FLOWER_CASES, ids=[f"{n}-{i}" for i, (n, _) in enumerate(FLOWER_CASES)]
)
def test_equals_a_transcription_of_flowers_aggregate_train(small, name, sets):
    """Four rounds of a real run (float64): Flower's strategy, fed the run's client heads and sample counts from
    the run's initial head, produces every round's global head (so it also starts each round where the run did)."""
    st, part = small
    method = get_method(name, sets)
    rec = _recorded_run(method, load_run_data(st, part, dtype=F64))
    p = method.p
    fl = FlowerFedOpt(name, {k: v.numpy() for k, v in rec[0]["glob"].items()}, p.eta, p.beta_1,
                      getattr(p, "beta_2", 0.0), p.tau)  # fmt: skip
    for rnd, r in enumerate(rec, start=1):
        for k, v in r["glob"].items():  # where the run started the round = what Flower sent
            np.testing.assert_allclose(v.numpy(), fl.current_arrays[k], rtol=1e-12, atol=1e-14)
        m = len(r["sizes"])
        replies = [({k: r["clients"][k][j].numpy() for k in r["clients"]}, r["sizes"][j]) for j in range(m)]
        want = fl.aggregate_train(rnd, replies)
        for k, v in r["out"].items():
            np.testing.assert_allclose(v.numpy(), want[k], rtol=1e-12, atol=1e-14)
    # the server step really mattered: the run is not FedAvg (whose head is the plain average)
    last = rec[-1]
    fedavg_head = sum(w * last["clients"]["W"][j] for j, w in enumerate(last["sizes"])) / sum(last["sizes"])
    assert (last["out"]["W"] - fedavg_head).abs().max() > 1e-3


# ---------------------------------------------------------------------------------------------- engines
ENGINE_CASES = [
    ("fedadam", {"batch_size": "16", "eta": "0.003"}),
    ("fedadam", {"batch_size": "16", "eta": "0.003", "bias_correction": "adam", "aggregation": "uniform"}),
    ("fedyogi", {"batch_size": "16", "eta": "0.003", "local_epochs": "2"}),
    ("fedadagrad", {"batch_size": "16", "eta": "0.003", "beta_1": "0.9", "v_init": "tau2"}),
]


@pytest.mark.parametrize(
    "name, sets", ENGINE_CASES, ids=[f"{n}-{i}" for i, (n, _) in enumerate(ENGINE_CASES)]
)
def test_batched_torch_and_fused_equal_the_loop_engine(small, name, sets):
    st, part = small

    def run(engine, kernel="auto"):
        data = load_run_data(st, part)
        return run_federated(get_method(name, sets), data, rounds=3, participation=0.5, seed=0, engine=engine,
                             kernel=kernel)  # fmt: skip

    gl, ml = run("loop")
    assert get_method(name, sets).has_fused()
    for kernel in ("torch", "fused"):
        gb, mb = run("batched", kernel)
        for k in gl:
            torch.testing.assert_close(gb[k], gl[k], atol=1e-5, rtol=1e-5)
        np.testing.assert_allclose([r["test_acc"] for r in mb], [r["test_acc"] for r in ml], atol=1e-5)
        np.testing.assert_allclose(
            [r["train_loss"] for r in mb[1:]], [r["train_loss"] for r in ml[1:]], rtol=1e-5
        )


# ---------------------------------------------------------------------------------------------- stacking
@pytest.fixture(scope="module")
def data32(small):
    st, _ = small
    part = make_partition(st.labels("train"), "dirichlet", clients=8, alpha=0.3, seed=0)
    return load_run_data(st, part)


@pytest.mark.parametrize("kernel", ["torch", "fused"])
@pytest.mark.parametrize("name", METHODS)
def test_stacked_runs_equal_runs_made_alone(data32, name, kernel):
    """Runs of one method with other seeds, participation and server settings, stacked (each run's own server
    state) = made one by one: bit for bit with the fused kernels, 1e-5 with the torch program (float64)."""
    data = data32 if kernel == "fused" else dataclasses.replace(
        data32, train_x=data32.train_x.double(), test_x=data32.test_x.double(),
        text_all=data32.text_all.double(), memo=None,
    )  # fmt: skip
    cases = [
        ({}, 0, 0.5),
        ({"eta": "0.003", "tau": "0.01"}, 1, 0.5),
        ({"eta": "0.001", "lr": "0.05"}, 0, 1.0),
    ]
    methods = [get_method(name, s) for s, _, _ in cases]
    got = run_stacked(methods, data, rounds=3, participation=[c[2] for c in cases], seeds=[c[1] for c in cases],
                      kernel=kernel)  # fmt: skip
    finals = set()
    for (sets, seed, part), (w, rows) in zip(cases, got):
        want_w, want_rows = run_federated(get_method(name, sets), data, rounds=3, participation=part, seed=seed,
                                          engine="batched", kernel=kernel)  # fmt: skip
        for k in want_w:
            if kernel == "fused":
                assert torch.equal(w[k], want_w[k]), k
            torch.testing.assert_close(w[k], want_w[k], atol=1e-5, rtol=1e-5)
        for a, b in zip(rows, want_rows, strict=True):
            assert a["clients"] == b["clients"]
            assert a["test_acc"] == pytest.approx(b["test_acc"], abs=1e-9)
        finals.add(round(float(w["W"].abs().sum()), 6))
    assert len(finals) == 3  # the runs really differ

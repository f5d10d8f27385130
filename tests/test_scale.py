"""Cross-device scale (issue 28): 100,000 clients, a few sampled a round. Correctness only (speed is measured by
bench/bench_scale.py): the batched engine equals the loop oracle on a 100,000-client partition, the compiled client
sampling draws numpy's clients, and no state a run keeps scales with the client count."""

import numpy as np
import pytest
import torch

from fedfeat.engine.context import COMPILED_SAMPLING_FROM, sample_clients
from fedfeat.engine.data import load_run_data
from fedfeat.engine.rng import TAG_SAMPLE_CLIENTS, numpy_rng
from fedfeat.engine.rounds import run_federated
from fedfeat.engine.sampling import legacy_choice
from fedfeat.methods import get_method
from fedfeat.partition.core import Partition
from fedfeat.store.synth import SynthParams, write_synthetic_store

CLIENTS = 100_000
ROWS = 2  # per client


@pytest.fixture(scope="module")
def big(tmp_path_factory):
    """A small store (200,000 x 8, 3 classes) cut into 100,000 clients of 2 rows (a random permutation)."""
    p = SynthParams(classes=3, dim=8, train_per_class=CLIENTS * ROWS // 3 + 1, test_per_class=20, templates=1)
    st = write_synthetic_store(tmp_path_factory.mktemp("s") / "s.zarr", p, stats=False, log=lambda *_: None)
    order = np.random.RandomState(0).permutation(len(st.labels("train")))[: CLIENTS * ROWS]
    offsets = np.arange(0, CLIENTS * ROWS + 1, ROWS)
    part = Partition.from_order_and_offsets(
        "iid", {"scheme": "iid", "clients": CLIENTS, "seed": 0}, order, offsets
    )
    return st, part


@pytest.mark.parametrize(
    "n, m", [(2, 1), (3, 3), (17, 4), (1000, 10), (4096, 40), (65_537, 65), (100_000, 100), (300_001, 7)]
)
def test_compiled_choice_is_numpys(n, m):
    for seed in (0, 1, 2**31 + 5, 2**32 - 1):
        want = np.random.RandomState(seed).choice(n, m, replace=False)
        got = legacy_choice(seed, n, m)
        assert got.dtype == want.dtype and np.array_equal(got, want), (n, m, seed)


def test_sample_clients_at_scale_is_numpys():
    for n, p in ((COMPILED_SAMPLING_FROM, 0.01), (CLIENTS, 0.001), (1_000_000, 0.0001)):
        for rnd in (1, 2, 7):
            want = np.sort(numpy_rng(3, rnd, TAG_SAMPLE_CLIENTS).choice(n, max(1, int(p * n)), replace=False))
            assert np.array_equal(sample_clients(3, rnd, n, p), want)


CASES = [
    ("fedavg", {"batch_size": "4", "local_epochs": "2"}),
    ("fst-cbdg", {"batch_size": "4", "local_epochs": "2", "gamma": "1"}),
    ("clip2fl", {"local_epochs": "2", "batch_size": "4", "match_steps": "3", "crt_epochs": "2"}),
]


def _run(big, name, sets, engine, rounds=2, participation=0.0004):
    st, part = big
    m = get_method(name, sets)
    seen = {}
    setup = m.setup

    def keep_ctx(ctx):
        seen["ctx"] = ctx
        setup(ctx)

    m.setup = keep_ctx
    data = load_run_data(st, part, dtype=torch.float64)
    glob, metrics = run_federated(m, data, rounds=rounds, participation=participation, seed=0, engine=engine)
    return glob, metrics, seen["ctx"]


@pytest.mark.parametrize("name, sets", CASES, ids=[c[0] for c in CASES])
def test_100k_clients_batched_equals_loop(big, name, sets):
    """100,000 clients, 40 a round: the batched engine (fused kernel where the method has one) equals the loop."""
    gb, mb, ctx = _run(big, name, sets, "batched")
    gl, ml, _ = _run(big, name, sets, "loop")
    if (
        name == "fst-cbdg"
    ):  # round_metrics' kept pseudo-label hits (the trained clients' rows redone) = all redone
        st, part = big
        y = torch.from_numpy(st.labels("train")[part.order_and_offsets()[0]])
        assert torch.equal(ctx.cache["pl_right"], (ctx.state["q"].argmax(1) == y).to(torch.float64))
    assert len(mb[1]["clients"]) == 40 and mb[1]["clients"] == ml[1]["clients"]
    assert max(mb[1]["clients"]) > CLIENTS // 2  # drawn from the whole range
    for k in gl:
        torch.testing.assert_close(gb[k], gl[k], atol=1e-5, rtol=1e-5)
    for a, b in zip(mb, ml):
        for k, v in a.items():
            if k in ("seconds", "train_seconds") or "sec_" in k:
                continue
            if isinstance(v, float):
                assert b[k] == pytest.approx(v, abs=1e-5), k
            elif isinstance(v, list) and v and isinstance(v[0], float):
                np.testing.assert_allclose(v, b[k], atol=1e-5)
            else:
                assert v == b[k], k


def _leading_dims(obj, out, path="state"):
    """Every tensor / array in ``obj`` (dicts, lists, tuples) as ``(path, shape, bytes)``."""
    if isinstance(obj, torch.Tensor):
        out.append((path, tuple(obj.shape), obj.numel() * obj.element_size()))
    elif isinstance(obj, np.ndarray):
        out.append((path, obj.shape, obj.nbytes))
    elif isinstance(obj, dict):
        for k, v in obj.items():
            _leading_dims(v, out, f"{path}.{k}")
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            _leading_dims(v, out, f"{path}[{i}]")
    return out


@pytest.mark.parametrize("name, sets", CASES, ids=[c[0] for c in CASES])
def test_no_state_scales_with_the_client_count(big, name, sets):
    """After a run of 100,000 clients, nothing the method keeps (``ctx.state``, ``ctx.cache``, the weights) has a
    client axis, and it holds as many bytes as a run of 10,000 clients with the same sampled clients' worth of rows
    (per-sample state, e.g. FST-CBDG's soft labels, follows the data, which both runs hold)."""
    st, part = big
    glob, _, ctx = _run(big, name, sets, "batched")
    found = _leading_dims({"state": ctx.state, "cache": ctx.cache, "glob": glob}, [])
    assert found
    bad = [(p, s) for p, s, _ in found if any(d >= CLIENTS for d in s) and s[0] != CLIENTS * ROWS]
    assert not bad, f"state with a client axis: {bad}"
    # the same rows held by 10,000 clients of 20 rows, the same number of rows sampled a round (40 x 2 = 4 x 20)
    order, _ = part.order_and_offsets()
    part10 = Partition.from_order_and_offsets(
        "iid", {"scheme": "iid", "clients": 10_000, "seed": 0}, order, np.arange(0, len(order) + 1, 20)
    )
    glob10, _, ctx10 = _run((st, part10), name, sets, "batched", participation=0.0004)
    found10 = _leading_dims({"state": ctx10.state, "cache": ctx10.cache, "glob": glob10}, [])
    big_bytes = sum(b for _, _, b in found)
    small_bytes = sum(b for _, _, b in found10)
    # round buffers follow the sampled clients (40 vs 4 a round: a few [m, K, D] buffers more), never anything in
    # proportion to the 10x client count ([100,000, K] alone would be 2.4 MB here)
    head = sum(v.numel() * v.element_size() for v in glob.values())
    assert big_bytes <= small_bytes + 8 * 40 * head, (big_bytes, small_bytes)

"""Issue 30, item 2: a run holds the store's features as they are stored (float16) and makes one working copy in the
method's dtype; the values a method sees equal those of upcasting first (so every number of every run is
unchanged)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from helpers_clip import synth_store
from typer.testing import CliRunner

from fedfeat.engine.data import build_context, load_run_data, upcast
from fedfeat.methods import get_method
from fedfeat.partition import make_partition
from fedfeat.store.featurestore import FeatureStore

runner = CliRunner()


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    path = synth_store(tmp_path_factory.mktemp("s") / "s.zarr", dim=24, train_per_class=30, test_per_class=10)
    return FeatureStore.open(path, mode="r")


def test_upcast_equals_normalising_the_upcast_whole():
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(1000, 48, generator=g) * 0.3).half()
    x[7] = 0  # a zero row: F.normalize's eps, the same in blocks
    for dt in (torch.float32, torch.float64):
        for chunk in (1, 7, 333, 5000):
            assert torch.equal(upcast(x, dt, True, chunk=chunk), F.normalize(x.to(dt), dim=-1))
            assert torch.equal(upcast(x, dt, False, chunk=chunk), x.to(dt))
    y = torch.randn(4, 3)
    assert upcast(y, torch.float32, False) is y  # already the working dtype: no copy


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("method", ["fedavg", "fedclip"])
def test_run_data_holds_float16_and_the_context_sees_the_upcast_values(store, dtype, method):
    part = make_partition(store.labels("train"), "iid", clients=3, seed=0)
    data = load_run_data(store, part, dtype=dtype)
    assert data.train_x.dtype == data.test_x.dtype == torch.float16  # as stored: half a float32 copy's bytes
    assert data.dtype == dtype and data.text_all.dtype == dtype
    m = get_method(method)
    ctx = build_context(data, m, 0, torch.device("cpu"))
    order, _ = part.order_and_offsets()
    want = torch.from_numpy(store.features("train")[order]).to(
        dtype
    )  # the values before: upcast, then normalise
    norm = m.p.normalize
    assert norm is (method == "fedavg")  # fedclip reads raw features (Fed-MP's code): both paths covered
    assert torch.equal(ctx.feats, F.normalize(want, dim=-1) if norm else want)
    assert ctx.feats.dtype == ctx.test_x.dtype == dtype


def test_a_shared_run_data_makes_its_working_copy_once(store):
    part = make_partition(store.labels("train"), "iid", clients=3, seed=0)
    data = load_run_data(store, part)
    data.memo = {}
    m = get_method("fedavg")
    a = build_context(data, m, 0, torch.device("cpu"))
    b = build_context(data, m, 1, torch.device("cpu"))
    assert a.feats is b.feats and a.test_x is b.test_x
    assert sorted(data.memo) == ["test_x:norm:torch.float32", "train_x:norm:torch.float32"]

"""Flower adapter (``fedfeat.integrations.flower``): the flwr-datasets partitioner returns exactly fedfeat's exported clients,
and ``client_features`` a client's cached rows. The example app (``examples/flower_app.py``) is compiled here and
imported where flwr is installed."""

import importlib.util
import json
import py_compile
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from fedfeat.cli.app import app
from fedfeat.errors import FedfeatError
from fedfeat.integrations import flower
from fedfeat.store.featurestore import FeatureStore
from fedfeat.store.synth import SynthParams, write_synthetic_store

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "flower_app.py"
QUIET = lambda *_: None  # noqa: E731


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    """A synth store with a stored dirichlet partition, and that partition exported by ``fedfeat partition``."""
    d = tmp_path_factory.mktemp("fl")
    p = SynthParams(classes=10, dim=16, train_per_class=30, test_per_class=10, templates=2)
    path = write_synthetic_store(d / "s.zarr", p, stats=False, log=QUIET).path
    export = d / "clients.json"
    r = CliRunner().invoke(
        app,
        ["partition", str(path), "--scheme", "dirichlet", "--alpha", "0.3", "--clients", "7", "--export",
         str(export)],
    )  # fmt: skip
    assert r.exit_code == 0, r.output
    key = "dirichlet-a0.3-c7-s19940817"
    assert key in FeatureStore.open(path).partition_keys()
    clients = [np.asarray(c) for c in json.loads(export.read_text())["clients"]]
    return path, key, export, clients


def _hf_dataset(store_path, split="train"):
    """An HF dataset over the store's rows, as the dataset the store encoded: row r of the split = store row r."""
    datasets = pytest.importorskip("datasets")
    st = FeatureStore.open(store_path)
    labels = st.labels(split)
    return datasets.Dataset.from_dict({"row": np.arange(len(labels)), "label": labels})


def test_partitioner_returns_exactly_the_exported_clients(made):
    pytest.importorskip("flwr_datasets")
    from flwr_datasets.partitioner import Partitioner

    from fedfeat.integrations.flower import FedfeatPartitioner

    path, key, export, clients = made
    ds = _hf_dataset(path)
    for part in (
        FedfeatPartitioner.from_store(path, key, label_column="label"),
        FedfeatPartitioner.from_json(export, store=path, label_column="label"),
        FedfeatPartitioner.from_json(export),
    ):
        assert isinstance(part, Partitioner)
        part.dataset = ds
        assert part.num_partitions == len(clients) == 7
        for i, want in enumerate(clients):
            got = part.load_partition(i)
            assert got["row"] == want.tolist()  # the same rows, in fedfeat's client order
            np.testing.assert_array_equal(part.partition_indices(i), want)
    assert sum(len(c) for c in clients) == len(ds)  # dirichlet drops nothing: every row is someone's


def test_partitioner_refuses_a_dataset_that_is_not_the_stores_split(made):
    pytest.importorskip("flwr_datasets")
    from fedfeat.integrations.flower import FedfeatPartitioner

    path, key, _, clients = made
    ds = _hf_dataset(path)
    short = FedfeatPartitioner.from_store(path, key)
    short.dataset = ds.select(range(len(ds) - 1))
    with pytest.raises(FedfeatError, match="rows"):
        short.load_partition(0)
    shuffled = FedfeatPartitioner.from_store(path, key, label_column="label")
    shuffled.dataset = ds.select(np.random.RandomState(0).permutation(len(ds)))
    with pytest.raises(FedfeatError, match="not the split the store encoded"):
        shuffled.load_partition(0)
    part = FedfeatPartitioner.from_store(path, key)
    part.dataset = ds
    with pytest.raises(FedfeatError, match=r"0\.\.6"):
        part.load_partition(7)
    with pytest.raises(FedfeatError, match="stored: dirichlet-a0.3"):
        FedfeatPartitioner.from_store(path, "iid-c3-s1")
    with pytest.raises(FedfeatError, match="no per-client test rows"):
        FedfeatPartitioner.from_store(path, key, test=True)


def test_dirichlet_joint_local_test_clients(made, tmp_path):
    pytest.importorskip("flwr_datasets")
    from fedfeat.integrations.flower import FedfeatPartitioner
    from fedfeat.partition.make import make_partition

    path = made[0]
    st = FeatureStore.open(path)
    p = make_partition(
        st.labels("train"),
        "dirichlet-joint",
        clients=3,
        alpha=0.5,
        test_labels=st.labels("test"),
        n_classes=10,
    )
    part = FedfeatPartitioner(p, store=st, test=True, label_column="label")
    part.dataset = _hf_dataset(path, "test")
    for i in range(3):
        assert part.load_partition(i)["row"] == p.params["test_clients"][i]


def test_client_features_are_the_clients_stored_rows(made):
    path, key, export, clients = made
    st = FeatureStore.open(path)
    feats, labels = st.features("train"), st.labels("train")
    for source in (key, export):
        for i in (0, 3, 6):
            x, y = flower.client_features(path, source, i)
            assert x.dtype == np.float32 and y.dtype == np.int64
            np.testing.assert_array_equal(x, feats[clients[i]].astype(np.float32))
            np.testing.assert_array_equal(y, labels[clients[i]])
    xt, yt = flower.client_features(st, key, 2, as_torch=True, normalize=True)
    assert isinstance(xt, torch.Tensor) and xt.shape == (len(clients[2]), 16)
    torch.testing.assert_close(xt.norm(dim=1), torch.ones(len(clients[2])))
    tx, ty = flower.split_features(path, "test")
    assert tx.shape == (100, 16) and ty.tolist() == st.labels("test").tolist()
    t = flower.text_features(path)
    assert t.shape == (10, 16) and np.allclose(np.linalg.norm(t, axis=1), 1, atol=1e-6)
    with pytest.raises(FedfeatError, match=r"pass 0\.\.6"):
        flower.client_features(path, key, 7)
    with pytest.raises(FedfeatError, match="--export"):
        flower.client_features(path, "nowhere.json", 0)


def test_missing_extra_is_one_line_naming_it(monkeypatch):
    monkeypatch.setitem(sys.modules, "flwr_datasets.partitioner", None)  # import fails as if not installed
    monkeypatch.setattr(flower, "_CLASS", [])
    with pytest.raises(FedfeatError, match=r"pip install 'fedfeat\[flower\]'") as e:
        flower.FedfeatPartitioner  # noqa: B018
    assert "\n" not in str(e.value)


def test_example_app_compiles_and_imports_with_flwr():
    py_compile.compile(str(EXAMPLE), doraise=True)
    pytest.importorskip("flwr")
    spec = importlib.util.spec_from_file_location("flower_app", EXAMPLE)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    assert mod.client_app is not None and mod.server_app is not None

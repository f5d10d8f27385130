"""``fedfeat combine``: several stores of one encoder as one store whose domains are the source datasets (FedTPG's
cross-dataset federation), on synthetic stores and on stores encoded by a tiny open_clip model (no downloads)."""

import json
from pathlib import Path

import numpy as np
import pytest
from helpers_clip import make_tiny_clip, run_cli, write_cifar10, write_imagefolder

from fedfeat.errors import FedfeatError
from fedfeat.store.combine import combine_stores
from fedfeat.store.featurestore import FeatureStore
from fedfeat.store.synth import SynthParams, write_synthetic_store

QUIET = {"stats": False, "log": lambda *a: None}


def _synth(path: Path, **kw) -> FeatureStore:
    p = SynthParams(
        **{"classes": 3, "dim": 8, "train_per_class": 10, "test_per_class": 4, "templates": 2, **kw}
    )
    return write_synthetic_store(path, p, **QUIET)


@pytest.fixture(scope="module")
def synth_pair(tmp_path_factory):
    d = tmp_path_factory.mktemp("synth")
    return _synth(d / "alpha.zarr"), _synth(d / "beta.zarr", classes=4, seed=1)


# ------------------------------------------------------------------ synthetic sources
def test_combined_store_concatenates_classes_rows_and_text(synth_pair, tmp_path):
    a, b = synth_pair
    out = tmp_path / "ab.zarr"
    r = run_cli(["combine", out, a.path, b.path])
    assert r.exit_code == 0, r.output
    st = FeatureStore.open(out)
    assert st.class_names == a.class_names + b.class_names and st.n_classes == 7
    assert st.domain_names == ["alpha", "beta"]  # both are "synthetic" datasets: the folder names
    assert st.attrs["domain_classes"] == [[0, 1, 2], [3, 4, 5, 6]]
    for split in ("train", "test"):
        na = a.n(split)
        assert st.n(split) == na + b.n(split)
        np.testing.assert_array_equal(st.features(split)[:na], a.features(split))
        np.testing.assert_array_equal(st.features(split)[na:], b.features(split))
        np.testing.assert_array_equal(
            st.labels(split), np.concatenate([a.labels(split), b.labels(split) + 3])
        )
        np.testing.assert_array_equal(st.domains(split), np.repeat([0, 1], [na, b.n(split)]))
    np.testing.assert_array_equal(
        st.text_features(), np.concatenate([a.text_features(), b.text_features()], 1)
    )
    assert st.templates == a.templates and st.embed_dim == 8
    fp = st.fingerprint
    assert fp["dataset"] == {"combined": [a.attrs["fingerprint_hash"], b.attrs["fingerprint_hash"]],
                             "names": ["alpha", "beta"]}  # fmt: skip
    assert [c["classes"] for c in st.attrs["combined_from"]] == [3, 4]
    assert st.attrs["combined_from"][1]["rows"] == {"train": 40, "test": 16}
    st.verify()
    assert run_cli(["info", out, "--verify"]).exit_code == 0
    # an identical store is kept; other names are another store (needs overwrite)
    before = (out / "zarr.json").stat().st_mtime_ns
    assert run_cli(["combine", out, a.path, b.path]).exit_code == 0
    assert (out / "zarr.json").stat().st_mtime_ns == before
    r = run_cli(["combine", out, a.path, b.path, "--name", "x", "--name", "y"])
    assert r.exit_code == 2 and "different store" in r.output
    st = combine_stores(out, [a.path, b.path], ["x", "y"], overwrite=True, chunk_rows=7, log=lambda *a: None)
    assert st.domain_names == ["x", "y"] and st.chunk_rows == 7 and st.n_chunks("train") == 10
    np.testing.assert_array_equal(st.features("train")[30:], b.features("train"))  # chunks across the border
    st.verify()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temporary folder left


def test_train_with_clients_as_source_datasets(synth_pair, tmp_path):
    a, b = synth_pair
    out = tmp_path / "ab.zarr"
    combine_stores(out, [a.path, b.path], ["pets", "cars"], log=lambda *a: None)
    r = run_cli(["train", "--store", out, "--method", "fedavg", "--partition", "domain", "--clients", 2,
                 "--rounds", 1, "--out", tmp_path / "runs"])  # fmt: skip
    assert r.exit_code == 0, r.output
    part = json.loads(next((tmp_path / "runs").glob("*/partition.json")).read_text())
    assert part["params"]["client_domains"] == ["pets", "cars"]
    assert [len(c) for c in part["clients"]] == [30, 40]


def test_mismatched_sources_are_one_line_and_leave_nothing(synth_pair, tmp_path):
    a, b = synth_pair
    out = tmp_path / "bad.zarr"

    def err(*args) -> str:
        r = run_cli(["combine", out, *args])
        assert r.exit_code == 2, r.output
        assert not out.exists() and not list(tmp_path.glob(".bad.zarr*"))
        return r.output.strip()

    wide = _synth(tmp_path / "wide.zarr", dim=16)
    msg = err(a.path, wide.path)
    assert "\n" not in msg and "embed_dim is 8 vs 16" in msg and str(wide.path) in msg and "--backbone" in msg
    more = _synth(tmp_path / "tmpl.zarr", templates=3)
    msg = err(a.path, more.path)
    assert "\n" not in msg and "templates is" in msg and "--templates" in msg
    assert "nested domains" in err(a.path, _synth(tmp_path / "dom.zarr", domains=2).path)
    assert "one --name per store" in err(a.path, b.path, "--name", "x")
    assert "at least two" in err(a.path)
    assert "repeat" in err(a.path, a.path)  # the same folder name twice: name them
    with pytest.raises(FedfeatError, match="one holds the other"):
        combine_stores(a.path, [a.path, b.path], ["x", "y"])


# ------------------------------------------------------------------ encoded sources: the live text encoder
@pytest.fixture(scope="module")
def encoded_pair(tmp_path_factory):
    d = tmp_path_factory.mktemp("enc")
    tc = make_tiny_clip(d / "tc")
    roots = {"cifar10": write_cifar10(d / "cifar-10-batches-py").root,
             "imagefolder": write_imagefolder(d / "animals", {"train": 6, "test": 2}).root}  # fmt: skip
    paths = []
    for fmt, root in roots.items():
        r = run_cli(["encode", "--dataset", fmt, "--root", root, "--backbone", tc.config, "--pretrained", tc.weights,
                     "--out", d / "cache", "--device", "cpu", "--chunk-rows", "16", "--batch-size", "16"])  # fmt: skip
        assert r.exit_code == 0, r.output
        paths.append(Path(r.stdout.strip().splitlines()[-1]))
    return tc, paths


def test_combined_encoded_stores_rebuild_the_text_encoder(encoded_pair, tmp_path, monkeypatch):
    from fedfeat.encoders.live import load_live_text

    monkeypatch.setenv("FEDFEAT_CACHE_DIR", str(tmp_path / "cache"))
    tc, (c10, animals) = encoded_pair
    out = tmp_path / "c10+animals.zarr"
    r = run_cli(["combine", out, c10, animals])
    assert r.exit_code == 0, r.output
    st = FeatureStore.open(out)
    assert st.domain_names == ["cifar10", "animals"]  # the datasets; "imagefolder" says the folder's name
    assert st.class_names[10:] == ["cat", "dog", "sea lion"] and st.attrs["domain_classes"][1] == [10, 11, 12]
    assert st.attrs["backbone_config"] == FeatureStore.open(c10).attrs["backbone_config"]
    assert st.fingerprint["backbone"] == FeatureStore.open(c10).fingerprint["backbone"]
    st.verify()
    live = load_live_text(st)  # the rebuilt tower reproduces the stored text of all 13 classes
    assert live.min_cosine >= 0.999
    r = run_cli(["train", "--store", out, "--method", "promptfl", "--set", "n_ctx=2", "--partition", "domain",
                 "--clients", 2, "--rounds", 1, "--set", "local_epochs=1", "--out", tmp_path / "runs"])  # fmt: skip
    assert r.exit_code == 0, r.output
    part = json.loads(next((tmp_path / "runs").glob("*/partition.json")).read_text())
    assert part["params"]["client_domains"] == ["cifar10", "animals"]


def test_each_dataset_is_predicted_over_its_own_classes(synth_pair, tmp_path):
    """A combined store's test rows are predicted over their own dataset's classes (``domain_classes``, FedTPG's
    per-dataset evaluation): no image of one dataset is predicted as a class of the other, where the same head's
    argmax over all classes does predict across; ``domain_acc`` is each dataset's accuracy."""
    import numpy as np
    from safetensors.torch import load_file

    a, b = synth_pair
    out = tmp_path / "ab.zarr"
    st = combine_stores(out, [a.path, b.path], ["pets", "cars"], log=lambda *a: None)
    r = run_cli(["train", "--store", out, "--method", "fedavg", "--partition", "domain", "--clients", 2,
                 "--participation", 1.0, "--rounds", 2, "--out", tmp_path / "runs"])  # fmt: skip
    assert r.exit_code == 0, r.output
    run = next((tmp_path / "runs").glob("*/summary.json")).parent
    conf = np.load(run / "results.npz")["confusion"]  # [true, predicted]
    assert conf[:3, 3:].sum() == 0 and conf[3:, :3].sum() == 0 and conf.sum() == 28
    w = load_file(run / "weights.safetensors")
    x = st.features("test").astype(np.float32)
    x /= np.linalg.norm(x, axis=1, keepdims=True)
    free = (x @ w["W"].numpy().T + w["b"].numpy()).argmax(1)  # the same head over all 7 classes
    y = st.labels("test")
    assert ((y < 3) != (free < 3)).sum() > 0  # unrestricted, some images land in the other dataset's classes
    s = json.loads((run / "summary.json").read_text())
    d = st.domains("test")
    restricted = np.diag(conf)  # hits per class
    for i, name in enumerate(["pets", "cars"]):
        cls = np.unique(y[d == i])
        assert s["domain_acc"][name] == pytest.approx(100 * restricted[cls].sum() / (d == i).sum())


@pytest.mark.parametrize("method", ["fedavg", "fedclip", "promptfl", "fedtpg"])
def test_the_four_methods_train_across_two_stores(encoded_pair, tmp_path, monkeypatch, method):
    """A federation across two datasets (issue 38): each method of the four trains on the combined store with one
    client per dataset, and its per-dataset accuracy is each dataset's over its own classes."""
    monkeypatch.setenv("FEDFEAT_CACHE_DIR", str(tmp_path / "cache"))
    tc, (c10, animals) = encoded_pair
    out = tmp_path / "two.zarr"
    combine_stores(out, [c10, animals], ["cifar10", "animals"], log=lambda *a: None)
    extra = ["--set", "n_ctx=2"] if method in ("promptfl", "fedtpg") else []
    r = run_cli(["train", "--store", out, "--method", method, "--partition", "domain", "--clients", 2,
                 "--participation", 1.0, "--rounds", 1, "--set", "local_epochs=1", *extra, "--out", tmp_path / "runs"])  # fmt: skip
    assert r.exit_code == 0, r.output
    run = next((tmp_path / "runs").glob("*/summary.json")).parent
    s = json.loads((run / "summary.json").read_text())
    assert set(s["domain_acc"]) == {"cifar10", "animals"}
    conf = __import__("numpy").load(run / "results.npz")["confusion"]
    assert conf[:10, 10:].sum() == 0 and conf[10:, :10].sum() == 0  # each dataset over its own classes

"""``encode --dataset hf:...`` and ``wds:...`` (fedfeat.data.hf) on fixtures written here, never downloaded.

The same images are written as an ImageFolder tree, as a Hugging Face ``DatasetDict`` saved with
``save_to_disk`` (image bytes embedded, ``ClassLabel`` names) and as webdataset tar shards in CLIP_benchmark's
layout (``train/{0,1}.tar``, ``test/{0,1}.tar``, ``classnames.txt``); all three must encode to the same store.
"""

import sys
import tarfile
import time
from pathlib import Path

import numpy as np
import pytest
from helpers_clip import (
    TINY_NAME,
    cli_error_text,
    kill_after_first_chunk,
    make_tiny_clip,
    run_cli,
    store_snapshot,
    write_imagefolder,
)

from fedfeat.data import open_dataset
from fedfeat.errors import FedfeatError
from fedfeat.store.featurestore import FeatureStore

datasets = pytest.importorskip("datasets")
wds = pytest.importorskip("webdataset")

CLASSES = ("cat", "dog", "sea_lion")


@pytest.fixture(scope="module")
def tc(tmp_path_factory):
    return make_tiny_clip(tmp_path_factory.mktemp("tinyclip"))


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """ImageFolder ``pets/{train,test}/<class>/<i>.png``: 12 train and 6 test images of varying sizes."""
    return write_imagefolder(
        tmp_path_factory.mktemp("data") / "pets", {"train": 4, "test": 2}, classes=CLASSES
    )


def write_hf(folder, d: Path) -> Path:
    """The folder's images as a saved ``DatasetDict`` (train + validation, which fedfeat stores as test)."""
    feats = datasets.Features(
        {
            "image": datasets.Image(),
            "label": datasets.ClassLabel(names=list(CLASSES)),
            "id": datasets.Value("int64"),
        }
    )
    parts = {}
    for split, src in (("train", "train"), ("validation", "test")):
        rows = {
            "image": [{"bytes": p.read_bytes(), "path": p.name} for p in folder.paths[src]],
            "label": folder.labels[src].tolist(),
            "id": list(range(len(folder.paths[src]))),
        }
        parts[split] = datasets.Dataset.from_dict(rows, features=feats)
    datasets.DatasetDict(parts).save_to_disk(str(d))
    return d


def write_wds(folder, d: Path) -> Path:
    """CLIP_benchmark's wds layout: ``d/{train,test}/{0,1}.tar`` + ``nshards.txt``, ``d/classnames.txt``."""
    for split in ("train", "test"):
        paths, labels = folder.paths[split], folder.labels[split]
        (d / split).mkdir(parents=True)
        half = (len(paths) + 1) // 2
        shards = [range(0, half), range(half, len(paths))]
        for k, rows in enumerate(shards):
            with wds.TarWriter(str(d / split / f"{k}.tar")) as sink:
                for i in rows:
                    sink.write({"__key__": f"s{i:07d}", "png": paths[i].read_bytes(), "cls": int(labels[i])})
        (d / split / "nshards.txt").write_text(f"{len(shards)}\n")
    (d / "classnames.txt").write_text("".join(f"{c}\n" for c in CLASSES))
    return d


def enc_args(dataset, tc, out, *extra, root=None):
    return [
        "encode",
        "--dataset",
        dataset,
        *(["--root", root] if root is not None else []),
        "--backbone",
        tc.config,
        "--pretrained",
        tc.weights,
        "--out",
        out,
        "--device",
        "cpu",
        "--chunk-rows",
        "4",
        "--batch-size",
        "4",
        *extra,
    ]


def encode_ok(args) -> Path:
    r = run_cli(args)
    assert r.exit_code == 0, (r.output, r.exception)
    return Path(r.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def folder_store(tc, folder, tmp_path_factory):
    return encode_ok(enc_args("imagefolder", tc, tmp_path_factory.mktemp("ref"), root=folder.root))


@pytest.fixture(scope="module")
def wds_root(folder, tmp_path_factory):
    return write_wds(folder, tmp_path_factory.mktemp("wds") / "wds_pets")


@pytest.fixture(scope="module")
def wds_store(tc, wds_root, tmp_path_factory):
    return encode_ok(enc_args(f"wds:{wds_root}", tc, tmp_path_factory.mktemp("wdsref")))


def assert_same_store(path: Path, ref: Path) -> None:
    a, b = FeatureStore.open(path), FeatureStore.open(ref)
    assert a.class_names == b.class_names == ["cat", "dog", "sea lion"]
    assert a.splits == b.splits == ["train", "test"]
    for split in ("train", "test"):
        np.testing.assert_array_equal(a.labels(split), b.labels(split))
        fa, fb = a.features(split).astype(np.float32), b.features(split).astype(np.float32)
        assert fa.shape == fb.shape and np.abs(fa - fb).max() <= 1e-6
    np.testing.assert_allclose(a.text_features(), b.text_features(), atol=1e-6)


# ---------------------------------------------------------------------------------------- equality
def test_hf_saved_dataset_encodes_like_imagefolder(tc, folder, folder_store, tmp_path):
    """A DatasetDict saved to disk (relative to --root; validation stored as test) encodes to the ImageFolder
    store's features, labels and class names; the store is named after the saved directory."""
    write_hf(folder, tmp_path / "pets_hf")
    path = encode_ok(enc_args("hf:pets_hf", tc, tmp_path / "cache", root=tmp_path))
    assert path == tmp_path / "cache" / "pets_hf" / f"{TINY_NAME}-tiny.zarr"
    assert_same_store(path, folder_store)
    fp = FeatureStore.open(path).fingerprint["dataset"]
    assert fp["format"] == "hf" and fp["source"]["splits"] == {"train": "train", "test": "validation"}
    assert fp["source"]["image_column"] == "image" and fp["source"]["label_column"] == "label"
    r = run_cli(enc_args("hf:pets_hf", tc, tmp_path / "cache", root=tmp_path))  # same data: nothing to do
    assert r.exit_code == 0 and "nothing to do" in r.output, r.output


def test_wds_shards_encode_like_imagefolder(tc, folder_store, wds_root, wds_store, tmp_path):
    """Two shards per split in CLIP_benchmark's layout encode to the ImageFolder store; a brace pattern over the
    same shards (relative to --root) opens the same rows, labels and class names."""
    assert wds_store.parent.name == "wds_pets"
    assert_same_store(wds_store, folder_store)
    ds = open_dataset("wds:{train,test}/{0..1}.tar", wds_root)
    ref = open_dataset(f"wds:{wds_root}", ".")
    assert ds.split_names == ref.split_names == ["train", "test"]
    assert ds.class_names == ref.class_names and ds.file_digests() == ref.file_digests()
    for s in ds.split_names:
        np.testing.assert_array_equal(ds.labels(s), ref.labels(s))
    assert ds.item_name("train", 7) == "train/1.tar[s0000007.png]"
    assert np.array_equal(np.asarray(ds.load_image("test", 5)), np.asarray(ref.load_image("test", 5)))


# ---------------------------------------------------------------------------------------- crash safety
def test_killed_wds_encode_resumes_identical(tc, wds_root, wds_store, tmp_path):
    """SIGKILL after the first chunk is recorded, then the same command: byte-identical to an uninterrupted
    run (a row range of the shards is the unit of work)."""
    out = tmp_path / "cache"
    args = enc_args(f"wds:{wds_root}", tc, out)
    path = out / "wds_pets" / f"{TINY_NAME}-tiny.zarr"
    kill_after_first_chunk(args, path)
    with pytest.raises(FedfeatError, match="incomplete"):
        FeatureStore.open(path)
    r = run_cli(args)
    assert r.exit_code == 0 and "resuming" in r.output, r.output
    assert store_snapshot(path) == store_snapshot(wds_store)


def test_changed_shard_reencodes_only_its_rows(folder, tmp_path):
    """A shard rewritten with other image bytes changes the fingerprint's files only; its rows are the ones
    re-encoded (encode's refresh rule), and another split's shards are untouched."""
    root = write_wds(folder, tmp_path / "w")
    ds = open_dataset(f"wds:{root}", ".")
    rows, other = ds.rows_of_files({"train/1.tar"})
    assert other == set() and list(rows) == ["train"] and rows["train"].tolist() == list(range(6, 12))
    assert ds.rows_of_files({"classnames.txt"}) == ({}, {"classnames.txt"})
    hf = open_dataset(f"hf:{write_hf(folder, tmp_path / 'h')}", ".")
    names = [n for n, _ in hf.files()]
    assert names == ["train/data-00000-of-00001.arrow", "validation/data-00000-of-00001.arrow"]
    rows, other = hf.rows_of_files({"validation/data-00000-of-00001.arrow"})
    assert other == set() and rows["test"].tolist() == list(range(6))


def write_hf_cache(folder, cache: Path) -> None:
    """``tiny/pets`` as the local ``datasets`` cache holds a Hub dataset (``tiny___pets/default/0.0.0/<hash>/``:
    ``pets-<split>.arrow`` + ``dataset_info.json``): train, validation (images as file paths, as a cached
    ``imagefolder`` keeps them), and an unlabelled test (labels -1)."""
    import pyarrow as pa

    feats = datasets.Features({"image": datasets.Image(), "label": datasets.ClassLabel(names=list(CLASSES))})
    d = cache / "tiny___pets" / "default" / "0.0.0" / "0123abcd"
    d.mkdir(parents=True)
    splits = datasets.SplitDict()
    for split, src in (("train", "train"), ("validation", "test"), ("test", "test")):
        y = folder.labels[src].tolist() if split != "test" else [-1] * len(folder.paths[src])
        images = [{"bytes": p.read_bytes(), "path": None} for p in folder.paths[src]]
        if split == "validation":
            images = [{"bytes": None, "path": str(p)} for p in folder.paths[src]]
        table = datasets.Dataset.from_dict({"image": images, "label": y}, features=feats).data.table
        with pa.OSFile(str(d / f"pets-{split}.arrow"), "wb") as f, pa.ipc.new_stream(f, table.schema) as w:
            w.write_table(table)
        splits.add(datasets.SplitInfo(name=split, num_examples=len(y), dataset_name="pets"))
    info = datasets.DatasetInfo(
        features=feats, config_name="default", dataset_name="pets", builder_name="parquet", splits=splits
    )
    info.write_to_directory(str(d))


def test_hf_local_cache_is_read_offline(folder, tmp_path, monkeypatch):
    """A dataset in the local datasets cache is read with offline mode forced (even with HF_HUB_OFFLINE unset,
    and restored afterwards); the unlabelled test split is left out and validation becomes test; a name that
    is not cached fails at once naming the cache, without trying the network."""
    import huggingface_hub.constants as hub

    write_hf_cache(folder, tmp_path / "hfcache")
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "hfcache"))
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(hub, "HF_HUB_OFFLINE", False)
    ds = open_dataset("hf:tiny/pets:default", tmp_path)
    assert (datasets.config.HF_HUB_OFFLINE, hub.HF_HUB_OFFLINE) == (False, False)
    assert ds.split_names == ["train", "test"] and ds.class_names == ["cat", "dog", "sea lion"]
    assert ds.split_sources == {"train": "train", "test": "validation"} and ds.dropped_splits == ["test"]
    np.testing.assert_array_equal(ds.labels("test"), folder.labels["test"])
    assert np.array_equal(np.asarray(ds.load_image("test", 3)), np.asarray(folder_image(folder, "test", 3)))
    ext = [str(p.resolve()) for p in folder.paths["test"]]  # image files named by path: fingerprinted too
    assert [n for n, _ in ds.files()] == sorted(["pets-train.arrow", "pets-validation.arrow", *ext])
    rows, other = ds.rows_of_files({ext[3]})
    assert other == set() and list(rows) == ["test"] and rows["test"].tolist() == [3]
    from fedfeat.data.external import default_store_name

    assert default_store_name("hf:tiny/pets:default", tmp_path) == "pets-default"
    t = time.monotonic()
    with pytest.raises(FedfeatError, match=r"'nobody/nothing' is not in the local datasets cache .*hfcache"):
        open_dataset("hf:nobody/nothing", tmp_path)
    assert time.monotonic() - t < 5


# ---------------------------------------------------------------------------------------- errors and options
def test_missing_extra_is_one_line(monkeypatch, tmp_path):
    """Without the optional packages: one line naming the extra, nothing else."""
    monkeypatch.setitem(sys.modules, "datasets", None)
    monkeypatch.setitem(sys.modules, "webdataset", None)
    with pytest.raises(FedfeatError) as e:
        open_dataset("hf:whatever", tmp_path)
    assert str(e.value) == "hf: datasets need the 'datasets' package: pip install 'fedfeat[hf]'"
    with pytest.raises(FedfeatError) as e:
        open_dataset("wds:x-{0..1}.tar", tmp_path)
    assert str(e.value) == "wds: shards need the 'webdataset' package: pip install 'fedfeat[hf]'"


def test_columns_named_by_flags_and_errors(tc, folder, tmp_path):
    """Two ClassLabel columns and no 'label': refused until --label-column names one; a plain int column needs
    --classnames; options on other formats, wds without class names, a gzipped shard and an uncached hub
    name are one-line errors."""
    images = [{"bytes": p.read_bytes(), "path": None} for p in folder.paths["test"]]
    y = folder.labels["test"].tolist()
    feats = datasets.Features(
        {
            "pic": datasets.Image(),
            "kind": datasets.ClassLabel(names=["a", "b", "c"]),
            "coarse": datasets.ClassLabel(names=["x", "y", "z"]),
            "raw": datasets.Value("int64"),
        }
    )
    datasets.Dataset.from_dict(
        {"pic": images, "kind": y, "coarse": y, "raw": y}, features=feats
    ).save_to_disk(str(tmp_path / "one"))
    with pytest.raises(FedfeatError, match=r"2 ClassLabel columns \(kind, coarse\); name the label column"):
        open_dataset("hf:one", tmp_path)
    ds = open_dataset("hf:one", tmp_path, {"label_column": "coarse"})
    assert ds.split_names == ["train"] and ds.class_names == ["x", "y", "z"] and ds.image_column == "pic"
    with pytest.raises(FedfeatError, match="not a ClassLabel.*--classnames FILE"):
        open_dataset("hf:one", tmp_path, {"label_column": "raw"})
    (tmp_path / "names.txt").write_text("red\ngreen\nblue_sky\n")
    ds = open_dataset("hf:one", tmp_path, {"label_column": "raw", "classnames": tmp_path / "names.txt"})
    assert ds.class_names == ["red", "green", "blue sky"]
    assert np.array_equal(np.asarray(ds.load_image("train", 1)), np.asarray(folder_image(folder, "test", 1)))
    with pytest.raises(FedfeatError, match="--image-column applies to hf: and wds: datasets only"):
        open_dataset("imagefolder", folder.root, {"image_column": "pic"})
    with pytest.raises(FedfeatError, match="not in the local datasets cache.*never downloads"):
        open_dataset("hf:nobody/nothing-here", tmp_path)

    root = write_wds(folder, tmp_path / "w")
    (root / "classnames.txt").unlink()
    with pytest.raises(FedfeatError, match="no classnames.txt beside the shards.*--classnames FILE"):
        open_dataset(f"wds:{root}", ".")
    ds = open_dataset(f"wds:{root}/train/{{0..1}}.tar", ".", {"classnames": tmp_path / "names.txt"})
    assert ds.split_names == ["train"] and ds.n("train") == 12
    with pytest.raises(FedfeatError, match="sample 's0000000' in .*0.tar has no image \\(jpg\\)"):
        open_dataset(f"wds:{root}/train", ".", {"classnames": tmp_path / "names.txt", "image_column": "JPG"})
    with tarfile.open(tmp_path / "z.tar", "w:gz") as tf:
        tf.add(root / "train" / "0.tar", arcname="x.tar")
    with pytest.raises(FedfeatError, match="not a readable uncompressed tar file"):
        open_dataset("wds:z.tar", tmp_path, {"classnames": tmp_path / "names.txt"})
    with pytest.raises(FedfeatError, match=r"shard .*2.tar not found \(6 of 8 missing\)"):
        open_dataset("wds:train/{0..7}.tar", root)

    r = run_cli(enc_args("imagefolder", tc, tmp_path / "c"))  # --root only optional for hf:/wds:
    assert "--root is required for --dataset imagefolder" in cli_error_text(r)


def folder_image(folder, split, i):
    from PIL import Image

    with Image.open(folder.paths[split][i]) as img:
        return img.convert("RGB")

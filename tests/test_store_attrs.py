"""Attributes that lie (issue 26, class 4): every attribute a store's writer records is checked against the arrays.

Each case plants one disagreement in a copy of a tiny store by editing its zarr attributes (or, for dtypes and
partitions, an array) and asserts that

* ``verify`` (``fedfeat info --verify``) names it in one line -- the attribute, its value and what the arrays
  say -- and ``info --verify`` prints every disagreement on a line of its own, then one error line, rc 2;
* where the disagreement is about shapes, chunking, dtypes or attribute types (``SHAPE``: what ``open`` checks
  from the arrays' metadata), ``train`` (Python and CLI) and ``info`` refuse the store in one line naming it;
* an honest store (synthetic, with pixels, with a partition, encode-shaped fingerprint) has no problem at all.
"""

from __future__ import annotations

import re
import shutil
import zlib

import numpy as np
import pytest
import zarr

import fedfeat
from fedfeat.errors import FedfeatError
from fedfeat.partition.stored import store_partition
from fedfeat.store.featurestore import DONE_BIT, FORMAT_VERSION, FeatureStore, fingerprint_hash
from fedfeat.store.synth import SynthParams, write_synthetic_store
from tests.helpers_clip import run_cli

TINY = SynthParams(classes=3, dim=8, train_per_class=20, test_per_class=5, templates=2)
FAST = dict(method="fedavg", rounds=1, clients=3, partition="iid", kernel="torch")


def _crc(a) -> int:
    return DONE_BIT | (zlib.crc32(np.ascontiguousarray(a).view(np.uint8).reshape(-1)) & 0xFFFFFFFF)


def _pixel_store(path):
    """A tiny store with pixels (2 x 2 images), complete."""
    rng = np.random.default_rng(0)
    st = FeatureStore.create(
        path, backbone="toy", pretrained="none", embed_dim=8, logit_scale=100.0, class_names=["a", "b", "c"],
        templates=["a photo of a {}."], preprocessing={"kind": "none"}, fingerprint={"toy": 1},
        labels={"train": np.arange(12) % 3, "test": np.arange(6) % 3}, chunk_rows=8,
        pixels={"size": [2, 2], "mean": [0.5, 0.5, 0.5], "std": [0.25, 0.25, 0.25]},
    )  # fmt: skip
    for split in st.splits:
        for i in range(st.n_chunks(split)):
            sl = st.chunk_slice(split, i)
            n = sl.stop - sl.start
            st.write_chunk(
                split, i, rng.standard_normal((n, 8)), rng.integers(0, 255, (n, 3, 2, 2), np.uint8)
            )
    st.write_text(rng.standard_normal((1, 3, 8)))
    st.mark_complete()


def _encode_like_store(path):
    """A store whose fingerprint has encode's shape (dataset, backbone, templates, preprocessing, precision)."""
    rng = np.random.default_rng(1)
    names, tmpl = ["cat", "dog", "eel"], ["a photo of a {}.", "a {}."]
    labels = {"train": np.arange(12) % 3, "test": np.arange(6) % 3}
    fp = {
        "format_version": FORMAT_VERSION, "encoder_version": 1,
        "dataset": {"format": "folder", "splits": {"train": 12, "test": 6}, "n_classes": 3, "class_names": names,
                    "files": "0" * 16},
        "backbone": {"name": "RN50", "config_sha256": "0" * 8}, "weights": {"tag": "openai"},
        "preprocessing": {"size": 224}, "templates": tmpl, "precision": "fp32",
    }  # fmt: skip
    st = FeatureStore.create(
        path, backbone="RN50", pretrained="openai", embed_dim=8, logit_scale=100.0, class_names=names,
        templates=tmpl, preprocessing={"size": 224, "transform": "Resize(224)"}, fingerprint=fp, labels=labels,
        extra_attrs={"dataset": "folder", "precision": "fp32", "backbone_config": {"embed_dim": 8},
                     "weights_file": None, "created_at": "2024-01-01T00:00:00+00:00"},
    )  # fmt: skip
    for split in st.splits:
        st.write_chunk(split, 0, rng.standard_normal((st.n(split), 8)))
    st.write_text(rng.standard_normal((2, 3, 8)))
    st.update_attrs(skipped={})
    st.mark_complete()


@pytest.fixture(scope="module")
def bases(tmp_path_factory):
    root = tmp_path_factory.mktemp("store-attrs")
    write_synthetic_store(root / "synth.zarr", TINY, stats=False, log=lambda *a: None)
    st = FeatureStore.open(root / "synth.zarr", mode="r+")
    store_partition(st, scheme="iid", clients=3, seed=0)  # partitions/iid-c3-s0
    _pixel_store(root / "pixels.zarr")
    _encode_like_store(root / "encoded.zarr")
    return root


# ---------------------------------------------------------------------------------------- planting
def attrs(**kv):
    def plant(g):
        g.attrs.update(kv)

    return plant


def fingerprint(**kv):
    """Change fields of the fingerprint and record its new hash (so that only the field lies)."""

    def plant(g):
        fp = {**g.attrs["fingerprint"], **kv}
        g.attrs.update(fingerprint=fp, fingerprint_hash=fingerprint_hash(fp))

    return plant


def dataset_fp(**kv):
    def plant(g):
        fp = dict(g.attrs["fingerprint"])
        fp["dataset"] = {**fp["dataset"], **kv}
        g.attrs.update(fingerprint=fp, fingerprint_hash=fingerprint_hash(fp))

    return plant


def drop_attr(name):
    def plant(g):
        a = dict(g.attrs)
        del a[name]
        g.attrs.put(a)

    return plant


def retype(name, dtype):
    """Rewrite array ``name`` with another dtype (same values, same shape and chunks)."""

    def plant(g):
        arr = g[name]
        data, shape, chunks = arr[:], arr.shape, arr.chunks
        parent, leaf = name.rsplit("/", 1)
        del g[parent][leaf]
        g[parent].create_array(leaf, shape=shape, chunks=chunks, dtype=dtype, fill_value=0)[:] = data.astype(
            dtype
        )

    return plant


def label(split, row, value):
    """Give ``row`` of ``split`` the label ``value``, with a matching checksum (so only the range lies)."""

    def plant(g):
        lab = g[f"{split}/labels"][:]
        lab[row] = value
        g[f"{split}/labels"][:] = lab
        g[f"{split}/labels_crc"][0] = _crc(lab.astype(np.int64))

    return plant


def partition(order=None, offsets=None, **params):
    """Rewrite the stored partition's arrays (checksums updated) or its params."""

    def plant(g):
        pg = g["partitions/iid-c3-s0"]
        a = dict(pg.attrs)
        for name, fn in (("order", order), ("offsets", offsets)):
            if fn is not None:
                new = fn(pg[name][:]).astype(np.int64)
                del pg[name]
                pg.create_array(
                    name, shape=new.shape, chunks=(max(len(new), 1),), dtype="int64", fill_value=0
                )
                pg[name][:] = new
                a["crc"][name] = _crc(new) ^ DONE_BIT
        a["params"] = {**a["params"], **params}
        pg.attrs.put(a)

    return plant


def _set(a, i, v):
    a = a.copy()
    a[i] = v
    return a


# id -> (base store, planter, patterns of the disagreement's line, shape: refused at open / train)
CASES = {
    "embed_dim": (
        "synth",
        attrs(embed_dim=16),
        [
            r"attribute embed_dim = 16, but train/features has D = 8",
            r"attribute embed_dim = 16, but text/features has D = 8",
        ],
        True,
    ),  # fmt: skip
    "embed_dim not int": (
        "synth",
        attrs(embed_dim="8"),
        [r"attribute embed_dim = '8' is not a positive integer"],
        True,
    ),
    "class_names more": (
        "synth",
        attrs(class_names=["a", "b", "c", "d"]),
        [r"attribute class_names = 4 classes, but text/features holds 3"],
        True,
    ),  # fmt: skip
    "class_names fewer": (
        "synth",
        attrs(class_names=["a", "b"]),
        [
            r"attribute class_names = 2 classes, but text/features holds 3",
            r"attribute class_names = 2 classes, but (train|test)/labels holds label 2 at row \d+",
        ],
        True,
    ),  # fmt: skip
    "class_names not strings": (
        "synth",
        attrs(class_names=[1, 2, 3]),
        [r"attribute class_names = \[1, 2, 3\] is not a non-empty list of strings"],
        True,
    ),  # fmt: skip
    "label out of range": (
        "synth",
        label("train", 5, 3),
        [r"attribute class_names = 3 classes, but train/labels holds label 3 at row 5"],
        False,
    ),  # fmt: skip
    "label below -1": (
        "synth",
        label("test", 0, -2),
        [r"attribute class_names = 3 classes, but test/labels holds label -2 at row 0"],
        False,
    ),  # fmt: skip
    "templates": (
        "synth",
        attrs(templates=["{}"]),
        [r"attribute templates = 1 templates, but text/features holds 2"],
        True,
    ),  # fmt: skip
    "splits count": (
        "synth",
        attrs(splits={"train": 61, "test": 15}),
        [r"attribute splits.train = 61, but train/features has 60 rows"],
        True,
    ),  # fmt: skip
    "splits extra": (
        "synth",
        attrs(splits={"train": 60, "test": 15, "val": 5}),
        [r"attribute splits = \{'val': 5\}, but the store has no group val"],
        True,
    ),  # fmt: skip
    "splits not a dict": (
        "synth",
        attrs(splits=["train"]),
        [r"attribute splits = \['train'\] is not a dict"],
        True,
    ),
    "chunk_rows": (
        "synth",
        attrs(chunk_rows=4),
        [
            r"attribute chunk_rows = 4, but train/features is chunked by 60 rows",
            r"attribute chunk_rows = 4, but train/done has \[1\] entries",
        ],
        True,
    ),  # fmt: skip
    "logit_scale nan": (
        "synth",
        attrs(logit_scale=float("nan")),
        [r"attribute logit_scale = nan is not a finite number > 0"],
        True,
    ),
    "logit_scale negative": (
        "synth",
        attrs(logit_scale=-1.0),
        [r"attribute logit_scale = -1.0 is not a finite number > 0"],
        True,
    ),
    "logit_scale zero": (
        "synth",
        attrs(logit_scale=0),
        [r"attribute logit_scale = 0 is not a finite number > 0"],
        True,
    ),
    "logit_scale string": (
        "synth",
        attrs(logit_scale="100"),
        [r"attribute logit_scale = '100' is not a finite number"],
        True,
    ),
    "backbone empty": (
        "synth",
        attrs(backbone=""),
        [r"attribute backbone = '' is not a non-empty string"],
        True,
    ),
    "complete not bool": (
        "synth",
        attrs(complete="yes"),
        [r"attribute complete = 'yes' is not true or false"],
        True,
    ),
    "features dtype": (
        "synth",
        retype("train/features", "float32"),
        [r"array train/features has dtype float32, but format version 2 stores float16"],
        True,
    ),  # fmt: skip
    "labels dtype": (
        "synth",
        retype("test/labels", "int32"),
        [r"array test/labels has dtype int32, but format version 2 stores int64"],
        True,
    ),  # fmt: skip
    "done dtype": (
        "synth",
        retype("test/done", "int64"),
        [r"array test/done has dtype int64, but format version 2 stores uint64"],
        True,
    ),
    "text dtype": (
        "synth",
        retype("text/features", "float32"),
        [r"array text/features has dtype float32"],
        True,
    ),
    "fingerprint_hash": (
        "synth",
        attrs(fingerprint_hash="0" * 16),
        [r"attribute fingerprint_hash = '0{16}', but the fingerprint attribute hashes to [0-9a-f]{16}"],
        False,
    ),  # fmt: skip
    "fingerprint dim": (
        "synth",
        fingerprint(dim=16),
        [r"attribute fingerprint.dim = 16, but the arrays have D = 8"],
        False,
    ),
    "fingerprint classes": (
        "synth",
        fingerprint(classes=4),
        [r"attribute fingerprint.classes = 4, but text/features holds 3"],
        False,
    ),
    "fingerprint templates": (
        "synth",
        fingerprint(templates=5),
        [r"attribute fingerprint.templates = 5, but text/features holds 2"],
        False,
    ),
    "fingerprint per class": (
        "synth",
        fingerprint(train_per_class=30),
        [r"attribute splits.train = 60, but fingerprint's train_per_class x classes = 30 x 3 = 90"],
        False,
    ),  # fmt: skip
    "synth_params": (
        "synth",
        attrs(synth_params={**TINY.__dict__, "seed": 5}),
        [r"attribute synth_params = \{seed: 5\}, but the fingerprint says \{seed: 0\}"],
        False,
    ),  # fmt: skip
    "skipped": (
        "synth",
        attrs(skipped={"train": ["img1.png"]}),
        [r"attribute skipped.train = 1 images, but train/labels marks 0 rows -1"],
        False,
    ),  # fmt: skip
    "pixels without arrays": (
        "synth",
        attrs(pixels={"size": [2, 2], "mean": [0.5] * 3, "std": [0.2] * 3}),
        [r"attribute pixels = .*, but split train has no pixels array"],
        True,
    ),  # fmt: skip
    "pixels size": (
        "pixels",
        attrs(pixels={"size": [4, 4], "mean": [0.5] * 3, "std": [0.25] * 3}),
        [r"attribute pixels.size = \[4, 4\], but train/pixels holds images of shape \[3, 2, 2\]"],
        True,
    ),  # fmt: skip
    "pixels std": (
        "pixels",
        attrs(pixels={"size": [2, 2], "mean": [0.5] * 3, "std": [0.25, 0, 0.25]}),
        [r"attribute pixels.std = \[0.25, 0, 0.25\] is not 3 finite numbers > 0"],
        True,
    ),  # fmt: skip
    "pixels attribute gone": (
        "pixels",
        drop_attr("pixels"),
        [r"array train/pixels exists, but the store has no attribute pixels"],
        True,
    ),  # fmt: skip
    "pixels dtype": (
        "pixels",
        retype("test/pixels", "int16"),
        [r"array test/pixels has dtype int16, but format version 2 stores uint8"],
        True,
    ),
    "pixels_crc count": (
        "pixels",
        attrs(chunk_rows=4),
        [
            r"attribute chunk_rows = 4, but train/features is chunked by 8 rows",
            r"attribute chunk_rows = 4, but train/pixels_crc has \[2\] entries",
        ],
        True,
    ),
    "backbone_config": (
        "encoded",
        attrs(backbone_config={"embed_dim": 16}),
        [r"attribute backbone_config.embed_dim = 16, but the store's arrays and embed_dim are D = 8"],
        True,
    ),  # fmt: skip
    "precision type": (
        "encoded",
        attrs(precision=32),
        [r"attribute precision = 32 is not a string or null"],
        True,
    ),
    "fingerprint backbone": (
        "encoded",
        fingerprint(backbone={"name": "ViT-B-32"}),
        [r"attribute fingerprint.backbone.name = 'ViT-B-32', but attribute backbone is 'RN50'"],
        False,
    ),  # fmt: skip
    "fingerprint precision": (
        "encoded",
        fingerprint(precision="fp16"),
        [r"attribute fingerprint.precision = 'fp16', but attribute precision is 'fp32'"],
        False,
    ),  # fmt: skip
    "fingerprint template list": (
        "encoded",
        fingerprint(templates=["a {}."]),
        [r"attribute fingerprint.templates = 1 templates, but attribute templates"],
        False,
    ),  # fmt: skip
    "fingerprint preprocessing": (
        "encoded",
        fingerprint(preprocessing={"size": 336}),
        [r"attribute fingerprint.preprocessing.size = 336, but attribute preprocessing.size is 224"],
        False,
    ),  # fmt: skip
    "fingerprint format": (
        "encoded",
        fingerprint(format_version=1),
        [r"attribute fingerprint.format_version = 1, but the store is format version 2"],
        False,
    ),  # fmt: skip
    "dataset splits": (
        "encoded",
        dataset_fp(splits={"train": 13, "test": 6}),
        [r"attribute fingerprint.dataset.splits = \{'train': 13, 'test': 6\}, but attribute splits"],
        False,
    ),  # fmt: skip
    "dataset n_classes": (
        "encoded",
        dataset_fp(n_classes=4),
        [r"attribute fingerprint.dataset.n_classes = 4, but class_names and text/features hold 3"],
        False,
    ),  # fmt: skip
    "dataset class names": (
        "encoded",
        dataset_fp(class_names=["cat", "dog", "emu"]),
        [r"attribute fingerprint.dataset.class_names = 3 names, but attribute class_names holds other"],
        False,
    ),  # fmt: skip
    "partition row out of range": (
        "synth",
        partition(order=lambda o: _set(o, 0, 60)),
        [r"partition iid-c3-s0: order holds row 60, but split train has 60 rows \(0..59\)"],
        False,
    ),  # fmt: skip
    "partition row twice": (
        "synth",
        partition(order=lambda o: _set(o, 1, o[0])),
        [r"partition iid-c3-s0: order holds a row twice"],
        False,
    ),  # fmt: skip
    "partition offsets": (
        "synth",
        partition(offsets=lambda f: _set(f, -1, f[-1] - 1)),
        [r"partition iid-c3-s0: offsets must rise from 0 to len\(order\) = 60"],
        False,
    ),  # fmt: skip
    "partition clients": (
        "synth",
        partition(clients=4),
        [r"partition iid-c3-s0: attribute params.clients = 4, but offsets describe 3 clients"],
        False,
    ),  # fmt: skip
    "partition n_samples": (
        "synth",
        partition(n_samples=61),
        [r"partition iid-c3-s0: attribute params.n_samples = 61, but split train has 60 rows"],
        False,
    ),  # fmt: skip
}


@pytest.fixture
def planted(request, bases, tmp_path):
    base, plant, patterns, shape = CASES[request.param]
    path = tmp_path / f"{base}.zarr"
    shutil.copytree(bases / f"{base}.zarr", path)
    plant(zarr.open_group(str(path), mode="r+", zarr_format=3))
    return path, patterns, shape


def _lines(msg: str) -> None:
    assert msg and "\n" not in msg and "Traceback" not in msg, msg


@pytest.mark.parametrize("name", ["synth", "pixels", "encoded"])
def test_an_honest_store_has_no_problem(bases, name):
    st = FeatureStore.open(bases / f"{name}.zarr")
    assert st.attribute_problems(deep=True) == []
    st.verify()


@pytest.mark.parametrize("planted", list(CASES), indirect=True)
def test_verify_names_every_planted_disagreement(planted):
    path, patterns, shape = planted
    st = FeatureStore.open(path, allow_incomplete=True, check=False)
    logged: list[str] = []
    with pytest.raises(FedfeatError) as e:
        st.verify(log=logged.append)
    msg = str(e.value)
    _lines(msg)
    for line in logged:
        _lines(line)
    for pat in patterns:  # each disagreement a line of its own
        assert any(re.search(pat, line) for line in logged), (pat, logged)
    fix = "fedfeat partition" if all(x.startswith("partition ") for x in logged) else "rebuild the store"
    assert re.search(re.escape(logged[0]), msg) and fix in msg, msg
    # without a log, the one line still names the first
    with pytest.raises(FedfeatError, match=re.escape(logged[0])):
        FeatureStore.open(path, allow_incomplete=True, check=False).verify()


@pytest.mark.parametrize("planted", [k for k, c in CASES.items() if c[3]], indirect=True)
def test_train_and_info_refuse_a_store_whose_shapes_lie(planted, tmp_path):
    path, patterns, _ = planted
    with pytest.raises(FedfeatError) as e:
        fedfeat.train(store=path, out=tmp_path / "runs", **FAST)
    msg = str(e.value)
    _lines(msg)
    assert re.search(patterns[0], msg) and "info --verify" in msg, msg
    assert not (tmp_path / "runs").exists() or not any((tmp_path / "runs").rglob("summary.json"))
    with pytest.raises(FedfeatError, match=re.escape(msg)):
        fedfeat.open_store(path)


@pytest.mark.parametrize("case", ["embed_dim", "class_names fewer", "pixels size", "done dtype"])
def test_cli_train_and_info_verify(bases, tmp_path, case):
    base, plant, patterns, _ = CASES[case]
    path = tmp_path / "s.zarr"
    shutil.copytree(bases / f"{base}.zarr", path)
    plant(zarr.open_group(str(path), mode="r+", zarr_format=3))
    r = run_cli(["train", "--store", path, "--out", tmp_path / "runs", "--method", "fedavg", "--rounds", "1",
                 "--clients", "3", "--partition", "iid", "--kernel", "torch", "--quiet"])  # fmt: skip
    assert r.exit_code == 2, r.output
    lines = r.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and re.search(patterns[0], lines[0]), r.output
    r = run_cli(["info", "--verify", path])
    assert r.exit_code == 2, r.output
    lines = r.output.strip().splitlines()
    assert lines[-1].startswith("error: ") and "Traceback" not in r.output, r.output
    for pat in patterns:
        assert any(re.search(pat, line) and not line.startswith("error") for line in lines), (pat, r.output)
    r = run_cli(["info", path])  # without --verify: refused in one line, pointing to --verify
    assert r.exit_code == 2 and "info --verify" in r.output and len(r.output.strip().splitlines()) == 1, (
        r.output
    )


def test_a_lying_partition_is_refused_when_read_and_made_again_by_fedfeat_partition(bases, tmp_path):
    """A stored partition whose order points outside its split: reading it is refused in one line, verify names
    it, and ``fedfeat partition`` with the same settings (what the message advises) replaces it."""
    from fedfeat.partition import stored

    path = tmp_path / "s.zarr"
    shutil.copytree(bases / "synth.zarr", path)
    partition(order=lambda o: _set(o, 0, 60))(zarr.open_group(str(path), mode="r+", zarr_format=3))
    with pytest.raises(
        FedfeatError, match=r"order holds row 60, but split train has 60 rows.*fedfeat partition"
    ) as e:
        stored.read(FeatureStore.open(path), "iid-c3-s0")
    _lines(str(e.value))
    r = run_cli(["info", "--verify", path])
    assert r.exit_code == 2 and "order holds row 60" in r.output, r.output
    r = run_cli(["partition", path, "--scheme", "iid", "--clients", "3", "--seed", "0"])
    assert r.exit_code == 0, r.output
    st = FeatureStore.open(path)
    assert st.attribute_problems() == [] and stored.read(st, "iid-c3-s0").n_clients == 3
    st.verify()

"""Every dataset reader, enumerated: ``fedfeat.data.files.DATASETS`` and the prefixes ``open_dataset`` accepts
(``hf:``, ``wds:``). Each has a tiny fixture in its published layout in ``FIXTURES``; a reader added without one
fails ``test_every_reader_has_a_fixture``, and every reader with one is opened through ``open_dataset`` and held
to the ``ImageDataset`` contract with values that a wrong reader would not produce (split order, sizes, labels,
class-name order, pixels, content fingerprint, the error for a missing or empty root)."""

from __future__ import annotations

import ast
import inspect
import os
import sys
import textwrap
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
from helpers_clip import CIFAR10_NAMES, write_cifar10, write_cifar100, write_imagefolder, write_listfile
from PIL import Image
from test_data_domains import _registry_fixtures

import fedfeat.data as data_pkg
from fedfeat.data import open_dataset
from fedfeat.data.base import ImageDataset
from fedfeat.data.files import DATASETS
from fedfeat.errors import FedfeatError


# ---------------------------------------------------------------------------------------- what open_dataset takes
def _advertised() -> list[str]:
    """The formats ``open_dataset`` lists for an unknown name: ``cifar10, ..., hf:NAME[:CONFIG], wds:PATTERN``."""
    with pytest.raises(FedfeatError) as e:
        open_dataset("no-such-reader", ".")
    return str(e.value).split("known: ", 1)[1].split(", ")


def _dispatched_prefixes() -> set[str]:
    """The prefixes ``open_dataset`` routes to an external reader: its ``name.startswith((...))`` strings."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(data_pkg.open_dataset)))
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "startswith" and node.args:
            arg = node.args[0]
            for c in arg.elts if isinstance(arg, ast.Tuple) else [arg]:
                if isinstance(c, ast.Constant) and isinstance(c.value, str):
                    out.add(c.value)
    return out


PREFIXES = [a.split(":", 1)[0] + ":" for a in _advertised() if ":" in a]  # ["hf:", "wds:"]
READERS = [*DATASETS, *PREFIXES]


# ---------------------------------------------------------------------------------------- fixtures
@dataclass
class Written:
    """What a fixture wrote, as the reader must report it."""

    spec: str  # the name given to open_dataset
    root: Path  # the root given to open_dataset
    labels: dict[str, np.ndarray]  # split -> labels, in the order the reader must report the splits
    class_names: list[str]  # in the format's label order
    pixels: Callable[[str, int], np.ndarray]  # [H, W, 3] uint8 written for image i of split
    image_file: Path  # a file holding one image's encoded bytes ...
    image_bytes: bytes  # ... these, exactly once
    image_item: tuple[str, int]  # ... of this item


def _png_pixels(paths: dict[str, list[Path]]) -> Callable[[str, int], np.ndarray]:
    def pixels(split: str, i: int) -> np.ndarray:
        with Image.open(paths[split][i]) as img:
            return np.asarray(img.convert("RGB"))

    return pixels


def _cifar_row(x: np.ndarray) -> bytes:
    return x.transpose(2, 0, 1).reshape(3072).tobytes()  # [32, 32, 3] -> the pickle's CHW row


def cifar10(tmp: Path) -> Written:
    fx = write_cifar10(tmp / "cifar-10-batches-py", n_train=10, n_test=3)  # 2 rows in each data_batch_k
    return Written(
        "cifar10",
        fx.root,
        {"train": fx.labels["train"], "test": fx.labels["test"]},
        list(CIFAR10_NAMES),  # batches.meta's order
        lambda s, i: fx.images[s][i],
        fx.root / "data_batch_5",
        _cifar_row(fx.images["train"][9]),
        ("train", 9),
    )


def cifar100(tmp: Path) -> Written:
    fx = write_cifar100(tmp / "cifar-100-python", n_train=6, n_test=4)
    assert fx.class_names[:2] == ["class 00", "aquarium fish"]  # meta's order, not sorted
    return Written(
        "cifar100",
        fx.root,
        {"train": fx.labels["train"], "test": fx.labels["test"]},
        fx.class_names,
        lambda s, i: fx.images[s][i],
        fx.root / "test",
        _cifar_row(fx.images["test"][3]),
        ("test", 3),
    )


def cinic10(tmp: Path) -> Written:
    # written test-first, classes unsorted: the reader orders splits train, valid, test and classes by name
    fx = write_imagefolder(
        tmp / "cinic", {"test": 1, "valid": 2, "train": 3}, classes=("bird", "airplane", "cat")
    )
    assert fx.class_names == ["airplane", "bird", "cat"]
    return Written(
        "cinic10",
        fx.root,
        {s: fx.labels[s] for s in ("train", "valid", "test")},
        fx.class_names,
        _png_pixels(fx.paths),
        fx.paths["valid"][-1],
        fx.paths["valid"][-1].read_bytes(),
        ("valid", 5),
    )


def imagefolder(tmp: Path) -> Written:
    fx = write_imagefolder(tmp / "pets", {"test": 2, "train": 3}, classes=("sea_lion", "cat", "dog"))
    return Written(
        "imagefolder",
        fx.root,
        {"train": fx.labels["train"], "test": fx.labels["test"]},
        ["cat", "dog", "sea lion"],  # sorted folder names, "_" -> " "
        _png_pixels(fx.paths),
        fx.paths["train"][-1],
        fx.paths["train"][-1].read_bytes(),
        ("train", 8),
    )


def listfile(tmp: Path) -> Written:
    fx = write_listfile(tmp / "lt")  # ImageNet_LT_{train,test}.txt, WordNet ids in classnames.txt
    return Written(
        "listfile",
        fx.root,
        {"train": fx.labels["train"], "test": fx.labels["test"]},
        ["tench", "goldfish", "great white shark"],  # classnames.txt's order, not sorted
        _png_pixels(fx.paths),
        fx.paths["test"][-1],
        fx.paths["test"][-1].read_bytes(),
        ("test", 2),
    )


def _hf_source(tmp: Path):
    """The images that test_datasets_hf's writers store (its CLASSES), and those writers."""
    pytest.importorskip("datasets")
    pytest.importorskip("webdataset")
    import test_datasets_hf as H

    return write_imagefolder(tmp / "src", {"train": 3, "test": 2}, classes=H.CLASSES), H


def hf(tmp: Path) -> Written:
    folder, H = _hf_source(tmp)
    H.write_hf(folder, tmp / "pets_hf")  # DatasetDict train + validation (stored as test), ClassLabel names
    return Written(
        "hf:pets_hf",
        tmp,
        {"train": folder.labels["train"], "test": folder.labels["test"]},
        ["cat", "dog", "sea lion"],
        _png_pixels(folder.paths),
        tmp / "pets_hf" / "validation" / "data-00000-of-00001.arrow",
        folder.paths["test"][-1].read_bytes(),
        ("test", 5),
    )


def wds(tmp: Path) -> Written:
    folder, H = _hf_source(tmp)
    H.write_wds(folder, tmp / "wds_pets")  # {train,test}/{0,1}.tar + nshards.txt, classnames.txt
    return Written(
        "wds:wds_pets",
        tmp,
        {"train": folder.labels["train"], "test": folder.labels["test"]},
        ["cat", "dog", "sea lion"],
        _png_pixels(folder.paths),
        tmp / "wds_pets" / "test" / "1.tar",
        folder.paths["test"][-1].read_bytes(),
        ("test", 5),
    )


FIXTURES: dict[str, Callable[[Path], Written]] = {
    "cifar10": cifar10,
    "cifar100": cifar100,
    "cinic10": cinic10,
    "imagefolder": imagefolder,
    "listfile": listfile,
    "hf:": hf,
    "wds:": wds,
}
# the domain / CoOp-layout readers (coop, domainnet, domainfolder and its presets): their fixtures live with their tests
FIXTURES.update(_registry_fixtures())

# Readers whose missing- or empty-root error does not yet name the root and the layout: reader -> what it says.
# Their test xfails while the gap lasts and fails once it is closed (then drop the entry).
LAYOUT_GAPS = {
    "hf:": "a relative hf:NAME not under --root is looked up as a Hub name: 'not in the local datasets cache'",
    "wds:": "a missing wds: path says 'shard ... not found; check the pattern', without the expected layout",
}

OLD_NS = 1_600_000_000_000_000_000  # files older than base._RACY_NS: their hashes are cached


def build(reader: str, tmp: Path, monkeypatch) -> Written:
    """The reader's fixture under ``tmp``, with fedfeat's hash and index caches (and the datasets cache, once
    imported) private to the test."""
    if reader not in FIXTURES:
        pytest.fail(f"reader {reader!r} has no fixture in FIXTURES")
    monkeypatch.setenv("FEDFEAT_CACHE_DIR", str(tmp / "fedfeat-cache"))
    w = FIXTURES[reader](tmp)
    if "datasets" in sys.modules:
        monkeypatch.setattr(sys.modules["datasets"].config, "HF_DATASETS_CACHE", str(tmp / "hf-cache"))
    return w


@pytest.fixture(params=READERS)
def reader(request):
    return request.param


# ---------------------------------------------------------------------------------------- coverage
def test_every_reader_has_a_fixture():
    missing = [r for r in READERS if r not in FIXTURES]
    assert not missing, (
        f"dataset readers without a fixture in tests/test_readers_registry.py FIXTURES: {', '.join(missing)}"
    )
    stale = [r for r in FIXTURES if r not in READERS]
    assert not stale, f"FIXTURES names readers that open_dataset no longer has: {', '.join(stale)}"
    assert set(LAYOUT_GAPS) <= set(READERS)


def test_the_readers_open_dataset_lists_are_the_ones_it_opens():
    """The unknown-name message lists the registry in order, then one entry per prefix that open_dataset
    dispatches on: a prefix added to the code but not to the message (or the reverse) is caught here."""
    listed = _advertised()
    assert [a for a in listed if ":" not in a] == list(DATASETS)
    assert set(PREFIXES) == _dispatched_prefixes() and PREFIXES
    for name, cls in DATASETS.items():
        assert issubclass(cls, ImageDataset) and cls.format == name and cls.layout, name


# ---------------------------------------------------------------------------------------- the contract
def test_reader_contract(reader, tmp_path, monkeypatch):
    w = build(reader, tmp_path, monkeypatch)
    ds = open_dataset(w.spec, w.root)
    assert isinstance(ds, ImageDataset)
    assert ds.split_names == list(w.labels)
    assert ds.class_names == w.class_names
    k = len(w.class_names)
    for split, want in w.labels.items():
        y = ds.labels(split)
        assert y.dtype == np.int64 and y.shape == (len(want),) and ds.n(split) == len(want), split
        assert y.min() >= 0 and y.max() < k, split
        np.testing.assert_array_equal(y, want, err_msg=split)
        names = [ds.item_name(split, i) for i in range(len(want))]
        assert len(set(names)) == len(names), f"{split}: item names repeat: {names}"
        for i in (0, len(want) - 1):
            img = ds.load_image(split, i)
            px = w.pixels(split, i)
            assert isinstance(img, Image.Image) and img.mode == "RGB", (split, i)
            assert img.size == (px.shape[1], px.shape[0]), (split, i)
            np.testing.assert_array_equal(np.asarray(img), px, err_msg=f"{split}[{i}]")
    with pytest.raises(FedfeatError, match=r"has no split 'nope'; it has: "):
        ds.labels("nope")
    files = ds.files()
    assert files == sorted(files) and all(size > 0 for _, size in files), files


def test_fingerprint_is_stable_and_sees_one_image_change(reader, tmp_path, monkeypatch):
    """Two opens give one fingerprint (the second from the hash cache); changing one image's bytes in place
    (same file size and names) changes it, and the changed file maps back to that image's row."""
    w = build(reader, tmp_path, monkeypatch)
    for dirpath, _, fnames in os.walk(tmp_path):
        for f in fnames:
            os.utime(Path(dirpath) / f, ns=(OLD_NS, OLD_NS))
    fp = open_dataset(w.spec, w.root).fingerprint()
    assert fp["splits"] == {s: len(y) for s, y in w.labels.items()} and fp["class_names"] == w.class_names
    ds = open_dataset(w.spec, w.root)
    assert ds.fingerprint() == fp

    blob = w.image_file.read_bytes()
    at = blob.find(w.image_bytes)
    assert at >= 0 and blob.count(w.image_bytes) == 1, "the fixture's image bytes are not in its file once"
    mid = at + len(w.image_bytes) // 2
    w.image_file.write_bytes(blob[:mid] + bytes([blob[mid] ^ 0xFF]) + blob[mid + 1 :])
    os.utime(w.image_file, ns=(OLD_NS + 10**9, OLD_NS + 10**9))
    changed = open_dataset(w.spec, w.root)
    fp2 = changed.fingerprint()
    assert fp2 != fp and fp2["files"]["sha256"] != fp["files"]["sha256"]
    assert fp2["files"]["files"] == fp["files"]["files"]  # same names and sizes: the content told them apart

    name = w.image_file.resolve().relative_to(changed.root.resolve()).as_posix()
    assert name in fp2["files"]["files"], (name, fp2["files"]["files"])
    rows, other = changed.rows_of_files({name})
    split, i = w.image_item
    assert other == set() and i in rows.get(split, ()), (name, rows)


@pytest.mark.parametrize("where", ["missing", "empty"])
def test_missing_or_empty_root_is_one_line_naming_the_layout(reader, where, tmp_path, monkeypatch):
    w = build(reader, tmp_path / "written", monkeypatch)
    root = tmp_path / "nowhere"
    if where == "empty":
        root.mkdir()
    with pytest.raises(FedfeatError) as e:
        open_dataset(w.spec, root)
    msg = str(e.value)
    assert "\n" not in msg, msg
    layout = DATASETS[reader].layout if reader in DATASETS else _external_layout(reader)
    named = str(root) in msg and layout in msg
    if reader in LAYOUT_GAPS:
        assert not named, f"{reader} now names the root and its layout: drop it from LAYOUT_GAPS"
        pytest.xfail(LAYOUT_GAPS[reader])
    assert named, f"not naming the root {root} and the layout {layout!r}: {msg}"


def _external_layout(prefix: str) -> str:
    if prefix == "hf:":
        from fedfeat.data.hf import HFDataset

        return HFDataset.layout
    from fedfeat.data.wds import WebDataset

    return WebDataset.layout

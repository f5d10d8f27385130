"""Dataset readers (CIFAR pickles, ImageFolder, CINIC-10, list files) and prompt templates."""

import pickle
import shutil

import numpy as np
import pytest
from helpers_clip import (
    CIFAR10_NAMES,
    write_cifar10,
    write_cifar100,
    write_corrupt,
    write_imagefolder,
    write_listfile,
)
from PIL import Image

from fedfeat.data import open_dataset
from fedfeat.data.base import UnreadableImage
from fedfeat.data.files import restricted_load
from fedfeat.data.templates import CIFAR_TEMPLATES, IMAGENET_TEMPLATES, fill, resolve_templates
from fedfeat.errors import FedfeatError


# ---------------------------------------------------------------------------------------- CIFAR
@pytest.mark.parametrize("protocol", ["py2", 4, 5])
def test_cifar10_reads_pickles_of_every_protocol(tmp_path, protocol):
    """Python 2 cPickle files (the published ones) and Python 3 re-pickles give the same images and labels."""
    fx = write_cifar10(tmp_path / "cifar-10-batches-py", protocol=protocol)
    ds = open_dataset("cifar10", fx.root)
    assert ds.split_names == ["train", "test"]
    assert ds.class_names == CIFAR10_NAMES
    for split in ("train", "test"):
        assert ds.labels(split).dtype == np.int64
        np.testing.assert_array_equal(ds.labels(split), fx.labels[split])
    img = ds.load_image("train", 7)
    assert img.mode == "RGB" and img.size == (32, 32)
    np.testing.assert_array_equal(np.asarray(img), fx.images["train"][7])
    np.testing.assert_array_equal(np.asarray(ds.load_image("test", 11)), fx.images["test"][11])
    assert ds.item_name("train", 0) == "data_batch_1[0]"
    assert ds.item_name("train", 39) == "data_batch_5[7]"  # 40 rows in 5 batches of 8


def test_cifar_root_may_be_the_parent_folder(tmp_path):
    write_cifar10(tmp_path / "cifar-10-batches-py")
    assert open_dataset("cifar10", tmp_path).root == tmp_path / "cifar-10-batches-py"


def test_cifar100_fine_labels_and_names(tmp_path):
    fx = write_cifar100(tmp_path / "cifar-100-python")
    ds = open_dataset("cifar100", tmp_path)
    assert len(ds.class_names) == 100 and ds.class_names[1] == "aquarium fish"  # "_" -> " "
    np.testing.assert_array_equal(ds.labels("train"), fx.labels["train"])  # fine, not coarse
    np.testing.assert_array_equal(np.asarray(ds.load_image("test", 3)), fx.images["test"][3])


class _Evil:
    def __reduce__(self):
        return (shutil.rmtree, ("/nonexistent-fedfeat-target",))


def test_restricted_unpickler_refuses_code(tmp_path):
    """A pickle that would call a function (here shutil.rmtree) is refused with the file's name."""
    fx = write_cifar10(tmp_path / "c")
    with open(fx.root / "data_batch_2", "wb") as f:
        pickle.dump({b"data": _Evil(), b"labels": []}, f)
    with pytest.raises(FedfeatError, match=r"data_batch_2 is not a readable CIFAR pickle.*shutil"):
        open_dataset("cifar10", fx.root)
    with pytest.raises(FedfeatError, match="refusing global posix.system|refusing global os.system"):
        p = tmp_path / "evil"
        p.write_bytes(b"cos\nsystem\n(S'echo hi'\ntR.")
        restricted_load(p)


def test_cifar_missing_and_malformed_files_name_the_file(tmp_path):
    fx = write_cifar10(tmp_path / "c")
    (fx.root / "test_batch").unlink()
    with pytest.raises(
        FedfeatError, match=r"test_batch not found; expected the CIFAR-10 python version folder"
    ):
        open_dataset("cifar10", fx.root)
    fx = write_cifar10(tmp_path / "d")
    with open(fx.root / "data_batch_3", "wb") as f:
        pickle.dump({b"data": np.zeros((4, 100), np.uint8), b"labels": [0, 1, 2, 3]}, f)
    with pytest.raises(FedfeatError, match=r"data_batch_3 has no 'data' array of shape \[N, 3072\] uint8"):
        open_dataset("cifar10", fx.root)
    (tmp_path / "e").mkdir()
    (tmp_path / "e" / "meta").write_bytes(b"garbage")
    with pytest.raises(FedfeatError, match=r"meta is not a readable CIFAR pickle"):
        open_dataset("cifar100", tmp_path / "e")
    with pytest.raises(FedfeatError, match="does not exist"):
        open_dataset("cifar10", tmp_path / "nowhere")
    with pytest.raises(FedfeatError, match="unknown dataset 'mnist'; known: cifar10, cifar100"):
        open_dataset("mnist", tmp_path)


# ---------------------------------------------------------------------------------------- folders and lists
def test_imagefolder_labels_follow_the_union_of_class_folders(tmp_path):
    fx = write_imagefolder(tmp_path / "pets", {"train": 3, "test": 2})
    shutil.rmtree(tmp_path / "pets" / "test" / "cat")  # test lacks a class: labels must still agree
    (tmp_path / "pets" / "train" / "dog" / "notes.txt").write_text("not an image")
    (tmp_path / "pets" / "train" / ".hidden").mkdir()
    ds = open_dataset("imagefolder", tmp_path / "pets")
    assert ds.class_names == ["cat", "dog", "sea lion"]
    assert ds.split_names == ["train", "test"]
    np.testing.assert_array_equal(ds.labels("train"), fx.labels["train"])
    np.testing.assert_array_equal(ds.labels("test"), [1, 1, 2, 2])
    assert ds.item_name("train", 3) == "train/dog/000.png"
    img = ds.load_image("train", 3)
    np.testing.assert_array_equal(
        np.asarray(img), np.asarray(Image.open(fx.paths["train"][3]).convert("RGB"))
    )


def test_imagefolder_errors(tmp_path):
    (tmp_path / "flat").mkdir()
    Image.new("RGB", (4, 4)).save(tmp_path / "flat" / "a.png")
    with pytest.raises(
        FedfeatError, match=r"no <split>/<class>/ folders under .*flat; expected root/<split>/<class>"
    ):
        open_dataset("imagefolder", tmp_path / "flat")


def test_cinic10_needs_its_three_splits(tmp_path):
    write_imagefolder(tmp_path / "cinic", {"train": 2, "valid": 1, "test": 1}, classes=CIFAR10_NAMES[:3])
    ds = open_dataset("cinic10", tmp_path / "cinic")
    assert ds.split_names == ["train", "valid", "test"] and ds.n("valid") == 3
    shutil.rmtree(tmp_path / "cinic" / "valid")
    with pytest.raises(FedfeatError, match=r"cinic10: .*valid not found; expected the CINIC-10 folder"):
        open_dataset("cinic10", tmp_path / "cinic")


def test_listfile_imagenet_lt_layout(tmp_path):
    fx = write_listfile(tmp_path / "lt")
    ds = open_dataset("listfile", fx.root)
    assert ds.class_names == ["tench", "goldfish", "great white shark"]  # WordNet ids dropped
    assert ds.split_names == ["train", "test"]  # from ImageNet_LT_train.txt / ImageNet_LT_test.txt
    np.testing.assert_array_equal(ds.labels("train"), fx.labels["train"])
    assert np.asarray(ds.load_image("test", 0)).shape == (36, 44, 3)


def test_listfile_class_names_with_label_numbers(tmp_path):
    fx = write_listfile(tmp_path / "lt")
    (fx.root / "classnames.txt").write_text("2 great_white_shark\n0 tench\n1 goldfish\n")
    (fx.root / "ImageNet_LT_train.txt").rename(fx.root / "train_list.txt")
    ds = open_dataset("listfile", fx.root)
    assert ds.class_names == ["tench", "goldfish", "great white shark"]
    assert ds.split_names == ["train", "test"]


def test_listfile_errors_name_file_and_line(tmp_path):
    fx = write_listfile(tmp_path / "lt")
    (fx.root / "ImageNet_LT_test.txt").write_text("test/a.JPEG 0\ntest/b.JPEG seven\n")
    with pytest.raises(FedfeatError, match=r"ImageNet_LT_test.txt:2: expected 'relative/path label'"):
        open_dataset("listfile", fx.root)
    (fx.root / "ImageNet_LT_test.txt").write_text("test/a.JPEG 3\n")
    with pytest.raises(FedfeatError, match=r"ImageNet_LT_test.txt:1: label 3 is outside 0..2"):
        open_dataset("listfile", fx.root)
    (fx.root / "classnames.txt").unlink()
    with pytest.raises(FedfeatError, match=r"classnames.txt not found; expected root/<split>.txt"):
        open_dataset("listfile", fx.root)


def test_corrupt_and_missing_images_fail_with_their_path(tmp_path):
    write_imagefolder(tmp_path / "d", {"train": 1})
    bad = write_corrupt(tmp_path / "d" / "train" / "cat" / "zzz.png")
    ds = open_dataset("imagefolder", tmp_path / "d")
    i = [ds.item_name("train", k) for k in range(ds.n("train"))].index("train/cat/zzz.png")
    with pytest.raises(UnreadableImage, match=rf"cannot read image {bad}.*--skip-bad"):
        ds.load_image("train", i)
    bad.unlink()
    with pytest.raises(UnreadableImage, match="file not found"):
        ds.load_image("train", i)


def test_fingerprint_tracks_file_names_and_sizes_not_location(tmp_path):
    write_imagefolder(tmp_path / "a", {"train": 2})
    fp = open_dataset("imagefolder", tmp_path / "a").fingerprint()
    shutil.copytree(tmp_path / "a", tmp_path / "b")
    assert open_dataset("imagefolder", tmp_path / "b").fingerprint() == fp
    Image.new("RGB", (50, 50), "red").save(tmp_path / "b" / "train" / "cat" / "000.png")
    assert open_dataset("imagefolder", tmp_path / "b").fingerprint() != fp
    fx = write_cifar10(tmp_path / "c")
    fpc = open_dataset("cifar10", fx.root).fingerprint()
    assert set(fpc["files"]["files"]) == {
        "batches.meta",
        "test_batch",
        *(f"data_batch_{i}" for i in range(1, 6)),
    }


def test_fingerprint_sees_a_same_size_edit_and_caches_hashes_by_size_and_mtime(tmp_path, monkeypatch):
    """Contents, not just sizes: flipping bytes in place changes the fingerprint. Hashes of unchanged files
    come from the cache (keyed by size and mtime_ns); an edited file is hashed again."""
    import os

    from fedfeat.data import base as D

    monkeypatch.setenv("FEDFEAT_CACHE_DIR", str(tmp_path / "cache"))
    fx = write_cifar10(tmp_path / "c")
    old = 1_600_000_000_000_000_000  # files older than the racy window are cacheable
    for f in fx.root.iterdir():
        os.utime(f, ns=(old, old))
    hashed = []
    real = D._hash_file
    monkeypatch.setattr(D, "_hash_file", lambda p: hashed.append(p.name) or real(p))
    fp = open_dataset("cifar10", fx.root).fingerprint()
    assert len(hashed) == 7 and fp["files"]["content"] == "blake2b-128"
    hashed.clear()
    assert open_dataset("cifar10", fx.root).fingerprint() == fp and hashed == []  # all from the cache
    f = fx.root / "data_batch_2"
    data = f.read_bytes()
    row = fx.images["train"][8].transpose(2, 0, 1).reshape(3072).tobytes()  # first image of batch 2
    assert data.count(row) == 1
    f.write_bytes(data.replace(row, bytes(255 - b for b in row)))
    os.utime(f, ns=(old + 10**9, old + 10**9))
    ds = open_dataset("cifar10", fx.root)
    fp2 = ds.fingerprint()
    assert hashed == ["data_batch_2"] and fp2 != fp and fp2["files"]["files"] == fp["files"]["files"]
    rows, other = ds.rows_of_files({"data_batch_2", "batches.meta"})
    assert rows == {"train": pytest.approx(np.arange(8, 16))} and other == {"batches.meta"}


# ---------------------------------------------------------------------------------------- templates
def test_template_sets():
    assert resolve_templates(None) == ["a photo of a {}."] == resolve_templates("single")
    assert len(resolve_templates("cifar")) == 18 and len(set(CIFAR_TEMPLATES)) == 18
    assert len(resolve_templates("imagenet")) == 80 and len(set(IMAGENET_TEMPLATES)) == 80
    assert fill("a photo of the big {}.", "sea lion") == "a photo of the big sea lion."


def test_imagenet_templates_match_open_clip():
    from fedfeat.encoders.openclip import import_open_clip

    oc = import_open_clip()
    assert [t("{}") for t in oc.OPENAI_IMAGENET_TEMPLATES] == list(IMAGENET_TEMPLATES)


def test_template_files_and_errors(tmp_path):
    f = tmp_path / "t.txt"
    f.write_text("# mine\na photo of a {}\n\nitap of a {c}.\n")
    assert resolve_templates(str(f)) == ["a photo of a {}", "itap of a {}."]
    assert resolve_templates("a sketch of a {}.") == ["a sketch of a {}."]
    f.write_text("no slot here\n")
    with pytest.raises(FedfeatError, match=r"t.txt:1\) must contain exactly one '\{\}'"):
        resolve_templates(str(f))
    with pytest.raises(FedfeatError, match="unknown templates 'cifar11'"):
        resolve_templates("cifar11")

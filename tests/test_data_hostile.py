"""Hostile data folders for ``hf:`` / ``wds:`` (issue 26, classes 8 and 9).

* ``nshards.txt`` is bounded by the ``.tar`` files present: a count that is not a plain integer, or that
  disagrees with the shards there (1e9, -1, huge, more or fewer than the folder holds), is one line naming the
  file and both numbers, at once (never an enumeration of a billion names); so are a FIFO or a folder in its
  place, a brace pattern naming a billion shards, and ``.cls`` members that are huge numbers or huge files.
* The README's ``--classnames FILE`` with a plain integer label column works: an ``int`` column named ``label``
  (then ``fine_label``) is taken when the dataset has no ``ClassLabel``, its labels index the file's names; a
  label outside them is one line naming the label, the file and its count of names. Same for wds ``.cls``.
"""

import io
import os
import tarfile
import time
from pathlib import Path

import numpy as np
import pytest
from helpers_clip import run_cli
from PIL import Image

from fedfeat.data import open_dataset
from fedfeat.errors import FedfeatError

datasets = pytest.importorskip("datasets")
pytest.importorskip("webdataset")


@pytest.fixture(autouse=True)
def _index_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("FEDFEAT_CACHE_DIR", str(tmp_path / "hash-cache"))  # wds shard indexes: not ~/.cache


def png(seed: int) -> bytes:
    rng = np.random.default_rng(seed)
    buf = io.BytesIO()
    Image.fromarray(rng.integers(0, 255, (12, 10, 3), dtype=np.uint8)).save(buf, format="PNG")
    return buf.getvalue()


def write_tar(path: Path, members: dict[str, bytes]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    with tarfile.open(path, "w") as tf:
        for name, data in members.items():
            ti = tarfile.TarInfo(name)
            ti.size = len(data)
            tf.addfile(ti, io.BytesIO(data))
    return path


def shard(path: Path, labels: list, start: int = 0) -> Path:
    """A webdataset shard: sample ``s<i>`` is ``s<i>.png`` + ``s<i>.cls`` (the label's text)."""
    members = {}
    for i, y in enumerate(labels, start):
        members[f"s{i:05d}.png"] = png(i)
        members[f"s{i:05d}.cls"] = y if isinstance(y, bytes) else str(y).encode()
    return write_tar(path, members)


def wds_folder(root: Path, n: int = 2, names=("cat", "dog", "owl")) -> Path:
    for k in range(n):
        shard(root / "train" / f"{k}.tar", [0, 1, 2], start=3 * k)
    (root / "classnames.txt").write_text("".join(f"{c}\n" for c in names))
    return root


def refused(fn, *patterns: str) -> str:
    """``fn()`` raises one ``FedfeatError`` line matching every pattern, within 5 s."""
    t = time.perf_counter()
    with pytest.raises(FedfeatError) as e:
        fn()
    msg = str(e.value)
    assert time.perf_counter() - t < 5, "the error took too long (did something enumerate a huge count?)"
    assert "\n" not in msg, msg
    for p in patterns:
        assert p in msg, (p, msg)
    return msg


# ---------------------------------------------------------------------------------------- class 8: nshards.txt
@pytest.mark.parametrize(
    "text, says",
    [
        ("1000000000\n", "says 1000000000 shards but"),  # the issue's 1e9: no billion names, no hang
        ("99999999999999999999999999", "not a shard count"),  # beyond any int64
        ("1e9", "'1e9', not a shard count"),
        ("-1", "'-1', not a shard count"),
        ("abc", "'abc', not a shard count"),
        ("", "'', not a shard count"),
        ("2 3", "'2 3', not a shard count"),
        ("3", "says 3 shards but"),  # one more than present
        ("1", "says 1 shards but"),  # one fewer: the second shard would be silently dropped
        ("0", "says 0 shards but"),
        ("2" + " " * 100, "not a shard count"),  # a big file is not read whole
    ],
)
def test_nshards_bounded_by_the_shards_present(tmp_path, text, says):
    root = wds_folder(tmp_path / "w")
    nfile = root / "train" / "nshards.txt"
    nfile.write_text(text)
    msg = refused(lambda: open_dataset(f"wds:{root}", "."), str(nfile), says)
    assert "2 .tar files" in msg  # the number present, beside the file's


def test_nshards_binary_fifo_and_folder_are_one_line(tmp_path):
    root = wds_folder(tmp_path / "w")
    nfile = root / "train" / "nshards.txt"
    nfile.write_bytes(b"\xff\xfe\x00\x01")
    refused(lambda: open_dataset(f"wds:{root}", "."), str(nfile), "not a shard count")
    nfile.unlink()
    os.mkfifo(nfile)  # reading a FIFO would block for ever
    refused(lambda: open_dataset(f"wds:{root}", "."), str(nfile), "not a regular file")
    nfile.unlink()
    nfile.mkdir()
    refused(lambda: open_dataset(f"wds:{root}", "."), str(nfile), "not a regular file")


def test_nshards_that_matches_is_used_and_misnamed_shards_are_named(tmp_path):
    root = wds_folder(tmp_path / "w")
    nfile = root / "train" / "nshards.txt"
    nfile.write_text("2\n")
    ds = open_dataset(f"wds:{root}", ".")
    assert ds.n("train") == 6 and ds.labels("train").tolist() == [0, 1, 2, 0, 1, 2]
    nfile.unlink()
    assert open_dataset(f"wds:{root}", ".").n("train") == 6  # no nshards.txt: every *.tar
    (root / "train" / "1.tar").rename(root / "train" / "b.tar")  # the count fits, the names do not
    nfile.write_text("2")
    refused(lambda: open_dataset(f"wds:{root}", "."), "1.tar not found", "says 2 shards", "holds 2 .tar")


def test_brace_pattern_of_a_billion_shards_is_refused_at_once(tmp_path):
    """braceexpand materialises a range in full: the count is bounded on the pattern's text first."""
    from fedfeat.data.external import default_store_name, pattern_count_bound

    root = wds_folder(tmp_path / "w")
    for pat in ("{0..999999999}.tar", "{000000..999999}-{0..9}.tar", "{0..99999999999999999999999}.tar"):
        spec = f"wds:{root}/train/{pat}"
        refused(lambda spec=spec: open_dataset(spec, "."), "shards, more than 100000", pat)
        refused(lambda spec=spec: default_store_name(spec, "."), "more than 100000")
    assert pattern_count_bound("{train,test}/{0..3}.tar") == 8 and pattern_count_bound("{0..10..2}") == 6
    assert pattern_count_bound("x-{a..c}.tar") == 52 and pattern_count_bound(r"a\{0..9\}.tar") == 1
    refused(lambda: open_dataset(f"wds:{root}/train/{{0..1.tar", "."), "cannot expand the pattern")
    ds = open_dataset(f"wds:{root}/train/{{0..1}}.tar", ".")  # a small pattern still works
    assert ds.n("train") == 6


@pytest.mark.parametrize(
    "cls, says",
    [
        (b"99999999999999999999999999", "not an integer label"),  # no OverflowError traceback
        (b"7" * 5000, "not an integer label"),  # a huge member is not read whole
        (b"1.5", "not an integer label"),
        (b"\xff\xfe", "not an integer label"),
        (b"-1", "has label -1, but the class-name file"),
        (b"3", "has label 3, but the class-name file"),
    ],
)
def test_hostile_cls_members(tmp_path, cls, says):
    root = tmp_path / "w"
    shard(root / "train" / "0.tar", [0, cls, 1])
    (root / "classnames.txt").write_text("cat\ndog\nowl\n")
    msg = refused(lambda: open_dataset(f"wds:{root}", "."), says)
    if "class-name file" in says:
        assert str(root / "classnames.txt") in msg and "has 3 names" in msg and "0..2" in msg


# ---------------------------------------------------------------------------------------- class 9: --classnames
def write_hf(d: Path, labels: dict[str, list[int]], column: str = "label", dtype: str = "int64") -> Path:
    """A saved ``DatasetDict`` whose label column is a plain integer (no ``ClassLabel``)."""
    feats = datasets.Features({"image": datasets.Image(), column: datasets.Value(dtype)})
    parts = {}
    for split, ys in labels.items():
        rows = {"image": [{"bytes": png(100 + i), "path": None} for i in range(len(ys))], column: ys}
        parts[split] = datasets.Dataset.from_dict(rows, features=feats)
    datasets.DatasetDict(parts).save_to_disk(str(d))
    return d


@pytest.mark.parametrize("column, dtype", [("label", "int64"), ("label", "int32"), ("fine_label", "uint8")])
def test_hf_plain_int_label_column_with_classnames(tmp_path, column, dtype):
    """The README: the label column is the ClassLabel, else ``label``, then ``fine_label``; a plain integer one
    takes its names from ``--classnames`` (one per line, in label order)."""
    write_hf(tmp_path / "plain", {"train": [2, 0, 1, 2], "validation": [1, 0]}, column, dtype)
    names = tmp_path / "names.txt"
    names.write_text("red\ngreen\nblue_sky\n")
    ds = open_dataset("hf:plain", tmp_path, {"classnames": names})
    assert ds.label_column == column
    assert ds.class_names == ["red", "green", "blue sky"]
    assert ds.split_names == ["train", "test"]  # validation stored as test
    assert ds.labels("train").tolist() == [2, 0, 1, 2] and ds.labels("test").tolist() == [1, 0]
    assert np.array_equal(np.asarray(ds.load_image("train", 3)), np.asarray(Image.open(io.BytesIO(png(103)))))
    # without --classnames: the one line says how to name the classes
    refused(
        lambda: open_dataset("hf:plain", tmp_path), f"column '{column}' is not a ClassLabel", "--classnames"
    )


def test_hf_int_label_outside_the_classnames_file(tmp_path):
    write_hf(tmp_path / "plain", {"train": [0, 1, 5, 2]})
    names = tmp_path / "names.txt"
    names.write_text("red\n\ngreen\nblue\n")  # 3 names: blank lines do not count
    refused(
        lambda: open_dataset("hf:plain", tmp_path, {"classnames": names}),
        "has label 5",
        f"class-name file {names} has 3 names",
        "0..2",
    )
    write_hf(tmp_path / "neg", {"train": [0, -3]})
    refused(lambda: open_dataset("hf:neg", tmp_path, {"classnames": names}), "has label -3", "has 3 names")
    import pyarrow as pa

    big = pa.table(
        {"image": [{"bytes": png(0), "path": None}] * 2, "label": pa.array([0, 2**64 - 1], pa.uint64())}
    )
    feats = datasets.Features({"image": datasets.Image(), "label": datasets.Value("uint64")})
    datasets.Dataset(big.cast(feats.arrow_schema)).save_to_disk(
        str(tmp_path / "big")
    )  # no OverflowError traceback
    refused(lambda: open_dataset("hf:big", tmp_path, {"classnames": names}), "not 64-bit integers", "'label'")


def test_hf_classlabel_still_wins_and_a_non_int_label_is_not_taken(tmp_path):
    feats = datasets.Features(
        {
            "image": datasets.Image(),
            "label": datasets.Value("string"),
            "kind": datasets.ClassLabel(names=["a", "b"]),
        }
    )
    rows = {"image": [{"bytes": png(i), "path": None} for i in range(2)], "label": ["x", "y"], "kind": [1, 0]}
    datasets.Dataset.from_dict(rows, features=feats).save_to_disk(str(tmp_path / "cl"))
    ds = open_dataset("hf:cl", tmp_path)
    assert ds.label_column == "kind" and ds.class_names == ["a", "b"]
    feats = datasets.Features({"image": datasets.Image(), "label": datasets.Value("float32")})
    rows = {"image": [{"bytes": png(i), "path": None} for i in range(2)], "label": [0.0, 1.0]}
    datasets.Dataset.from_dict(rows, features=feats).save_to_disk(str(tmp_path / "fl"))
    (tmp_path / "n.txt").write_text("a\nb\n")
    refused(
        lambda: open_dataset("hf:fl", tmp_path, {"classnames": tmp_path / "n.txt"}), "no ClassLabel column"
    )


def test_wds_cls_labels_index_the_classnames_file(tmp_path):
    root = tmp_path / "w"
    shard(root / "train" / "0.tar", [2, 0, 1])
    shard(root / "test" / "0.tar", [1, 1])
    names = tmp_path / "elsewhere.txt"
    names.write_text("0 zero\n2 two\n1 one\n")  # numbered lines, any order: the number is the label
    ds = open_dataset(f"wds:{root}", ".", {"classnames": names})
    assert ds.class_names == ["zero", "one", "two"]
    assert ds.labels("train").tolist() == [2, 0, 1] and ds.labels("test").tolist() == [1, 1]
    names.write_text("zero\none\n")
    refused(
        lambda: open_dataset(f"wds:{root}", ".", {"classnames": names}),
        "has label 2",
        f"class-name file {names} has 2 names",
        "0..1",
    )


def test_encode_cli_hf_plain_int_labels_with_classnames(tmp_path):
    """End to end: ``encode --dataset hf:DIR --classnames FILE`` on a plain int ``label`` column (no
    --label-column), through a tiny random CLIP: the store has the file's names and the dataset's labels."""
    from helpers_clip import make_tiny_clip

    from fedfeat.store.featurestore import FeatureStore

    tc = make_tiny_clip(tmp_path / "tc")
    write_hf(tmp_path / "plain", {"train": [2, 0, 1, 2], "test": [1, 0]})
    (tmp_path / "names.txt").write_text("red\ngreen\nblue\n")
    args = ["encode", "--dataset", "hf:plain", "--root", tmp_path, "--classnames", tmp_path / "names.txt",
            "--backbone", tc.config, "--pretrained", tc.weights, "--out", tmp_path / "out", "--device", "cpu",
            "--batch-size", "4"]  # fmt: skip
    r = run_cli(args)
    assert r.exit_code == 0, (r.output, r.exception)
    st = FeatureStore.open(Path(r.stdout.strip().splitlines()[-1]))
    assert st.class_names == ["red", "green", "blue"]
    assert st.labels("train").tolist() == [2, 0, 1, 2] and st.labels("test").tolist() == [1, 0]
    (tmp_path / "names.txt").write_text("red\ngreen\n")
    r = run_cli([*args[:-8], "--backbone", tc.config, "--pretrained", tc.weights, "--out", tmp_path / "o2",
                 "--device", "cpu"])  # fmt: skip
    assert r.exit_code == 2 and r.output.count("\n") == 1, r.output
    assert "has label 2" in r.output and "has 2 names" in r.output


def test_open_dataset_options_of_wrong_names_or_types(tmp_path):
    """``open_dataset``'s options: a wrong name or type is one line, not a TypeError from inside a reader."""
    root = wds_folder(tmp_path / "w")
    refused(lambda: open_dataset(f"wds:{root}", ".", {"classnames": 3}), "classnames = 3", "a path")
    refused(
        lambda: open_dataset(f"wds:{root}", ".", {"label_colum": "cls"}),
        "unknown dataset option 'label_colum'",
    )
    refused(
        lambda: open_dataset(f"wds:{root}", ".", {"label_column": ["cls"]}), "label_column", "a column name"
    )
    refused(lambda: open_dataset(f"wds:{root}", ".", "cls"), "options must be a dict")
    assert open_dataset(f"wds:{root}", ".", {"classnames": root / "classnames.txt"}).class_names == [
        "cat",
        "dog",
        "owl",
    ]

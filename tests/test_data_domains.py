"""Multi-domain and CoOp readers (``fedfeat.data.domains``) and the store's per-row domains.

Tiny fixtures in the published layouts (8x8 PNGs): a CoOp dataset folder with its ``split_zhou`` JSON, a DomainNet
root with per-domain list files, PACS-style domain folders. Each is encoded through the real ``fedfeat encode``
with the tiny open_clip model, and the store's splits, class names, labels and per-row domains are checked against
what the fixture wrote. FedCLIP's split is checked against a transcription of its code written here (global
``np.random.seed`` + ``np.random.shuffle``, as ``prepare_data_dg_clip.py`` does), not against the reader's own.
``DOMAIN_FIXTURES`` holds the new readers' fixtures in ``test_readers_registry``'s ``Written`` form; the registry's
contract tests are run on them here.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from helpers_clip import make_tiny_clip, run_cli
from PIL import Image

from fedfeat.data import open_dataset
from fedfeat.data.files import DATASETS
from fedfeat.errors import FedfeatError
from fedfeat.store.featurestore import FeatureStore

_RNG = np.random.default_rng(7)


def _png(path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(_RNG.integers(0, 256, (8, 8, 3), dtype=np.uint8)).save(path)
    return path


# ---------------------------------------------------------------------------------------- fixtures
COOP_NAMES = {0: "yorkshire_terrier", 1: "abyssinian", 2: "Bengal"}  # label order, not sorted


def write_coop(root: Path) -> dict:
    """CoOp's oxford_pets/: images/<file>.jpg-like PNGs and split_zhou_OxfordPets.json."""
    d = root / "oxford_pets"
    split, want = {}, {}
    for s, per in (("train", 3), ("val", 1), ("test", 2)):
        items = []
        for y, cname in COOP_NAMES.items():
            for i in range(per):
                fn = f"{cname}_{s}_{i}.png"
                _png(d / "images" / fn)
                items.append([fn, y, cname])
        items = items[::-1] if s == "test" else items  # list order, not label order
        split[s] = items
        want[s] = ([f"images/{p}" for p, _, _ in items], np.asarray([y for _, y, _ in items]))
    (d / "split_zhou_OxfordPets.json").write_text(json.dumps(split))
    return {"root": d, "splits": want, "class_names": ["yorkshire terrier", "abyssinian", "Bengal"]}


DN_CLASSES = ["zebra", "apple", "the_eiffel_tower"]  # label order (folder names)
DN_DOMAINS = ["sketch", "clipart"]  # written in this order; read alphabetically


def write_domainnet(root: Path) -> dict:
    want: dict[str, tuple[list, list, list]] = {"train": ([], [], []), "test": ([], [], [])}
    for d, dom in enumerate(sorted(DN_DOMAINS)):
        for s, per in (("train", 2 + d), ("test", 1)):
            lines = []
            for y, c in enumerate(DN_CLASSES):
                for i in range(per):
                    rel = f"{dom}/{c}/{dom}_{c}_{s}{i}.png"
                    _png(root / rel)
                    lines.append((rel, y))
            lines = lines[::-1] if dom == "sketch" else lines
            (root / f"{dom}_{s}.txt").write_text("".join(f"{p} {y}\n" for p, y in lines))
            want[s][0].extend(p for p, _ in lines)
            want[s][1].extend(y for _, y in lines)
            want[s][2].extend([d] * len(lines))
    return {"root": root, "splits": {s: (p, np.asarray(y), np.asarray(d)) for s, (p, y, d) in want.items()}}


PACS_DOMAINS = ["art_painting", "cartoon", "photo", "sketch"]


def write_domain_folders(root: Path, domains=PACS_DOMAINS, classes=("guitar", "dog", "elephant")) -> Path:
    """``root/<domain>/<class>/<i>.png``, a different count per domain (so the 60/20/20 rounding varies)."""
    for d, dom in enumerate(domains):
        for k, c in enumerate(classes):
            for i in range(1 + (d + k) % 3):
                _png(root / dom / c / f"{i:02d}.png")
    return root


def fedclip_reference(domain_dir: Path, seed: int = 0, datapercent: float = 0.6) -> dict[str, list[str]]:
    """FedCLIP's split transcribed from microsoft/PersonalizedFL fedclip/utils/prepare_data_dg_clip.py:82-89
    (commit 441670ed), on torchvision ImageFolder's sample order (flat class folders: sorted classes, sorted
    files). Uses numpy's global RNG exactly as that code does (state restored afterwards)."""
    classes = sorted(p.name for p in domain_dir.iterdir() if p.is_dir())
    imgs = [
        f"{c}/{f.name}" for c in classes for f in sorted((domain_dir / c).iterdir(), key=lambda p: p.name)
    ]
    state = np.random.get_state()
    try:
        l = len(imgs)
        index = np.arange(l)
        np.random.seed(seed)
        np.random.shuffle(index)
    finally:
        np.random.set_state(state)
    l1, l2, l3 = int(l * datapercent), int(l * 0.2), int(l * 0.2)
    return {
        "train": [imgs[i] for i in index[:l1]],
        "val": [imgs[i] for i in index[l1 : l1 + l2]],
        "test": [imgs[i] for i in index[l1 + l2 : l1 + l2 + l3]],
        "rest": [imgs[i] for i in index[l1 + l2 + l3 :]],  # unused by FedCLIP; fedfeat keeps them
    }


# ---------------------------------------------------------------------------------------- encoding
@pytest.fixture(scope="module")
def tc(tmp_path_factory):
    return make_tiny_clip(tmp_path_factory.mktemp("tinyclip"))


def _encode(fmt: str, root: Path, tc, out: Path, *extra) -> FeatureStore:
    args = ["encode", "--dataset", fmt, "--root", root, "--backbone", tc.config, "--pretrained", tc.weights,
            "--out", out, "--device", "cpu", "--chunk-rows", "16", "--batch-size", "16", *extra]  # fmt: skip
    r = run_cli(args)
    assert r.exit_code == 0, (r.output, r.exception)
    st = FeatureStore.open(Path(r.stdout.strip().splitlines()[-1]))
    st.verify()
    return st


def test_coop_encodes_the_split_file(tc, tmp_path, monkeypatch):
    monkeypatch.setenv("FEDFEAT_CACHE_DIR", str(tmp_path / "cache"))
    fx = write_coop(tmp_path / "data")
    ds = open_dataset("coop", tmp_path / "data")  # CoOp's data folder: finds oxford_pets/
    assert ds.root == fx["root"] and ds.domain_names is None and ds.domains("train") is None
    for s, (paths, _) in fx["splits"].items():
        assert [ds.item_name(s, i) for i in range(ds.n(s))] == paths
    st = _encode("coop", fx["root"], tc, tmp_path / "out")
    assert st.path.parent.name == "oxford_pets"
    assert st.splits == ["train", "val", "test"]
    assert st.class_names == fx["class_names"]
    for s, (paths, y) in fx["splits"].items():
        assert st.n(s) == len(paths)
        np.testing.assert_array_equal(st.labels(s), y)
        assert st.domains(s) is None
    assert st.domain_names is None and "domain_names" not in st.attrs


def test_domainnet_records_each_rows_domain(tc, tmp_path, monkeypatch):
    monkeypatch.setenv("FEDFEAT_CACHE_DIR", str(tmp_path / "cache"))
    fx = write_domainnet(tmp_path / "domainnet")
    st = _encode("domainnet", fx["root"], tc, tmp_path / "out")
    assert st.domain_names == ["clipart", "sketch"]
    assert st.class_names == ["zebra", "apple", "the eiffel tower"]
    assert st.splits == ["train", "test"]
    ds = open_dataset("domainnet", fx["root"])
    for s, (paths, y, d) in fx["splits"].items():
        assert st.n(s) == len(paths) and [ds.item_name(s, i) for i in range(ds.n(s))] == paths
        np.testing.assert_array_equal(st.labels(s), y)
        got = st.domains(s)
        assert got.dtype == np.int64
        np.testing.assert_array_equal(got, d)
    # a subset of the domains is its own store, named after them
    sub = _encode("domainnet", fx["root"], tc, tmp_path / "out", "--domains", "sketch")
    assert sub.path.parent.name == "domainnet-sketch" and sub.domain_names == ["sketch"]
    _, y, d = fx["splits"]["train"]
    np.testing.assert_array_equal(sub.labels("train"), y[d == 1])
    np.testing.assert_array_equal(sub.domains("train"), np.zeros(int((d == 1).sum())))


def test_pacs_split_is_fedclips(tc, tmp_path, monkeypatch):
    monkeypatch.setenv("FEDFEAT_CACHE_DIR", str(tmp_path / "cache"))
    root = write_domain_folders(tmp_path / "PACS")
    st = _encode("pacs", root, tc, tmp_path / "out")
    ds = open_dataset("pacs", root)
    classes = ["dog", "elephant", "guitar"]
    assert st.domain_names == PACS_DOMAINS and st.class_names == classes
    want: dict[str, tuple[list, list, list]] = {s: ([], [], []) for s in ("train", "val", "test", "rest")}
    for d, dom in enumerate(PACS_DOMAINS):
        for s, rel in fedclip_reference(root / dom).items():
            want[s][0].extend(f"{dom}/{r}" for r in rel)
            want[s][1].extend(classes.index(r.split("/")[0]) for r in rel)
            want[s][2].extend([d] * len(rel))
    assert st.splits == ["train", "val", "test", "rest"] and want["rest"][0]  # the fixture leaves some out
    for s, (paths, y, d) in want.items():
        assert [ds.item_name(s, i) for i in range(ds.n(s))] == paths, s
        assert st.n(s) == len(paths)
        np.testing.assert_array_equal(st.labels(s), y)
        np.testing.assert_array_equal(st.domains(s), d)
    # the rows FedCLIP's rounding leaves out are kept in "rest": every image is in exactly one split
    every = sorted(ds.item_name(s, i) for s in ds.split_names for i in range(ds.n(s)))
    assert every == sorted(p.relative_to(root).as_posix() for p in root.rglob("*.png"))


# ---------------------------------------------------------------------------------------- bad inputs
def test_bad_inputs_are_one_line(tmp_path):
    def err(fmt, root, **opts) -> str:
        with pytest.raises(FedfeatError) as e:
            open_dataset(fmt, root, opts or None)
        msg = str(e.value)
        assert "\n" not in msg, msg
        return msg

    fx = write_coop(tmp_path / "coop")
    (fx["root"] / "split_zhou_OxfordPets.json").unlink()
    assert "no split_zhou_*.json" in err("coop", fx["root"])
    fx = write_coop(tmp_path / "coop2")
    (fx["root"] / "images" / fx["splits"]["val"][0][0].split("/")[-1]).unlink()
    assert "missing" in err("coop", fx["root"]) and "restore" in err("coop", fx["root"])
    (fx["root"] / "split_zhou_OxfordPets.json").write_text("{not json")
    assert "not valid JSON" in err("coop", fx["root"])

    dn = write_domainnet(tmp_path / "dn")
    missing = dn["splits"]["test"][0][0]
    (dn["root"] / missing).unlink()
    assert missing in err("domainnet", dn["root"])
    assert "no domain 'real'" in err("domainnet", dn["root"], domains="real")
    with (dn["root"] / "clipart_train.txt").open("a") as f:
        f.write("clipart/zebra/x.png seven\n")
    assert "clipart_train.txt:" in err("domainnet", dn["root"])

    pacs = write_domain_folders(tmp_path / "pacs")
    for c in (pacs / "cartoon").iterdir():
        for p in c.iterdir():
            p.unlink()
        c.rmdir()
    assert "has no class folders" in err("pacs", pacs) and str(pacs / "cartoon") in err("pacs", pacs)
    (pacs / "cartoon").rmdir()
    assert "no domain folder cartoon" in err("pacs", pacs)
    assert "--domains applies to" in err("imagefolder", pacs, domains="photo")


def test_stores_without_domains_are_unchanged(tmp_path):
    kw = dict(backbone="b", pretrained="none", embed_dim=4, logit_scale=100.0, class_names=["a", "b"],
              templates=["{}"], preprocessing={}, fingerprint={"x": 1}, chunk_rows=4)  # fmt: skip
    labels = {"train": np.array([0, 1, 1]), "test": np.array([1])}
    plain = FeatureStore.create(tmp_path / "plain.zarr", labels=labels, **kw)
    assert plain.domain_names is None and plain.domains("train") is None and "domain_names" not in plain.attrs
    assert not any("domains" in p.name for p in (tmp_path / "plain.zarr").rglob("*"))
    doms = {"train": np.array([1, 0, 1]), "test": np.array([0])}
    st = FeatureStore.create(
        tmp_path / "dom.zarr", labels=labels, domains=doms, domain_names=["p", "q"], **kw
    )
    assert st.domain_names == ["p", "q"] and st.attribute_problems() == []
    np.testing.assert_array_equal(st.domains("train"), [1, 0, 1])
    assert {k: v for k, v in st.attrs.items() if k != "domain_names"} == plain.attrs
    st._g["train/domains"][0] = 0  # changed behind the checksum
    with pytest.raises(FedfeatError, match="train/domains .* does not match its checksum"):
        st.domains("train")
    st._g["train/domains"][0] = 5
    assert any("domain_names" in p for p in st.attribute_problems())
    with pytest.raises(FedfeatError, match="ids outside"):
        FeatureStore.create(tmp_path / "bad.zarr", labels=labels, domains={"train": [0, 0, 2], "test": [0]},
                            domain_names=["p", "q"], **kw)  # fmt: skip


# ---------------------------------------------------------------------------------------- the registry contract
def _registry_fixtures():
    """The new readers' fixtures in ``test_readers_registry``'s ``Written`` form (for its ``FIXTURES``)."""
    from test_readers_registry import Written, _png_pixels

    def coop(tmp: Path):
        fx = write_coop(tmp / "data")
        paths = {s: [fx["root"] / p for p in ps] for s, (ps, _) in fx["splits"].items()}
        f = paths["test"][-1]
        return Written("coop", fx["root"], {s: y for s, (_, y) in fx["splits"].items()}, fx["class_names"],
                       _png_pixels(paths), f, f.read_bytes(), ("test", len(paths["test"]) - 1))  # fmt: skip

    def domainnet(tmp: Path):
        fx = write_domainnet(tmp / "dn")
        paths = {s: [fx["root"] / p for p in ps] for s, (ps, _, _) in fx["splits"].items()}
        f = paths["train"][3]
        return Written("domainnet", fx["root"], {s: y for s, (_, y, _) in fx["splits"].items()},
                       ["zebra", "apple", "the eiffel tower"], _png_pixels(paths), f, f.read_bytes(), ("train", 3))  # fmt: skip

    def folders(fmt: str, domains: list[str]):
        def make(tmp: Path):
            root = write_domain_folders(tmp / fmt, domains)
            ds_paths: dict[str, list[Path]] = {}
            labels: dict[str, list[int]] = {}
            classes = ["dog", "elephant", "guitar"]
            for dom in domains:
                for s, rel in fedclip_reference(root / dom).items():
                    ds_paths.setdefault(s, []).extend(root / dom / r for r in rel)
                    labels.setdefault(s, []).extend(classes.index(r.split("/")[0]) for r in rel)
            f = ds_paths["val"][1]
            labels = {s: np.asarray(y) for s, y in labels.items() if y}
            return Written(fmt, root, labels, classes, _png_pixels(ds_paths),
                           f, f.read_bytes(), ("val", 1))  # fmt: skip

        return make

    return {
        "coop": coop,
        "domainnet": domainnet,
        "domainfolder": folders("domainfolder", ["a_domain", "b_domain"]),
        "pacs": folders("pacs", PACS_DOMAINS),
        "officehome": folders("officehome", ["Art", "Clipart", "Product", "Real_World"]),
        "vlcs": folders("vlcs", ["Caltech101", "LabelMe", "SUN09", "VOC2007"]),
        "office-caltech10": folders("office-caltech10", ["amazon", "caltech", "dslr", "webcam"]),
    }


NEW_READERS = ["coop", "domainnet", "domainfolder", "pacs", "officehome", "vlcs", "office-caltech10"]


@pytest.fixture
def registry(monkeypatch):
    import test_readers_registry as R

    for name, make in _registry_fixtures().items():
        monkeypatch.setitem(R.FIXTURES, name, make)
    return R


@pytest.mark.parametrize("reader", NEW_READERS)
def test_new_readers_meet_the_registry_contract(reader, registry, tmp_path, monkeypatch):
    assert reader in DATASETS
    registry.test_reader_contract(reader, tmp_path / "contract", monkeypatch)
    registry.test_fingerprint_is_stable_and_sees_one_image_change(reader, tmp_path / "fp", monkeypatch)


@pytest.mark.parametrize("reader", NEW_READERS)
def test_new_readers_name_root_and_layout(reader, registry, tmp_path, monkeypatch):
    for where in ("missing", "empty"):
        registry.test_missing_or_empty_root_is_one_line_naming_the_layout(
            reader, where, tmp_path / where, monkeypatch
        )

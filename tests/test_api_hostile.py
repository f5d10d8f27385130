"""The Python API, used carelessly or with hostile arguments (issue 26, classes 1 and 6).

Class 1, data loss: no public function deletes a complete store, or anything that is not a fedfeat store (a
folder of the user's files, a file, what a symbolic link points to), unless an explicit ``overwrite=True`` says
so -- and not even then when it is not a store. Every case checks the bytes of everything under its folder
before and after.

Class 6, the API validates like the CLI: paths are ``str`` or any ``os.PathLike``; wrong types, bad modes,
unknown settings and bad hyperparameters are one ``FedfeatError`` line naming the problem and the fix (never an
AttributeError, never "damaged, rebuild with --force" advice for a mistyped argument).
"""

from __future__ import annotations

import hashlib
import os
import shutil
from pathlib import Path

import numpy as np
import pytest

import fedfeat
from fedfeat.errors import FedfeatError
from fedfeat.store.featurestore import FeatureStore, copy_store
from fedfeat.store.synth import SynthParams, write_synthetic_store

TINY = SynthParams(classes=3, dim=8, train_per_class=20, test_per_class=5, templates=2)
OTHER = SynthParams(classes=3, dim=8, train_per_class=20, test_per_class=5, templates=2, seed=1)
FAST = dict(method="fedavg", rounds=1, clients=3, partition="iid", kernel="torch")


def quiet(*a):
    pass


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    root = tmp_path_factory.mktemp("api-hostile")
    write_synthetic_store(root / "s.zarr", TINY, stats=False, log=quiet)
    write_synthetic_store(root / "other.zarr", OTHER, stats=False, log=quiet)
    return root


def tree(path: Path) -> dict:
    """Every entry under ``path`` (following nothing): relative name -> content hash, link target or "dir"."""
    out = {}
    for dirpath, dirnames, filenames in os.walk(path, followlinks=False):
        for name in dirnames + filenames:
            p = Path(dirpath) / name
            rel = str(p.relative_to(path))
            if p.is_symlink():
                out[rel] = "link:" + os.readlink(p)
            elif p.is_dir():
                out[rel] = "dir"
            else:
                out[rel] = hashlib.sha256(p.read_bytes()).hexdigest()
    return out


def one_line(e: pytest.ExceptionInfo) -> str:
    msg = str(e.value)
    assert msg and "\n" not in msg and "Traceback" not in msg, msg
    return msg


# ---------------------------------------------------------------------------------------- targets
def _complete_store(ws: Path, base: Path) -> Path:
    shutil.copytree(base / "s.zarr", ws / "t.zarr")
    return ws / "t.zarr"


def _user_folder(ws: Path, base: Path) -> Path:
    (ws / "t.zarr").mkdir()
    (ws / "t.zarr" / "thesis.tex").write_text("three years of work")
    (ws / "t.zarr" / "zarr.json").write_text('{"node_type": "group", "zarr_format": 3, "attributes": {}}')
    return ws / "t.zarr"


def _user_zarr_group(ws: Path, base: Path) -> Path:
    import zarr

    g = zarr.open_group(str(ws / "t.zarr"), mode="w", zarr_format=3)
    g.attrs["mine"] = True  # a user's own zarr data, no fedfeat attributes
    g.create_array("data", shape=(4,), dtype="int32")[:] = np.arange(4)
    return ws / "t.zarr"


def _plain_file(ws: Path, base: Path) -> Path:
    (ws / "t.zarr").write_bytes(b"not a store, and not yours to delete")
    return ws / "t.zarr"


def _link_to_folder(ws: Path, base: Path) -> Path:
    (ws / "elsewhere").mkdir()
    (ws / "elsewhere" / "photos.txt").write_text("irreplaceable")
    (ws / "t.zarr").symlink_to(ws / "elsewhere", target_is_directory=True)
    return ws / "t.zarr"


def _link_to_store(ws: Path, base: Path) -> Path:
    shutil.copytree(base / "s.zarr", ws / "real.zarr")
    (ws / "t.zarr").symlink_to(ws / "real.zarr", target_is_directory=True)
    return ws / "t.zarr"


def _dangling_link(ws: Path, base: Path) -> Path:
    (ws / "t.zarr").symlink_to(ws / "gone", target_is_directory=True)
    return ws / "t.zarr"


TARGETS = {
    "complete store": _complete_store,
    "user folder": _user_folder,
    "user zarr group": _user_zarr_group,
    "plain file": _plain_file,
    "symlink to folder": _link_to_folder,
    "symlink to store": _link_to_store,
    "dangling symlink": _dangling_link,
}
NOT_STORES = [k for k in TARGETS if "store" not in k]


def _create(path, **kw):
    return FeatureStore.create(
        path,
        backbone="toy",
        pretrained="none",
        embed_dim=4,
        logit_scale=100.0,
        class_names=["a", "b"],
        templates=["a photo of a {}."],
        preprocessing={"kind": "none"},
        fingerprint={"toy": 1},
        labels={"train": np.arange(6) % 2, "test": np.arange(2) % 2},
        chunk_rows=4,
        **kw,
    )


# ---------------------------------------------------------------------------------------- class 1
@pytest.mark.parametrize("kind", TARGETS)
@pytest.mark.parametrize("how", ["open_store", "FeatureStore.open", "open_store(Path)"])
def test_open_for_writing_never_deletes(tmp_path, base, kind, how):
    target = TARGETS[kind](tmp_path, base)
    before = tree(tmp_path)
    with pytest.raises(FedfeatError) as e:
        if how == "open_store":
            fedfeat.open_store(str(target), mode="w")
        elif how == "FeatureStore.open":
            FeatureStore.open(str(target), mode="w")
        else:
            fedfeat.open_store(Path(target), "w")
    msg = one_line(e)
    assert tree(tmp_path) == before, msg  # byte for byte, links included
    if "store" in kind and kind != "dangling symlink":
        # the CLI's words ("already exists; pass --force to replace it"), with the API's argument
        assert "already exists" in msg and "overwrite=True" in msg and "--force" in msg, msg
    elif kind == "dangling symlink":
        assert "no store at" in msg, msg
    else:
        assert "not a fedfeat store" in msg and "damaged" not in msg, msg


@pytest.mark.parametrize("kind", TARGETS)
@pytest.mark.parametrize("overwrite", [False, True])
def test_create_deletes_only_stores_and_only_with_overwrite(tmp_path, base, kind, overwrite):
    target = TARGETS[kind](tmp_path, base)
    before = tree(tmp_path)
    replaceable = overwrite and kind in ("complete store", "symlink to store")
    if not replaceable:
        with pytest.raises(FedfeatError) as e:
            _create(target, overwrite=overwrite)
        msg = one_line(e)
        assert tree(tmp_path) == before, msg
        if kind == "dangling symlink":  # an unmounted disk's link: never replaced by a local folder
            assert "symbolic link" in msg and "does not exist" in msg, msg
        elif kind in NOT_STORES:
            assert "not a fedfeat store" in msg and "replaces stores only" in msg, msg
        else:
            assert "already exists" in msg and "overwrite=True" in msg and "--force" in msg, msg
        return
    st = _create(target, overwrite=True)
    assert st.embed_dim == 4 and not st.complete  # the new store replaced the old one
    assert not target.is_symlink()
    if kind == "symlink to store":  # the link went; the store it pointed to is untouched
        real = {k: v for k, v in before.items() if k.startswith("real.zarr")}
        assert {k: v for k, v in tree(tmp_path).items() if k.startswith("real.zarr")} == real
        assert FeatureStore.open(tmp_path / "real.zarr").embed_dim == 8


def test_create_resumes_what_a_killed_create_left_and_fills_an_empty_folder(tmp_path):
    import zarr

    half = tmp_path / "half.zarr"  # killed inside create: a group without attributes, a split's group
    zarr.open_group(str(half), mode="w", zarr_format=3).require_group("train")
    assert _create(half).embed_dim == 4
    (tmp_path / "empty.zarr").mkdir()
    assert _create(tmp_path / "empty.zarr").embed_dim == 4
    # an unfinished store (its writer may still be at work) needs overwrite, as a complete one does
    with pytest.raises(FedfeatError, match="already exists.*unfinished.*overwrite=True"):
        _create(half)


def test_open_w_with_overwrite_rewrites_in_place_and_deletes_nothing(tmp_path, base):
    target = _complete_store(tmp_path, base)
    feats = FeatureStore.open(target).features("train").copy()
    st = fedfeat.open_store(target, "w", overwrite=True)
    assert (
        not st.complete
    )  # unfinished until mark_complete: a writer killed midway leaves no "complete" store
    with pytest.raises(FedfeatError, match="incomplete"):
        fedfeat.open_store(target)
    np.testing.assert_array_equal(FeatureStore.open(target, allow_incomplete=True).features("train"), feats)
    new = np.ones((st.chunk_slice("train", 0).stop, 8), np.float16)
    st.write_chunk("train", 0, new)
    st.mark_complete()
    np.testing.assert_array_equal(fedfeat.open_store(target).features("train"), new)
    # an unfinished store opened with "w" is resumed, no overwrite needed
    st = fedfeat.open_store(target, "w", overwrite=True)
    assert fedfeat.open_store(target, "w").missing() == {"train": 0, "test": 0, "text": 0}


@pytest.mark.parametrize("kind", NOT_STORES)
def test_other_public_paths_that_replace_directories(tmp_path, base, kind):
    """write_synthetic_store (synth) and copy_store, even with force / overwrite, never delete a non-store."""
    target = TARGETS[kind](tmp_path, base)
    before = tree(tmp_path)
    for call in (
        lambda: write_synthetic_store(target, TINY, force=True, stats=False, log=quiet),
        lambda: copy_store(base / "s.zarr", target, overwrite=True),
        lambda: copy_store(base / "s.zarr", target),
    ):
        with pytest.raises(FedfeatError) as e:
            call()
        assert tree(tmp_path) == before, one_line(e)


def test_copy_store_over_a_link_to_a_store_replaces_the_link_only(tmp_path, base):
    target = _link_to_store(tmp_path, base)
    real = tree(tmp_path / "real.zarr")
    with pytest.raises(FedfeatError, match="already exists"):
        copy_store(base / "other.zarr", target)
    copy_store(base / "other.zarr", target, overwrite=True)
    assert tree(tmp_path / "real.zarr") == real
    assert not target.is_symlink()
    assert FeatureStore.open(target).attrs["synth_params"]["seed"] == 1


def test_create_on_an_object_store_deletes_only_stores(tmp_path):
    import uuid

    import fsspec

    url = f"memory://fedfeat-hostile-{uuid.uuid4().hex[:8]}/t.zarr"
    fs, p = fsspec.core.url_to_fs(url)
    fs.pipe_file(f"{p}/notes.txt", b"mine")
    with pytest.raises(FedfeatError, match="not a fedfeat store"):
        _create(url, overwrite=True)
    assert fs.cat_file(f"{p}/notes.txt") == b"mine"
    fs.rm(p, recursive=True)
    _create(url)
    with pytest.raises(FedfeatError, match="already exists.*overwrite=True"):
        _create(url)
    assert _create(url, overwrite=True).embed_dim == 4


# ---------------------------------------------------------------------------------------- class 6
class MyPath:
    """An os.PathLike that is not a pathlib.Path."""

    def __init__(self, p):
        self.p = str(p)

    def __fspath__(self):
        return self.p


def test_pathlike_works_wherever_a_str_does(tmp_path, base):
    from fedfeat.report.stores import print_store_info

    for p in (base / "s.zarr", MyPath(base / "s.zarr"), str(base / "s.zarr")):
        assert fedfeat.open_store(p).n_classes == 3
        assert FeatureStore.open(p, mode="r").embed_dim == 8
        print_store_info(p, as_json=True)
    run = fedfeat.train(store=base / "s.zarr", out=tmp_path / "runs", **FAST)
    assert Path(run["path"]).parent == tmp_path / "runs"
    run2 = fedfeat.train(store=MyPath(base / "s.zarr"), out=MyPath(tmp_path / "runs2"), **FAST)
    assert run2["final_acc"] == run["final_acc"]
    for p in (tmp_path / "runs", MyPath(tmp_path / "runs")):
        df = fedfeat.load_runs(p, as_frame=False)
        assert [r["path"] for r in df] == [run["path"]]
    st = _create(tmp_path / "new.zarr")  # create takes a Path (and a PathLike)
    assert st.path == tmp_path / "new.zarr"
    assert _create(MyPath(tmp_path / "new2.zarr")).embed_dim == 4


def test_numpy_numbers_are_numbers(tmp_path, base):
    run = fedfeat.train(
        store=base / "s.zarr", out=tmp_path, **{**FAST, "rounds": np.int64(1), "clients": np.int32(3)},
        participation=np.float64(0.5), params={"lr": np.float32(0.25), "batch_size": np.int64(10)},
    )  # fmt: skip
    assert run["rounds"] == 1 and run["params"]["lr"] == 0.25 and run["params"]["batch_size"] == 10
    m = fedfeat.get_method("fedavg", {"lr": np.float64(0.5), "normalize": np.bool_(False)})
    assert m.p.lr == 0.5 and m.p.normalize is False


# (call, patterns the one line must hold); every call must raise FedfeatError
BAD_CALLS = {
    "mode x": (lambda s: fedfeat.open_store(s, mode="x"), ["mode must be r, r\\+ or w", "'x'"]),
    "mode W": (lambda s: FeatureStore.open(s, mode="W"), ["mode must be r, r\\+ or w"]),
    "mode int": (lambda s: fedfeat.open_store(s, mode=1), ["mode must be r, r\\+ or w", "got 1"]),
    "mode a (zarr's)": (lambda s: fedfeat.open_store(s, mode="a"), ["mode must be r, r\\+ or w"]),
    "path int": (lambda s: fedfeat.open_store(3), ["path must be a str or os.PathLike", "int"]),
    "path bytes": (lambda s: fedfeat.open_store(os.fsencode(s)), ["str or os.PathLike", "bytes"]),
    "path None": (lambda s: FeatureStore.open(None), ["str or os.PathLike", "NoneType"]),
    "path empty": (lambda s: fedfeat.open_store(""), ["path is empty"]),
    "overwrite str": (
        lambda s: fedfeat.open_store(s, "w", overwrite="yes"),
        ["overwrite must be True or False"],
    ),
    "params list value": (
        lambda s: fedfeat.train(store=s, params={"lr": [1]}, **FAST),
        ["lr", "not a number, a string or a bool", "params=\\{'lr': 0.01\\}"],
    ),
    "params as str": (lambda s: fedfeat.train(store=s, params="lr=1", **FAST), ["params must be a dict"]),
    "params unparsable": (
        lambda s: fedfeat.train(store=s, params={"lr": "fast"}, **FAST),
        ["fedavg.lr", "float"],
    ),
    "params float for int": (
        lambda s: fedfeat.train(store=s, params={"batch_size": 50.5}, **FAST),
        ["batch_size", "expected int"],
    ),
    "params unknown key": (
        lambda s: fedfeat.train(store=s, params={"lrr": 1}, **FAST),
        ["no hyperparameter 'lrr'"],
    ),
    "params int key": (
        lambda s: fedfeat.train(store=s, params={1: 1}, **FAST),
        ["not a hyperparameter name"],
    ),
    "params nan": (lambda s: fedfeat.train(store=s, params={"lr": float("nan")}, **FAST), ["not finite"]),
    "get_method object": (lambda s: fedfeat.get_method("fedavg", {"lr": object()}), ["fedavg.lr", "float"]),
    "get_method str overrides": (
        lambda s: fedfeat.get_method("fedavg", "lr=1"),
        ["must be a dict", "'lr=1'"],
    ),
    "get_method list overrides": (lambda s: fedfeat.get_method("fedavg", [("lr", 1)]), ["must be a dict"]),
    "get_method int key": (lambda s: fedfeat.get_method("fedavg", {0: 1}), ["not a string", "valid keys"]),
    "get_method bool for float": (lambda s: fedfeat.get_method("fedavg", {"lr": True}), ["fedavg.lr"]),
    "get_method name list": (lambda s: fedfeat.get_method(["fedavg"]), ["method name must be a string"]),
    "get_method unknown": (lambda s: fedfeat.get_method("fedvag"), ["unknown method 'fedvag'"]),
    "rounds str": (
        lambda s: fedfeat.train(store=s, **{**FAST, "rounds": "3"}),
        ["rounds", "integer", "not converted"],
    ),
    "rounds float": (lambda s: fedfeat.train(store=s, **{**FAST, "rounds": 1.0}), ["rounds", "integer"]),
    "rounds bool": (lambda s: fedfeat.train(store=s, **{**FAST, "rounds": True}), ["rounds", "integer"]),
    "participation str": (
        lambda s: fedfeat.train(store=s, participation="0.5", **FAST),
        ["participation", "number"],
    ),
    "store int": (lambda s: fedfeat.train(store=3, **FAST), ["store", "string", "--store"]),
    "out list": (lambda s: fedfeat.train(store=s, out=["runs"], **FAST), ["out", "string"]),
    "unknown setting": (
        lambda s: fedfeat.train(store=s, roundz=3, **FAST),
        ["unknown run settings", "roundz"],
    ),
    "overwrite not bool": (
        lambda s: fedfeat.train(store=s, overwrite="no", **FAST),
        ["overwrite must be True"],
    ),
    "load_runs int": (lambda s: fedfeat.load_runs(3), ["load_runs path 1", "str or os.PathLike"]),
    "load_runs metrics": (lambda s: fedfeat.load_runs(s, metrics="yes"), ["metrics must be True or False"]),
    "make_partition scheme int": (
        lambda s: fedfeat.make_partition(np.arange(30) % 3, 3, clients=3),
        ["scheme must be a string"],
    ),
    "make_partition alpha str": (
        lambda s: fedfeat.make_partition(np.arange(30) % 3, "dirichlet", clients=3, alpha="0.5"),
        ["alpha must be a number", "'0.5'"],
    ),
    "make_partition clients bool": (
        lambda s: fedfeat.make_partition(np.arange(30) % 3, "iid", clients=True),
        ["clients must be an integer"],
    ),
    "make_partition imbalance str": (
        lambda s: fedfeat.make_partition(np.arange(30) % 3, "iid", clients=3, imbalance_factor="10"),
        ["imbalance_factor must be a number"],
    ),
    "make_partition seed float": (
        lambda s: fedfeat.make_partition(np.arange(30) % 3, "iid", clients=3, seed=1.5),
        ["seed must be an integer"],
    ),
}


@pytest.mark.parametrize("case", BAD_CALLS)
def test_bad_arguments_are_one_fedfeat_error_line(tmp_path, base, case):
    call, patterns = BAD_CALLS[case]
    store = tmp_path / "s.zarr"
    shutil.copytree(base / "s.zarr", store)
    before = tree(tmp_path)
    with pytest.raises(FedfeatError) as e:
        call(store)
    msg = one_line(e)
    for pat in patterns:
        assert __import__("re").search(pat, msg), (pat, msg)
    assert "damaged" not in msg and "rebuild" not in msg, msg  # an argument's mistake is not the store's
    after = tree(tmp_path)
    assert after == before, msg  # nothing written: no run directory, no store change


def test_the_valid_forms_of_those_arguments_work(tmp_path, base):
    """The same calls with well-typed arguments succeed (the refusals above are about types only)."""
    store = tmp_path / "s.zarr"
    shutil.copytree(base / "s.zarr", store)
    for mode in ("r", "r+"):
        assert fedfeat.open_store(store, mode=mode).complete
    run = fedfeat.train(store=store, out=tmp_path / "runs", params={"lr": "0.02", "batch_size": 10}, **FAST)
    assert run["params"]["lr"] == 0.02 and run["params"]["batch_size"] == 10
    assert fedfeat.get_method("fedavg", {"lr": 1, "local-epochs": "2"}).p.local_epochs == 2
    p = fedfeat.make_partition(
        np.arange(30) % 3, "dirichlet", clients=3, alpha=np.float64(0.5), seed=np.int64(0)
    )
    assert p.n_clients == 3


def test_copy_store_onto_itself_or_into_itself_deletes_nothing(tmp_path, base):
    src = _complete_store(tmp_path, base)
    before = tree(tmp_path)
    (tmp_path / "link.zarr").symlink_to(src, target_is_directory=True)
    for dst in (src, str(src) + "/", tmp_path / "link.zarr", src / "inner.zarr", tmp_path):
        with pytest.raises(FedfeatError, match="one holds the other") as e:
            copy_store(src, dst, overwrite=True)
        one_line(e)
    assert {k: v for k, v in tree(tmp_path).items() if k != "link.zarr"} == before


def test_store_readers_refuse_bad_splits_and_rows_in_one_line(base):
    st = fedfeat.open_store(base / "s.zarr")
    for call, pat in (
        (lambda: st.labels(["train"]), "has no split \\['train'\\]"),
        (lambda: st.features(None), "has no split None"),
        (lambda: st.features_rows("train", "abc"), "rows must be a 1-D sequence of integer"),
        (lambda: st.features_rows("train", np.ones(60, bool)), "rows must be a 1-D sequence of integer"),
        (lambda: st.features_rows("train", [[0, 1]]), "rows must be a 1-D sequence of integer"),
        (lambda: st.features_rows("train", [60]), "outside 0..59"),
    ):
        with pytest.raises(FedfeatError, match=pat) as e:
            call()
        one_line(e)
    assert st.features_rows("train", []).shape == (0, 8)
    np.testing.assert_array_equal(st.features_rows("train", [3, 1]), st.features("train")[[3, 1]])


def test_run_federated_refuses_wrong_types_in_one_line(base):
    from fedfeat.engine.data import load_run_data

    st = fedfeat.open_store(base / "s.zarr")
    data = load_run_data(st, fedfeat.make_partition(st.labels("train"), "iid", clients=3))
    m = fedfeat.get_method("fedavg")
    ok = dict(rounds=1, participation=1.0, seed=0, kernel="torch")
    for bad, pat in (
        ({"rounds": "2"}, "rounds must be an integer, got '2'"),
        ({"rounds": 1.5}, "rounds must be an integer"),
        ({"participation": "1"}, "participation must be a number"),
        ({"seed": "x"}, "seed must be an integer"),
        ({"eval_every": True}, "eval_every must be an integer"),
        ({"engine": 3}, "unknown engine"),
    ):
        with pytest.raises(FedfeatError, match=pat) as e:
            fedfeat.run_federated(m, data, **{**ok, **bad})
        one_line(e)
    _, rows = fedfeat.run_federated(m, data, **{**ok, "rounds": np.int64(1), "participation": np.float32(1)})
    _, ref = fedfeat.run_federated(m, data, **ok)
    assert [r["test_acc"] for r in rows] == [r["test_acc"] for r in ref] and len(rows) == 2

"""Issue 26, classes 7, 10 and 11: paths are local paths or URLs parsed as URLs, nothing follows a symbolic link out
of ``--out``; a reproduce table with nothing in it is an error, not a table of n/a; Ctrl-C always ends with 130 and
leaves nothing that looks complete (numba's first compile included).
"""

from __future__ import annotations

import ctypes
import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from fedfeat.cli.app import app
from fedfeat.errors import FedfeatError
from fedfeat.report import rundir
from fedfeat.runs import reproduce as R
from fedfeat.store.urls import local_path, store_location, url_kind

REPO = Path(__file__).resolve().parents[1]
runner = CliRunner()
FAST = ["--kernel", "torch", "--rounds", "1", "--clients", "4", "--quiet"]
TINY = ["--classes", "4", "--dim", "16", "--train-per-class", "60", "--test-per-class", "10", "--templates", "2",
        "--no-stats"]  # fmt: skip


def _cli(*args):
    return runner.invoke(app, [str(a) for a in args])


def _one_error_line(r, code: int = 2) -> str:
    assert r.exit_code == code, (r.exit_code, r.output, r.exception)
    lines = [x for x in r.output.splitlines() if x.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), r.output
    assert "Traceback" not in r.output
    return lines[0]


def _tree(root: Path) -> dict:
    """Every path under ``root`` (links not followed) with its kind, size and mtime."""
    out = {}
    for dirpath, dirs, files in os.walk(root):
        for n in dirs + files:
            p = Path(dirpath) / n
            st = p.lstat()
            out[str(p.relative_to(root))] = (st.st_mode, st.st_size, st.st_mtime_ns)
    return out


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("paths-store") / "s.zarr"
    r = _cli("synth", "--out", path, *TINY)
    assert r.exit_code == 0, r.output
    return path


# ---------------------------------------------------------------------------------------- class 7: URLs
def test_url_kinds_and_local_paths():
    """What each spelling is: plain paths stay local, file:// is its local path, everything else with :// or ::
    (or a URL that pathlib collapsed to one '/') is a URL, refused where a local path is needed."""
    assert url_kind("runs") is None and url_kind("a:b") is None and url_kind("dir/x:/y") is None
    assert url_kind("memory://runs") == "url" and url_kind("simplecache::file:///x") == "url"
    assert url_kind("file:///tmp/x") == "file" and url_kind(Path("memory://runs")) == "collapsed"
    assert local_path("file:///tmp/r") == Path("/tmp/r") and local_path(Path("file:///tmp/r")) == Path(
        "/tmp/r"
    )
    assert local_path("file://localhost/tmp/a%20b") == Path("/tmp/a b")
    for bad in ("memory://runs", "s3://b/runs", "simplecache::file:///tmp/r", Path("memory://runs"), "memory:/runs",
                "zip::file:///tmp/a.zip"):  # fmt: skip
        with pytest.raises(FedfeatError, match=r"not a URL .*--store"):
            local_path(bad, "--out")
    # stores: URLs (chains too) stay URLs; a URL made into a Path is refused, never a folder named 'memory:'
    assert store_location("memory://c/s.zarr/") == "memory://c/s.zarr"
    assert store_location("simplecache::memory://c/s.zarr") == "simplecache::memory://c/s.zarr"
    assert store_location(Path("file:///tmp/s.zarr")) == Path("/tmp/s.zarr")
    with pytest.raises(FedfeatError, match=r"pathlib.Path .*as a str"):
        store_location(Path("memory://c/s.zarr"))
    with pytest.raises(FedfeatError, match=r"one '/'; write memory://c/s.zarr"):
        store_location("memory:/c/s.zarr")
    with pytest.raises(FedfeatError, match=r"chained URL is read-only here.*file:///tmp/s.zarr"):
        store_location("simplecache::file:///tmp/s.zarr", write="--out")


def _url_cases(tmp: Path, store: Path) -> list[list]:
    return [
        ["train", "--store", store, "--out", "memory://runs", *FAST],
        ["train", "--store", store, "--out", f"simplecache::file://{tmp}/runs", *FAST],
        ["train", "--store", store, "--out", "zip::memory://a.zip", *FAST],
        ["sweep", "--store", store, "--out", "memory://runs", "--seed", "0,1", *FAST[:-1]],
        ["reproduce", "fst-cbdg-table4", "--out", "memory://r", "--store-root", tmp / "nothing"],
        ["reproduce", "fst-cbdg-table4", "--synthetic", "--store-root", "memory://cache"],
        ["report", "memory://runs"],
        ["report", tmp, "--plot", "memory://x.png"],
        ["partition", store, "--clients", "4", "--no-save", "--export", "memory://p.json"],
        ["partition", store, "--clients", "4", "--no-save", "--plot", "s3://bucket/p.png"],
        ["train", "--resume", "memory://runs/x"],
        ["synth", "--out", f"simplecache::file://{tmp}/s2.zarr", *TINY],
        ["synth", "--out", "memory:/s3.zarr", *TINY],
    ]


@pytest.mark.parametrize("i", range(13))
def test_url_where_a_local_path_is_needed_is_refused_and_writes_nothing(i, store, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "valuable.txt").write_text("keep")
    before = _tree(tmp_path)
    line = _one_error_line(_cli(*_url_cases(tmp_path, store)[i]))
    assert "URL" in line
    assert _tree(tmp_path) == before  # no folder named 'memory:', 'simplecache:' or 'zip:', nothing else
    assert not list(tmp_path.glob("*:*"))


def test_file_url_out_is_the_local_directory(store, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    r = _cli("train", "--store", store, "--out", f"file://{tmp_path}/runs", "--name", "r", *FAST)
    assert r.exit_code == 0, r.output
    assert (tmp_path / "runs" / "r" / "summary.json").is_file() and not list(tmp_path.glob("file:*"))


def test_chained_store_url_is_read_through_fsspec(store, tmp_path, monkeypatch):
    """``simplecache::file://...`` is an fsspec chain, read through fsspec (not a local folder 'simplecache:')."""
    monkeypatch.chdir(tmp_path)
    url = f"simplecache::file://{store}"
    r = _cli("train", "--store", url, "--out", tmp_path / "runs", "--name", "chained", *FAST)
    assert r.exit_code == 0, r.output
    plain = _cli("train", "--store", store, "--out", tmp_path / "runs", "--name", "plain", *FAST)
    assert plain.exit_code == 0, plain.output
    rows = [(tmp_path / "runs" / n / "metrics.jsonl").read_text().splitlines() for n in ("chained", "plain")]
    strip = [[{k: v for k, v in json.loads(x).items() if "seconds" not in k} for x in rs] for rs in rows]
    assert strip[0] == strip[1]
    assert _cli("info", url).exit_code == 0 and not list(tmp_path.glob("simplecache*"))


def test_stores_on_object_storage_still_work_for_reproduce(tmp_path, monkeypatch):
    """--store-root may be a store URL: reproduce finds ROOT/<dataset>/<backbone>-*.zarr there (memory://)."""
    from fedfeat.store.featurestore import FeatureStore, copy_store
    from fedfeat.store.synth import SynthParams, write_synthetic_store

    monkeypatch.setattr(R, "SYNTH_SHAPES", {("cifar10", "RN50"): dict(classes=10, dim=16)})
    local = tmp_path / "s.zarr"
    write_synthetic_store(local, SynthParams(classes=10, dim=16, train_per_class=30, test_per_class=5, templates=2),
                          stats=False, log=lambda *a: None)  # fmt: skip
    FeatureStore.open(local, mode="r+").update_attrs(backbone="RN50", pretrained="openai")
    root = f"memory://paths-{os.getpid()}-{time.monotonic_ns()}"
    copy_store(local, f"{root}/cifar10/RN50-openai.zarr")
    t = R.Table("tiny-url", "tiny", "RN50", "make cache-x", [R.Column("cifar10", "iid", {"partition": "iid"})],
                [R.Row("FedAvg", "fedavg")], {}, {"clients": 4, "participation": 1.0, "rounds": 1, "device": "cpu",
                                                  "kernel": "torch"})  # fmt: skip
    monkeypatch.setitem(R.TABLES, "tiny-url", t)
    cells = json.loads(R.reproduce("tiny-url", store_root=root, seeds=1, out=tmp_path / "runs", fmt="json",
                                   log=lambda *a: None))  # fmt: skip
    assert cells[0]["n"] == 1 and cells[0]["mean"] is not None


# ---------------------------------------------------------------------------------------- class 7: symlinks
def _finished(store: Path, out: Path, name: str) -> Path:
    r = _cli("train", "--store", store, "--out", out, "--name", name, *FAST)
    assert r.exit_code == 0, r.output
    return out / name


@pytest.fixture(scope="module")
def unfinished(store, tmp_path_factory) -> Path:
    """An interrupted run (killed after round 2 of 3, checkpointed every round): OUT/.partial-r, made once."""
    out = tmp_path_factory.mktemp("unfinished")
    env = dict(os.environ, FEDFEAT_FAULT="after-round-2", PYTHONPATH=str(REPO))
    p = subprocess.run([sys.executable, "-m", "fedfeat", "train", "--store", str(store), "--out", str(out), "--name",
                        "r", "--kernel", "torch", "--rounds", "3", "--clients", "4", "--quiet",
                        "--checkpoint-every", "1"], env=env, capture_output=True, text=True)  # fmt: skip
    assert p.returncode == -signal.SIGKILL, p.stderr
    return out / ".partial-r"


def _hostile(kind: str, store: Path, out: Path, victim: Path, unfinished: Path) -> list:
    """Plant a link of ``kind`` under ``out`` pointing at ``victim`` (a folder outside ``out``); the argv to run."""
    name = "r"
    train = ["train", "--store", store, "--out", out, "--name", name, *FAST]
    if kind == "final":
        (out / name).symlink_to(victim, target_is_directory=True)
        return train
    if kind == "final-overwrite":
        (out / name).symlink_to(victim, target_is_directory=True)
        return [*train, "--overwrite"]
    if kind == "final-dangling":
        (out / name).symlink_to(victim / "nothing-here")
        return [*train, "--overwrite"]
    if kind in ("partial", "partial-overwrite", "partial-resume"):
        (out / f".partial-{name}").symlink_to(victim, target_is_directory=True)
        (victim / "config.toml").write_text((victim.parent / "config.toml").read_text())
        if kind == "partial-resume":
            return ["train", "--resume", out / name]
        return [*train, "--overwrite"] if kind == "partial-overwrite" else train
    if kind == "old":
        (out / f".old-{name}").symlink_to(victim, target_is_directory=True)
        return [*train, "--overwrite"]
    if kind == "lock":
        (out / f".lock-{name}").symlink_to(victim / "lockfile")
        return train
    if kind in ("metrics-resume", "checkpoint-resume", "config-resume"):
        part = out / f".partial-{name}"
        shutil.copytree(unfinished, part)
        f = {"metrics-resume": "metrics.jsonl", "checkpoint-resume": "checkpoint.safetensors",
             "config-resume": "config.toml"}[kind]  # fmt: skip
        (victim / f).write_bytes((part / f).read_bytes())
        (part / f).unlink()
        (part / f).symlink_to(victim / f)
        return ["train", "--resume", out / name]
    raise AssertionError(kind)


KINDS = ["final", "final-overwrite", "final-dangling", "partial", "partial-overwrite", "partial-resume", "old",
         "lock", "metrics-resume", "checkpoint-resume", "config-resume"]  # fmt: skip


@pytest.mark.parametrize("kind", KINDS)
def test_links_out_of_out_are_refused_and_their_targets_untouched(kind, store, unfinished, tmp_path):
    """A run directory, partial directory, old directory, lock or a partial run's file that is a symbolic link to a
    folder outside --out: train refuses in one line; the link's target is neither published into, written through
    nor deleted, and nothing new is left under --out (no .partial- symlink, no half-written directory, no lock)."""
    out = tmp_path / "runs"
    out.mkdir()
    victim = tmp_path / "elsewhere" / "precious"
    victim.mkdir(parents=True)
    (victim / "data.txt").write_text("not a run")
    (victim.parent / "config.toml").write_text(
        (_finished(store, tmp_path / "ref", "x") / "config.toml").read_text()
    )
    argv = _hostile(kind, store, out, victim, unfinished)
    links = {p.name: os.readlink(p) for p in out.rglob("*") if p.is_symlink()}
    before_out, before_victim = _tree(out), _tree(victim.parent)
    line = _one_error_line(_cli(*argv))
    assert "symbolic link" in line and "remove the link itself" in line
    assert _tree(victim.parent) == before_victim  # nothing written through, published into or deleted
    assert (
        _tree(out) == before_out
    )  # nothing new or removed under --out: the links are still there, unchanged
    assert {p.name: os.readlink(p) for p in out.rglob("*") if p.is_symlink()} == links
    assert not list(out.rglob("summary.json"))


def test_publish_refuses_a_link_that_appears_while_the_run_is_written(store, tmp_path, monkeypatch):
    """The check is repeated at publication: a NAME link made during the run is refused there, its target kept,
    and the run's partial directory goes (no .partial- left behind)."""
    from fedfeat.runs import train as T

    out, victim = tmp_path / "runs", tmp_path / "victim"
    victim.mkdir()
    (victim / "keep.txt").write_text("x")
    real_publish = rundir.RunDir.publish

    def publish(self, overwrite):
        self.final.symlink_to(victim, target_is_directory=True)
        return real_publish(self, overwrite)

    monkeypatch.setattr(rundir.RunDir, "publish", publish)
    from fedfeat.runs.config import resolve_config

    cfg = resolve_config({"store": str(store), "out": str(out), "name": "r", "kernel": "torch", "rounds": 1,
                          "clients": 4}, None, None)  # fmt: skip
    with pytest.raises(FedfeatError, match="symbolic link"):
        T.train(cfg, overwrite=True, progress=False, log=lambda *a: None)
    assert sorted(p.name for p in victim.iterdir()) == ["keep.txt"]
    assert sorted(p.name for p in out.iterdir()) == ["r"] and (out / "r").is_symlink()


def test_a_symlinked_out_itself_is_used_as_given(store, tmp_path):
    """--out may itself be a link (the user named it): the run lands in its target."""
    real = tmp_path / "disk" / "runs"
    real.mkdir(parents=True)
    (tmp_path / "runs").symlink_to(real, target_is_directory=True)
    _finished(store, tmp_path / "runs", "r")
    assert (real / "r" / "summary.json").is_file()


# ---------------------------------------------------------------------------------------- class 10: empty tables
@pytest.fixture()
def small_shapes(monkeypatch):
    monkeypatch.setattr(R, "SYNTH_SHAPES", {
        ("cifar10", "RN50"): dict(classes=10, train_per_class=40, test_per_class=5, dim=16, templates=2),
        ("cifar100", "RN50"): dict(classes=100, train_per_class=4, test_per_class=1, dim=16, templates=2),
    })  # fmt: skip


def _fake_encoded(path: Path, classes: int = 10, dim: int = 16, backbone: str | None = "RN50") -> Path:
    """A store at ``path`` that reads as ``fedfeat encode`` output (a synthetic store whose attributes say so)."""
    from fedfeat.store.featurestore import FeatureStore
    from fedfeat.store.synth import SynthParams, write_synthetic_store

    p = SynthParams(classes=classes, dim=dim, train_per_class=40, test_per_class=5, templates=2)
    write_synthetic_store(path, p, stats=False, log=lambda *a: None)
    if backbone is not None:
        FeatureStore.open(path, mode="r+").update_attrs(backbone=backbone, pretrained="openai")
    return path


def _store_case(case: str, root: Path) -> tuple[Path, str]:
    """Plant ``case`` as ROOT/cifar10/RN50-x.zarr (cifar100 gets a good store); the pattern the error names."""
    bad = root / "cifar10" / "RN50-x.zarr"
    _fake_encoded(root / "cifar100" / "RN50-openai.zarr", classes=100)
    if case == "empty":
        bad.mkdir(parents=True)
        return bad, "not a fedfeat store"
    if case == "garbage-meta":
        bad.mkdir(parents=True)
        (bad / "zarr.json").write_text("{not json")
        return bad, "not a fedfeat store"
    if case == "file":
        bad.parent.mkdir(parents=True)
        bad.write_text("x")
        return bad, "store"
    if case == "incomplete":
        _fake_encoded(bad)
        import zarr

        zarr.open_group(str(bad), mode="r+").attrs.update({"complete": False})
        return bad, "incomplete|unfinished|not complete|never finished"
    if case == "wrong-classes":
        _fake_encoded(bad, classes=4)
        return bad, "has 4 classes, cifar10 has 10"
    if case == "wrong-backbone":
        _fake_encoded(bad, backbone="ViT-B-32")
        return bad, "holds ViT-B-32 features, not RN50"
    if case == "wrong-dim":
        _fake_encoded(bad, dim=8)
        return bad, "D = 8, RN50 gives D = 16"
    if case == "synthetic":
        _fake_encoded(bad, backbone=None)
        return bad, "synthetic store"
    raise AssertionError(case)


@pytest.mark.parametrize(
    "case",
    [
        "empty",
        "garbage-meta",
        "file",
        "incomplete",
        "wrong-classes",
        "wrong-backbone",
        "wrong-dim",
        "synthetic",
    ],  # fmt: skip
)
def test_reproduce_on_unusable_stores_is_one_error_naming_the_store(
    case, small_shapes, tmp_path, monkeypatch
):
    import re

    monkeypatch.chdir(tmp_path)
    root = tmp_path / "cache"
    bad, why = _store_case(case, root)
    line = _one_error_line(_cli("reproduce", "fst-cbdg-table4", "--store-root", root, "--seeds", "1", "--rounds",
                                "1", "--out", tmp_path / "runs", "--quiet"))  # fmt: skip
    assert str(bad) in line and re.search(why, line), line
    assert not list(tmp_path.rglob("summary.json"))


def test_reproduce_takes_the_first_usable_candidate(small_shapes, tmp_path):
    root = tmp_path / "cache"
    (root / "cifar10" / "RN50-a.zarr").mkdir(parents=True)  # an empty folder first
    good = _fake_encoded(root / "cifar10" / "RN50-b.zarr")
    _fake_encoded(root / "cifar10" / "RN50x4-openai.zarr")  # another backbone's name: not a candidate
    assert R.find_store(root, "cifar10", "RN50", R.TABLES["fst-cbdg-table4"], False, print) == good


def _tiny_table(monkeypatch, rows, metric="final_acc", columns=None):
    cols = columns or [R.Column("cifar10", "iid", {"partition": "iid"})]
    t = R.Table("tiny-empty", "tiny", "RN50", "make cache-x", cols, rows, {}, {"clients": 4, "participation": 1.0,
                "rounds": 1, "device": "cpu", "kernel": "torch"}, metric=metric)  # fmt: skip
    monkeypatch.setitem(R.TABLES, "tiny-empty", t)


def test_a_table_with_no_number_for_an_undocumented_reason_fails(small_shapes, tmp_path, monkeypatch):
    """Every cell n/a because the runs record no value of the table's metric: exit status 2, one line naming the
    cell and why."""
    _tiny_table(monkeypatch, [R.Row("FedAvg", "fedavg"), R.Row("Missing", None, why="not in fedfeat")],
                metric="novel_f1")  # fmt: skip
    line = _one_error_line(_cli("reproduce", "tiny-empty", "--synthetic", "--store-root", tmp_path / "c", "--seeds",
                                "1", "--out", tmp_path / "runs", "--quiet"))  # fmt: skip
    assert "no cell has a number" in line and "FedAvg in iid: its runs record no novel_f1" in line


def test_tables_whose_n_a_cells_are_documented_still_print(small_shapes, tmp_path, monkeypatch):
    """A row fedfeat does not have (every cell n/a) prints with status 0; so does a table with some numbers."""
    _tiny_table(monkeypatch, [R.Row("Missing", None, why="not in fedfeat")])
    r = _cli("reproduce", "tiny-empty", "--synthetic", "--store-root", tmp_path / "c", "--seeds", "1", "--out",
             tmp_path / "runs")  # fmt: skip
    assert r.exit_code == 0 and "n/a for Missing (all columns): not in fedfeat" in r.output, r.output
    _tiny_table(monkeypatch, [R.Row("FedAvg", "fedavg"), R.Row("Missing", None, why="not in fedfeat")])
    r = _cli("reproduce", "tiny-empty", "--synthetic", "--store-root", tmp_path / "c", "--seeds", "1", "--out",
             tmp_path / "runs", "--format", "json", "--quiet")  # fmt: skip
    assert r.exit_code == 0, r.output
    cells = json.loads(r.output[r.output.index("[") :])
    assert [c["mean"] is not None for c in cells] == [True, False]


def test_a_stand_in_of_other_parameters_is_refused_not_used(small_shapes, tmp_path):
    from fedfeat.store.synth import SynthParams, write_synthetic_store

    root = tmp_path / "c"
    write_synthetic_store(root / "synth-cifar10-rn50.zarr", SynthParams(classes=3, dim=8, train_per_class=5,
                          test_per_class=2, templates=1), stats=False, log=lambda *a: None)  # fmt: skip
    with pytest.raises(FedfeatError, match=r"synth-cifar10-rn50.zarr is not the stand-in this table needs"):
        R.find_store(root, "cifar10", "RN50", R.TABLES["fst-cbdg-table4"], True, lambda *a: None)
    (root / "synth-cifar100-rn50.zarr").mkdir()  # an empty folder where a stand-in goes: built there
    R.find_store(root, "cifar100", "RN50", R.TABLES["fst-cbdg-table4"], True, lambda *a: None)


# ---------------------------------------------------------------------------------------- class 11: interrupts
def _swallowing_callback(action):
    """Run ``action`` inside a ctypes callback (as LLVM calls numba's object-cache hook): an exception raised there
    is printed and dropped by ctypes, never propagated."""
    proto = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p)

    def cmp(a, b):
        action()
        return 0

    arr = (ctypes.c_int * 2)(1, 2)
    ctypes.CDLL(None).qsort(arr, 2, ctypes.sizeof(ctypes.c_int), proto(cmp))


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_an_interrupt_a_callback_swallows_is_raised_again():
    def sigint():
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(0.05)  # the handler runs here, inside the callback

    # without the latch the interrupt is lost (what numba's compile did): the code just goes on
    if signal.getsignal(signal.SIGINT) is signal.default_int_handler:
        _swallowing_callback(sigint)
    with pytest.raises(KeyboardInterrupt):
        with rundir.interrupt_latch():
            _swallowing_callback(sigint)
            for _ in range(200):  # the next Python lines: the interrupt comes back here
                time.sleep(0.01)
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_check_interrupt_and_deferral():
    with rundir.interrupt_latch():
        rundir.check_interrupt()  # nothing came: no-op
        with pytest.raises(KeyboardInterrupt):
            with rundir.deferred_interrupts():
                os.kill(os.getpid(), signal.SIGINT)
                time.sleep(0.05)
                done = True  # reached: held back until the block's end
        assert done and isinstance(rundir.interrupted(), KeyboardInterrupt)
        with pytest.raises(KeyboardInterrupt):
            rundir.check_interrupt()  # the commit points see it, whoever swallowed it
    assert rundir.interrupted() is None  # nothing carries over to later calls
    rundir.check_interrupt()


def test_the_cli_exits_130_when_a_library_swallowed_the_interrupt(store, monkeypatch):
    import fedfeat.report.stores as stores

    real = stores.print_store_info

    def swallowing(*a, **k):
        _swallowing_callback(lambda: (os.kill(os.getpid(), signal.SIGINT), time.sleep(0.05)))
        return real(*a, **k)

    monkeypatch.setattr(stores, "print_store_info", swallowing)
    r = _cli("info", store)
    assert r.exit_code == 130 and "error: interrupted (Ctrl-C)" in r.output, r.output


# numba's first compile of the fused kernels, interrupted: a fresh NUMBA_CACHE_DIR, and LLVM's object-cache hook
# (the ctypes callback that swallowed KeyboardInterrupt) marks the moment the process is inside the compile
_WRAP = textwrap.dedent("""
    import os, signal, sys, time
    from pathlib import Path
    import llvmlite.binding.executionengine as ee
    marker, orig = Path(os.environ["MARKER"]), ee.ExecutionEngine.set_object_cache
    def set_object_cache(self, notify_func=None, getbuffer_func=None):
        def notify(module, buf):
            if not marker.exists():
                marker.write_text("in-compile")
                if os.environ.get("SELF_SIGINT"):
                    os.kill(os.getpid(), signal.SIGINT)
                time.sleep(float(os.environ.get("HOLD", "0")))  # the test's SIGINT comes in here
            if notify_func is not None:
                return notify_func(module, buf)
        return orig(self, notify, getbuffer_func)
    ee.ExecutionEngine.set_object_cache = set_object_cache
    from fedfeat.cli import main
    main(sys.argv[1:])
""")


def _popen(args, tmp: Path, **env):
    e = dict(os.environ, PYTHONPATH=str(REPO), NUMBA_CACHE_DIR=str(tmp / "numba-cache"), **env)
    return subprocess.Popen([sys.executable, *map(str, args)], env=e, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)  # fmt: skip


def _wait_for(cond, p, timeout=60.0):
    t = time.monotonic()
    while not cond():
        assert p.poll() is None, p.communicate()
        assert time.monotonic() - t < timeout, "timed out"
        time.sleep(0.02)


def _finish(p, timeout=120):
    try:
        out, err = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        p.kill()
        out, err = p.communicate()
        raise AssertionError(f"not stopped by SIGINT: {err[-2000:]}") from None
    return p.returncode, out, err


def _nothing_complete(out: Path) -> None:
    """No summary.json, no finished (visible) run directory, no lock left under ``out``."""
    if not out.exists():
        return
    assert not list(out.rglob("summary.json"))
    assert not [p.name for p in out.iterdir() if not p.name.startswith(".")]
    assert not list(out.glob(".lock-*"))


@pytest.mark.parametrize("how", [pytest.param("self", marks=pytest.mark.slow), "outside"])
def test_ctrl_c_during_numbas_first_compile_exits_130(how, store, tmp_path):
    """SIGINT while numba compiles the fused kernel (a fresh cache): sent from outside while LLVM's callback runs,
    or (slow) raised by the process itself inside that callback -- where ctypes dropped it and the run went on to
    publish with rc 0 before the fix."""
    pytest.importorskip("llvmlite.binding.executionengine")
    from llvmlite.binding.executionengine import ExecutionEngine

    if not hasattr(ExecutionEngine, "set_object_cache"):
        pytest.skip("llvmlite without the object-cache hook this test times the interrupt with")
    (tmp_path / "wrap.py").write_text(_WRAP)
    marker, out = tmp_path / "in-compile", tmp_path / "runs"
    env = (
        {"MARKER": str(marker), "SELF_SIGINT": "1"} if how == "self" else {"MARKER": str(marker), "HOLD": "5"}
    )
    p = _popen([tmp_path / "wrap.py", "train", "--store", store, "--out", out, "--method", "fedavg", "--kernel",
                "fused", "--rounds", "2", "--clients", "4", "--quiet"], tmp_path, **env)  # fmt: skip
    if how == "outside":
        _wait_for(marker.exists, p)
        p.send_signal(signal.SIGINT)
    rc, stdout, err = _finish(p)
    assert marker.read_text() == "in-compile"  # the interrupt came inside the compile
    assert rc == 130, (rc, stdout, err)
    assert "error: interrupted (Ctrl-C)" in err and "Traceback" not in err and "Exception ignored" not in err
    assert "run:" not in stdout
    _nothing_complete(out)


def test_ctrl_c_after_some_rounds_exits_130_and_the_run_resumes(store, tmp_path):
    out = tmp_path / "runs"
    p = _popen(["-m", "fedfeat", "train", "--store", store, "--out", out, "--name", "r", "--kernel", "torch",
                "--rounds", "100000", "--clients", "4", "--quiet", "--checkpoint-every", "1"], tmp_path)  # fmt: skip
    part = out / ".partial-r"
    _wait_for(lambda: (part / "checkpoint.safetensors").is_file()
              and len((part / "metrics.jsonl").read_text().splitlines()) > 3, p)  # fmt: skip
    p.send_signal(signal.SIGINT)
    rc, stdout, err = _finish(p)
    assert rc == 130 and err.strip().splitlines() == ["error: interrupted (Ctrl-C)"], err
    assert f"resume with: fedfeat train --resume {out / 'r'}" in stdout
    _nothing_complete(out)
    assert (part / "checkpoint.safetensors").is_file() and not (part / "summary.json").exists()


def test_ctrl_c_during_a_sweep_exits_130_and_keeps_only_finished_runs(store, tmp_path):
    out = tmp_path / "runs"
    p = _popen(["-m", "fedfeat", "sweep", "--store", store, "--out", out, "--kernel", "torch", "--rounds", "100000",
                "--clients", "4", "--seed", "0,1", "--method", "fedavg,fedprox", "--no-stack", "--quiet"],
               tmp_path)  # fmt: skip
    _wait_for(lambda: any(len((d / "metrics.jsonl").read_text().splitlines()) > 2
                          for d in out.glob(".partial-*") if (d / "metrics.jsonl").is_file()), p)  # fmt: skip
    p.send_signal(signal.SIGINT)
    rc, _, err = _finish(p)
    assert rc == 130 and "error: interrupted (Ctrl-C)" in err, err
    _nothing_complete(out)


_ENCODE_WRAP = textwrap.dedent("""
    import ctypes, os, signal, sys, time
    from fedfeat.store.featurestore import FeatureStore
    real, calls = FeatureStore.write_chunk, []
    def sigint():
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(0.05)
    def write_chunk(self, *a, **k):
        calls.append(1)
        if len(calls) == 2:  # Ctrl-C while the second chunk is written
            if os.environ["HOW"] == "swallowed":  # inside a ctypes callback, which drops the exception
                proto = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p)
                cb = proto(lambda x, y: (sigint(), 0)[1])
                ctypes.CDLL(None).qsort((ctypes.c_int * 2)(1, 2), 2, ctypes.sizeof(ctypes.c_int), cb)
            else:
                sigint()
        return real(self, *a, **k)
    FeatureStore.write_chunk = write_chunk
    from fedfeat.cli import main
    main(sys.argv[1:])
""")


@pytest.mark.slow  # ~10 s each: open_clip and the tiny model in a fresh interpreter
@pytest.mark.parametrize("how", ["raised", "swallowed"])
def test_ctrl_c_during_encode_exits_130_and_the_store_stays_incomplete(how, tmp_path):
    """SIGINT while encode writes its second chunk -- raised, or swallowed by a ctypes callback: status 130, the
    store without its complete flag (resumable), no lock left."""
    from helpers_clip import make_tiny_clip, write_cifar10

    from fedfeat.store.featurestore import FeatureStore

    tc = make_tiny_clip(tmp_path / "tinyclip")
    c10 = write_cifar10(tmp_path / "data" / "cifar-10-batches-py", n_train=64, n_test=16)
    (tmp_path / "wrap.py").write_text(_ENCODE_WRAP)
    p = _popen([tmp_path / "wrap.py", "encode", "--dataset", "cifar10", "--root", c10.root, "--backbone", tc.config,
                "--pretrained", tc.weights, "--out", tmp_path / "cache", "--device", "cpu", "--chunk-rows", "8",
                "--batch-size", "8"], tmp_path, HOW=how)  # fmt: skip
    rc, stdout, err = _finish(p)
    assert rc == 130 and err.strip().splitlines()[-1] == "error: interrupted (Ctrl-C)", (rc, stdout, err)
    (path,) = (tmp_path / "cache").glob("*/*.zarr")
    st = FeatureStore.open(path, allow_incomplete=True)
    assert not st.complete and any(v for v in st.missing().values())
    assert not list((tmp_path / "cache").glob("*/*.lock"))

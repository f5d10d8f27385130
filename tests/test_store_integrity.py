"""Store integrity: checksums, non-finite values, read-only stores, full disks, writer locks.

Every store here is tiny (synth with --dim 8, or ``FeatureStore.create`` with chunks of 4 rows); damage is done
to the files on disk, as a failing disk, a careless ``rm`` or another program would do it.
"""

import errno
import json
import os
import shlex
import shutil
import socket
import subprocess
import sys

import numpy as np
import pytest
import zarr
from helpers_clip import read_only_bind, run_mounted, unshare_available
from typer.testing import CliRunner

from fedfeat.cli.app import app
from fedfeat.errors import FedfeatError
from fedfeat.partition import stored
from fedfeat.store.featurestore import DONE_BIT, FeatureStore, crc
from fedfeat.store.lock import StoreLock

runner = CliRunner()
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _new(path, n_train=10, d=8, chunk_rows=4, synthetic=True):
    st = FeatureStore.create(
        path,
        backbone="synthetic" if synthetic else "toy",
        pretrained="none",
        embed_dim=d,
        logit_scale=100.0,
        class_names=["a", "b"],
        templates=["a photo of a {}.", "a {}."],
        preprocessing={"kind": "none"},
        fingerprint={"x": 1},
        labels={"train": np.arange(n_train) % 2, "test": np.arange(4) % 2},
        chunk_rows=chunk_rows,
    )
    rng = np.random.default_rng(0)
    for split in st.splits:
        for i in range(st.n_chunks(split)):
            sl = st.chunk_slice(split, i)
            st.write_chunk(split, i, rng.standard_normal((sl.stop - sl.start, d)))
    st.write_text(rng.standard_normal((2, 2, d)))
    st.mark_complete()
    return FeatureStore.open(path)


@pytest.fixture
def store(tmp_path):
    _new(tmp_path / "s.zarr")
    return tmp_path / "s.zarr"


def one_line_error(args) -> str:
    r = runner.invoke(app, [str(a) for a in args])
    lines = [ln for ln in r.output.splitlines() if ln.strip()]
    assert r.exit_code == 2 and len(lines) == 1 and lines[0].startswith("error: "), (r.output, r.exception)
    return lines[0]


def chunk_file(store, split, i) -> str:
    """The file of feature chunk ``i`` (zarr v3 default keys: ``c/<row chunk>/<col chunk>``)."""
    p = store / split / "features" / "c" / str(i) / "0"
    assert p.is_file(), sorted(str(q) for q in (store / split / "features").rglob("*"))
    return p


# ---------------------------------------------------------------------------------------- non-finite values
def _poison(store, split_row_col):
    """Write NaN straight through zarr (a writer without checks) with a matching checksum, drop ``finite``."""
    g = zarr.open_group(str(store), mode="r+")
    a = g["train/features"][...]
    for r, c in split_row_col:
        a[r, c] = np.nan
    g["train/features"][...] = a
    for i in range(3):
        g["train/done"][i] = DONE_BIT | crc(a[i * 4 : (i + 1) * 4])
    meta = store / "zarr.json"
    d = json.loads(meta.read_text())
    d["attributes"].pop("finite")
    meta.write_text(json.dumps(d))


def test_nan_row_is_refused_naming_split_and_row(store):
    _poison(store, [(6, 2), (9, 0)])
    before = (store / "zarr.json").read_bytes()
    with pytest.raises(FedfeatError, match=r"train/features row 6 is not finite \(NaN or inf\).*--force"):
        FeatureStore.open(store)  # no finite record: checked once on open
    assert (store / "zarr.json").read_bytes() == before  # mode "r" records nothing
    st = FeatureStore(store, zarr.open_group(str(store), mode="r"))  # skip open's check: reads refuse too
    with pytest.raises(FedfeatError, match="train/features row 6 is not finite"):
        st.features("train")
    with pytest.raises(FedfeatError, match="train/features row 9 is not finite"):
        st.features_rows("train", np.array([1, 9]))
    np.testing.assert_array_equal(st.features_rows("train", np.array([3, 0])).shape, (2, 8))  # chunk 0 clean
    assert "row 6" in one_line_error(["info", "--verify", store])


def test_finite_record_is_written_once_when_writable(store):
    meta = store / "zarr.json"
    d = json.loads(meta.read_text())
    d["attributes"].pop("finite")
    meta.write_text(json.dumps(d))
    FeatureStore.open(store)  # read-only: checks in memory, writes nothing
    assert "finite" not in json.loads(meta.read_text())["attributes"]
    FeatureStore.open(store, mode="r+")
    assert json.loads(meta.read_text())["attributes"]["finite"] is True


def test_writers_refuse_non_finite_values(tmp_path):
    st = FeatureStore.create(
        tmp_path / "w.zarr",
        backbone="toy",
        pretrained="none",
        embed_dim=4,
        logit_scale=1.0,
        class_names=["a", "b"],
        templates=["{}"],
        preprocessing={},
        fingerprint={},
        labels={"train": np.zeros(4, dtype=np.int64)},
        chunk_rows=4,
    )
    x = np.ones((4, 4))
    x[2, 1] = 1e6  # beyond float16's range: inf once stored
    with pytest.raises(FedfeatError, match="train/features row 2: not finite"):
        st.write_chunk("train", 0, x)
    assert not st.done_chunks("train").any()
    t = np.ones((1, 2, 4))
    t[0, 1, 0] = np.nan
    with pytest.raises(FedfeatError, match="text/features template 0, class 1: not finite"):
        st.write_text(t)
    assert not st.text_done()


def test_inf_text_feature_is_refused(store):
    g = zarr.open_group(str(store), mode="r+")
    t = g["text/features"][...]
    t[1, 0, 3] = np.inf
    g["text/features"][...] = t
    g["text/done"][0] = DONE_BIT | crc(t)
    with pytest.raises(FedfeatError, match="text/features template 1, class 0 is not finite"):
        FeatureStore.open(store).text_features()


# ---------------------------------------------------------------------------------------- checksums
def test_deleted_chunk_file_is_refused_by_loading_and_info_verify(store):
    chunk_file(store, "train", 1).unlink()
    st = FeatureStore.open(store)  # opening stays cheap: it does not read the features
    msg = r"train/features chunk 1 \(rows 4-7\) does not match its checksum.*rebuild the store"
    with pytest.raises(FedfeatError, match=msg):
        st.features("train")
    with pytest.raises(FedfeatError, match=msg):
        st.features_rows("train", np.array([5]))
    np.testing.assert_array_equal(st.features_rows("train", np.array([0, 9])).shape, (2, 8))  # intact chunks
    st.features("test")  # the other split is intact
    line = one_line_error(["info", "--verify", store])
    assert "train/features chunk 1 (rows 4-7)" in line and "fedfeat synth --force" in line
    r = runner.invoke(app, ["info", str(store)])  # without --verify: shown, no error
    assert r.exit_code == 0


def test_bit_flipped_chunk_is_refused(store):
    f = chunk_file(store, "train", 2)
    data = bytearray(f.read_bytes())
    data[len(data) // 2] ^= 0x10
    f.write_bytes(bytes(data))
    with pytest.raises(FedfeatError, match=r"train/features chunk 2 \(rows 8-9\)"):
        FeatureStore.open(store).features("train")
    assert "train/features chunk 2 (rows 8-9)" in one_line_error(["info", "--verify", store])


def test_chunk_overwritten_with_other_values_is_refused(store):
    g = zarr.open_group(str(store), mode="r+")
    g["test/features"][0:4] = np.ones((4, 8), dtype=np.float16)  # valid, finite, but not what was written
    with pytest.raises(FedfeatError, match=r"test/features chunk 0 \(rows 0-3\) does not match its checksum"):
        FeatureStore.open(store).features("test")


def test_deleted_done_entry_labels_and_text_are_refused(store, tmp_path):
    shutil.copytree(store, tmp_path / "b.zarr")
    (store / "train" / "done" / "c" / "0").unlink()
    with pytest.raises(FedfeatError, match=r"train/features chunk 0 \(rows 0-3\) has no checksum record"):
        FeatureStore.open(store).features("train")
    b = tmp_path / "b.zarr"
    (b / "train" / "labels" / "c" / "0").unlink()  # labels would read as -1: every row "skipped"
    with pytest.raises(FedfeatError, match=r"train/labels .*does not match its checksum"):
        FeatureStore.open(b).labels("train")
    (b / "text" / "features" / "c" / "0" / "0" / "0").unlink()
    with pytest.raises(FedfeatError, match="text/features does not match its checksum"):
        FeatureStore.open(b).text_features()
    line = one_line_error(["partition", b, "--scheme", "iid", "--clients", "2"])
    assert "train/labels" in line


def test_broken_store_metadata_is_one_line(store):
    (store / "train" / "done" / "zarr.json").unlink()
    line = one_line_error(["info", store])
    assert "train/done is missing or unreadable" in line and "--force" in line
    meta = store / "zarr.json"
    d = json.loads(meta.read_text())
    del d["attributes"]["class_names"]
    meta.write_text(json.dumps(d))
    assert "attributes lack class_names" in one_line_error(["info", store])


def test_format_version_1_is_refused_with_the_rebuild_command(store):
    meta = store / "zarr.json"
    d = json.loads(meta.read_text())
    d["attributes"]["format_version"] = 1
    meta.write_text(json.dumps(d))
    line = one_line_error(["info", store])
    assert "format version 1" in line and "fedfeat synth --force" in line


def test_corrupted_partition_is_refused(tmp_path):
    out = tmp_path / "p.zarr"
    r = runner.invoke(app, ["synth", "--out", str(out), "--classes", "3", "--dim", "8", "--train-per-class",
                            "20", "--test-per-class", "5", "--templates", "1", "--no-stats"])  # fmt: skip
    assert r.exit_code == 0, r.output
    r = runner.invoke(app, ["partition", str(out), "--scheme", "iid", "--clients", "3"])
    assert r.exit_code == 0, r.output
    st = FeatureStore.open(out)
    (key,) = st.partition_keys()
    (out / "partitions" / key / "order" / "c" / "0").unlink()
    with pytest.raises(FedfeatError, match=f"partitions/{key}/order does not match its checksum"):
        stored.read(st, key)


# ---------------------------------------------------------------------------------------- synth: atomic
def test_synth_full_disk_leaves_nothing_that_looks_like_a_store(tmp_path, monkeypatch):
    def full(self, *a, **k):
        raise OSError(errno.ENOSPC, "No space left on device", str(self.path / "train/features/c/0/0"))

    monkeypatch.setattr(FeatureStore, "write_chunk", full)
    out = tmp_path / "s.zarr"
    args = ["synth", "--out", out, "--classes", "2", "--dim", "8", "--train-per-class", "5", "--no-stats"]
    line = one_line_error(args)
    assert f"at {out}" in line and "no space left on device" in line and "free space" in line
    assert list(tmp_path.iterdir()) == []  # no store, no temporary sibling
    monkeypatch.undo()
    r = runner.invoke(app, [str(a) for a in args])  # no --force needed afterwards
    assert r.exit_code == 0, r.output
    assert FeatureStore.open(out).complete


def test_synth_force_replaces_a_store_only_once_the_new_one_is_complete(tmp_path, monkeypatch):
    out = tmp_path / "s.zarr"
    base = ["synth", "--out", out, "--classes", "2", "--dim", "8", "--train-per-class", "5", "--no-stats"]
    assert runner.invoke(app, [str(a) for a in base]).exit_code == 0
    old = FeatureStore.open(out).features("train")
    monkeypatch.setattr(
        FeatureStore, "write_text", lambda *a: (_ for _ in ()).throw(OSError(errno.EROFS, "x"))
    )
    line = one_line_error(base + ["--seed", "1", "--force"])
    assert "read-only file system" in line
    np.testing.assert_array_equal(FeatureStore.open(out).features("train"), old)  # the old store is intact
    assert sorted(p.name for p in tmp_path.iterdir()) == ["s.zarr"]


# ---------------------------------------------------------------------------------------- read-only stores
needs_unshare = pytest.mark.skipif(
    not unshare_available(),
    reason="needs `unshare -rm` with mounts (a user namespace) for a truly read-only store or a full disk",
)


def _read_only(store, *argv) -> subprocess.CompletedProcess:
    return run_mounted(read_only_bind(store), list(argv))


def _tree(path):
    return {str(p): (p.stat().st_size, p.stat().st_mtime_ns) for p in sorted(path.rglob("*"))}


@needs_unshare
def test_read_only_store_opens_and_partitions_in_memory(store):
    before = _tree(store.parent)
    probe = (
        "from fedfeat.store.featurestore import FeatureStore as F; import sys; s = F.open(sys.argv[1], mode='r'); "
        "s.verify(); print(s.features('train').shape, s.labels('train').sum(), s.text_features().shape); "
        "open(sys.argv[1] + '/probe', 'w')"
    )
    p = _read_only(store, sys.executable, "-c", probe, store)
    assert "(10, 8) 5 (2, 2, 8)" in p.stdout and "Read-only file system" in p.stderr, p.stdout + p.stderr
    fedfeat = [sys.executable, "-m", "fedfeat"]
    p = _read_only(store, *fedfeat, "partition", store, "--scheme", "iid", "--clients", "2", "--no-save",
                   "--stats")  # fmt: skip
    out = " ".join(p.stdout.split())
    assert p.returncode == 0 and "2 clients, 10 of 10 samples" in out and "per-client counts" in out, out
    p = _read_only(store, *fedfeat, "partition", store, "--scheme", "iid", "--clients", "2")
    lines = [ln for ln in (p.stdout + p.stderr).splitlines() if ln.strip()]
    assert p.returncode == 2 and len(lines) == 1, p.stdout + p.stderr
    assert "read-only file system" in lines[0] and "--no-save" in lines[0]
    p = _read_only(store, *fedfeat, "info", "--verify", store)
    assert p.returncode == 0 and "checksums match" in p.stdout, p.stdout + p.stderr
    assert _tree(store.parent) == before  # nothing written, not even beside the store


# ---------------------------------------------------------------------------------------- locks
def _dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def test_lock_refuses_a_live_holder_and_takes_over_a_stale_one(tmp_path):
    target = tmp_path / "x.zarr"
    with StoreLock(target) as held:
        holder = json.loads(held.path.read_text())
        assert holder["pid"] == os.getpid() and holder["host"] == socket.gethostname()
        with pytest.raises(FedfeatError, match=rf"pid {os.getpid()} on host {socket.gethostname()}, since "):
            StoreLock(target).acquire()
    assert not held.path.exists()  # released
    lock = target.with_name("x.zarr.lock")
    lock.write_text(json.dumps({"pid": _dead_pid(), "host": socket.gethostname(), "since": "earlier"}))
    msgs = []
    with StoreLock(target, log=msgs.append):
        assert json.loads(lock.read_text())["pid"] == os.getpid()
    assert len(msgs) == 1 and "taking over the stale lock" in msgs[0] and "no longer running" in msgs[0]
    lock.write_text(json.dumps({"pid": 1, "host": "elsewhere.example", "since": "2026-01-01T00:00:00+00:00"}))
    with pytest.raises(FedfeatError, match=r"pid 1 on host elsewhere\.example.*remove .*x\.zarr\.lock"):
        StoreLock(target).acquire()
    assert json.loads(lock.read_text())["host"] == "elsewhere.example"  # another host's lock is left alone


@needs_unshare
def test_synth_on_a_really_full_disk(tmp_path):
    """A 200 KiB tmpfs: the 2.5 MB store cannot fit; one line, exit 2, and nothing left on the disk."""
    disk = tmp_path / "disk"
    disk.mkdir()
    out = disk / "s.zarr"
    synth = shlex.join([sys.executable, "-m", "fedfeat", "synth", "--out", str(out), "--dim", "256",
                        "--train-per-class", "500", "--no-stats"])  # fmt: skip
    script = f"{synth}; echo rc=$?; echo left: $(ls -A {shlex.quote(str(disk))})"
    p = run_mounted(f"mount -t tmpfs -o size=200k tmpfs {shlex.quote(str(disk))}", ["sh", "-c", script])
    assert p.stdout.split() == ["rc=2", "left:"], p.stdout + p.stderr  # nothing on the disk
    lines = [ln for ln in p.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith(
        f"error: cannot finish writing the synthetic store at {out}"
    )
    assert "no space left on device" in lines[0], lines

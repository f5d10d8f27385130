"""Issue 26, classes 2, 3 and the report side of 8: stale locks, checkpoints that must be checked before they are
trusted, and run directories whose files are not what they claim to be.

* Locks (``fedfeat.store.lock``: a run's ``OUT/.lock-NAME`` and a store's ``STORE.lock`` follow the same rules):
  written atomically (a full disk leaves no lock), an empty, garbage or dead-writer lock is taken over with a
  message, a live writer's or another host's lock is refused.
* Checkpoints (``fedfeat.engine.checkpoint``): a flipped byte anywhere, a truncated file, another run's checkpoint,
  a round out of range, metric rows missing, repeated or edited before it, the previous format: ``--resume``
  refuses in one line that says how to start afresh; only a matching checkpoint resumes, equal to the
  uninterrupted run.
* Reports: a FIFO, a socket or a directory in place of ``metrics.jsonl`` / ``summary.json`` is skipped with one
  warning line (never opened, never a hang); summary keys of the wrong type are skipped naming the file and key.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from typer.testing import CliRunner

from fedfeat.cli.app import app
from fedfeat.engine import checkpoint
from fedfeat.errors import FedfeatError
from fedfeat.report import rundir
from fedfeat.report.load import load_runs
from fedfeat.report.rundir import Lock
from fedfeat.runs.config import RunConfig
from fedfeat.runs.train import train
from fedfeat.store import lock as locks
from fedfeat.store.lock import StoreLock

runner = CliRunner()
HOST = socket.gethostname()
ROUNDS, EVERY, KILL = 6, 2, 5  # checkpoints after rounds 2 and 4; killed after round 5: resumes after round 4


def _cli(*args):
    return runner.invoke(app, [str(a) for a in args])


def _one_line_error(r) -> str:
    """A refused command: exit 2, exactly one line, no traceback."""
    assert r.exit_code == 2, (r.exit_code, r.output, r.exception)
    lines = [ln for ln in r.output.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), r.output
    assert "Traceback" not in r.output
    return lines[0]


def _dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    out = tmp_path_factory.mktemp("lc") / "s.zarr"
    r = _cli("synth", "--out", out, "--classes", "4", "--dim", "16", "--train-per-class", "30",
             "--test-per-class", "10", "--templates", "2", "--no-stats")  # fmt: skip
    assert r.exit_code == 0, r.output
    return out


def _cfg(store, out, **kw) -> RunConfig:
    base = dict(method="fedavg", store=str(store), clients=4, rounds=ROUNDS, participation=0.5, kernel="torch",
                out=str(out), name="x")  # fmt: skip
    return RunConfig(**{**base, **kw})


class _Kill(KeyboardInterrupt):
    """Stands for a kill at a fault point (a KeyboardInterrupt: the run keeps its checkpointed partial dir)."""


def _train_killed(cfg: RunConfig, after: int, every: int = EVERY) -> None:
    def fault(name: str) -> None:
        if name == f"after-round-{after}":
            raise _Kill

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(rundir, "fault_point", fault)
        with pytest.raises(_Kill):
            train(cfg, checkpoint_every=every, progress=False, log=lambda s: None)


def _metrics(run: Path) -> list[dict]:
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if "seconds" not in k} for r in rows]


def _same_run(a: Path, b: Path) -> None:
    assert _metrics(a) == _metrics(b)
    wa, wb = load_file(a / "weights.safetensors"), load_file(b / "weights.safetensors")
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)


@pytest.fixture(scope="module")
def runs(store, tmp_path_factory):
    """An uninterrupted fst-cbdg run (state: soft labels) and the same run killed after round 5 (checkpoint of
    round 4, metric rows 0..5), to be copied by each test."""
    root = tmp_path_factory.mktemp("lc-runs")
    train(_cfg(store, root / "u", method="fst-cbdg"), checkpoint_every=0, progress=False, log=lambda s: None)
    _train_killed(_cfg(store, root / "k", method="fst-cbdg"), KILL)
    assert (root / "k" / ".partial-x" / rundir.CHECKPOINT).is_file()
    return {"u": root / "u" / "x", "k": root / "k"}


@pytest.fixture
def partial(runs, tmp_path):
    """A fresh copy of the interrupted run: ``(run path to resume, its partial directory)``."""
    out = tmp_path / "k"
    shutil.copytree(runs["k"], out)
    return out / "x", out / ".partial-x"


def _snapshot(d: Path) -> dict:
    return {str(p.relative_to(d)): p.read_bytes() for p in sorted(d.rglob("*")) if p.is_file()}


def _refused(run: Path, part: Path, *patterns: str) -> str:
    """``train --resume`` is refused in one line naming how to start afresh, and leaves the unfinished run as it
    was (a later fix of the damage can still resume it)."""
    before = _snapshot(part)
    line = _one_line_error(_cli("train", "--resume", run, "--quiet"))
    assert "cannot resume" in line and "drop --resume and pass --overwrite" in line, line
    for pat in patterns:
        assert pat in line, (pat, line)
    assert _snapshot(part) == before
    assert not run.exists() and not list(run.parent.glob(".lock-*"))
    return line


def _resumes(run: Path, reference: Path) -> None:
    r = _cli("train", "--resume", run, "--quiet")
    assert r.exit_code == 0, r.output
    _same_run(reference, run)


# ============================================================================================== locks
def _lock(kind: str, where: Path):
    """``(lock object, its file)`` of a run directory's lock or a store's lock under ``where``."""
    if kind == "run":
        lk = Lock(where / ".lock-x", "run x", log=None)
        return lk, lk.path
    lk = StoreLock(where / "s.zarr")
    return lk, lk.path


def _holds_me(path: Path) -> bool:
    doc = json.loads(path.read_text())
    return doc["pid"] == os.getpid() and doc["host"] == HOST


@pytest.mark.parametrize("kind", ["run", "store"])
@pytest.mark.parametrize(
    "content, why",
    [
        (b"", "empty or unreadable"),
        (b"\x00\xff garbage \x13", "empty or unreadable"),
        (b'{"pid": 12', "empty or unreadable"),  # cut short
        (b"[1, 2]", "empty or unreadable"),  # JSON, not a record
        (b'{"pid": "12", "host": "h"}', "empty or unreadable"),  # a pid that is no pid
        (b'{"pid": -5, "host": "h"}', "empty or unreadable"),
        (b'{"host": "h"}', "empty or unreadable"),
        ("dead", "no longer running"),
        ("reused", "another process"),  # a live pid that is not the writer (start time differs)
        ("rebooted", "restarted"),
    ],
)
def test_a_stale_lock_is_taken_over_with_a_message(tmp_path, capsys, kind, content, why):
    lk, path = _lock(kind, tmp_path)
    if content == "dead":
        content = json.dumps({"pid": _dead_pid(), "host": HOST, "since": "earlier"}).encode()
    elif content == "reused":  # our parent's pid (alive) with a start time it never had
        me = locks.lock_record()
        if "start_ticks" not in me:
            pytest.skip("no /proc here: start ticks unknown")
        content = json.dumps({**me, "pid": os.getppid(), "start_ticks": me["start_ticks"] + 12345}).encode()
    elif content == "rebooted":
        me = locks.lock_record()
        if "boot" not in me:
            pytest.skip("no boot id here")
        content = json.dumps({**me, "pid": os.getppid(), "boot": "another-boot"}).encode()
    path.write_bytes(content)
    lk.acquire()
    try:
        assert _holds_me(path)
        err = capsys.readouterr().err.strip().splitlines()
        assert (
            len(err) == 1 and err[0].startswith("warning: taking over the stale lock") and str(path) in err[0]
        )
        assert why in err[0], err[0]
    finally:
        lk.release()
    assert not path.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == []  # no temporary or aside file left


@pytest.mark.parametrize("kind", ["run", "store"])
def test_a_live_writer_and_another_hosts_lock_are_refused(tmp_path, kind):
    lk, path = _lock(kind, tmp_path)
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        for holder in (locks.lock_record(), {"pid": live.pid, "host": HOST, "since": "then"},
                       {"pid": _dead_pid(), "host": "elsewhere.example", "since": "then"}):  # fmt: skip
            raw = json.dumps(holder).encode()
            path.write_bytes(raw)
            with pytest.raises(FedfeatError) as e:
                lk.acquire()
            msg = str(e.value)
            assert "\n" not in msg and f"pid {holder['pid']} on host {holder['host']}" in msg
            assert path.read_bytes() == raw  # never taken over, never rewritten
            lk.release()  # not ours: left alone
            assert path.read_bytes() == raw
    finally:
        live.kill()
        live.wait()


@pytest.mark.parametrize("kind", ["run", "store"])
def test_a_full_disk_while_writing_the_lock_leaves_no_lock(tmp_path, monkeypatch, kind):
    lk, path = _lock(kind, tmp_path)

    def full(fd, data):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(locks, "_write_all", full)
    with pytest.raises(FedfeatError) as e:
        lk.acquire()
    assert "\n" not in str(e.value) and "space" in str(e.value).lower() and str(path) in str(e.value)
    assert list(tmp_path.iterdir()) == []  # neither the lock nor its temporary file
    monkeypatch.undo()  # space freed: the next writer is not refused
    lk.acquire()
    assert _holds_me(path)
    lk.release()


def test_a_full_disk_during_train_then_freed_space(store, tmp_path, monkeypatch):
    """The issue's case through the CLI: the lock cannot be written (ENOSPC); one line, nothing left; once space
    is free, the same command runs."""

    def full(fd, data):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(locks, "_write_all", full)
    args = ["train", "--store", store, "--out", tmp_path, "--name", "x", "--kernel", "torch", "--clients", "4",
            "--rounds", "2", "--quiet"]  # fmt: skip
    line = _one_line_error(_cli(*args))
    assert "no space left" in line.lower() and ".lock-x" in line
    assert list(tmp_path.iterdir()) == []
    monkeypatch.undo()
    assert _cli(*args).exit_code == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["x"]


def test_a_zero_byte_run_lock_left_by_an_old_full_disk_is_taken_over_by_train(store, tmp_path):
    (tmp_path / ".lock-x").write_bytes(b"")
    r = runner.invoke(app, ["train", "--store", str(store), "--out", str(tmp_path), "--name", "x", "--kernel",
                            "torch", "--clients", "4", "--rounds", "2", "--quiet"])  # fmt: skip
    assert r.exit_code == 0, r.output
    assert "taking over the stale lock" in r.stderr and "empty or unreadable" in r.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["x"]


@pytest.mark.skipif(
    sys.platform != "linux" or shutil.which("unshare") is None, reason="needs unshare for a tmpfs"
)
def test_a_really_full_disk_leaves_no_lock_and_freeing_space_lets_train_run(store, tmp_path):
    if subprocess.run(["unshare", "-rm", "true"], capture_output=True).returncode != 0:
        pytest.skip("user namespaces are not available here")
    disk = tmp_path / "disk"
    disk.mkdir()
    fedfeat = f"{sys.executable} -m fedfeat train --store {store} --out {disk} --name x --kernel torch --clients 4 --rounds 2 --quiet"  # fmt: skip
    script = (
        f"mount -t tmpfs -o size=2m tmpfs {disk} && (dd if=/dev/zero of={disk}/fill bs=4k 2>/dev/null; true) && "
        f"{fedfeat}; echo rc=$?; ls -A {disk}; rm {disk}/fill; {fedfeat} >/dev/null; echo rc=$?; ls -A {disk}"
    )
    env = dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1")
    p = subprocess.run(
        ["unshare", "-rm", "sh", "-c", script], env=env, capture_output=True, text=True, timeout=120
    )
    out = p.stdout.split()
    assert out == ["rc=2", "fill", "rc=0", "x"], p.stdout + p.stderr
    err = [ln for ln in p.stderr.splitlines() if ln.strip()]
    assert len(err) == 1 and "space" in err[0].lower(), p.stderr


def test_of_many_takers_of_one_stale_lock_exactly_one_wins(tmp_path):
    path = tmp_path / ".lock-x"
    for _ in range(5):
        path.write_text(json.dumps({"pid": _dead_pid(), "host": HOST}))
        won, refused, barrier = [], [], threading.Barrier(8)

        def take(barrier=barrier, won=won, refused=refused):
            lk = Lock(path, "run x", log=lambda m: None)
            barrier.wait()
            try:
                lk.acquire()
                won.append(lk)
            except FedfeatError as e:
                refused.append(str(e))

        threads = [threading.Thread(target=take) for _ in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert len(won) == 1 and len(refused) == 7, (won, refused)
        won[0].release()
        assert list(tmp_path.iterdir()) == []


def test_a_fifo_or_directory_in_place_of_the_lock_does_not_hang(tmp_path):
    os.mkfifo(tmp_path / ".lock-x")
    lk = Lock(tmp_path / ".lock-x", "run x", log=lambda m: None).acquire()  # a FIFO is no lock: replaced
    assert _holds_me(lk.path)
    lk.release()
    (tmp_path / ".lock-x").mkdir()
    with pytest.raises(FedfeatError, match="cannot create lock"):
        Lock(tmp_path / ".lock-x", "run x", log=lambda m: None).acquire()


# ============================================================================================== checkpoints
def test_a_matching_checkpoint_resumes_equal_to_the_uninterrupted_run(runs, partial):
    run, part = partial
    meta = checkpoint.verify(part / rundir.CHECKPOINT)
    assert meta["round"] == "4" and meta["format"] == "fedfeat-checkpoint-2" and meta["rows_n"] == "5"
    ident = json.loads(meta["run"])
    assert ident["run"]["method"] == "fst-cbdg" and ident["partition"] and ident["store_fingerprint"]
    assert "out" not in ident["run"] and "name" not in ident["run"] and "device" not in ident["run"]
    _resumes(run, runs["u"])


def _header_len(p: Path) -> int:
    return int.from_bytes(p.read_bytes()[:8], "little")


def _flip(p: Path, at: int, mask: int = 0x01) -> None:
    b = bytearray(p.read_bytes())
    b[at] ^= mask
    p.write_bytes(bytes(b))


OFFSETS = {
    "length-prefix": lambda p, n: 0,
    "length-prefix-high": lambda p, n: 5,
    "header-start": lambda p, n: 8,
    "in-round": lambda p, n: 8 + p.read_bytes()[8:].index(b'"round":"') + 9,
    "in-tree": lambda p, n: 8 + p.read_bytes()[8:].index(b'"tree":"') + 20,
    "in-run-identity": lambda p, n: 8 + p.read_bytes()[8:].index(b'"run":"') + 30,
    "in-rows-digest": lambda p, n: 8 + p.read_bytes()[8:].index(b'"rows":"') + 10,
    "in-digest": lambda p, n: 8 + p.read_bytes()[8:].index(b'"fedfeat_digest":"') + 20,
    "tensor-name": lambda p, n: 8 + p.read_bytes()[8:].index(b'"glob/') + 7,
    "dtype": lambda p, n: 8 + p.read_bytes()[8:].index(b'"dtype":"F32"') + 10,
    "header-padding": lambda p, n: 8 + n - 1,
    "first-tensor-byte": lambda p, n: 8 + n,
    "middle-tensor-byte": lambda p, n: (8 + n + p.stat().st_size) // 2,
    "last-byte": lambda p, n: p.stat().st_size - 1,
}


@pytest.mark.parametrize("where", list(OFFSETS))
def test_a_flipped_byte_anywhere_is_refused(partial, where):
    run, part = partial
    ck = part / rundir.CHECKPOINT
    good = ck.read_bytes()
    for mask in (0x01, 0x80, 0xFF):
        ck.write_bytes(good)
        _flip(ck, OFFSETS[where](ck, _header_len(ck)), mask)
        assert ck.read_bytes() != good
        _refused(run, part)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_any_change_of_any_byte_fails_the_digest(partial, data):
    """Every byte of the file is covered: ``verify`` refuses any single-byte change (in-process: fast)."""
    _, part = partial
    ck = part / rundir.CHECKPOINT
    good = ck.read_bytes()
    at = data.draw(st.integers(0, len(good) - 1))
    mask = data.draw(st.integers(1, 255))
    bad = bytearray(good)
    bad[at] ^= mask
    tmp = part / "flipped.safetensors"
    tmp.write_bytes(bytes(bad))
    with pytest.raises(FedfeatError) as e:
        checkpoint.load(tmp, "cpu")
    assert "\n" not in str(e.value) and "cannot resume" in str(e.value)


@pytest.mark.parametrize("keep", [0, 3, 8, 9, 40, "half", "minus1"])
def test_a_truncated_checkpoint_is_refused(partial, keep):
    run, part = partial
    ck = part / rundir.CHECKPOINT
    data = ck.read_bytes()
    n = {"half": len(data) // 2, "minus1": len(data) - 1}.get(keep, keep)
    ck.write_bytes(data[:n])
    _refused(run, part)


@pytest.mark.parametrize(
    "what", ["appended", "random", "json", "text", "pickle", "directory", "fifo", "other-safetensors"]
)
def test_not_a_checkpoint_is_refused(partial, what):
    run, part = partial
    ck = part / rundir.CHECKPOINT
    if what == "appended":
        ck.write_bytes(ck.read_bytes() + b"\x00")
    elif what == "random":
        ck.write_bytes(os.urandom(5000))
    elif what == "json":
        ck.write_bytes(b'{"round": 4}')
    elif what == "text":
        ck.write_bytes((b"\x10\x00\x00\x00\x00\x00\x00\x00" + b"not json at all!") * 2)
    elif what == "pickle":
        ck.unlink()
        torch.save({"W": torch.zeros(2)}, ck)
    elif what == "directory":
        ck.unlink()
        ck.mkdir()
    elif what == "fifo":
        ck.unlink()
        os.mkfifo(ck)
    else:  # a valid safetensors file, not a fedfeat checkpoint
        save_file({"W": torch.zeros(2)}, str(ck), metadata={"format": "pt"})
    if what in ("directory", "fifo"):
        line = _one_line_error(_cli("train", "--resume", run, "--quiet"))
        assert "not a regular file" in line and "--overwrite" in line
    else:
        _refused(run, part)


def _rewrite(ck: Path, meta_update: dict | None = None, *, sign: bool = True, drop=()) -> None:
    """Rewrite the checkpoint with other metadata (the same tensors) and, with ``sign``, a digest that matches:
    what a careful forger, or another run, would write."""
    with safe_open(str(ck), framework="pt") as f:
        meta = dict(f.metadata())
    meta.update(meta_update or {})
    meta[checkpoint.DIGEST] = "0" * 64
    for k in drop:
        meta.pop(k, None)
    tensors = load_file(str(ck))
    save_file(tensors, str(ck), metadata=meta)
    if sign and checkpoint.DIGEST in meta:
        with open(ck, "r+b") as f:
            h, pos = checkpoint._hash_file(f, ck)
            f.seek(pos)
            f.write(h.encode())


def test_a_re_signed_copy_is_accepted_so_the_forgeries_below_test_their_own_check(runs, partial):
    run, part = partial
    _rewrite(part / rundir.CHECKPOINT)
    _resumes(run, runs["u"])


def _identity(part: Path) -> dict:
    with safe_open(str(part / rundir.CHECKPOINT), framework="pt") as f:
        return json.loads(f.metadata()["run"])


@pytest.mark.parametrize(
    "change, named",
    [
        (lambda i: i["run"].update(method="fedprox"), "run.method"),
        (lambda i: i["run"].update(seed=1), "run.seed"),
        (lambda i: i["run"].update(rounds=7), "run.rounds"),
        (lambda i: i["run"].update(participation=1.0), "run.participation"),
        (lambda i: i["params"].update(lr=0.5), "params.lr"),
        (lambda i: i.update(store_fingerprint="0123456789abcdef"), "store_fingerprint"),
        (lambda i: i.update(partition="dirichlet-a0.5-c4-s1"), "partition"),
        (lambda i: i.pop("partition"), "partition"),
    ],
)
def test_another_runs_checkpoint_is_refused_naming_what_differs(partial, change, named):
    run, part = partial
    ident = _identity(part)
    change(ident)
    blob = json.dumps(ident, sort_keys=True)
    _rewrite(part / rundir.CHECKPOINT, {"run": blob, "run_digest": checkpoint.sha256_json(ident)})
    line = _refused(run, part, "belongs to another run", named)
    assert "in the checkpoint" in line


@pytest.mark.parametrize(
    "other",
    [
        {"method": "fedavgm"},
        {"seed": 3},
        {"alpha": 0.5},
        {"clients": 5},
        {"params": {"lr": 0.02}},
        {"method": "fst-cbdg", "store": "other"},
    ],
)
def test_a_checkpoint_copied_from_another_real_run_is_refused(store, runs, partial, tmp_path, other):
    """The issue's case: a checkpoint of another run (method, settings, store, partition) copied in; before, it
    resumed and mixed two runs with rc 0."""
    run, part = partial
    if other.get("store") == "other":
        other_store = tmp_path / "o.zarr"
        r = _cli("synth", "--out", other_store, "--classes", "4", "--dim", "16", "--train-per-class", "30",
                 "--test-per-class", "10", "--templates", "2", "--no-stats", "--seed", "5")  # fmt: skip
        assert r.exit_code == 0, r.output
        store, other = other_store, {k: v for k, v in other.items() if k != "store"}
    kw = {"method": "fst-cbdg", **other}
    _train_killed(_cfg(store, tmp_path / "o", **kw), KILL)
    shutil.copy(tmp_path / "o" / ".partial-x" / rundir.CHECKPOINT, part / rundir.CHECKPOINT)
    _refused(run, part, "belongs to another run")


def test_an_edited_config_toml_no_longer_matches_its_checkpoint(partial):
    run, part = partial
    cfg = part / "config.toml"
    cfg.write_text(cfg.read_text().replace("rounds = 6", "rounds = 60"))
    _refused(run, part, "belongs to another run", "run.rounds")


@pytest.mark.parametrize("rnd", ["99", "6", "0", "-1", "abc", "", "4.0", " 4", "1" * 30])
def test_a_round_out_of_range_is_refused(partial, rnd):
    """Round 99 (or 6, the last) would look finished; 0 and -1 would retrain; none of them is ever written."""
    run, part = partial
    _rewrite(part / rundir.CHECKPOINT, {"round": rnd})
    _refused(run, part, "outside this run's rounds 1..5")


def test_the_previous_format_and_another_version_are_refused(partial):
    run, part = partial
    ck = part / rundir.CHECKPOINT
    _rewrite(ck, {"fedfeat": "0.0.1"})
    _refused(run, part, "written by fedfeat 0.0.1")
    with safe_open(str(ck), framework="pt") as f:
        meta = {k: v for k, v in f.metadata().items() if k in ("round", "tree")}
    save_file(load_file(str(ck)), str(ck), metadata={**meta, "format": "fedfeat-checkpoint-1"})
    _refused(run, part, "previous format", "cannot be checked")
    _rewrite(ck, {"format": "fedfeat-checkpoint-2", "fedfeat": checkpoint.__version__}, sign=False)
    _refused(run, part, "does not match its digest")  # a digest never filled in
    _rewrite(ck, drop=(checkpoint.DIGEST,))
    _refused(run, part, "no valid digest")


def _rows(part: Path) -> list[str]:
    return (part / "metrics.jsonl").read_text().splitlines(keepends=True)


@pytest.mark.parametrize(
    "edit, named",
    [
        (lambda r: r[:2] + r[3:], "lacks the rows of rounds 2"),
        (lambda r: [], "lacks the rows of rounds 0, 1, 2, 3, 4"),
        (lambda r: r[:1], "lacks the rows of rounds 1, 2, 3, 4"),
        (lambda r: r[:2] + ['{"round": 2, "test_acc": 5.0, "cut', *r[2:]], "lacks the rows of rounds 2"),
        (lambda r: r[:4] + r[3:], "repeated"),
        (lambda r: [r[0], r[2], r[1], *r[3:]], "out of order"),
        (lambda r: [r[0], r[1].replace('"round": 1', '"round": "1"'), *r[2:]], "lacks the rows of rounds 1"),
        (lambda r: [r[0], json.dumps({**json.loads(r[1]), "test_acc": 99.5}) + "\n", *r[2:]], "not those"),
        (lambda r: [r[0], r[1].replace('"train_loss": ', '"train_loss": 1'), *r[2:]], "not those"),
    ],
)
def test_metric_rows_missing_extra_or_edited_before_the_checkpoint_are_refused(partial, edit, named):
    run, part = partial
    (part / "metrics.jsonl").write_text("".join(edit(_rows(part))))
    _refused(run, part, named)


@pytest.mark.parametrize(
    "edit",
    [
        lambda r: r[:5],  # the row after the checkpoint lost
        lambda r: r + ['{"round": 6, "te'],  # a row cut short by the kill
        lambda r: r[:5] + ["garbage\n", "more\n"],
        lambda r: r + r[5:],  # the row after the checkpoint twice
    ],
)
def test_rows_after_the_checkpoint_are_redone(runs, partial, edit):
    run, part = partial
    (part / "metrics.jsonl").write_text("".join(edit(_rows(part))))
    _resumes(run, runs["u"])


def test_the_start_afresh_command_in_the_refusal_works(runs, partial):
    run, part = partial
    _flip(part / rundir.CHECKPOINT, 8 + _header_len(part / rundir.CHECKPOINT) + 3)
    line = _refused(run, part)
    cmd = line.split("pass --overwrite: ", 1)[1].split()
    assert cmd[:2] == ["fedfeat", "train"] and cmd[-1] == "--overwrite"
    r = _cli(*cmd[1:], "--quiet")
    assert r.exit_code == 0, r.output
    _same_run(runs["u"], run)


def test_report_all_lists_a_damaged_checkpoint_without_failing(partial):
    run, part = partial
    (part / rundir.CHECKPOINT).write_bytes(b"\x00" * 3)
    r = _cli("report", run.parent, "--all")
    assert r.exit_code == 0 and "| x | fst-cbdg | interrupted | 5/6 | - |" in r.output, r.output


# ============================================================================================== report: kinds, types
@pytest.fixture(scope="module")
def finished(store, tmp_path_factory):
    root = tmp_path_factory.mktemp("lc-report")
    train(_cfg(store, root, name="good", rounds=2), progress=False, log=lambda s: None)
    return root / "good"


def _alarm(seconds: int):
    def fire(signum, frame):
        raise TimeoutError("report blocked")

    signal.signal(signal.SIGALRM, fire)
    signal.alarm(seconds)


def _bad_copy(finished: Path, tmp_path: Path, file: str, how) -> Path:
    shutil.copytree(finished, tmp_path / "good")
    bad = tmp_path / "bad"
    shutil.copytree(finished, bad)
    how(bad / file)
    return bad


def _fifo(p: Path) -> None:
    p.unlink()
    os.mkfifo(p)


def _dir(p: Path) -> None:
    p.unlink()
    p.mkdir()


def _sock(p: Path) -> None:
    p.unlink()
    s = socket.socket(socket.AF_UNIX)
    try:
        s.bind(str(p))
    except OSError:
        pytest.skip("socket path too long here")
    finally:
        s.close()


def _dev(p: Path) -> None:
    p.unlink()
    p.symlink_to("/dev/zero")


@pytest.mark.parametrize("file", ["metrics.jsonl", "summary.json"])
@pytest.mark.parametrize("kind, how", [("FIFO", _fifo), ("directory", _dir), ("socket", _sock),
                                       ("character device", _dev)])  # fmt: skip
def test_report_reads_regular_files_only(finished, tmp_path, file, kind, how):
    bad = _bad_copy(finished, tmp_path, file, how)
    _alarm(20)
    try:
        r = runner.invoke(app, ["report", str(tmp_path)])
        assert r.exit_code == 0, r.output
        assert r.stdout.count("| fedavg") == 1
        warns = [ln for ln in r.stderr.splitlines() if ln.strip()]
        assert len(warns) == 1 and f"skipped {bad}" in warns[0] and kind in warns[0], r.stderr
        assert "not a regular file" in warns[0] and file in warns[0]
        r = runner.invoke(app, ["report", str(bad)])
        line = _one_line_error(r)
        assert "no readable finished runs" in line and kind in line
        recs = load_runs(tmp_path, as_frame=False, warn=lambda m: None)
        assert [Path(x["path"]).name for x in recs] == ["good"]
    finally:
        signal.alarm(0)


def test_report_all_does_not_block_on_a_fifo_in_an_unfinished_run(partial):
    run, part = partial
    _fifo(part / "metrics.jsonl")
    _alarm(20)
    try:
        line = _one_line_error(_cli("train", "--resume", run, "--quiet"))
        assert "metrics.jsonl is a FIFO" in line and "--overwrite" in line
        _fifo(part / "config.toml")
        r = _cli("report", run.parent, "--all")
        assert r.exit_code == 0 and "| x | ? | interrupted | 0/? | round 4 |" in r.output, r.output
    finally:
        signal.alarm(0)


@pytest.mark.parametrize(
    "key, value, expected",
    [
        ("final_acc", "93.1", "a number"),
        ("final_acc", None, "a number"),
        ("initial_acc", [1.0], "a number"),
        ("best_acc", True, "a number"),
        ("rounds", [1, 2], "an integer"),
        ("rounds", 2.0, "an integer"),
        ("seed", "0", "an integer"),
        ("method", 3, "a string"),
        ("partition", {"a": 1}, "a string"),
        ("params", "lr=0.1", "a table"),
        ("seconds_per_round", "fast", "a number"),
        ("bytes_up", None, "a number"),
        ("many_acc", "high", "a number"),
        ("store_fingerprint", 5, "a string"),
        ("clients", 4.5, "an integer"),
        ("uses_labels", "yes", "true or false"),
    ],
)
def test_summary_keys_of_the_wrong_type_skip_the_run_naming_file_and_key(
    finished, tmp_path, key, value, expected
):
    def edit(p: Path) -> None:
        s = json.loads(p.read_text())
        s[key] = value
        p.write_text(json.dumps(s))

    bad = _bad_copy(finished, tmp_path, "summary.json", edit)
    for flags in ([], ["--seeds"], ["--best"], ["--format", "json"], ["--format", "csv"]):
        r = runner.invoke(app, ["report", str(tmp_path), *flags])
        assert r.exit_code == 0, (flags, r.output, r.exception)
        warns = [ln for ln in r.stderr.splitlines() if ln.strip()]
        assert len(warns) == 1 and str(bad / "summary.json") in warns[0], r.stderr
        assert f"key '{key}'" in warns[0] and expected in warns[0]
    line = _one_line_error(runner.invoke(app, ["report", str(bad)]))
    assert f"key '{key}'" in line and "no readable finished runs" in line


@pytest.mark.parametrize(
    "edit, named",
    [
        (lambda r: {**r, "test_acc": "50"}, "'test_acc'"),
        (lambda r: {**r, "round": "1"}, "'round'"),
        (lambda r: {**r, "round": True}, "'round'"),
        (lambda r: {**r, "many_acc": [1]}, "'many_acc'"),
    ],
)
def test_metric_rows_of_the_wrong_type_skip_the_run(finished, tmp_path, edit, named):
    def bad_rows(p: Path) -> None:
        rows = [json.loads(x) for x in p.read_text().splitlines()]
        rows[1] = edit(rows[1])
        p.write_text("".join(json.dumps(r) + "\n" for r in rows))

    bad = _bad_copy(finished, tmp_path, "metrics.jsonl", bad_rows)
    r = runner.invoke(app, ["report", str(tmp_path), "--plot", str(tmp_path / "c.png")])
    assert r.exit_code == 0, (r.output, r.exception)
    warns = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(warns) == 1 and str(bad / "metrics.jsonl") in warns[0] and named in warns[0], r.stderr


def test_summary_that_is_not_an_object(finished, tmp_path):
    _bad_copy(finished, tmp_path, "summary.json", lambda p: p.write_text("[1, 2, 3]"))
    r = runner.invoke(app, ["report", str(tmp_path)])
    assert r.exit_code == 0 and "JSON list, not a fedfeat summary" in r.stderr

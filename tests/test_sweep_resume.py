"""An interrupted ``fedfeat sweep`` / ``fedfeat reproduce`` is finished by running the same command again (issue 36).

A kill (a real SIGKILL, no clean-up: the killed process leaves its run's ``.partial-NAME`` and a stale
``.lock-NAME``) at several points -- inside a stacked run while its rows are written, inside a run made alone before
and after its first checkpoint, after a run's summary but before its rename, between runs, and twice in a row --
then the same command again: finished runs are skipped, the run with a checkpoint is resumed from it, the others
start again, the dead process's locks are taken over. Every run directory then equals the one an uninterrupted
grid wrote: ``metrics.jsonl`` without timings, ``summary.json`` without timings, provenance and
``resumed_after_round``, ``config.toml`` (but its ``out``), ``weights.safetensors``, ``partition.json``,
``results.npz``, ``curve.png`` byte for byte; nothing unfinished or locked is left.

The killed command runs in a forked copy of the test process (the command line through ``CliRunner``, killed by
``FEDFEAT_FAULT``: ``fedfeat.report.rundir.fault_point``), so no interpreter start-up is paid per kill.
"""

from __future__ import annotations

import json
import os
import re
import signal
import time
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from fedfeat.cli.app import app
from fedfeat.methods import fst_cbdg
from fedfeat.report import rundir
from fedfeat.store import lock as locks

runner = CliRunner()


def _cli(*args):
    return runner.invoke(app, [str(a) for a in args])


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    out = tmp_path_factory.mktemp("sr") / "s.zarr"
    r = _cli("synth", "--out", out, "--classes", "4", "--dim", "16", "--train-per-class", "30",
             "--test-per-class", "10", "--templates", "2", "--no-stats")  # fmt: skip
    assert r.exit_code == 0, r.output
    return out


# fedavg's two seeds are one stacked program (no checkpoints); centralized does not stack: each run is made alone
# and checkpoints after round 10 (the default --checkpoint-every) of its 12
def _sweep_args(store, out) -> list:
    return ["sweep", "--store", store, "--method", "fedavg,centralized", "--seed", "0,1", "--clients", "4",
            "--rounds", "12", "--kernel", "torch", "--quiet", "--out", out]  # fmt: skip


@pytest.fixture(scope="module")
def reference(store, tmp_path_factory):
    out = tmp_path_factory.mktemp("sr-ref") / "runs"
    r = _cli(*_sweep_args(store, out))
    assert r.exit_code == 0, r.output
    assert len(_runs(out)) == 4
    return out


def _killed(fault: str, args: list) -> None:
    """Run ``fedfeat ARGS`` in a forked copy of this process with ``FEDFEAT_FAULT=fault``; it must die of SIGKILL."""
    pid = os.fork()
    if pid == 0:  # the child: never returns into pytest
        code = 3
        try:
            os.environ["FEDFEAT_FAULT"] = fault
            getattr(rundir, "_FAULT_HITS", {}).clear()  # counts of fault points reached, from nought
            fst_cbdg._POOLS.clear()  # the parent's thread pools: their threads did not survive the fork
            r = _cli(*args)
            code = 4 if r.exit_code else 5  # not killed: the fault point was never reached
        finally:
            os._exit(code)
    for _ in range(6000):  # a hung child is failed (after minutes), never waited for for ever
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        time.sleep(0.05)
    else:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        pytest.fail(f"FEDFEAT_FAULT={fault}: the command hung")
    assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL, (
        f"FEDFEAT_FAULT={fault}: the command was not killed (status {status})"
    )


def _runs(out: Path) -> list[Path]:
    return sorted(p for p in out.iterdir() if not p.name.startswith("."))


def _timing(key: str) -> bool:
    return (
        "seconds" in key
        or key.startswith("sec_")
        or key in ("peak_rss_bytes", "rss_bytes_at_end", "peak_device_bytes")
    )


# how a run was made, not what it computed: where and by what, resumed after which round, in a stack of how many
# (a stack's runs left unfinished by a kill are made again alone or in a smaller stack: bit for bit the same run)
HOW = ("provenance", "resumed_after_round", "stacked_runs")


def _result(run: Path) -> dict:
    """What a run computed: every file, timings, provenance and how it was made (resumed, threads) aside."""
    got = {}
    for f in sorted(run.iterdir()):
        if f.name == "metrics.jsonl":
            rows = [json.loads(x) for x in f.read_text().splitlines()]
            got[f.name] = [{k: v for k, v in r.items() if not _timing(k)} for r in rows]
        elif f.name == "summary.json":
            s = json.loads(f.read_text())
            s.get("env", {}).pop("threads", None)
            got[f.name] = {k: v for k, v in s.items() if not _timing(k) and k not in HOW}
        elif f.name == "config.toml":  # its out is where the run was written
            got[f.name] = re.sub(r"(?m)^out = .*$", "out = OUT", f.read_text())
        elif f.name == "results.npz":  # a zip: its members' dates differ, its arrays may not
            with np.load(f) as z:
                got[f.name] = {k: z[k].tobytes() + str(z[k].dtype).encode() for k in z.files}
        else:
            got[f.name] = f.read_bytes()
    return got


def _resumed(out: Path) -> list:
    """The rounds after which runs under ``out`` were resumed from a checkpoint."""
    got = [json.loads((p / "summary.json").read_text()).get("resumed_after_round") for p in _runs(out)]
    return [r for r in got if r is not None]


def _same_grid(out: Path, reference: Path) -> None:
    assert [p.name for p in _runs(out)] == [p.name for p in _runs(reference)]
    left = sorted(p.name for p in out.iterdir() if p.name.startswith("."))
    assert left == [], f"unfinished runs or locks left: {left}"
    for a, b in zip(_runs(out), _runs(reference)):
        ra, rb = _result(a), _result(b)
        assert ra.keys() == rb.keys(), a.name
        for k in ra:
            assert ra[k] == rb[k], f"{a.name}/{k} differs from the uninterrupted grid's"


SWEEP_KILLS = {
    # (faults, one after another; then the same command again finishes the grid)
    "in a stacked run's rows": ("after-round-5",),
    "in a stack's second run, the first published": ("after-round-5@2",),
    "in a stacked run, its summary written": ("before-publish",),
    "alone, before its checkpoint": ("after-round-5@3",),
    "alone, after its checkpoint": ("after-round-11@3",),
    "alone, summary written": ("before-publish@3",),
    "between runs, then inside one": ("sweep-next@2", "after-round-3@1"),
    "after a checkpoint, twice": ("after-round-11@3", "after-round-11@1"),
}


@pytest.mark.parametrize("faults", SWEEP_KILLS.values(), ids=SWEEP_KILLS.keys())
def test_a_killed_sweep_is_finished_by_the_same_command(store, reference, tmp_path, faults):
    out = tmp_path / "runs"
    args = _sweep_args(store, out)
    for fault in faults:
        _killed(fault, args)
    hidden = [p.name for p in out.iterdir() if p.name.startswith(".")]
    if faults[-1] != "sweep-next@2":
        assert any(h.startswith(".partial-") for h in hidden) and any(
            h.startswith(".lock-") for h in hidden
        ), hidden
    r = _cli(*args[:-3], "--out", out)  # the same command (with its per-run lines)
    assert r.exit_code == 0, r.output
    assert "failed" not in r.output.replace("failed 0", "")
    if faults[-1].startswith("after-round-11"):  # the alone run kept a checkpoint of round 10
        assert "interrupted, resumed from its checkpoint" in r.output
        assert _resumed(out) == [10]
    _same_grid(out, reference)


@pytest.mark.parametrize("fault, run", [("after-round-11@3", "centralized"), ("after-round-5", "fedavg")])
def test_a_run_a_live_process_holds_is_refused_then_finished(store, reference, tmp_path, fault, run):
    """A lock of a live writer is never taken over: that run fails (named, with the holder), the others -- its
    stack's other run too -- are made; once the writer is gone the same command finishes the grid."""
    out = tmp_path / "runs"
    args = _sweep_args(store, out)
    _killed(fault, args)
    (lock,) = out.glob(f".lock-{run}*seed0*")
    lock.unlink()
    lock.write_text(json.dumps(locks.lock_record()))  # this (live) process writes that run now
    part = next(out.glob(f".partial-{run}*seed0*"))
    before = sorted((p.name, p.read_bytes()) for p in part.iterdir())
    r = _cli(*args)
    assert r.exit_code == 1, r.output
    assert f"is being written by pid {os.getpid()}" in r.output and "1 run(s) failed" in r.output
    assert f"  {part.name.removeprefix('.partial-')}: run " in r.output
    assert sorted((p.name, p.read_bytes()) for p in part.iterdir()) == before  # left as it was
    assert len(_runs(out)) == 3
    lock.unlink()  # the writer is gone (its lock with it)
    r = _cli(*args)
    assert r.exit_code == 0, r.output
    _same_grid(out, reference)


def test_an_unfinished_run_of_other_settings_is_not_replaced(store, tmp_path):
    """A ``.partial-NAME`` whose config.toml is not the grid point's (another run given that name) is refused in one
    line, left as it is; the rest of the grid is made."""
    out = tmp_path / "runs"
    args = _sweep_args(store, out)
    _killed("after-round-11@3", args)
    part = next(out.glob(".partial-centralized*seed0*"))
    cfg = part / "config.toml"
    cfg.write_text(cfg.read_text().replace("rounds = 12", "rounds = 13"))
    r = _cli(*args)
    assert r.exit_code == 1, r.output
    assert "an unfinished run of other settings is in" in r.output and "1 run(s) failed" in r.output
    assert "rounds = 13" in cfg.read_text() and (part / rundir.CHECKPOINT).is_file()
    assert len(_runs(out)) == 3


# ------------------------------------------------------------------------------------------------ reproduce
SHAPES = {
    ("cifar10", "RN50"): dict(classes=10, train_per_class=100, test_per_class=20, dim=16, templates=2),
    ("cifar100", "RN50"): dict(classes=100, train_per_class=20, test_per_class=4, dim=16, templates=2, s=0.1),
    ("cinic10", "RN50"): dict(classes=10, train_per_class=100, test_per_class=20, dim=16, templates=2),
}


@pytest.fixture(scope="module")
def table(tmp_path_factory):
    """FST-CBDG Table 1 (5 rows x 3 datasets) on tiny stand-ins, 1 seed, 11 rounds: 15 runs made alone (one seed
    and one run per method and dataset: nothing to stack), those that train checkpointing after round 10; the
    stand-ins built once, the uninterrupted grid and its printed table."""
    from fedfeat.runs import reproduce as R

    root = tmp_path_factory.mktemp("sr-table")
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(R, "SYNTH_SHAPES", SHAPES)

        def args(out):
            return ["reproduce", "fst-cbdg-table1", "--synthetic", "--seeds", "1", "--rounds", "11", "--store-root",
                    root / "cache", "--out", out, "--quiet", "--format", "json"]  # fmt: skip

        r = _cli(*args(root / "ref"))
        assert r.exit_code == 0, r.output
        assert len(_runs(root / "ref")) == 15
        yield args, root / "ref", r.stdout


REPRODUCE_KILLS = {
    "alone, after its checkpoint": ("after-round-11@2",),
    "between runs, then before a checkpoint": ("sweep-next@5", "after-round-4@2"),
}


@pytest.mark.parametrize("faults", REPRODUCE_KILLS.values(), ids=REPRODUCE_KILLS.keys())
def test_a_killed_reproduce_is_finished_by_the_same_command(table, tmp_path, faults):
    args, reference, printed = table
    out = tmp_path / "runs"
    for fault in faults:
        _killed(fault, args(out))
    assert any(p.name.startswith(".partial-") for p in out.iterdir())
    r = _cli(*args(out))
    assert r.exit_code == 0, r.output
    assert r.stdout == printed  # the same table
    assert _resumed(out) == ([10] if faults[-1].startswith("after-round-11") else [])
    _same_grid(out, reference)

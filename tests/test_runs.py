"""Run directories you can trust: names, exclusive runs, atomic replacement, resume, identity, replay, reports.

Kills are real: a subprocess is SIGKILLed at a named point (``FEDFEAT_FAULT``, ``fedfeat.report.rundir.fault_point``)
and nothing of its clean-up runs.
"""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from typer.testing import CliRunner

from fedfeat.cli.app import app
from fedfeat.engine import checkpoint
from fedfeat.report.rundir import Lock

runner = CliRunner()
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
BASE = ["--clients", "10", "--rounds", "6", "--participation", "0.3", "--quiet"]


def _synth(out: Path, dim: int = 32) -> Path:
    r = runner.invoke(
        app,
        ["synth", "--out", str(out), "--dim", str(dim), "--train-per-class", "60", "--test-per-class", "20",
         "--templates", "2", "--no-stats"],
    )  # fmt: skip
    assert r.exit_code == 0, r.output
    return out


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    return _synth(tmp_path_factory.mktemp("runs") / "s.zarr")


def _cli(*args):
    return runner.invoke(app, [str(a) for a in args])


def _proc(*args, fault: str | None = None, cwd=None):
    env = dict(ENV, FEDFEAT_FAULT=fault) if fault else ENV
    return subprocess.run(
        [sys.executable, "-m", "fedfeat", *map(str, args)], env=env, cwd=cwd, capture_output=True, text=True
    )


def _metrics(run: Path) -> list[dict]:
    """Per-round rows without the timings (which differ between any two runs)."""
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if "seconds" not in k and not k.startswith("sec_")} for r in rows]


def _same_run(a: Path, b: Path) -> None:
    assert _metrics(a) == _metrics(b)
    if not (a / "weights.safetensors").exists():  # zeroshot keeps none
        assert not (b / "weights.safetensors").exists()
        return
    wa, wb = load_file(a / "weights.safetensors"), load_file(b / "weights.safetensors")
    assert wa.keys() == wb.keys()
    for k in wa:
        assert torch.equal(wa[k], wb[k]), k


def _tree(root: Path) -> dict:
    return {str(p.relative_to(root)): p.stat().st_mtime_ns for p in root.rglob("*")}


# ---------------------------------------------------------------------------------------------- names
@pytest.mark.parametrize("name", ["..", ".", "../../x", "a/b", "", ".hidden", "/abs/dir"])
def test_bad_names_are_refused_and_delete_nothing(store, tmp_path, name):
    (tmp_path / "keep").mkdir()
    (tmp_path / "keep" / "precious.txt").write_text("data")
    out = tmp_path / "keep" / "runs"
    out.mkdir()
    before = _tree(tmp_path)
    r = _cli("train", "--store", store, "--out", out, "--name", name, "--kernel", "torch", *BASE)
    assert r.exit_code == 2, r.output
    assert "path component" in r.output and r.output.count("\n") == 1
    assert _tree(tmp_path) == before


def test_absolute_name_in_replayed_config_is_refused(store, tmp_path):
    cfg = tmp_path / "c.toml"
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "f").write_text("x")
    cfg.write_text(
        f'[run]\nmethod = "fedavg"\nstore = "{store}"\nname = "{victim}"\nclients = 10\nrounds = 1\n'
    )
    r = _cli("train", "--config", cfg, "--out", tmp_path / "runs", "--quiet")
    assert r.exit_code == 2 and "path component" in r.output
    assert (victim / "f").read_text() == "x"


# ---------------------------------------------------------------------------------------------- identity
def test_default_name_identity_and_replay_from_elsewhere(store, tmp_path, monkeypatch):
    """Name = method, store, partition, seed, hash of the non-default settings; replaying config.toml from another
    working directory gives the same name and the same metrics; another store (D = 16) gives another name."""
    r = _cli(
        "train", "--store", store, "--out", tmp_path / "a", "--method", "fedntd", "--set", "lr=0.05", *BASE
    )
    assert r.exit_code == 0, r.output
    (run,) = (tmp_path / "a").iterdir()
    assert run.name.startswith("fedntd__s__dirichlet-a0.1-c10-s19940817__seed0__")
    assert len(run.name) < 100
    summary = json.loads((run / "summary.json").read_text())
    prov = summary["provenance"]
    assert prov["fedfeat"] and prov["command"] and summary["store_fingerprint"]
    cfg = (run / "config.toml").read_text()
    assert f'store = "{Path(store).resolve()}"' in cfg and "store_fingerprint" in cfg and "name =" not in cfg
    elsewhere = tmp_path / "cwd"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    r = _cli("train", "--config", run / "config.toml", "--out", "b", "--quiet")
    assert r.exit_code == 0, r.output
    _same_run(run, elsewhere / "b" / run.name)
    other = _synth(tmp_path / "d16" / "s.zarr", dim=16)
    r = _cli(
        "train", "--store", other, "--out", tmp_path / "a", "--method", "fedntd", "--set", "lr=0.05", *BASE
    )
    assert r.exit_code == 0, r.output
    assert len(list((tmp_path / "a").iterdir())) == 2  # same method, store name and partition; other store


def test_replay_refuses_a_store_with_another_fingerprint(store, tmp_path):
    r = _cli("train", "--store", store, "--out", tmp_path, "--name", "x", "--method", "fedavg", *BASE)
    assert r.exit_code == 0, r.output
    cfg = tmp_path / "x" / "config.toml"
    text = cfg.read_text()
    fp = json.loads((tmp_path / "x" / "summary.json").read_text())["store_fingerprint"]
    cfg.write_text(text.replace(fp, "0123456789abcdef"))
    r = _cli("train", "--config", cfg, "--out", tmp_path / "b", "--quiet")
    assert r.exit_code == 2 and fp in r.output and "0123456789abcdef" in r.output and "--store" in r.output


# ---------------------------------------------------------------------------------------------- one writer
def test_same_name_refuses_and_overwrite_replaces(store, tmp_path):
    args = ["train", "--store", store, "--out", tmp_path, "--name", "x", "--kernel", "torch", *BASE]
    assert _cli(*args, "--method", "fedavg").exit_code == 0
    r = _cli(*args, "--method", "fedprox")
    assert r.exit_code == 2 and "--overwrite" in r.output
    assert json.loads((tmp_path / "x" / "summary.json").read_text())["method"] == "fedavg"
    r = _cli(*args, "--method", "fedprox", "--overwrite")
    assert r.exit_code == 0, r.output
    assert json.loads((tmp_path / "x" / "summary.json").read_text())["method"] == "fedprox"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["x"]  # no lock, partial or old copy left


def test_a_held_lock_refuses_naming_the_holder_and_a_dead_holder_is_stale(store, tmp_path):
    lock = Lock(tmp_path / ".lock-x", "run x").acquire()
    args = ["train", "--store", store, "--out", tmp_path, "--name", "x", "--method", "fedavg", *BASE]
    r = _cli(*args)
    assert r.exit_code == 2 and f"pid {os.getpid()}" in r.output
    lock.release()
    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True
    )
    import socket

    (tmp_path / ".lock-x").write_text(json.dumps({"pid": int(dead.stdout), "host": socket.gethostname()}))
    assert _cli(*args).exit_code == 0  # the dead process's lock was taken over
    assert not (tmp_path / ".lock-x").exists()


def test_two_concurrent_trains_of_one_name(store, tmp_path):
    args = ["train", "--store", store, "--out", tmp_path, "--name", "x", "--method", "fedavg", "--kernel", "torch",
            "--clients", "10", "--rounds", "40", "--participation", "1", "--quiet"]  # fmt: skip
    procs = [
        subprocess.Popen([sys.executable, "-m", "fedfeat", *map(str, args)], env=ENV, stderr=subprocess.PIPE,
                         stdout=subprocess.PIPE, text=True)
        for _ in range(2)
    ]  # fmt: skip
    outs = [(p.wait(), p.stderr.read()) for p in procs]
    codes = sorted(c for c, _ in outs)
    assert codes == [0, 2], outs
    err = next(e for c, e in outs if c == 2)
    assert "being written by pid" in err or "--overwrite" in err
    assert json.loads((tmp_path / "x" / "summary.json").read_text())["rounds"] == 40


# ---------------------------------------------------------------------------------------------- kills and resume
@pytest.mark.parametrize("method", ["fst-cbdg", "fedavgm"])
def test_sigkill_mid_run_then_resume_equals_the_uninterrupted_run(store, tmp_path, method):
    args = ["train", "--store", store, "--method", method, "--name", "x", "--kernel", "torch", *BASE]
    assert _proc(*args, "--out", tmp_path / "u").returncode == 0
    killed = _proc(*args, "--out", tmp_path / "k", "--checkpoint-every", "2", fault="after-round-5")
    assert killed.returncode == -9
    assert not (tmp_path / "k" / "x").exists()
    r = _cli("report", tmp_path / "k", "--all")
    assert r.exit_code == 0 and "round 4" in r.output and "--resume" in r.output
    r = _cli("train", "--resume", tmp_path / "k" / "x", "--quiet")
    assert r.exit_code == 0, r.output
    assert "after round 4" in r.output
    _same_run(tmp_path / "u" / "x", tmp_path / "k" / "x")
    assert sorted(p.name for p in (tmp_path / "k").iterdir()) == ["x"]


def test_kill_before_the_rename_loses_nothing_and_shows_no_orphan(store, tmp_path):
    args = ["train", "--store", store, "--out", tmp_path, "--name", "x", "--kernel", "torch", *BASE]
    assert _cli(*args, "--method", "fedavg").exit_code == 0
    old = (tmp_path / "x" / "summary.json").read_bytes()
    p = _proc(*args, "--method", "fedprox", "--overwrite", fault="before-publish")
    assert p.returncode == -9
    assert (tmp_path / "x" / "summary.json").read_bytes() == old  # the old run is intact
    r = _cli("report", tmp_path)
    assert r.exit_code == 0 and r.output.count("| fedavg") == 1 and "fedprox" not in r.output
    r = _cli("train", "--resume", tmp_path / "x", "--overwrite", "--quiet")
    assert r.exit_code == 0, r.output  # the finished new run is published
    assert json.loads((tmp_path / "x" / "summary.json").read_text())["method"] == "fedprox"


def test_resume_refuses_flags_and_finished_runs(store, tmp_path):
    assert (
        _cli(
            "train", "--store", store, "--out", tmp_path, "--name", "x", "--method", "fedavg", *BASE
        ).exit_code
        == 0
    )
    r = _cli("train", "--resume", tmp_path / "x", "--quiet")
    assert r.exit_code == 2 and "finished" in r.output
    r = _cli("train", "--resume", tmp_path / "x", "--rounds", "9")
    assert r.exit_code == 2 and "--rounds" in r.output
    r = _cli("train", "--resume", tmp_path / "nothing")
    assert r.exit_code == 2 and "--all" in r.output


def test_checkpoint_round_trip_keeps_values_and_aliasing(tmp_path):
    head = {"W": torch.randn(3, 4), "b": torch.zeros(3)}
    state = {"q": torch.rand(5, 3), "head": head, "crt": head, "v": None, "agg": {"n": 2, "xs": [torch.ones(2)]},
             "round_buffers": {"x": torch.empty(100)}}  # fmt: skip
    checkpoint.save(tmp_path / "c.safetensors", 7, {"W": torch.arange(4.0)}, state, extra={"note": "n"})
    rnd, glob, st = checkpoint.load(tmp_path / "c.safetensors", "cpu")
    assert rnd == 7 and torch.equal(glob["W"], torch.arange(4.0))
    assert torch.equal(st["q"], state["q"]) and torch.equal(st["crt"]["W"], head["W"])
    assert st["head"]["W"] is st["crt"]["W"] and st["v"] is None and st["agg"]["n"] == 2
    assert "round_buffers" not in st and checkpoint.read_meta(tmp_path / "c.safetensors")["note"] == "n"


# ---------------------------------------------------------------------------------------------- bad values
def test_weights_that_blow_up_stop_the_run(store, tmp_path):
    r = _cli("train", "--store", store, "--out", tmp_path, "--method", "fedavg", "--kernel", "torch",
             "--set", "lr=1e38", "--set", "logit_scale=1e30", *BASE)  # fmt: skip
    assert r.exit_code == 2, r.output
    assert "round 1 of fedavg" in r.output and "non-finite" in r.output
    assert list(tmp_path.iterdir()) == []  # nothing left, not even hidden


@pytest.mark.parametrize("kv", ["lr=nan", "logit_scale=inf", "momentum=-inf"])
def test_non_finite_hyperparameters_are_refused(store, tmp_path, kv):
    r = _cli("train", "--store", store, "--out", tmp_path, "--method", "fedavg", "--set", kv, *BASE)
    assert r.exit_code == 2 and "not finite" in r.output
    assert not tmp_path.exists() or list(tmp_path.iterdir()) == []


# ---------------------------------------------------------------------------------------------- read-only store
@pytest.mark.skipif(shutil.which("unshare") is None, reason="needs unshare for a read-only bind mount")
def test_train_on_a_read_only_store_with_a_new_partition(store, tmp_path):
    ro = tmp_path / "ro.zarr"
    shutil.copytree(store, ro)
    probe = subprocess.run(["unshare", "-rm", "true"], capture_output=True)
    if probe.returncode != 0:
        pytest.skip("user namespaces are not available here")
    before = _tree(ro)
    cmd = (
        f"mount --bind -o ro {ro} {ro} && exec {sys.executable} -m fedfeat train --store {ro} --method fedavg "
        f"--partition shard --shards 2 --clients 5 --rounds 2 --out {tmp_path / 'runs'} --name x --quiet"
    )
    p = subprocess.run(["unshare", "-rm", "sh", "-c", cmd], env=ENV, capture_output=True, text=True)
    assert p.returncode == 0, p.stderr
    assert (tmp_path / "runs" / "x" / "summary.json").is_file()
    part = json.loads((tmp_path / "runs" / "x" / "partition.json").read_text())
    assert part["scheme"] == "shard" and len(part["clients"]) == 5
    assert _tree(ro) == before


# ---------------------------------------------------------------------------------------------- report
def test_report_skips_temporaries_and_unreadable_runs(store, tmp_path):
    assert (
        _cli(
            "train", "--store", store, "--out", tmp_path, "--name", "good", "--method", "fedavg", *BASE
        ).exit_code
        == 0
    )
    (tmp_path / ".tmp-x-123").mkdir()
    (tmp_path / ".tmp-x-123" / "summary.json").write_text("")
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "summary.json").write_text("")
    (tmp_path / "cut").mkdir()
    (tmp_path / "cut" / "summary.json").write_text('{"method": "fed')
    shutil.copytree(tmp_path / "good", tmp_path / "nometrics")
    (tmp_path / "nometrics" / "metrics.jsonl").unlink()
    r = runner.invoke(app, ["report", str(tmp_path)])
    assert r.exit_code == 0
    assert r.stdout.count("| fedavg") == 1
    assert sum("warning: skipped" in line for line in r.stderr.splitlines()) == 3
    r = runner.invoke(app, ["report", str(tmp_path / "empty"), str(tmp_path / "cut")])
    assert r.exit_code == 2 and "no readable finished runs" in r.stderr


def test_labels_that_are_not_class_ids_are_refused(store, tmp_path):
    from fedfeat.store.featurestore import FeatureStore

    bad = tmp_path / "bad.zarr"
    shutil.copytree(store, bad)
    st = FeatureStore.open(bad, mode="r+")
    lab = st.labels("test").copy()
    lab[3] = 99
    st._write_labels("test", lab)  # checksummed like a store written so: only the range check can catch it
    r = _cli("train", "--store", bad, "--out", tmp_path / "runs", "--method", "fedavg", *BASE)
    assert r.exit_code == 2 and "test label 99 at row 3" in r.output and "10 classes" in r.output
    assert not (tmp_path / "runs").exists()


@pytest.mark.parametrize(
    "method", ["zeroshot", "fedavg", "fedntd", "fst-cbdg", "fst-cbdg --set self_training=false"]
)
def test_every_demo_method_replays_from_its_config_elsewhere(store, tmp_path, monkeypatch, method):
    """`make demo`'s methods: `train --config RUN/config.toml --out elsewhere` from another directory reproduces
    the run (same name, same metrics minus timings, same weights)."""
    monkeypatch.chdir(tmp_path)
    r = _cli("train", "--store", store, "--method", *method.split(), "--partition", "shard", *BASE)
    assert r.exit_code == 0, r.output
    (run,) = (tmp_path / "runs").iterdir()
    other = tmp_path / "other"
    other.mkdir()
    monkeypatch.chdir(other)
    r = _cli("train", "--config", run / "config.toml", "--out", "elsewhere", "--quiet")
    assert r.exit_code == 0, r.output
    _same_run(run, other / "elsewhere" / run.name)


def test_seed_table_groups_runs_that_differ_only_in_seed():
    from fedfeat.report.tables import seed_table

    def s(method, seed, acc, lr=0.01):
        return {"method": method, "seed": seed, "final_acc": acc, "best_acc": acc, "partition": "p", "rounds": 2,
                "clients": 10, "participation": 1.0, "store_fingerprint": "f", "params": {"lr": lr}}  # fmt: skip

    text = seed_table(
        [s("fedavg", 0, 70.0), s("fedavg", 1, 74.0), s("fedavg", 2, 78.0), s("fedavg", 0, 50.0, 0.1)]
    )
    lines = text.splitlines()
    assert len(lines) == 4  # header, rule, two groups
    assert "| fedavg | - |  | p | 2 | 3 | 0,1,2 | 74.00 ± 4.00 |" in lines[2]  # sample std of 70, 74, 78
    assert "| fedavg | lr=0.1 |  | p | 2 | 1 | 0 | 50.00 |" in lines[3]
    groups = json.loads(
        seed_table([s("fedavg", 0, 70.0), s("fedavg", 1, 74.0), s("fedavg", 2, 78.0)], "json")
    )
    assert groups[0]["metrics"]["final_acc"] == {"mean": 74.0, "std": 4.0, "n": 3} and groups[0]["seeds"] == [
        0,
        1,
        2,
    ]


def _wait_rows(path: Path, n: int, proc, timeout: float = 60.0) -> None:
    import time

    t0 = time.time()
    while time.time() - t0 < timeout and proc.poll() is None:
        if path.is_file() and len(path.read_text().splitlines()) >= n:
            return
        time.sleep(0.05)
    raise AssertionError(f"{path} did not reach {n} rows")


@pytest.mark.parametrize("every", [2, 0])
def test_sigterm_keeps_a_checkpointed_run_and_removes_one_without(store, tmp_path, every):
    """SIGTERM (a job's time limit): exit 143 with one line; with a checkpoint the unfinished run stays for
    --resume (and ends equal to an uninterrupted run); without one nothing is left."""
    import signal

    args = ["train", "--store", store, "--method", "fedavg", "--name", "x", "--kernel", "torch", "--clients", "10",
            "--participation", "1", "--rounds", "400", "--quiet"]  # fmt: skip
    p = subprocess.Popen(
        [sys.executable, "-m", "fedfeat", *map(str, args), "--out", str(tmp_path / "k"), "--checkpoint-every",
         str(every)], env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    _wait_rows(tmp_path / "k" / ".partial-x" / "metrics.jsonl", 6, p)
    p.send_signal(signal.SIGTERM)
    _, err = p.communicate(timeout=60)
    assert p.returncode == 143 and err.strip().splitlines()[-1] == "error: terminated (SIGTERM)"
    assert not (tmp_path / "k" / ".lock-x").exists() and not (tmp_path / "k" / "x").exists()
    if every == 0:
        assert list((tmp_path / "k").iterdir()) == []
        return
    assert (tmp_path / "k" / ".partial-x" / "checkpoint.safetensors").is_file()
    assert _cli("train", "--resume", tmp_path / "k" / "x", "--quiet").exit_code == 0
    assert _proc(*args, "--out", tmp_path / "u").returncode == 0
    _same_run(tmp_path / "u" / "x", tmp_path / "k" / "x")


@pytest.mark.skipif(shutil.which("unshare") is None, reason="needs unshare for a small tmpfs")
def test_a_full_disk_during_train_is_one_line_and_leaves_nothing(store, tmp_path):
    if subprocess.run(["unshare", "-rm", "true"], capture_output=True).returncode != 0:
        pytest.skip("user namespaces are not available here")
    out = tmp_path / "small"
    out.mkdir()
    cmd = (
        f"mount -t tmpfs -o size=64k tmpfs {out} && {sys.executable} -m fedfeat train --store {store} --method "
        f"fedavg --clients 10 --rounds 2 --out {out} --name x --quiet; rc=$?; ls -A {out}; exit $rc"
    )
    p = subprocess.run(["unshare", "-rm", "sh", "-c", cmd], env=ENV, capture_output=True, text=True)
    assert p.returncode == 2, p.stderr
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "space" in lines[0].lower(), p.stderr
    assert p.stdout.strip() == ""  # the tmpfs is left empty: no partial run, no lock


def test_report_plot_honours_pdf_and_svg(store, tmp_path):
    assert (
        _cli(
            "train", "--store", store, "--out", tmp_path, "--name", "x", "--method", "fedavg", *BASE
        ).exit_code
        == 0
    )
    for name, magic in (("c.pdf", b"%PDF"), ("c.svg", b"<?xml"), ("c.png", b"\x89PNG")):
        r = _cli("report", tmp_path, "--plot", tmp_path / "fig" / name)
        assert r.exit_code == 0, r.output
        assert (tmp_path / "fig" / name).read_bytes()[:5].startswith(magic)
    r = _cli("report", tmp_path, "--plot", tmp_path / "fig" / "c.txt")
    assert r.exit_code == 2 and ".pdf or .svg" in r.output and not (tmp_path / "fig" / "c.txt").exists()
    assert sorted(p.name for p in (tmp_path / "fig").iterdir()) == ["c.pdf", "c.png", "c.svg"]


def test_python_api_trains_and_loads_runs(store, tmp_path):
    import fedfeat

    st = fedfeat.open_store(store)
    assert st.n_classes == 10
    rec = fedfeat.train(store=str(store), method="fedprox", clients=10, rounds=2, out=str(tmp_path), name="api",
                        params={"mu": 0.3}, kernel="torch")  # fmt: skip
    assert rec["method"] == "fedprox" and rec["params"]["mu"] == 0.3 and Path(rec["path"]).name == "api"
    runs = fedfeat.load_runs(tmp_path, as_frame=False, metrics=True)
    assert (  # metrics=True: one row per run and round
        [r["name"] for r in runs] == ["api"] * 3
        and runs[0]["params.mu"] == 0.3
        and [r["round"] for r in runs] == [0, 1, 2]
    )
    assert runs[0]["final_acc"] == rec["final_acc"]
    with pytest.raises(fedfeat.errors.FedfeatError, match="unknown run settings"):
        fedfeat.train(store=str(store), epochs=3)
    cfg = fedfeat.RunConfig(method="fedavg")
    assert (cfg.rounds, cfg.clients, cfg.participation) == (10, 100, 0.1)


def test_long_tailed_runs_report_shot_groups_by_default(store, tmp_path):
    """60 samples per class, long tail IF 10: class counts 60 .. 6; 10 classes -> CIFAR-10-LT groups (> 1500,
    < 200): every class is 'few', so few = the overall accuracy and many / medium have no classes (None)."""
    args = ["train", "--store", store, "--out", tmp_path, "--name", "lt", "--method", "fedavg", "--partition",
            "dirichlet", "--imbalance-factor", "10", "--clients", "5", "--rounds", "1", "--quiet"]  # fmt: skip
    assert _cli(*args).exit_code == 0
    row = _metrics(tmp_path / "lt")[-1]
    assert (
        row["few_acc"] == pytest.approx(row["test_acc"])
        and row["many_acc"] is None
        and row["medium_acc"] is None
    )


def test_local_test_reports_the_mean_of_per_client_accuracies(store, tmp_path):
    """--local-test proportional: local_acc is the unweighted mean over clients of their accuracies on their own
    test rows; recomputed here from the run's weights, predictions and the split."""
    import numpy as np

    from fedfeat.engine.data import load_run_data
    from fedfeat.partition.make import local_test_split, make_partition
    from fedfeat.store.featurestore import FeatureStore

    args = ["train", "--method", "zeroshot", "--store", str(store), "--clients", "4", "--partition", "dirichlet",
            "--alpha", "0.3", "--out", str(tmp_path), "--local-test", "proportional", "--quiet", "--rounds", "1"]  # fmt: skip
    r = runner.invoke(app, args)
    assert r.exit_code == 0, r.output
    (run,) = [p for p in tmp_path.iterdir() if not p.name.startswith(".")]
    summary = json.loads((run / "summary.json").read_text())
    st = FeatureStore.open(store)
    part = make_partition(st.labels("train"), "dirichlet", clients=4, alpha=0.3)
    data = load_run_data(st, part)
    text = torch.nn.functional.normalize(data.text_all[0], dim=-1)
    pred = (torch.nn.functional.normalize(data.test_x.float(), dim=-1) @ text.T).argmax(1).numpy()
    y = data.test_y.numpy()
    rows = local_test_split(part, st.labels("train"), y, st.n_classes, seed=0)
    want = np.mean([(pred[r] == y[r]).mean() * 100 for r in rows if len(r)])
    assert summary["local_acc"] == pytest.approx(want, abs=1e-9)
    assert summary["local_acc"] != pytest.approx(summary["final_acc"], abs=1e-6)  # not the global accuracy
    rep = runner.invoke(app, ["report", str(tmp_path)])
    assert "local acc" in rep.output
    bad = runner.invoke(app, args[:-2] + ["--local-test", "yes", "--name", "x"])
    assert bad.exit_code == 2 and "--local-test must be one of none, proportional" in bad.output


def test_local_test_joint_uses_the_test_split_drawn_with_the_partition(store, tmp_path):
    import numpy as np

    from fedfeat.engine.data import load_run_data
    from fedfeat.partition.make import make_partition
    from fedfeat.store.featurestore import FeatureStore

    args = ["train", "--method", "zeroshot", "--store", str(store), "--clients", "4", "--partition",
            "dirichlet-joint", "--alpha", "0.5", "--out", str(tmp_path), "--local-test", "joint", "--quiet"]  # fmt: skip
    r = runner.invoke(app, args)
    assert r.exit_code == 0, r.output
    (run,) = [p for p in tmp_path.iterdir() if not p.name.startswith(".")]
    summary = json.loads((run / "summary.json").read_text())
    assert summary["partition"] == "dirichlet-joint-a0.5-c4-s2"
    st = FeatureStore.open(store)
    part = make_partition(
        st.labels("train"), "dirichlet-joint", clients=4, alpha=0.5, test_labels=st.labels("test")
    )
    data = load_run_data(st, part, local_test="joint")
    text = torch.nn.functional.normalize(data.text_all[0], dim=-1)
    pred = (torch.nn.functional.normalize(data.test_x.float(), dim=-1) @ text.T).argmax(1).numpy()
    y = data.test_y.numpy()
    want = np.mean(
        [(pred[t] == y[t]).mean() * 100 for t in map(np.asarray, part.params["test_clients"]) if len(t)]
    )
    assert summary["local_acc"] == pytest.approx(want, abs=1e-9)
    bad = runner.invoke(app, ["train", "--method", "zeroshot", "--store", str(store), "--clients", "4",
                              "--local-test", "joint", "--out", str(tmp_path / "b"), "--quiet"])  # fmt: skip
    assert (
        bad.exit_code == 2
        and "--local-test joint takes the test split drawn with the partition" in bad.output
    )

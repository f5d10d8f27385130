"""Sweeps across methods with method-specific hyperparameters, launchers (``fedfeat sweep --launcher
local|slurm|ray``: the same run directories), the progress display and failed runs reported at the end."""

from __future__ import annotations

import json
import sys
import types
from pathlib import Path

import pytest
from typer.testing import CliRunner

from fedfeat.cli.app import app
from fedfeat.runs import sweep as sw

runner = CliRunner()


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    out = tmp_path_factory.mktemp("la") / "s.zarr"
    r = runner.invoke(app, ["synth", "--out", str(out), "--dim", "16", "--train-per-class", "20",
                            "--test-per-class", "8", "--templates", "2", "--no-stats"])  # fmt: skip
    assert r.exit_code == 0, r.output
    return out


def _runs(d: Path) -> list[Path]:
    return sorted(p for p in d.iterdir() if not p.name.startswith("."))


def _rows(run: Path) -> list[dict]:
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    for r in rows:
        for k in list(r):
            if "seconds" in k:
                r.pop(k)
    return rows


def _same_dirs(a: Path, b: Path) -> None:
    ra, rb = _runs(a), _runs(b)
    assert [p.name for p in ra] == [p.name for p in rb] and ra
    for x, y in zip(ra, rb):
        assert _rows(x) == _rows(y), x.name
        wx = sorted(p.name for p in x.iterdir() if p.suffix in (".safetensors", ".pt", ".npz"))
        assert wx, f"{x.name}: no weights file"
        for n in wx:
            if n != "results.npz":
                assert (x / n).read_bytes() == (y / n).read_bytes(), f"{x.name}/{n}"


def test_expand_drops_a_param_a_method_lacks_once_and_says_so_once():
    said: list[str] = []
    pts = sw.expand(
        grid={"method": ["fedavg", "fedprox"], "seed": [0]}, params={"mu": [0.01, 0.1]}, log=said.append
    )
    assert [(s["method"], p) for s, p in pts] == [
        ("fedavg", {}),
        ("fedprox", {"mu": 0.01}),
        ("fedprox", {"mu": 0.1}),
    ]
    assert said == ["fedavg: no hyperparameter mu; those grid keys are skipped for it"]


def test_readme_sweep_across_methods_with_mu_runs(store, tmp_path):
    # the README's promise: fedavg and fedprox with --set mu=...; fedavg appears once, fedprox twice
    args = ["sweep", "--store", str(store), "--method", "fedavg,fedprox", "--set", "mu=0.01,0.1", "--partition",
            "iid", "--clients", "4", "--participation", "0.5", "--rounds", "2", "--out", str(tmp_path / "r"),
            "--format", "json"]  # fmt: skip
    r = runner.invoke(app, args)
    assert r.exit_code == 0, r.output
    assert r.output.count("fedavg: no hyperparameter mu") == 1
    names = [p.name for p in _runs(tmp_path / "r")]
    assert (
        sum(n.startswith("fedavg__") for n in names) == 1
        and sum(n.startswith("fedprox__") for n in names) == 2
    )


def test_a_plugin_param_in_a_sweep_with_fedavg(store, tmp_path):
    import dataclasses

    from fedfeat.methods import REGISTRY, register
    from fedfeat.methods.linear import FedAvg

    @dataclasses.dataclass(frozen=True)
    class SmoothParams(FedAvg.Params):
        smoothing: float = 0.0

    class Smooth(FedAvg):
        name = "smooth-test"
        Params = SmoothParams

    register(Smooth)
    try:
        pts = sw.expand(grid={"method": ["fedavg", "smooth-test"]}, params={"smoothing": [0.0, 0.1]})
        assert [(s["method"], p) for s, p in pts] == [
            ("fedavg", {}), ("smooth-test", {"smoothing": 0.0}), ("smooth-test", {"smoothing": 0.1})
        ]  # fmt: skip
    finally:
        REGISTRY.pop("smooth-test", None)


ARGS = ["--method", "fedavg,fedprox", "--seed", "0,1", "--partition", "iid", "--clients", "4", "--participation",
        "0.5", "--rounds", "2", "--set", "mu=0.1", "--quiet"]  # fmt: skip


def _sweep(store, out: Path, *extra: str):
    r = runner.invoke(app, ["sweep", "--store", str(store), *ARGS, "--out", str(out), *extra])
    assert r.exit_code == 0, r.output
    return r


def test_slurm_launcher_debug_cluster_writes_what_local_writes_and_skips_finished(store, tmp_path):
    pytest.importorskip("submitit")
    _sweep(store, tmp_path / "local")
    _sweep(store, tmp_path / "slurm", "--launcher", "slurm", "--slurm-cluster", "debug", "--jobs", "3")
    _same_dirs(tmp_path / "local", tmp_path / "slurm")
    # re-launched: every run finished, nothing submitted
    r = runner.invoke(app, ["sweep", "--store", str(store), *[a for a in ARGS if a != "--quiet"], "--out",
                            str(tmp_path / "slurm"), "--launcher", "slurm", "--slurm-cluster", "debug"])  # fmt: skip
    assert r.exit_code == 0, r.output
    assert r.output.count("finished already, skipped") == 4 and "job(s)" not in r.output


def test_slurm_launcher_local_cluster_subprocess(store, tmp_path):
    pytest.importorskip("submitit")
    _sweep(store, tmp_path / "local", "--no-stack")
    _sweep(store, tmp_path / "sub", "--launcher", "slurm", "--slurm-cluster", "local", "--jobs", "1")
    _same_dirs(tmp_path / "local", tmp_path / "sub")


def _fake_ray(monkeypatch) -> list:
    """A ``ray`` module that runs each task in this process (remote -> a ref holding its result)."""
    calls: list = []
    fake = types.ModuleType("ray")
    fake.is_initialized = lambda: True

    class Ref:
        def __init__(self, value):
            self.value = value

    def remote(fn):
        def run(*a):
            calls.append(len(a[0]))
            return Ref(fn(*a))

        return types.SimpleNamespace(remote=run)

    fake.remote = remote
    fake.wait = lambda refs, num_returns=1: (refs[:num_returns], refs[num_returns:])
    fake.get = lambda ref: ref.value
    monkeypatch.setitem(sys.modules, "ray", fake)
    return calls


def test_ray_launcher_writes_what_local_writes(store, tmp_path, monkeypatch):
    calls = _fake_ray(monkeypatch)
    _sweep(store, tmp_path / "local")
    _sweep(store, tmp_path / "ray", "--launcher", "ray", "--jobs", "2")
    assert sorted(calls) == [2, 2]  # 4 runs in 2 tasks
    _same_dirs(tmp_path / "local", tmp_path / "ray")
    calls.clear()
    _sweep(store, tmp_path / "ray", "--launcher", "ray", "--jobs", "2")
    assert calls == []  # finished runs: nothing launched


def test_a_failed_run_does_not_stop_the_rest_and_is_reported(store, tmp_path, monkeypatch):
    from fedfeat.runs import train as tr

    real = tr.train

    def flaky(cfg, *a, **k):
        if cfg.seed == 1 and cfg.method == "fedavg":
            raise RuntimeError("boom in round 1")
        return real(cfg, *a, **k)

    monkeypatch.setattr(tr, "train", flaky)
    r = runner.invoke(
        app, ["sweep", "--store", str(store), *ARGS, "--no-stack", "--out", str(tmp_path / "f")]
    )
    assert r.exit_code == 1
    assert "1 run(s) failed:" in r.output and "RuntimeError: boom in round 1" in r.output
    assert len(_runs(tmp_path / "f")) == 3  # the other three are written
    assert r.output.count("| fedprox |") >= 1  # the closing table of the runs that were made


def test_display_counts_done_and_failed():
    d = sw.Display(3, quiet=True)
    d.advance()
    d.advance(failed=1)
    assert (d.done, d.failed) == (2, 1)
    assert sw.failure_lines([sw.Failure(0, "a", "x")]) == ["1 run(s) failed:", "  a: x"]


def test_ray_launcher_real_local_ray(store, tmp_path):
    ray = pytest.importorskip("ray")
    _sweep(store, tmp_path / "local", "--no-stack")
    ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False)
    try:
        _sweep(store, tmp_path / "ray", "--launcher", "ray", "--jobs", "1")
    finally:
        ray.shutdown()
    _same_dirs(tmp_path / "local", tmp_path / "ray")


def test_progress_line_on_stderr_unless_quiet(store, tmp_path):
    args = [
        "sweep",
        "--store",
        str(store),
        *[a for a in ARGS if a != "--quiet"],
        "--out",
        str(tmp_path / "p"),
    ]
    r = runner.invoke(app, args)
    assert r.exit_code == 0, r.output
    assert "4/4 failed 0 ETA" in r.stderr and "failed 0" not in r.stdout  # done/total, failures, ETA
    q = runner.invoke(app, [*args, "--quiet"])
    assert q.exit_code == 0 and "failed 0" not in q.stderr


def test_reproduce_goes_on_after_a_failed_run_and_exits_1(tmp_path, monkeypatch):
    from fedfeat.runs import reproduce as R
    from fedfeat.runs import train as tr

    monkeypatch.setattr(R, "SYNTH_SHAPES", {
        ("cifar10", "RN50"): dict(classes=10, train_per_class=30, test_per_class=6, dim=16, templates=2),
        ("cifar100", "RN50"): dict(classes=100, train_per_class=6, test_per_class=2, dim=16, templates=2, s=0.1),
    })  # fmt: skip
    real = tr.train_stacked

    def equal_fails(cfgs, **k):  # the "Equal sampling" row's runs fail, the others are made
        ok = [c for c in cfgs if c.params.get("balance") != "equal"]
        got = iter(real(ok, **k) if ok else [])
        return [RuntimeError("no memory") if c.params.get("balance") == "equal" else next(got) for c in cfgs]

    monkeypatch.setattr(tr, "train_stacked", equal_fails)
    r = runner.invoke(app, ["reproduce", "fst-cbdg-table4", "--synthetic", "--seeds", "1", "--rounds", "1",
                            "--store-root", str(tmp_path / "c"), "--out", str(tmp_path / "r"), "--format", "json"])  # fmt: skip
    assert r.exit_code == 1, r.output
    cells = json.loads(r.stdout)
    # 4 columns, one of them undrawable at this size (n/a): the balanced row's 3 runs made, the equal row's failed
    assert sorted(c["n"] for c in cells if c["row"] == "Balanced sampling") == [0, 1, 1, 1]
    assert {c["n"] for c in cells if c["row"] == "Equal sampling"} == {0}
    assert "3 run(s) failed:" in r.stderr and r.stderr.count(": RuntimeError: no memory") == 3 + 3
    assert "6/6 failed 3" in r.stderr  # the progress line: done / total, failures

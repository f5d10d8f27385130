"""``fedfeat compile`` (run by ``make install``) compiles every fused-kernel signature a float32 run uses: a run made
after it compiles nothing more (a warm-up with other argument types would leave the first run to compile)."""

from __future__ import annotations

import json

import pytest
from helpers_clip import synth_store
from typer.testing import CliRunner

from fedfeat.cli.app import app
from fedfeat.runs.compile import compile_kernels, signatures
from fedfeat.runs.writers import process_age

runner = CliRunner()


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    path = synth_store(tmp_path_factory.mktemp("s") / "s.zarr", dim=16, train_per_class=30, test_per_class=10)
    return path


def test_runs_after_compile_compile_nothing(store, tmp_path):
    r = runner.invoke(app, ["compile"])
    assert r.exit_code == 0, r.output
    assert "fused kernels ready" in r.output
    before = signatures()
    assert all(v >= 1 for v in before.values()), before
    common = ["--store", str(store), "--partition", "dirichlet", "--alpha", "0.5", "--clients", "6", "--rounds", "2",
              "--participation", "0.5", "--device", "cpu", "--kernel", "fused", "--quiet"]  # fmt: skip
    for i, method in enumerate(["fedavg", "fedprox", "fedntd", "fst-cbdg"]):
        r = runner.invoke(app, ["train", "--method", method, *common, "--out", str(tmp_path / f"r{i}")])
        assert r.exit_code == 0, r.output
        (summary,) = (tmp_path / f"r{i}").glob("*/summary.json")
        assert json.loads(summary.read_text())["kernel"] == "fused"
    for method in ["fedavg", "fst-cbdg"]:  # stacked runs: the same compiled code
        r = runner.invoke(
            app, ["sweep", "--method", method, *common, "--seed", "0,1", "--out", str(tmp_path / method)]
        )
        assert r.exit_code == 0, r.output
    assert signatures() == before


def test_compile_twice_loads_the_cache():
    compile_kernels()
    res = compile_kernels()
    assert res["compile_seconds"] == 0.0
    assert res["signatures"] == signatures()


def test_process_age_is_this_processes_age():
    import time

    age = process_age()
    assert age is not None and 0 < age < time.monotonic() + 1  # started after boot, and before now
    time.sleep(0.05)
    assert process_age() >= age

"""`fedfeat train / methods / report` through the CLI: run directories, replay, errors."""

import json

import pytest
from typer.testing import CliRunner

from fedfeat.cli.app import app

runner = CliRunner()


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    out = tmp_path_factory.mktemp("t") / "s.zarr"
    r = runner.invoke(
        app,
        ["synth", "--out", str(out), "--dim", "32", "--train-per-class", "60", "--test-per-class", "20",
         "--templates", "2", "--no-stats"],
    )  # fmt: skip
    assert r.exit_code == 0, r.output
    return out


def _train(store, out, *extra):
    args = ["train", "--store", str(store), "--clients", "10", "--rounds", "3", "--participation", "0.3",
            "--out", str(out), "--quiet", *extra]  # fmt: skip
    r = runner.invoke(app, args)
    assert r.exit_code == 0, r.output
    return r


def test_run_directory_contents_and_determinism(store, tmp_path):
    _train(store, tmp_path / "a", "--method", "fst-cbdg", "--name", "x", "--set", "batch_size=8")
    _train(store, tmp_path / "b", "--method", "fst-cbdg", "--name", "x", "--set", "batch_size=8")
    run = tmp_path / "a" / "x"
    for f in ("config.toml", "metrics.jsonl", "summary.json", "curve.png", "weights.safetensors"):
        assert (run / f).is_file(), f
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["round"] for r in rows] == [0, 1, 2, 3]
    for key in ("test_acc", "pseudo_label_acc", "train_loss", "bytes_up", "bytes_down", "seconds"):
        assert key in rows[1], key
    assert rows[1]["bytes_up"] == 3 * (10 * 32 + 10) * 4  # 3 clients upload W [10, 32] and b [10] as float32
    other = [json.loads(line) for line in (tmp_path / "b" / "x" / "metrics.jsonl").read_text().splitlines()]
    assert [r["test_acc"] for r in rows] == [r["test_acc"] for r in other]
    assert not list((tmp_path / "a").glob(".tmp-*"))  # no half-written run left behind

    from safetensors.torch import load_file

    w = load_file(run / "weights.safetensors")
    assert w["W"].shape == (10, 32) and w["b"].shape == (10,)


def test_config_replays_the_run(store, tmp_path):
    _train(store, tmp_path, "--method", "fedprox", "--name", "orig", "--set", "mu=0.3", "--seed", "5")
    cfg = tmp_path / "orig" / "config.toml"
    assert "mu = 0.3" in cfg.read_text()
    r = runner.invoke(app, ["train", "--config", str(cfg), "--name", "replay", "--quiet"])
    assert r.exit_code == 0, r.output
    a = (tmp_path / "orig" / "metrics.jsonl").read_text().splitlines()
    b = (tmp_path / "replay" / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(x)["test_acc"] for x in a] == [json.loads(x)["test_acc"] for x in b]
    assert json.loads((tmp_path / "replay" / "summary.json").read_text())["params"]["mu"] == 0.3


def test_report_table_and_plot(store, tmp_path):
    _train(store, tmp_path / "runs", "--method", "zeroshot")
    _train(store, tmp_path / "runs", "--method", "fedavg")
    png = tmp_path / "all.png"
    r = runner.invoke(app, ["report", str(tmp_path / "runs"), "--plot", str(png)])
    assert r.exit_code == 0, r.output
    assert "| zeroshot |" in r.output and "| fedavg |" in r.output and "final acc" in r.output
    assert png.read_bytes()[:4] == b"\x89PNG"
    r = runner.invoke(app, ["report", str(tmp_path / "runs"), "--format", "csv"])
    assert r.output.splitlines()[0].startswith("method,settings,partition")


def test_unknown_method_lists_the_known(store, tmp_path):
    r = runner.invoke(app, ["train", "--store", str(store), "--method", "nope", "--out", str(tmp_path)])
    assert r.exit_code == 2
    assert "unknown method 'nope'" in r.output and "fst-cbdg" in r.output and "fedavg" in r.output


def test_kernel_flag(store, tmp_path):
    r = runner.invoke(app, ["train", "--store", str(store), "--method", "creff", "--kernel", "fused", "--clients", "10",
                            "--out", str(tmp_path)])  # fmt: skip
    assert r.exit_code == 2 and "no fused kernel" in r.output and len(r.output.strip().splitlines()) == 1
    _train(store, tmp_path, "--method", "fedavg", "--name", "f", "--set", "batch_size=8", "--kernel", "fused")
    _train(store, tmp_path, "--method", "fedavg", "--name", "t", "--set", "batch_size=8", "--kernel", "torch")
    f, t = (json.loads((tmp_path / n / "summary.json").read_text()) for n in ("f", "t"))
    assert (f["kernel"], t["kernel"]) == ("fused", "torch")
    assert f["final_acc"] == pytest.approx(t["final_acc"], abs=1e-9)


def test_unknown_hyperparameter_lists_the_valid(store, tmp_path):
    r = runner.invoke(
        app, ["train", "--store", str(store), "--method", "fedavg", "--set", "lrr=1", "--out", str(tmp_path)]
    )
    assert r.exit_code == 2 and "valid keys" in r.output and "lr" in r.output
    r = runner.invoke(
        app, ["train", "--store", str(store), "--method", "fedavg", "--set", "lr=abc", "--out", str(tmp_path)]
    )
    assert r.exit_code == 2 and "bad value" in r.output


def test_methods_lists_labels_and_defaults():
    r = runner.invoke(app, ["methods"])
    assert r.exit_code == 0
    for name in ("zeroshot", "centralized", "fedavg", "fedprox", "fedavgm", "fedntd", "fst-cbdg"):
        assert name in r.output
    assert "beta=0.9" in r.output and "gamma=0.0" in r.output
    from fedfeat.methods import method_table

    kernels = {row["name"]: row["kernels"] for row in method_table()}
    assert kernels["fst-cbdg"] == "fused (CPU), torch" and kernels["creff"] == "torch"

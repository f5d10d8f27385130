"""CLI of the foundation: synth, info, partition; errors are one line with exit status 2."""

import json

import numpy as np
import pytest
from typer.testing import CliRunner

from fedfeat.cli.app import app
from fedfeat.store.featurestore import FeatureStore

runner = CliRunner()


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    out = tmp_path_factory.mktemp("s") / "s.zarr"
    r = runner.invoke(
        app,
        ["synth", "--out", str(out), "--dim", "16", "--train-per-class", "60", "--test-per-class", "10",
         "--templates", "2", "--no-stats"],
    )  # fmt: skip
    assert r.exit_code == 0, r.output
    return out


def test_info_shows_attributes(store):
    r = runner.invoke(app, ["info", str(store)])
    assert r.exit_code == 0, r.output
    assert "complete" in r.output and "airplane" in r.output and "600 x 16" in r.output


def test_partition_stats_export_plot(store, tmp_path):
    exp, png = tmp_path / "p.json", tmp_path / "h.png"
    r = runner.invoke(
        app,
        ["partition", str(store), "--scheme", "shard", "--shards", "2", "--clients", "10", "--stats",
         "--export", str(exp), "--plot", str(png)],
    )  # fmt: skip
    assert r.exit_code == 0, r.output
    d = json.loads(exp.read_text())
    assert len(d["clients"]) == 10 and sorted(sum(d["clients"], [])) == list(range(600))
    assert png.stat().st_size > 1000 and png.read_bytes()[:4] == b"\x89PNG"
    assert "shard-sh2-c10-s19940817" in FeatureStore.open(store).partition_keys()
    labels = FeatureStore.open(store).labels("train")
    assert all(len(set(labels[c])) <= 2 for c in d["clients"])


@pytest.mark.parametrize(
    "args, needle",
    [
        (["--scheme", "dirichlet", "--alpha", "0"], "alpha"),
        (["--scheme", "nope"], "iid, shard, dirichlet"),
        (["--scheme", "iid", "--clients", "100000"], "clients"),
        (["--scheme", "shard", "--shards", "3", "--clients", "7"], "shard"),
    ],
)
def test_user_errors_are_one_line(store, args, needle):
    r = runner.invoke(app, ["partition", str(store), *args])
    assert r.exit_code == 2
    lines = [ln for ln in r.output.strip().splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: ") and needle in lines[0], r.output


def test_bad_store_path_is_one_line(tmp_path):
    r = runner.invoke(app, ["info", str(tmp_path / "missing.zarr")])
    assert r.exit_code == 2 and r.output.startswith("error: no store at")


def test_every_flag_is_documented():
    """Every option and argument of every command carries a help text (read from the click command)."""
    import typer

    group = typer.main.get_command(app)
    assert {"synth", "info", "partition", "train", "methods", "report", "encode"} <= set(group.commands)
    for name, cmd in group.commands.items():
        assert cmd.help, name
        for param in cmd.params:
            if param.name != "help":
                assert getattr(param, "help", None), f"{name} {param.name} has no help text"
    r = runner.invoke(app, ["partition", "--help"], env={"COLUMNS": "200"})
    assert r.exit_code == 0 and "--imbalance-factor" in r.output and "--export" in r.output


def test_synth_deterministic_via_cli(store, tmp_path):
    out2 = tmp_path / "t.zarr"
    r = runner.invoke(
        app,
        ["synth", "--out", str(out2), "--dim", "16", "--train-per-class", "60", "--test-per-class", "10",
         "--templates", "2", "--no-stats"],
    )  # fmt: skip
    assert r.exit_code == 0
    np.testing.assert_array_equal(
        FeatureStore.open(store).features("test"), FeatureStore.open(out2).features("test")
    )


def test_info_verify_reports_what_it_checked(store):
    r = runner.invoke(app, ["info", "--verify", str(store)])
    assert r.exit_code == 0, r.output
    assert "2 feature chunks (700 rows), labels, text features: checksums match, all finite" in r.output
    r = runner.invoke(app, ["info", "--verify", "--json", str(store)])
    assert json.loads(r.output)["verified"] == {"chunks": 2, "rows": 700, "text": 1}


def test_partition_export_into_a_missing_directory_is_refused_first(store, tmp_path):
    before = sorted(p.name for p in (store / "partitions").iterdir())
    target = tmp_path / "nodir" / "p.json"
    r = runner.invoke(
        app, ["partition", str(store), "--scheme", "iid", "--clients", "3", "--export", str(target)]
    )
    assert r.exit_code == 2 and r.output.count("\n") == 1, r.output
    assert f"directory {target.parent} does not exist; create it first" in r.output
    assert sorted(p.name for p in (store / "partitions").iterdir()) == before  # nothing saved either


def test_synth_never_replaces_a_directory_it_did_not_write(tmp_path):
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "thesis.txt").write_text("irreplaceable\n")
    for extra in ([], ["--force"]):
        r = runner.invoke(
            app, ["synth", "--out", str(mine), "--classes", "2", "--dim", "8", "--no-stats", *extra]
        )
        assert r.exit_code == 2 and "is not a fedfeat store" in r.output and "--out" in r.output, r.output
    assert [p.name for p in mine.iterdir()] == ["thesis.txt"]

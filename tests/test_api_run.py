"""The Python API's run object and three broken items of issue 27.

* ``fedfeat.train`` takes ``store=`` as a ``str``, an ``os.PathLike`` or an open ``FeatureStore`` and returns a
  ``fedfeat.Run`` (path, config, summary, metrics, weights, results; ``run["final_acc"]`` still works);
  ``fedfeat.load_runs(metrics=True)`` is a long table, one row per run and round.
* A run's ``seconds`` leave numba's compiling out; ``compile_seconds`` records it.
* ``zeroshot`` draws no partition (its settings are ignored, even undrawable ones) and writes no weights.
"""

import json
import time
from pathlib import Path

import numpy as np
import pytest
from safetensors.torch import load_file
from typer.testing import CliRunner

import fedfeat
from fedfeat.cli.app import app
from fedfeat.errors import FedfeatError

runner = CliRunner()
FAST = {"clients": 4, "rounds": 2, "participation": 0.5, "kernel": "torch", "partition": "shard", "shards": 2}


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    out = tmp_path_factory.mktemp("api") / "s.zarr"
    r = runner.invoke(
        app,
        ["synth", "--out", str(out), "--classes", "4", "--dim", "16", "--train-per-class", "20",
         "--test-per-class", "10", "--templates", "2", "--no-stats"],
    )  # fmt: skip
    assert r.exit_code == 0, r.output
    return out


# ---------------------------------------------------------------------------------------------- the Run object
def test_train_takes_an_open_store_and_returns_a_run(store, tmp_path):
    st = fedfeat.open_store(store)
    run = fedfeat.train(
        store=st, method="fedavg", out=tmp_path, name="a", **FAST
    )  # refused before: not a str
    assert isinstance(run, fedfeat.Run) and run.path == tmp_path / "a"
    summary = json.loads((tmp_path / "a" / "summary.json").read_text())
    assert (
        run.summary == summary and run["final_acc"] == summary["final_acc"] and run["path"] == str(run.path)
    )
    assert dict(run) == {**summary, "path": str(run.path)}  # the old record, key for key
    assert run.config.method == "fedavg" and run.config.rounds == 2 and run.config.shards == 2
    rows = [json.loads(x) for x in (run.path / "metrics.jsonl").read_text().splitlines()]
    m = run.metrics
    got = m.to_dict("records") if hasattr(m, "to_dict") else m
    assert [r["round"] for r in got] == [0, 1, 2] and [r["test_acc"] for r in got] == [
        r["test_acc"] for r in rows
    ]
    w, ref = run.weights(), load_file(run.path / "weights.safetensors")
    assert w.keys() == ref.keys() == {"W", "b"} and all((w[k] == ref[k]).all() for k in w)
    assert tuple(w["W"].shape) == (4, 16)
    res = run.results()
    if (run.path / "results.npz").is_file():
        assert res["class_acc"].shape == (3, 4)
        assert np.allclose(res["class_acc"][-1], rows[-1]["per_class_acc"])
    # the same run from a Path and from a str (by the same name: the same results)
    for s in (Path(store), str(store)):
        again = fedfeat.train(store=s, method="fedavg", out=tmp_path / "b", name="a", overwrite=True, **FAST)
        assert again["final_acc"] == run["final_acc"]
    loaded = fedfeat.Run.load(tmp_path / "a")
    assert loaded.summary == run.summary and "final_acc=" in repr(loaded)
    with pytest.raises(FedfeatError, match="not a finished run directory"):
        fedfeat.Run.load(tmp_path)


def test_load_runs_metrics_is_one_row_per_run_and_round(store, tmp_path):
    fedfeat.train(store=store, method="fedavg", out=tmp_path, name="two", seed=1, **FAST)
    fedfeat.train(store=store, method="fedprox", out=tmp_path, name="one", params={"mu": 0.5},
                  **{**FAST, "rounds": 1})  # fmt: skip
    rows = fedfeat.load_runs(tmp_path, metrics=True, as_frame=False)
    assert [(r["name"], r["round"]) for r in rows] == [
        ("one", 0),
        ("one", 1),
        ("two", 0),
        ("two", 1),
        ("two", 2),
    ]
    assert all("metrics" not in r for r in rows)
    assert {r["seed"] for r in rows if r["name"] == "two"} == {1} and rows[0]["params.mu"] == 0.5
    assert rows[0]["path"] == str(tmp_path / "one") and rows[0]["method"] == "fedprox"
    per_round = [
        json.loads(x)["test_acc"] for x in (tmp_path / "two" / "metrics.jsonl").read_text().splitlines()
    ]
    assert [r["test_acc"] for r in rows if r["name"] == "two"] == per_round
    assert len(fedfeat.load_runs(tmp_path, as_frame=False)) == 2  # without metrics: one record per run
    pd = pytest.importorskip("pandas")
    df = fedfeat.load_runs(tmp_path, metrics=True)
    assert isinstance(df, pd.DataFrame) and len(df) == 5 and "metrics" not in df.columns
    assert df.groupby("method")["round"].max().to_dict() == {"fedavg": 2, "fedprox": 1}


# ---------------------------------------------------------------------------------------- compile time apart
def test_seconds_leave_numba_compiling_out(store, tmp_path):
    """A plugin whose first round compiles a fresh numba function and spends 0.5 s inside a ``numba:compile``
    event (as a fused kernel's first compile does, ~25 s): ``compile_seconds`` holds both, ``seconds`` neither."""
    import numba
    from numba.core import event

    from fedfeat.methods import REGISTRY, LinearHead, register

    class CompilesOnce(LinearHead):
        name = "test-compiles-once"
        state_keys = {"compiled": "server: 1 once the first round compiled (test)"}

        def local_begin(self, ctx, plan, glob):
            if not ctx.state.get("compiled"):
                ctx.state["compiled"] = 1
                assert numba.njit(lambda x: x + 1)(1) == 2  # a real compile (a new closure: never cached)
                with event.trigger_event("numba:compile"):
                    time.sleep(0.5)
            return super().local_begin(ctx, plan, glob)

    register(CompilesOnce)
    try:
        t = time.perf_counter()
        run = fedfeat.train(store=store, method="test-compiles-once", out=tmp_path, name="c", **FAST)
        outside = time.perf_counter() - t
    finally:
        REGISTRY.pop("test-compiles-once", None)
    s = dict(run)
    assert s["compile_seconds"] >= 0.5 and s["seconds"] >= 0
    assert s["seconds"] + s["compile_seconds"] <= outside  # together within the call's wall time
    assert s["seconds"] < outside - 0.5
    plain = fedfeat.train(store=store, method="fedavg", out=tmp_path, name="p", **FAST)
    assert plain["compile_seconds"] == 0.0  # the torch program: nothing compiled


# --------------------------------------------------------------------------------- zeroshot needs no partition
def test_zeroshot_ignores_an_undrawable_partition_and_writes_no_weights(store, tmp_path):
    # 80 train samples: 5000 clients, or 1000 clients of 2 shards each, cannot be drawn
    a = fedfeat.train(store=store, method="zeroshot", out=tmp_path, clients=5000, alpha=0.01, rounds=1)
    assert "no-partition" in a.path.name and a.summary["partition"] == "no-partition"
    assert not (a.path / "weights.safetensors").exists() and not (a.path / "partition.json").exists()
    assert "trains nothing" in a.summary["weights"]
    with pytest.raises(FedfeatError, match="no weights.safetensors: none written: zeroshot trains nothing"):
        a.weights()
    # the same run whatever the (ignored) partition settings: one name, one accuracy
    r = runner.invoke(
        app,
        ["train", "--method", "zeroshot", "--store", str(store), "--partition", "shard", "--shards", "1000",
         "--clients", "1000", "--rounds", "1", "--out", str(tmp_path / "cli"), "--quiet"],
    )  # fmt: skip
    assert r.exit_code == 0, r.output
    (b,) = (tmp_path / "cli").iterdir()
    assert b.name == a.path.name
    assert json.loads((b / "summary.json").read_text())["final_acc"] == a["final_acc"]
    # the hand-computed zero-shot accuracy: argmax of the test features against the first template's prompts
    st = fedfeat.open_store(store)
    x = np.asarray(st.features("test"), np.float64)
    y = np.asarray(st.labels("test"))
    t = np.asarray(st.text_features(), np.float64).reshape(-1, st.n_classes, x.shape[1])[0]
    x /= np.linalg.norm(x, axis=1, keepdims=True)
    assert a["final_acc"] == pytest.approx(((x @ t.T).argmax(1) == y).mean() * 100)

"""``fedfeat eval``: a saved run's head, adapter or prompt scored on another store (``fedfeat.runs.evaluate``)."""

import json

import numpy as np
import pytest
from typer.testing import CliRunner

from fedfeat.cli.app import app
from fedfeat.report.load import load_results

runner = CliRunner()


def _synth(out, seed, *extra):
    r = runner.invoke(app, ["synth", "--out", str(out), "--dim", "16", "--train-per-class", "30",
                            "--test-per-class", "12", "--templates", "2", "--no-stats", "--seed", str(seed), *extra])  # fmt: skip
    assert r.exit_code == 0, r.output
    return out


@pytest.fixture(scope="module")
def stores(tmp_path_factory):
    d = tmp_path_factory.mktemp("ev")
    return _synth(d / "a.zarr", 0), _synth(d / "b.zarr", 7)


def _run(store, out, method="fedavg", *extra):
    r = runner.invoke(app, ["train", "--store", str(store), "--method", method, "--clients", "4", "--rounds", "2",
                            "--participation", "0.5", "--out", str(out), "--name", "r", "--quiet", *extra])  # fmt: skip
    assert r.exit_code == 0, r.output
    return out / "r"


def test_head_on_its_own_store_equals_the_final_accuracy_and_on_a_shifted_store_is_wx_plus_b(
    stores, tmp_path
):
    from safetensors.torch import load_file

    from fedfeat.methods import get_method
    from fedfeat.store.featurestore import FeatureStore

    a, b = stores
    run = _run(a, tmp_path, "fedavg", "--kernel", "torch")
    r = runner.invoke(
        app, ["eval", str(run), "--store", str(a), "--format", "json", "--out", str(tmp_path / "e")]
    )
    assert r.exit_code == 0, r.output
    res = json.loads(r.output)
    summary = json.loads((run / "summary.json").read_text())
    assert res["acc"] == summary["final_acc"]  # exactly: the engine's own prediction
    assert (tmp_path / "e" / "eval.json").is_file()
    assert list((tmp_path / "e").glob("*_zeroshot_classification.json"))
    assert load_results(tmp_path / "e")["confusion"].sum() == res["test_rows"]
    # the shifted store: accuracy of W x + b there, by hand
    res2 = json.loads(runner.invoke(app, ["eval", str(run), "--store", str(b), "--format", "json"]).output)
    st = FeatureStore.open(b)
    w = load_file(run / "weights.safetensors")
    x = np.asarray(st.features("test"), dtype=np.float32)
    y = np.asarray(st.labels("test"))
    keep = y >= 0
    scale = get_method("fedavg").p.logit_scale
    pred = (scale * (x[keep] @ w["W"].numpy().T + w["b"].numpy())).argmax(1)
    assert res2["acc"] == pytest.approx((pred == y[keep]).mean() * 100, abs=1e-9)
    K = len(st.class_names)
    assert len(res2["per_class_acc"]) == K
    conf = np.zeros((K, K))
    np.add.at(conf, (y[keep], pred), 1)
    tp = np.diag(conf)
    p = np.where(conf.sum(0) > 0, tp / np.maximum(conf.sum(0), 1), 0)
    r = np.where(conf.sum(1) > 0, tp / np.maximum(conf.sum(1), 1), 0)
    f1 = np.where(p + r > 0, 2 * p * r / np.where(p + r > 0, p + r, 1), 0)
    used = (conf.sum(0) > 0) | (conf.sum(1) > 0)
    assert res2["macro_f1"] == pytest.approx(100 * f1[used].mean(), abs=1e-9)
    np.testing.assert_allclose(res2["per_class_acc"], 100 * r, atol=1e-9)


def test_head_missing_a_target_class_is_one_line_and_zeroshot_evaluates(stores, tmp_path):
    a, _ = stores
    more = _synth(tmp_path / "k12.zarr", 3, "--classes", "12")
    run = _run(a, tmp_path / "h", "fedavg", "--kernel", "torch")
    bad = runner.invoke(app, ["eval", str(run), "--store", str(more)])
    assert bad.exit_code == 2 and "not among the run's classes" in bad.output
    assert len(bad.output.strip().splitlines()) == 1
    zs = _run(a, tmp_path / "z", "zeroshot")
    r = runner.invoke(app, ["eval", str(zs), "--store", str(a), "--format", "json"])
    assert r.exit_code == 0, r.output
    assert json.loads(r.output)["acc"] == json.loads((zs / "summary.json").read_text())["final_acc"]
    r = runner.invoke(
        app, ["eval", str(zs), "--store", str(more), "--format", "json"]
    )  # any classes: its text
    assert r.exit_code == 0 and len(json.loads(r.output)["per_class_acc"]) == 12, r.output


def test_base_to_novel_classes_and_a_missing_class_is_one_line(stores, tmp_path):
    from fedfeat.store.featurestore import FeatureStore

    a, _ = stores
    run = _run(a, tmp_path, "fedavg", "--kernel", "torch")
    names = list(FeatureStore.open(a).class_names)
    r = runner.invoke(
        app, ["eval", str(run), "--store", str(a), "--format", "json", "--classes", ",".join(names[:3])]
    )
    assert r.exit_code == 0, r.output
    res = json.loads(r.output)
    assert res["test_rows"] == 3 * 12 and res["classes"] == names[:3]
    bad = runner.invoke(app, ["eval", str(run), "--store", str(a), "--classes", "unicorn"])
    assert bad.exit_code == 2 and "unicorn" in bad.output and len(bad.output.strip().splitlines()) == 1


def test_adapter_fedclip_runs(stores, tmp_path):
    a, b = stores
    run = _run(a, tmp_path, "fedclip")
    r = runner.invoke(app, ["eval", str(run), "--store", str(b), "--format", "json"])
    assert r.exit_code == 0, r.output
    res = json.loads(r.output)
    own = json.loads(runner.invoke(app, ["eval", str(run), "--store", str(a), "--format", "json"]).output)
    assert own["acc"] == json.loads((run / "summary.json").read_text())["final_acc"]
    assert 0 <= res["acc"] <= 100


def test_prompt_promptfl_on_the_tiny_clip_store_runs(tmp_path):
    from helpers_clip import TINY_NAME, make_tiny_clip, run_cli, write_cifar10

    tc = make_tiny_clip(tmp_path / "clip")
    c10 = write_cifar10(tmp_path / "cifar-10-batches-py", n_train=60, n_test=20)
    args = ["encode", "--dataset", "cifar10", "--root", c10.root, "--backbone", tc.config, "--pretrained",
            tc.weights, "--out", tmp_path / "cache", "--device", "cpu", "--templates", "cifar"]  # fmt: skip
    assert run_cli(args).exit_code == 0
    store = tmp_path / "cache" / "cifar10" / f"{TINY_NAME}-tiny.zarr"
    r = run_cli(["train", "--method", "promptfl", "--store", store, "--rounds", "1", "--clients", "2",
                 "--set", "n_ctx=4", "--set", "batch_size=8", "--out", tmp_path / "runs", "--name", "p",
                 "--quiet"])  # fmt: skip
    assert r.exit_code == 0, r.output
    run = tmp_path / "runs" / "p"
    r = run_cli(["eval", run, "--store", store, "--format", "json"])
    assert r.exit_code == 0, r.output
    res = json.loads(r.output)
    assert res["acc"] == pytest.approx(json.loads((run / "summary.json").read_text())["final_acc"], abs=1e-6)

"""``fedfeat eval`` outputs a researcher can publish: one output per store (never a silent overwrite), another
evaluation replaced only with --overwrite, and unscored classes reported as missing, not as 0 % (issue 35)."""

import json

import numpy as np
import pytest
from typer.testing import CliRunner

from fedfeat.cli.app import app
from fedfeat.report.load import load_results

runner = CliRunner()


def _synth(out, seed):
    r = runner.invoke(app, ["synth", "--out", str(out), "--dim", "16", "--train-per-class", "30",
                            "--test-per-class", "12", "--templates", "2", "--no-stats", "--seed", str(seed)])  # fmt: skip
    assert r.exit_code == 0, r.output
    return out


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """Two stores with one file name in two dataset folders (as `encode` names an hf: and a wds: dataset encoded
    with one model), and a fedavg run on the first."""
    d = tmp_path_factory.mktemp("evp")
    a = _synth(d / "cache" / "cifar10" / "RN50-openai.zarr", 0)
    b = _synth(d / "cache" / "cifar10-wds" / "RN50-openai.zarr", 7)
    r = runner.invoke(app, ["train", "--store", str(a), "--method", "fedavg", "--clients", "4", "--rounds", "2",
                            "--participation", "0.5", "--kernel", "torch", "--out", str(d / "runs"), "--name", "r",
                            "--quiet"])  # fmt: skip
    assert r.exit_code == 0, r.output
    return a, b, d / "runs" / "r"


def _eval(run, store, *extra):
    return runner.invoke(app, ["eval", str(run), "--store", str(store), "--format", "json", *extra])


def _fingerprint(store):
    from fedfeat.store.featurestore import FeatureStore

    return FeatureStore.open(store).attrs["fingerprint_hash"]


def _names(store):
    from fedfeat.store.featurestore import FeatureStore

    return list(FeatureStore.open(store).class_names)


def test_two_stores_with_one_file_name_get_two_outputs(setup):
    a, b, run = setup
    ra, rb = _eval(run, a), _eval(run, b)
    assert ra.exit_code == 0 and rb.exit_code == 0, ra.output + rb.output
    oa, ob = json.loads(ra.output)["out"], json.loads(rb.output)["out"]
    assert oa != ob
    outs = sorted(p for p in run.iterdir() if p.name.startswith("eval-"))
    assert len(outs) == 2
    for out, store in ((oa, a), (ob, b)):  # each output still holds its own store's evaluation
        doc = json.loads((run / out.split("/")[-1] / "eval.json").read_text())
        assert doc["store_fingerprint"] == _fingerprint(store) and doc["store"] == str(store)
    assert _fingerprint(a) != _fingerprint(b)
    # the name says which store: its folder, its name and its fingerprint's first 8 hex digits
    assert oa.endswith(f"eval-cifar10-RN50-openai-{_fingerprint(a)[:8]}")
    assert ob.endswith(f"eval-cifar10-wds-RN50-openai-{_fingerprint(b)[:8]}")


def test_another_evaluation_is_replaced_only_with_overwrite(setup, tmp_path):
    a, b, run = setup
    out = tmp_path / "e"
    assert _eval(run, a, "--out", str(out)).exit_code == 0
    before = (out / "eval.json").read_text()
    bad = _eval(run, b, "--out", str(out))
    assert bad.exit_code != 0 and "--overwrite" in bad.output, bad.output
    assert len(bad.output.strip().splitlines()) == 1
    assert (out / "eval.json").read_text() == before  # untouched
    # the same evaluation again replaces its own output without a flag
    assert _eval(run, a, "--out", str(out)).exit_code == 0
    # --classes makes another evaluation too
    two = ",".join(_names(a)[:2])
    other = _eval(run, a, "--out", str(out), "--classes", two)
    assert other.exit_code != 0 and "already holds the evaluation of run" in other.output, other.output
    ok = _eval(run, b, "--out", str(out), "--overwrite")
    assert ok.exit_code == 0, ok.output
    assert json.loads((out / "eval.json").read_text())["store_fingerprint"] == _fingerprint(b)
    assert len(list(out.glob("*_zeroshot_classification.json"))) == 1


def test_a_run_directory_as_out_is_refused(setup):
    a, _, run = setup
    before = (run / "results.npz").read_bytes()
    for extra in ([], ["--overwrite"]):
        r = _eval(run, a, "--out", str(run), *extra)
        assert r.exit_code != 0 and "not an evaluation's" in r.output, r.output
    assert (run / "results.npz").read_bytes() == before and not (run / "eval.json").exists()


def test_unscored_classes_are_missing_not_zero_and_left_out_of_the_means(setup, tmp_path):
    """--classes with the first 3 classes: the other 7 have no test row. By hand: the head's prediction restricted
    to the 3 classes, each class's recall; the mean class accuracy is their mean."""
    from safetensors.torch import load_file

    from fedfeat.methods import get_method
    from fedfeat.store.featurestore import FeatureStore

    a, _, run = setup
    names = _names(a)[:3]
    st = FeatureStore.open(a)
    r = _eval(run, a, "--classes", ",".join(names), "--out", str(tmp_path / "e"))
    assert r.exit_code == 0, r.output
    res = json.loads(r.output)
    w = load_file(run / "weights.safetensors")
    x = np.asarray(st.features("test"), dtype=np.float32)
    y = np.asarray(st.labels("test"))
    keep = y < 3
    z = get_method("fedavg").p.logit_scale * (x[keep] @ w["W"].numpy()[:3].T + w["b"].numpy()[:3])
    pred, yk = z.argmax(1), y[keep]
    recall = [100 * float((pred[yk == c] == c).mean()) for c in range(3)]
    assert res["per_class_acc"][:3] == pytest.approx(recall, abs=1e-9)
    assert res["per_class_acc"][3:] == [None] * 7  # missing, not 0.0
    assert res["unscored_classes"] == 7 and res["scored_classes"] == 3
    assert res["mean_class_acc"] == pytest.approx(np.mean(recall), abs=1e-9)
    saved = json.loads((tmp_path / "e" / "eval.json").read_text())
    assert saved["per_class_acc"][3:] == [None] * 7  # valid JSON null, not NaN
    ca = load_results(tmp_path / "e")["class_acc"][0]
    assert np.isnan(ca[3:]).all() and ca[:3] == pytest.approx(recall, abs=1e-9)
    md = runner.invoke(app, ["eval", str(run), "--store", str(a), "--classes", ",".join(names), "--out",
                             str(tmp_path / "e")])  # fmt: skip
    assert md.exit_code == 0 and "7 class(es) have no test row here and are unscored" in md.output, md.output
    assert "3 scored of 10" in md.output

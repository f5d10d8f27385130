"""Eval and weights never score the wrong thing silently (issue 36): ``fedfeat eval`` checks the store it scores
against the run's recorded fingerprint and says which store it scored; it never writes into a run directory;
``weights.safetensors`` carries a digest (``summary.json``'s ``weights_sha256``) checked by eval and
``Run.weights()``; runs made before the digest existed are still refused non-finite or misshapen weights; eval's
device, truncated weights and a damaged ``results.npz`` (eval, ``fedfeat.load_results``, report) are one line."""

import hashlib
import json
import shutil
import zipfile

import numpy as np
import pytest
import torch
from test_eval import _synth  # the same small store
from typer.testing import CliRunner

from fedfeat.cli.app import app
from fedfeat.errors import FedfeatError

runner = CliRunner()


def _train(store, out, name="r", *extra, method="fedavg"):
    r = runner.invoke(app, ["train", "--store", str(store), "--method", method, "--kernel", "torch",
                            "--clients", "4", "--rounds", "2", "--participation", "0.5", "--out", str(out),
                            "--name", name, "--quiet", *extra])  # fmt: skip
    assert r.exit_code == 0, r.output
    return out / name


def _eval(run, *args):
    return runner.invoke(app, ["eval", str(run), "--format", "json", *map(str, args)])


def _fp(store) -> str:
    from fedfeat.store.featurestore import FeatureStore

    return FeatureStore.open(store).attrs["fingerprint_hash"]


def _one_line(r) -> str:
    assert r.exit_code != 0 and isinstance(r.exception, SystemExit), r.output  # an error, not a traceback
    lines = [x for x in r.output.strip().splitlines() if x.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:"), r.output
    return lines[0]


@pytest.fixture(scope="module")
def stores(tmp_path_factory):
    d = tmp_path_factory.mktemp("trust")
    return _synth(d / "a.zarr", 0), _synth(d / "b.zarr", 7)


@pytest.fixture(scope="module")
def run(stores, tmp_path_factory):
    """A finished fedavg run on store a (the run is not changed by the tests that use it)."""
    return _train(stores[0], tmp_path_factory.mktemp("run"))


def _copy_run(run, dest):
    shutil.copytree(run, dest)
    return dest


# ---------------------------------------------------------------------------------- 1. the store that is scored


def test_another_store_at_the_runs_recorded_path_is_refused_naming_both_fingerprints(stores, tmp_path):
    """A store replaced at the run's path (same class names, other features) scored 5.4 % as the run's "own test
    data" on b234b95; now eval refuses it, without --store and with --store equal to the recorded path."""
    a, b = stores
    place = shutil.copytree(a, tmp_path / "data" / "s.zarr")
    run = _train(place, tmp_path / "runs")
    final = json.loads((run / "summary.json").read_text())["final_acc"]
    ok = _eval(run)  # no --store: the run's own store, at its recorded path
    assert ok.exit_code == 0, ok.output
    res = json.loads(ok.output)
    assert res["acc"] == final and res["own_store"] is True
    assert res["store_fingerprint"] == res["run_store_fingerprint"] == _fp(a)
    shutil.rmtree(place)
    shutil.copytree(b, place)  # another store now sits at the run's recorded path
    for extra in ([], ["--store", place], ["--store", str(place) + "/"]):
        line = _one_line(_eval(run, *extra, "--out", tmp_path / "e"))
        assert _fp(a) in line and _fp(b) in line and "--store" in line and "--store-fingerprint" in line, line
    assert not (tmp_path / "e").exists()
    # the run's store given where it now is: scored as the run's own (its fingerprint is the recorded one)
    back = shutil.copytree(a, tmp_path / "moved.zarr")
    moved = _eval(run, "--store", back, "--out", tmp_path / "e2")
    assert moved.exit_code == 0, moved.output
    res = json.loads(moved.output)
    assert res["acc"] == final and res["own_store"] is True and res["store"] == str(back)
    # --store-fingerprint is checked too: a wrong one is refused naming both
    line = _one_line(_eval(run, "--store", back, "--store-fingerprint", _fp(b), "--out", tmp_path / "e3"))
    assert _fp(a) in line and _fp(b) in line, line


def test_a_head_is_not_mapped_by_the_class_names_of_a_store_that_replaced_the_runs(stores, tmp_path):
    """Domain shift onto store b while the run's path holds another store (its class order reversed): the head's
    rows cannot be mapped by that store's names -- refused, where b234b95 mapped them by the wrong names."""
    a, b = stores
    place = shutil.copytree(a, tmp_path / "s.zarr")
    run = _train(place, tmp_path / "runs")
    shutil.rmtree(place)
    other = _synth(tmp_path / "rev.zarr", 3, "--classes", "10")
    shutil.copytree(other, place)
    r = _eval(run, "--store", b, "--out", tmp_path / "e")
    line = _one_line(r)
    assert _fp(a) in line and str(place) in line and "class names" in line, line
    # even when the user vouches for the replacement at the recorded path, a head's rows stay unmapped
    line = _one_line(_eval(run, "--store-fingerprint", _fp(other), "--out", tmp_path / "e"))
    assert "class names" in line, line


def test_domain_shift_says_in_eval_json_which_store_was_scored(stores, run, tmp_path):
    a, b = stores
    r = _eval(run, "--store", b, "--out", tmp_path / "e")
    assert r.exit_code == 0, r.output
    doc = json.loads((tmp_path / "e" / "eval.json").read_text())
    assert doc["store"] == str(b) and doc["store_fingerprint"] == _fp(b)
    assert doc["run_store_fingerprint"] == _fp(a) and doc["own_store"] is False
    assert doc["run_store"].endswith("a.zarr")
    # the store's fingerprint given by the user must be the scored store's
    ok = _eval(run, "--store", b, "--store-fingerprint", _fp(b), "--out", tmp_path / "e", "--overwrite")
    assert ok.exit_code == 0, ok.output


# ------------------------------------------------------------------------------ 2. nothing written into a run


def test_out_that_is_the_run_or_another_run_is_refused_and_nothing_changes(stores, run, tmp_path):
    a, _ = stores
    other = _train(a, tmp_path / "o", "x")
    link = tmp_path / "link"
    link.symlink_to(run, target_is_directory=True)
    for target in (run, other, link):
        before = {p.name: p.read_bytes() for p in target.iterdir() if p.is_file()}
        for extra in ([], ["--overwrite"]):
            line = _one_line(_eval(run, "--store", a, "--out", target, *extra))
            assert "run" in line and "--out" in line, line
        assert {p.name: p.read_bytes() for p in target.iterdir() if p.is_file()} == before
        assert not (target / "eval.json").exists()
    # a folder that holds a run's summary.json only is a run directory too
    half = tmp_path / "half"
    half.mkdir()
    (half / "summary.json").write_text("{}")
    assert "summary.json" in _one_line(_eval(run, "--store", a, "--out", half))
    # the default output, a subfolder of the run, is the evaluation's own
    ok = _eval(run, "--store", a)
    assert ok.exit_code == 0, ok.output
    out = json.loads(ok.output)["out"]
    assert out.startswith(str(run) + "/eval-") and (run / "results.npz").is_file()


# ----------------------------------------------------------------------------------- 3. the weights' digest


def test_weights_digest_is_recorded_deterministic_and_names_nothing(stores, run, tmp_path):
    a, _ = stores
    s = json.loads((run / "summary.json").read_text())
    data = (run / "weights.safetensors").read_bytes()
    assert s["weights_sha256"] == hashlib.sha256(data).hexdigest()
    again = _train(
        a, tmp_path, "r"
    )  # the same command: the same bytes, the same digest (check_identity compares)
    s2 = json.loads((again / "summary.json").read_text())
    assert s2["weights_sha256"] == s["weights_sha256"] and s2["name"] == s["name"]
    zs = runner.invoke(app, ["train", "--store", str(a), "--method", "zeroshot", "--out", str(tmp_path), "--name",
                             "z", "--quiet"])  # fmt: skip
    assert zs.exit_code == 0, zs.output
    assert "weights_sha256" not in json.loads((tmp_path / "z" / "summary.json").read_text())


def _tamper(run_dir, how: str) -> None:
    """Change ``run_dir``'s weights: a flipped bit in the data, truncated, all NaN, or one class short."""
    from safetensors.torch import load_file, save_file

    p = run_dir / "weights.safetensors"
    if how == "bit":
        b = bytearray(p.read_bytes())
        b[-3] ^= 0x01  # a bit of the last tensor's data, not its header: still a valid safetensors file
        p.write_bytes(bytes(b))
    elif how == "truncated":
        p.write_bytes(p.read_bytes()[:-40])
    elif how == "nan":
        w = load_file(p)
        save_file({k: torch.full_like(v, float("nan")) for k, v in w.items()}, p)
    elif how == "short":
        w = load_file(p)
        save_file({k: v[:-1].contiguous() for k, v in w.items()}, p)


@pytest.mark.parametrize("how", ["bit", "truncated", "nan", "short"])
def test_changed_weights_are_refused_by_eval_and_run_weights(stores, run, tmp_path, how):
    from fedfeat import Run

    a, _ = stores
    r = _copy_run(run, tmp_path / "r")
    ok = _eval(r, "--store", a, "--out", tmp_path / "before")
    assert ok.exit_code == 0, ok.output
    _tamper(r, how)
    line = _one_line(_eval(r, "--store", a, "--out", tmp_path / "e"))
    assert "weights.safetensors of run" in line and "does not match its recorded digest" in line, line
    assert line.endswith("re-run the run"), line
    assert not (tmp_path / "e").exists()
    with pytest.raises(FedfeatError, match="does not match its recorded digest"):
        Run.load(r).weights()


@pytest.mark.parametrize(
    "how,said", [("truncated", "cannot read"), ("nan", "NaN or infinite"), ("short", "does not fit the run")]
)
def test_a_run_made_before_the_digest_is_read_but_bad_weights_are_refused(stores, run, tmp_path, how, said):
    """A run whose summary.json has no weights_sha256 (made before issue 36): intact weights are scored as before;
    truncated, non-finite or one-class-short weights are one line (b234b95 scored them: 0.4 %, 10.0 %, 45.6 %)."""
    from fedfeat import Run

    a, _ = stores
    r = _copy_run(run, tmp_path / "r")
    s = json.loads((r / "summary.json").read_text())
    del s["weights_sha256"]
    (r / "summary.json").write_text(json.dumps(s))
    ok = _eval(r, "--store", a, "--out", tmp_path / "before")
    assert ok.exit_code == 0, ok.output
    assert json.loads(ok.output)["acc"] == s["final_acc"]
    assert set(Run.load(r).weights()) == {"W", "b"}
    _tamper(r, how)
    line = _one_line(_eval(r, "--store", a, "--out", tmp_path / "e"))
    assert said in line and "weights.safetensors" in line and "re-run" in line, line
    with pytest.raises(FedfeatError, match=said):
        Run.load(r).weights()


def test_a_head_of_another_width_is_one_line(stores, run, tmp_path):
    """Store of another encoder (32-dimensional features): the head's width is named, not a matmul traceback."""
    c = _synth(tmp_path / "wide.zarr", 0, "--dim", "32")
    line = _one_line(_eval(run, "--store", c, "--out", tmp_path / "e"))
    assert (
        "32-dimensional features" in line and "head takes 16" in line and "encoded by the run's model" in line
    )


# ------------------------------------------------------------------------------ 4. one line, not a traceback


def test_eval_device_is_checked_as_train_checks_it(stores, run, tmp_path):
    a, _ = stores
    line = _one_line(_eval(run, "--store", a, "--device", "tpu", "--out", tmp_path / "e"))
    assert "unknown device 'tpu'" in line, line
    if not torch.cuda.is_available():
        line = _one_line(_eval(run, "--store", a, "--device", "cuda", "--out", tmp_path / "e"))
        assert "no CUDA device" in line, line
    assert not (tmp_path / "e").exists()


def _npz(path, **arrays):
    with open(path, "wb") as f:
        np.savez_compressed(f, **arrays)


GOOD = {
    "rounds": np.array([0, 2]),
    "class_acc": np.full((2, 3), 50.0),
    "confusion": np.eye(3, dtype=np.int64),
}
BAD = {
    "class_acc 1-D": {**GOOD, "class_acc": np.full(2, 50.0)},
    "class_acc rows": {**GOOD, "class_acc": np.full((3, 3), 50.0)},
    "confusion NaN": {**GOOD, "confusion": np.where(np.eye(3) > 0, np.nan, 0.0)},
    "confusion shape": {**GOOD, "confusion": np.eye(4, dtype=np.int64)},
    "negative count": {**GOOD, "confusion": -np.eye(3, dtype=np.int64)},
    "rounds float": {**GOOD, "rounds": np.array([0.0, 2.5])},
    "accuracy > 100": {**GOOD, "class_acc": np.full((2, 3), 250.0)},
    "client_acc rows": {**GOOD, "client_acc": np.full((1, 4), 50.0)},
    "no rounds": {k: v for k, v in GOOD.items() if k != "rounds"},
}


def _damage_zip(p, case: str) -> None:
    if case == "a .npy":  # one array, not a zip of them
        with open(p, "wb") as f:
            np.save(f, np.arange(3))
    elif case == "crc":  # a byte changed inside a compressed member
        _npz(p, **GOOD)
        b = bytearray(p.read_bytes())
        b[60] ^= 0xFF
        p.write_bytes(bytes(b))
    elif case == "not a zip":
        p.write_bytes(b"PK\x03\x04 not really a zip")
    else:  # a member that is no array
        with zipfile.ZipFile(p, "w") as z:
            z.writestr("rounds.npy", b"\x93NUMPY garbage")


@pytest.mark.parametrize("case", [*BAD, "zip"])
def test_a_damaged_results_npz_is_one_line_naming_it(tmp_path, case):
    import fedfeat

    p = tmp_path / "results.npz"
    for how in [case] if case in BAD else ["a .npy", "crc", "not a zip", "bad member"]:
        if case in BAD:
            _npz(p, **BAD[case])
        else:
            _damage_zip(p, how)
        with pytest.raises(FedfeatError) as e:
            fedfeat.load_results(tmp_path)
        msg = str(e.value)
        assert str(p) in msg and "\n" not in msg, (how, msg)
    _npz(p, **GOOD)
    got = fedfeat.load_results(tmp_path)
    assert got["class_acc"].shape == (2, 3) and got["confusion"].dtype == np.int64


def test_report_skips_the_per_client_column_of_a_run_with_a_damaged_results_npz(stores, tmp_path):
    a, _ = stores
    for seed in (0, 1):
        _train(a, tmp_path / "runs", f"s{seed}", "--seed", str(seed), "--local-test", "proportional")
    good = np.load(tmp_path / "runs" / "s0" / "results.npz")["client_acc"][-1]
    bad = tmp_path / "runs" / "s1" / "results.npz"
    arrays = dict(np.load(bad))
    _npz(bad, **{**arrays, "client_acc": arrays["client_acc"][-1]})  # 1-D: the wrong shape
    r = runner.invoke(app, ["report", str(tmp_path / "runs"), "--format", "csv"])
    assert r.exit_code == 0, r.output
    warns = [x for x in r.stderr.splitlines() if x.startswith("warning:")]
    assert len(warns) == 1 and str(bad) in warns[0], r.stderr
    lines = r.stdout.strip().splitlines()
    col = lines[0].split(",").index("worst-10% client acc")
    cells = {ln.split(",")[-1]: ln.split(",")[col] for ln in lines[1:]}
    assert cells["s1"] == "-"
    want = np.sort(good[~np.isnan(good)])[: max(1, int(np.ceil(0.1 * np.isfinite(good).sum())))].mean()
    assert float(cells["s0"]) == pytest.approx(want, abs=5e-3)
    # the per-client figure: the damaged run is left out with a warning, the other drawn
    fig = runner.invoke(app, ["report", str(tmp_path / "runs"), "--plot", str(tmp_path / "c.png"), "--kind",
                              "clients"])  # fmt: skip
    assert fig.exit_code == 0, fig.output
    assert (tmp_path / "c.png").stat().st_size > 0 and str(bad) in fig.stderr


@pytest.mark.parametrize("method", ["ccvr", "creff"])
def test_a_method_whose_prediction_needs_its_training_state_is_refused_not_scored(stores, tmp_path, method):
    """CCVR's evaluated head is the calibrated one, kept in ctx.state during training (and saved as W_cal, b_cal);
    eval's fresh state has none, so its predict falls back on the FedAvg head: b234b95 scored that (24.2 % on a
    run that ended at 54.2 %) as the run's model. Now refused in one line; a head method without such state
    (fedavg-tau-norm) is still scored exactly as the run ended."""
    a, _ = stores
    run = _train(a, tmp_path, method, "--set", "local_epochs=1", method=method)
    assert json.loads((run / "summary.json").read_text())["method"] == method
    line = _one_line(_eval(run, "--out", tmp_path / "e"))
    assert f"method {method} predicts from its training state" in line, line
    assert ("'calibrated'" if method == "ccvr" else "'crt'") in line, line
    assert not (tmp_path / "e").exists()
    tau = _train(a, tmp_path, "tau", method="fedavg-tau-norm")
    ok = _eval(tau, "--out", tmp_path / "t")
    assert ok.exit_code == 0, ok.output
    assert json.loads(ok.output)["acc"] == json.loads((tau / "summary.json").read_text())["final_acc"]

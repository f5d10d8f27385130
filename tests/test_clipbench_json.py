"""``fedfeat train --method zeroshot`` writes CLIP_benchmark's result JSON (``fedfeat.report.clipbench``).

The schema is CLIP_benchmark's (LAION-AI/CLIP_benchmark @ 48de38c): ``clip_benchmark/cli.py`` ``main_eval`` dumps
``{"dataset", "model", "pretrained", "task", "metrics", "language"}`` to ``{dataset}_{pretrained}_{model}_{language}_
{task}.json``; ``metrics/zeroshot_classification.py`` ``evaluate`` gives ``acc1``, ``acc5`` (fractions; NaN under 5
classes) and ``mean_per_class_recall`` (sklearn's ``balanced_accuracy_score``). The metrics are recomputed here by
hand from the store's features.
"""

import json
import math
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

import fedfeat
from fedfeat.cli.app import app
from fedfeat.report import clipbench
from fedfeat.store.featurestore import FeatureStore
from fedfeat.store.synth import SynthParams, write_synthetic_store

# CLIP_benchmark's dump (cli.py main_eval) and its zero-shot classification metrics (single-label datasets)
CLIPBENCH_KEYS = {
    "dataset": str,
    "model": str,
    "pretrained": str,
    "task": str,
    "metrics": dict,
    "language": str,
}
CLIPBENCH_METRICS = {"acc1", "acc5", "mean_per_class_recall"}
QUIET = lambda *_: None  # noqa: E731


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    p = SynthParams(classes=10, dim=32, train_per_class=30, test_per_class=20, templates=3)
    return write_synthetic_store(tmp_path_factory.mktemp("cb") / "s.zarr", p, stats=False, log=QUIET).path


def _hand(store_path, templates="first", split="test"):
    """CLIP_benchmark's numbers, by hand: cosine logits, top-1/top-5 hits, mean recall of the present classes."""
    st = FeatureStore.open(store_path)
    x = st.features(split).astype(np.float64)
    y = st.labels(split)
    x /= np.linalg.norm(x, axis=1, keepdims=True)
    t = st.text_features().astype(np.float64)
    t /= np.linalg.norm(t, axis=-1, keepdims=True)
    t = t[0] if templates == "first" else t.mean(0)
    t /= np.linalg.norm(t, axis=-1, keepdims=True)
    logits = x @ t.T  # [N, K]
    order = np.argsort(-logits, axis=1)
    acc1 = float(np.mean(order[:, 0] == y))
    acc5 = float(np.mean([yi in o[:5] for yi, o in zip(y, order)])) if t.shape[0] >= 5 else float("nan")
    recalls = [np.mean(order[y == c, 0] == c) for c in np.unique(y)]
    return {"acc1": acc1, "acc5": acc5, "mean_per_class_recall": float(np.mean(recalls))}


def _validate(doc: dict) -> None:
    """The document has CLIP_benchmark's keys and types, and ``clip_benchmark build`` can merge it."""
    assert set(doc) == set(CLIPBENCH_KEYS)
    for k, typ in CLIPBENCH_KEYS.items():
        assert isinstance(doc[k], typ), k
    assert doc["task"] == "zeroshot_classification" and doc["language"] == "en"
    assert set(doc["metrics"]) == CLIPBENCH_METRICS
    for v in doc["metrics"].values():
        assert isinstance(v, float) and (math.isnan(v) or 0.0 <= v <= 1.0)
    row = {**doc["metrics"], **doc}  # cli.py main_build's process_file
    del row["metrics"]
    row["model_fullname"] = row["model"] + " " + row["pretrained"]


def _close(doc_metrics: dict, want: dict) -> None:
    for k, v in want.items():
        got = doc_metrics[k]
        assert (math.isnan(v) and math.isnan(got)) or got == pytest.approx(v, abs=1e-9), (k, got, v)


def test_zeroshot_run_writes_clipbench_json(store, tmp_path):
    r = CliRunner().invoke(
        app,
        ["train", "--method", "zeroshot", "--store", str(store), "--clients", "5", "--rounds", "1",
         "--out", str(tmp_path), "--quiet"],
    )  # fmt: skip
    assert r.exit_code == 0, r.output
    (run,) = [p for p in tmp_path.iterdir() if p.is_dir()]
    name = "synthetic_none_synthetic_en_zeroshot_classification.json"  # {dataset}_{pretrained}_{model}_{lang}_{task}
    assert (run / name).is_file()
    assert json.loads((run / "summary.json").read_text())["clip_benchmark"] == name
    doc = json.loads((run / name).read_text())
    _validate(doc)
    assert (doc["dataset"], doc["model"], doc["pretrained"]) == ("synthetic", "synthetic", "none")
    want = _hand(store)
    _close(doc["metrics"], want)
    assert want["acc5"] > want["acc1"]  # the check is not vacuous
    final = json.loads((run / "summary.json").read_text())["final_acc"]
    assert doc["metrics"]["acc1"] == pytest.approx(
        final / 100, abs=1e-9
    )  # the run's own accuracy, as a fraction


def test_ensemble_dataset_name_and_open_vocab(store, tmp_path):
    """``templates=ensemble`` is CLIP_benchmark's classifier; ``benchmark_dataset`` names the dataset; an open-vocab
    partition (whose run evaluates a query set) still reports the whole test split over all classes."""
    run = fedfeat.train(
        method="zeroshot", store=str(store), partition="disjoint-classes", shots=5, clients=2, rounds=1,
        out=str(tmp_path), params={"templates": "ensemble", "benchmark_dataset": "wds/vtab/cifar10"},
    )  # fmt: skip
    name = "vtab_cifar10_none_synthetic_en_zeroshot_classification.json"
    assert run["clip_benchmark"] == name
    doc = json.loads((Path(run["path"]) / name).read_text())
    _validate(doc)
    assert doc["dataset"] == "wds/vtab/cifar10"  # as CLIP_benchmark's "dataset": its --dataset argument
    _close(doc["metrics"], _hand(store, templates="ensemble"))


def test_metrics_match_clip_benchmark_definitions():
    """Unbalanced targets (balanced accuracy != accuracy), a class never predicted, one absent from the targets."""
    rng = np.random.RandomState(0)
    logits = rng.randn(40, 6)
    y = np.array([0] * 20 + [1] * 10 + [2] * 5 + [3] * 3 + [4] * 2)  # class 5 absent
    logits[np.arange(30), y[:30]] += 2.0
    m = clipbench.metrics(logits, y)
    pred = logits.argmax(1)
    assert m["acc1"] == pytest.approx(np.mean(pred == y))
    top5 = np.argsort(-logits, 1)[:, :5]
    assert m["acc5"] == pytest.approx(np.mean((top5 == y[:, None]).any(1)))
    rec = [np.mean(pred[y == c] == c) for c in range(5)]  # sklearn: classes only in y_pred are dropped
    assert m["mean_per_class_recall"] == pytest.approx(np.mean(rec))
    assert m["mean_per_class_recall"] != pytest.approx(m["acc1"])
    few = clipbench.metrics(logits[:, :3], np.minimum(y, 2))  # < 5 classes: acc5 is NaN, as in CLIP_benchmark
    assert math.isnan(few["acc5"]) and not math.isnan(few["acc1"])


def test_filename_follows_clip_benchmark_pattern():
    doc = {"dataset": "wds/imagenet1k", "model": "ViT-B-32", "pretrained": "/ckpt/dir/epoch_32.pt",
           "task": "zeroshot_classification", "language": "en", "metrics": {}}  # fmt: skip
    assert clipbench.filename(doc) == "imagenet1k_epoch_32.pt_ViT-B-32_en_zeroshot_classification.json"
    doc.update(dataset="cifar10", pretrained="openai", model="RN50")
    assert clipbench.filename(doc) == "cifar10_openai_RN50_en_zeroshot_classification.json"

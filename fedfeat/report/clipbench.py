"""Zero-shot results in CLIP_benchmark's JSON schema, so fedfeat's numbers merge into CLIP_benchmark tables.

``fedfeat train --method zeroshot`` writes, beside ``summary.json``, one file named as CLIP_benchmark's default
``--output`` pattern ``{dataset}_{pretrained}_{model}_{language}_{task}.json`` (e.g.
``cifar10_openai_RN50_en_zeroshot_classification.json``), holding what ``clip_benchmark eval`` dumps::

    {"dataset": "cifar10", "model": "RN50", "pretrained": "openai", "task": "zeroshot_classification",
     "metrics": {"acc1": 0.716, "acc5": 0.968, "mean_per_class_recall": 0.716}, "language": "en"}

Source: ``LAION-AI/CLIP_benchmark`` @ 48de38c, ``clip_benchmark/cli.py`` (``main_eval``: the ``dump`` dict and the
output name; ``dataset`` there is the ``--dataset`` argument, the file name uses it with ``/`` made ``_``) and
``clip_benchmark/metrics/zeroshot_classification.py`` (``evaluate``): ``acc1``/``acc5`` are top-1/top-5 accuracy
as fractions in [0, 1] (``acc5`` is NaN when the dataset has fewer than 5 classes, as there: ``json.dump`` writes
it as ``NaN``, which ``json.load`` and ``clip_benchmark build`` read back), ``mean_per_class_recall`` is
scikit-learn's ``balanced_accuracy_score(target, pred)``: the mean over the classes present in the targets of
each class's recall. ``clip_benchmark build runs/*/*_zeroshot_classification.json --output benchmark.csv`` merges
these files with its own (name the files: given a directory, ``build`` would read ``summary.json`` too).

The metrics are computed from the run's zero-shot logits on the store's test split (all classes; the split's rows
with label -1 are left out, as in training). fedfeat's default prompt is the store's first template
(``--set templates=first``); CLIP_benchmark averages all the dataset's templates, which is
``--set templates=ensemble`` on a store encoded with its templates.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import torch

__all__ = ["KEYS", "METRIC_KEYS", "TASK", "filename", "metrics", "result", "write"]

TASK = "zeroshot_classification"
# CLIP_benchmark's dump, in its order
KEYS = ("dataset", "model", "pretrained", "task", "metrics", "language")
METRIC_KEYS = ("acc1", "acc5", "mean_per_class_recall")
LANGUAGE = "en"  # fedfeat's prompts are CLIP_benchmark's English templates


def metrics(logits, target, n_classes: int | None = None) -> dict:
    """CLIP_benchmark's zero-shot metrics of ``logits`` ``[N, K]`` for ``target`` ``[N]`` class ids.

    ``acc1``, ``acc5``: top-k accuracy as a fraction (``output.topk(5)`` as there; ``acc5`` NaN below 5 classes);
    ``mean_per_class_recall``: the mean recall of the classes present in ``target`` (``balanced_accuracy_score``).
    """
    logits = torch.as_tensor(logits).detach().float().cpu()
    target = torch.as_tensor(target).detach().long().cpu()
    K = logits.shape[1] if n_classes is None else n_classes
    n = len(target)
    top = logits.topk(min(5, logits.shape[1]), dim=1).indices  # [N, k]
    hit = top.eq(target[:, None])
    acc1 = float(hit[:, 0].sum()) / n
    acc5 = float(hit.any(1).sum()) / n if K >= 5 else float("nan")
    pred = logits.argmax(1)
    cnt = torch.bincount(target, minlength=K).double()
    ok = torch.bincount(target[pred == target], minlength=K).double()
    present = cnt > 0
    mpcr = float((ok[present] / cnt[present]).mean())
    return {"acc1": acc1, "acc5": acc5, "mean_per_class_recall": mpcr}


def dataset_name(store) -> str:
    """The dataset's name as CLIP_benchmark would say it: the store's ``dataset`` attribute (``encode``'s
    ``--dataset``), or for the generic readers (``imagefolder``, ``listfile``) the store's dataset directory, which
    ``encode`` names after the data's folder (``cache/<name>/<backbone>-<weights>.zarr``)."""
    ds = str(store.attrs.get("dataset") or "")
    if ds in ("", "imagefolder", "listfile"):
        parent = Path(str(store.path)).parent.name
        return parent or ds or "dataset"
    return ds


def result(store, logits: torch.Tensor, target: torch.Tensor, *, dataset: str | None = None) -> dict:
    """The JSON document CLIP_benchmark's ``eval`` writes, for a store's zero-shot ``logits`` on ``target``."""
    return {
        "dataset": dataset or dataset_name(store),
        "model": str(store.attrs.get("backbone")),
        "pretrained": str(store.attrs.get("pretrained")),
        "task": TASK,
        "metrics": metrics(logits, target, store.n_classes),
        "language": LANGUAGE,
    }


def _slug(s: str) -> str:
    return re.sub(r"[^A-Za-z0-9._+=-]+", "_", s).strip("_") or "x"


def filename(doc: dict) -> str:
    """CLIP_benchmark's default output name ``{dataset}_{pretrained}_{model}_{language}_{task}.json``: the dataset
    without a ``wds/`` prefix and with ``/`` as ``_``, the pretrained weights' file name when they are a path (its
    ``os.path.basename``); fedfeat also makes any other character unsafe in a file name ``_``."""
    ds = doc["dataset"].removeprefix("wds/").replace("/", "_")
    pretrained = os.path.basename(doc["pretrained"].rstrip("/")) or doc["pretrained"]
    parts = (ds, pretrained, doc["model"], doc["language"], doc["task"])
    return "_".join(_slug(p) for p in parts) + ".json"


def write(run_dir: str | Path, doc: dict) -> Path:
    """Write ``doc`` into ``run_dir`` under its CLIP_benchmark name (atomically); returns the path."""
    path = Path(run_dir) / filename(doc)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(doc))  # NaN stays NaN (acc5 below 5 classes), as CLIP_benchmark's json.dump
    os.replace(tmp, path)
    return path

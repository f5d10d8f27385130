"""``fedfeat eval RUN --store STORE``: a saved run's trained model evaluated on another store's test split.

The run's ``config.toml`` gives the method and its hyperparameters, ``weights.safetensors`` the trained parameters.
The target store's test split is scored with the method's own ``predict`` (the engine's evaluation), so a run
evaluated on its own store gives its final test accuracy exactly. Cases: the same classes on another store, domain
shift (same class names, other features), base -> novel (``classes``: a subset of the target's class names; the
prediction is the argmax over those classes only, over their test rows).

Class mapping, by class name: a linear head (``LinearHead``: fedavg, fedprox, ...) has one weight row per class of
the run's store; its rows are taken in the target's class order, and a target class the run never saw is a one-line
error. A method that predicts from the target store's class text features (adapters such as fedclip, prompts such
as promptfl / fedtpg) scores any class. Methods whose saved weights need their run's training state (per-client
prompts, server data) are refused where their ``predict`` cannot use the saved weights alone.

Output (``out``, default ``RUN/eval-<folder>-<store name>-<fingerprint>``: the folder holding the store -- the
dataset's folder in ``encode``'s layout ``cache/<dataset>/<backbone>-<weights>.zarr`` --, the store's name and the first
8 hex digits of its fingerprint hash, so two datasets encoded with one model, ``hf:`` and ``wds:`` stores both named
``RN50-openai.zarr``, get two outputs): ``eval.json`` (accuracy, per-class accuracy, mean class accuracy, macro F1,
the run, the store and its fingerprint), ``results.npz`` (``class_acc`` [1, K], ``confusion`` [K, K]; as a run's)
and the result in CLIP_benchmark's JSON (``fedfeat.report.clipbench``). ``eval.json`` is written last (atomically),
so an output without it is unfinished.

An output that holds another evaluation (another run, store fingerprint or ``classes``) is not replaced unless
``overwrite`` (``--overwrite``): a one-line error names the flag. The same evaluation made again replaces its own
output. A folder that holds anything else than an evaluation's files (a run directory given as ``--out``) is refused.

Unscored classes: a class with no test row here (outside ``classes``, or absent from the store's test split) has no
accuracy. It is ``null`` in ``eval.json``'s ``per_class_acc`` and NaN in ``results.npz``'s ``class_acc``, left out of
``mean_class_acc``, and counted in ``unscored_classes``. ``macro_f1`` averages over the classes in the targets or
the predictions (scikit-learn's ``f1_score(average="macro")``), so an unscored class enters it only where the model
predicted it (F1 0)."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import numpy as np
import torch

from fedfeat.errors import FedfeatError

# the files an evaluation writes (``evaluate_run``): an output folder holding only these (or nothing) is an
# evaluation's; a CLIP_benchmark file is named ``*_zeroshot_classification.json`` (``fedfeat.report.clipbench``)
EVAL_FILES = ("eval.json", "results.npz")
_CLIPBENCH_SUFFIX = "_zeroshot_classification.json"


def _is_eval_file(name: str) -> bool:
    return name in EVAL_FILES or name.endswith(_CLIPBENCH_SUFFIX) or (name.startswith(".") and ".tmp" in name)


def default_out(run: Path, store_path, fingerprint: str) -> Path:
    """``RUN/eval-<folder>-<store name>-<fingerprint[:8]>`` (module docstring): unique per store.

    Example::

        >>> default_out(Path("runs/r"), "cache/cifar10/RN50-openai.zarr", "0123456789abcdef")
        PosixPath('runs/r/eval-cifar10-RN50-openai-01234567')
    """
    p = Path(str(store_path).rstrip("/"))
    stem = p.name[: -len(".zarr")] if p.name.endswith(".zarr") else p.name
    parts = [x for x in (p.parent.name, stem, fingerprint[:8]) if x]
    return run / re.sub(r"[^A-Za-z0-9._+=-]+", "_", "eval-" + "-".join(parts))


def _check_dest(dest: Path, ident: dict, overwrite: bool) -> None:
    """Refuse to write into ``dest`` when it holds another evaluation (unless ``overwrite``) or anything that is not
    an evaluation's file; the same evaluation (``ident``) made again replaces its own output."""
    if not dest.exists():
        return
    if not dest.is_dir():
        raise FedfeatError(f"output {dest} is a file, not a directory; choose another --out")
    other = sorted(f.name for f in dest.iterdir() if not _is_eval_file(f.name))
    if other:
        raise FedfeatError(
            f"output {dest} holds files that are not an evaluation's ({', '.join(other[:3])}); choose another --out"
        )
    old = dest / "eval.json"
    if not old.is_file() or overwrite:
        return  # nothing finished there (an interrupted evaluation), or replacing it was asked for
    try:
        doc = json.loads(old.read_text())
        was = {k: doc.get(k) for k in ident}
    except (OSError, ValueError, AttributeError):
        doc, was = {}, None
    if was != ident:
        said = (
            "an unreadable eval.json"
            if was is None
            else f"the evaluation of run {doc.get('run')} on store {doc.get('store')} (fingerprint "
            f"{doc.get('store_fingerprint')}, {len(doc.get('classes') or [])} classes)"
        )
        raise FedfeatError(
            f"{dest} already holds {said}; pass --overwrite to replace it, or --out for another folder"
        )


def _clear(dest: Path) -> None:
    """Remove an earlier evaluation's files (``eval.json`` first: the folder never looks finished meanwhile)."""
    (dest / "eval.json").unlink(missing_ok=True)
    for f in dest.iterdir():
        if _is_eval_file(f.name) and f.is_file():
            f.unlink()


def evaluate_run(
    run: str | Path, store: str | Path, *, out: str | Path | None = None, classes: list[str] | None = None,
    device: str = "cpu", overwrite: bool = False,
) -> dict:  # fmt: skip
    """Evaluate run directory ``run``'s trained model on ``store``'s test split; writes ``out`` and returns the
    metrics (``eval.json``'s content). ``overwrite``: replace another evaluation already in ``out`` (module
    docstring)."""
    from safetensors.torch import load_file

    from fedfeat.engine.data import build_context, load_run_data
    from fedfeat.methods import get_method
    from fedfeat.methods.head import LinearHead
    from fedfeat.partition import make_partition
    from fedfeat.report import clipbench
    from fedfeat.runs.config import resolve_config
    from fedfeat.runs.writers import write_results
    from fedfeat.store.featurestore import FeatureStore

    run = Path(run)
    if not (run / "config.toml").is_file() or not (run / "summary.json").is_file():
        raise FedfeatError(f"{run} is not a finished run directory (needs config.toml and summary.json)")
    cfg = resolve_config({}, run / "config.toml", None)
    method = get_method(cfg.method, cfg.params)
    # as fedfeat.runs.train: a method that trains nothing (zeroshot) saves no weights; its model on the target
    # store is its init_global there (the target's class text features)
    trained = method.federated or method.centralized
    if trained and not (run / "weights.safetensors").is_file():
        raise FedfeatError(f"run {run} has no weights.safetensors: there is no trained model to evaluate")
    dev = torch.device(device)
    src = FeatureStore.open(cfg.store) if Path(str(cfg.store)).exists() else None
    st = FeatureStore.open(store)
    names = list(st.class_names)
    if classes:
        miss = [c for c in classes if c not in names]
        if miss:
            raise FedfeatError(
                f"--classes {', '.join(miss)} not in store {store}'s classes; choose among {names[:10]}"
            )
    from fedfeat.store.format import fingerprint_hash

    fp = str(st.attrs.get("fingerprint_hash") or fingerprint_hash(st.fingerprint))
    ident = {"run": str(run.resolve()), "store_fingerprint": fp, "classes": classes or names}
    dest = Path(out) if out is not None else default_out(run, store, fp)
    # before any work: a refused output costs nothing; inside the run (the default) the place names the run, which
    # may have moved since
    _check_dest(dest, ident if out is not None else {k: v for k, v in ident.items() if k != "run"}, overwrite)
    weights = {k: v.to(dev) for k, v in load_file(run / "weights.safetensors").items()} if trained else {}
    if trained and isinstance(
        method, LinearHead
    ):  # one weight row per class of the run's store: mapped by name
        run_names = list(src.class_names) if src is not None else None
        if run_names is None:
            raise FedfeatError(f"the run's store {cfg.store} is gone: its class names map the head's rows")
        want = classes or names
        missing = [c for c in want if c not in run_names]
        if missing:
            raise FedfeatError(
                f"class {missing[0]!r} of store {store} is not among the run's classes ({len(missing)} missing); "
                "a linear head predicts only the classes it was trained on: pass --classes with the shared ones"
            )
        idx = torch.tensor([run_names.index(c) if c in run_names else 0 for c in names], device=dev)
        weights = {k: (v[idx] if v.ndim and v.shape[0] == len(run_names) else v) for k, v in weights.items()}
    y_all = np.asarray(st.labels("train"))
    part = make_partition(y_all, "iid", clients=1)
    data = load_run_data(st, part, device=dev)
    if method.needs_live_text:
        from fedfeat.encoders.live import load_live_text

        data.live = load_live_text(st, device=dev, pretrained=cfg.pretrained)
    ctx = build_context(data, method, cfg.seed, dev)
    method.setup(ctx)
    if not trained:
        weights = method.init_global(ctx)
    with torch.no_grad():
        try:
            logits = method.predict(ctx, weights, ctx.test_x).float()
        except (KeyError, RuntimeError, FedfeatError) as e:
            raise FedfeatError(
                f"method {cfg.method}'s saved weights cannot score store {store} on their own ({e}); "
                "fedfeat eval takes linear heads, adapters and prompts"
            ) from None
    y = data.test_y
    K = len(names)
    keep = torch.ones_like(y, dtype=torch.bool)
    if classes:  # base -> novel: only these classes, their rows
        cls = torch.tensor([names.index(c) for c in classes], device=y.device)
        keep = torch.isin(y, cls)
        masked = torch.full_like(logits, float("-inf"))
        masked[:, cls] = logits[:, cls]
        logits = masked
    logits, y = logits[keep], y[keep]
    if not len(y):
        raise FedfeatError(
            f"store {store}'s test split has no row of the classes to score; pass --classes with classes it has "
            "test images of"
        )
    pred = logits.contiguous().argmax(1)
    conf = torch.bincount(y * K + pred, minlength=K * K).view(K, K).cpu().numpy().astype(np.int64)
    present = conf.sum(1) > 0  # the scored classes: those with a test row here
    scored = present | (conf.sum(0) > 0)  # macro F1's classes: in the targets or the predictions
    tp = np.diag(conf).astype(np.float64)
    prec = np.divide(tp, conf.sum(0), out=np.zeros(K), where=conf.sum(0) > 0)
    rec = np.divide(tp, conf.sum(1), out=np.zeros(K), where=present)
    f1 = np.divide(2 * prec * rec, prec + rec, out=np.zeros(K), where=(prec + rec) > 0)
    # an unscored class has no accuracy: null in eval.json, NaN in results.npz, not in any mean
    per_class = [100 * float(r) if ok else None for r, ok in zip(rec, present)]
    res = {
        "run": ident["run"],
        "method": cfg.method,
        "store": str(store),
        "store_fingerprint": fp,
        "classes": ident["classes"],
        "test_rows": int(len(y)),
        "acc": float((pred == y).double().mean()) * 100,
        "per_class_acc": per_class,
        "mean_class_acc": 100 * float(rec[present].mean()),  # over the scored classes (balanced accuracy)
        "scored_classes": int(present.sum()),
        "unscored_classes": int(K - present.sum()),
        # macro F1 over the classes in the targets or the predictions (scikit-learn's f1_score(average="macro"))
        "macro_f1": 100 * float(f1[scored].mean()),
    }
    dest.mkdir(parents=True, exist_ok=True)
    _clear(dest)
    rows = [
        {"round": 0, "test_acc": res["acc"], "per_class_acc": [np.nan if a is None else a for a in per_class]}
    ]
    write_results(dest, rows, conf)
    doc = clipbench.result(st, logits.cpu(), y.cpu())
    res["clip_benchmark"] = clipbench.write(dest, doc).name
    tmp = dest / ".eval.json.tmp"
    tmp.write_text(json.dumps(res, indent=1))
    os.replace(tmp, dest / "eval.json")  # last: an output without eval.json is unfinished
    res["out"] = str(dest)
    return res

"""``fedfeat eval RUN [--store STORE]``: a saved run's trained model evaluated on a store's test split.

The run's ``config.toml`` gives the method and its hyperparameters, ``weights.safetensors`` the trained parameters.
The target store's test split is scored with the method's own ``predict`` (the engine's evaluation), so a run
evaluated on its own store gives its final test accuracy exactly. Cases: the same classes on another store, domain
shift (same class names, other features), base -> novel (``classes``: a subset of the target's class names; the
prediction is the argmax over those classes only, over their test rows).

The store scored is checked (issue 36). Without ``store`` -- or with the run's recorded path -- it is the run's own
store, and its fingerprint must be the one the run recorded (``summary.json`` / ``config.toml``
``store_fingerprint``): another store that now sits at that path is a one-line error naming both fingerprints (pass
the run's store with ``--store``, or ``--store-fingerprint`` with the new store's to score it anyway).
``store_fingerprint`` (``--store-fingerprint``) asserts the scored store's fingerprint for any store. ``eval.json``
says what was scored: ``store`` and ``store_fingerprint``, beside the run's ``run_store`` and
``run_store_fingerprint``; ``own_store`` is true where the two fingerprints are equal.

The weights are read by ``fedfeat.runs.run.read_weights``: their bytes must match the sha256 the run recorded
(``summary.json``'s ``weights_sha256``); a run made before it did is read without the check, but non-finite weights
and a head whose shape is not the run's classes are refused. Every saved parameter must have the shape the method's
model has on the scored store (``init_global``): a head of another width (another encoder's store) is one line.

Class mapping, by class name: a linear head (``LinearHead``: fedavg, fedprox, ...) has one weight row per class of
the run's store; its rows are taken in the target's class order, and a target class the run never saw is a one-line
error. The run's class names come from a store with the run's recorded fingerprint: the scored store, else the
store at the run's recorded path -- another store there is refused (its names would map the rows wrongly). A
method that predicts from the target store's class text features (adapters such as fedclip, prompts such as
promptfl / fedtpg) scores any class. Methods whose saved weights need their run's training state (per-client
prompts, server data) are refused where their ``predict`` cannot use the saved weights alone: a ``predict`` that
reads ``ctx.state`` (ccvr's calibrated head, creff / clip2fl's re-trained one, fedopt / fedcopl's personal prompts)
is refused in one line, rather than scoring the fallback it would find there.

Output (``out``, default ``RUN/eval-<folder>-<store name>-<fingerprint>``: the folder holding the store -- the
dataset's folder in ``encode``'s layout ``cache/<dataset>/<backbone>-<weights>.zarr`` --, the store's name and the first
8 hex digits of its fingerprint hash, so two datasets encoded with one model, ``hf:`` and ``wds:`` stores both named
``RN50-openai.zarr``, get two outputs): ``eval.json`` (accuracy, per-class accuracy, mean class accuracy, macro F1,
the run, the store and its fingerprint), ``results.npz`` (``class_acc`` [1, K], ``confusion`` [K, K]; as a run's)
and the result in CLIP_benchmark's JSON (``fedfeat.report.clipbench``). ``eval.json`` is written last (atomically),
so an output without it is unfinished.

An output that holds another evaluation (another run, store fingerprint or ``classes``) is not replaced unless
``overwrite`` (``--overwrite``): a one-line error names the flag. The same evaluation made again replaces its own
output. A folder that holds anything else than an evaluation's files is refused, and so is an ``out`` that is the
run directory itself or any run directory (it holds a run's ``summary.json``, ``config.toml``, ...): nothing but a
run's own command writes into a run's files (the default ``RUN/eval-*`` subfolders are the evaluations' own).

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
WEIGHTS = "weights.safetensors"
# a run directory's own files (``fedfeat.runs.train``): an --out holding one is a run, never written into
RUN_FILES = (
    "summary.json",
    "config.toml",
    "metrics.jsonl",
    WEIGHTS,
    "checkpoint.safetensors",
    "partition.json",
)
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


def _same_store(a, b) -> bool:
    """Whether ``a`` and ``b`` name one store location (``canonical_store``: absolute paths, URLs as given)."""
    from fedfeat.store.urls import canonical_store

    try:
        return canonical_store(str(a)) == canonical_store(str(b))
    except (FedfeatError, OSError, ValueError):
        return str(a) == str(b)


def _refuse_run_dir(dest: Path, run: Path) -> None:
    """An ``--out`` that is the run itself or any run directory (finished or being written) is never written to:
    only a run's own command writes into its files (its ``eval-*`` subfolders are the evaluations' own)."""
    try:
        same = dest.resolve() == run.resolve()
    except (OSError, RuntimeError):  # a symlink loop: not the run, and _check_dest / mkdir say what it is
        same = False
    if same:
        raise FedfeatError(
            f"--out {dest} is the run directory {run}, whose files are not an evaluation's: an evaluation never "
            "writes into a run; leave --out out (RUN/eval-<store>-<fingerprint>) or choose another folder"
        )
    held = [f for f in RUN_FILES if os.path.lexists(dest / f)] if dest.is_dir() else []
    if held:
        raise FedfeatError(
            f"--out {dest} is a run directory (it holds {held[0]}, not an evaluation's file): an evaluation never "
            "writes into a run; choose another --out"
        )


def _fingerprint(st) -> str:
    from fedfeat.store.format import fingerprint_hash

    return str(st.attrs.get("fingerprint_hash") or fingerprint_hash(st.fingerprint))


def _head_class_names(run: Path, cfg, recorded: str | None, st, fp: str, own: bool) -> list[str]:
    """The class names of the run's store, in its order: a linear head's rows. From the scored store when it is
    the run's (its fingerprint is the recorded one), else from the store at the run's recorded path -- only when
    that is still the run's store (another store there would map the rows by the wrong names)."""
    from fedfeat.store.featurestore import FeatureStore

    if fp == recorded or (recorded is None and own):
        return list(st.class_names)
    try:
        src = FeatureStore.open(cfg.store)
    except FedfeatError:
        src = None
    if src is None:
        raise FedfeatError(
            f"the run's store {cfg.store} is gone or unreadable: its class names map the head's rows; put it back, "
            "or pass it with --store to score the run's own test data"
        )
    have = _fingerprint(src)
    if recorded is not None and have != recorded:
        raise FedfeatError(
            f"the store at run {run}'s recorded path {cfg.store} has fingerprint {have}, not the run's {recorded}: "
            "its class names cannot map the head's rows; put the run's store back at that path"
        )
    return list(src.class_names)


def _check_fit(run: Path, cfg, weights: dict, ref: dict, store) -> None:
    """The saved weights against the shapes of the method's model on the scored store (``init_global``): a key
    both have must have one shape (a head one class short, a prompt of another length, another encoder's width)."""
    for k, v in ref.items():
        w = weights.get(k)
        if w is not None and tuple(w.shape) != tuple(v.shape):
            raise FedfeatError(
                f"{WEIGHTS} of run {run} does not fit {cfg.method}'s model on store {store}: {k} is "
                f"{list(w.shape)}, the model needs {list(v.shape)}; score a store of the run's encoder, or re-run "
                "the run"
            )


def _record_state_reads(ctx) -> list:
    """Make ``ctx.state`` note every key read from it (returned list, filled as reads happen). The state a
    prediction reads is the run's training state, which eval does not restore: here it is unset or fresh from the
    set-up, so the prediction would be of another model than the run's final one (CCVR's uncalibrated head while
    the saved weights hold the calibrated one; FedOpt's initial local prompts)."""
    reads: list = []
    base = ctx.state

    class Recording(type(base)):
        __slots__ = ()

        def __getitem__(self, k):
            reads.append(k)
            return super().__getitem__(k)

        def get(self, k, default=None):
            reads.append(k)
            return super().get(k, default)

        def __contains__(self, k):
            reads.append(k)
            return super().__contains__(k)

    try:
        rec = Recording(
            getattr(base, "declared", None), getattr(base, "owner", ""), getattr(base, "where", "")
        )
    except TypeError:  # a plain dict (a Context made by hand)
        rec = Recording()
    dict.update(rec, base)
    ctx.state = rec
    return reads


def evaluate_run(
    run: str | Path, store: str | Path | None = None, *, out: str | Path | None = None,
    classes: list[str] | None = None, device: str = "cpu", overwrite: bool = False,
    store_fingerprint: str | None = None,
) -> dict:  # fmt: skip
    """Evaluate run directory ``run``'s trained model on ``store``'s test split (default: the run's own store, at
    its recorded path); writes ``out`` and returns the metrics (``eval.json``'s content). ``overwrite``: replace
    another evaluation already in ``out``; ``store_fingerprint``: the fingerprint the scored store must have
    (module docstring)."""
    from fedfeat.engine.data import build_context, load_run_data
    from fedfeat.engine.rounds import resolve_device
    from fedfeat.methods import get_method
    from fedfeat.methods.head import LinearHead
    from fedfeat.partition import make_partition
    from fedfeat.report import clipbench
    from fedfeat.report.load import load_run
    from fedfeat.runs.config import resolve_config
    from fedfeat.runs.run import read_weights, run_classes
    from fedfeat.runs.writers import write_results
    from fedfeat.store.featurestore import FeatureStore

    run = Path(run)
    if not (run / "config.toml").is_file() or not (run / "summary.json").is_file():
        raise FedfeatError(f"{run} is not a finished run directory (needs config.toml and summary.json)")
    summary, rows = load_run(run)  # a damaged summary.json / metrics.jsonl: one line
    cfg = resolve_config({}, run / "config.toml", None)
    dev = resolve_device(device)  # --device tpu, or cuda without a GPU: one line, before any work
    method = get_method(cfg.method, cfg.params)
    # as fedfeat.runs.train: a method that trains nothing (zeroshot) saves no weights; its model on the target
    # store is its init_global there (the target's class text features)
    trained = method.federated or method.centralized
    if trained and not os.path.lexists(run / WEIGHTS):
        raise FedfeatError(f"run {run} has no {WEIGHTS}: there is no trained model to evaluate")
    recorded = summary.get("store_fingerprint") or cfg.store_fingerprint  # the store the run was trained on
    if store is None:
        store = cfg.store
    own = _same_store(store, cfg.store)  # the run's own store, by its recorded path
    st = FeatureStore.open(store)
    fp = _fingerprint(st)
    want = store_fingerprint if store_fingerprint is not None else (recorded if own else None)
    if want is not None and fp != want:
        if store_fingerprint is not None:
            raise FedfeatError(
                f"store {store} has fingerprint {fp}, not {want} (--store-fingerprint); pass the store with that "
                "fingerprint, or drop --store-fingerprint"
            )
        raise FedfeatError(
            f"store {store} at run {run}'s recorded path has fingerprint {fp}, but the run was trained on a store "
            f"with fingerprint {recorded}: another store sits there now; pass the run's store with --store, or "
            f"--store-fingerprint {fp} to score this one anyway"
        )
    names = list(st.class_names)
    if classes:
        miss = [c for c in classes if c not in names]
        if miss:
            raise FedfeatError(
                f"--classes {', '.join(miss)} not in store {store}'s classes; choose among {names[:10]}"
            )
    ident = {"run": str(run.resolve()), "store_fingerprint": fp, "classes": classes or names}
    dest = Path(out) if out is not None else default_out(run, store, fp)
    if out is not None:
        _refuse_run_dir(dest, run)
    # before any work: a refused output costs nothing; inside the run (the default) the place names the run, which
    # may have moved since
    _check_dest(dest, ident if out is not None else {k: v for k, v in ident.items() if k != "run"}, overwrite)
    weights = {}
    # checked: against its recorded digest, or (older runs) finite; a head's shape against the run's classes
    if trained:
        weights = read_weights(run, summary, method=cfg.method, classes=run_classes(rows))
        weights = {k: v.to(dev) for k, v in weights.items()}
    # a linear head: one weight row per class of the run's store, mapped by name
    if trained and isinstance(method, LinearHead):
        run_names = _head_class_names(run, cfg, recorded, st, fp, own)
        if weights["W"].shape[0] != len(run_names):
            raise FedfeatError(
                f"{WEIGHTS} of run {run} has {weights['W'].shape[0]} class rows, its store {len(run_names)} "
                "classes; re-run the run"
            )
        if weights["W"].shape[1] != st.embed_dim:
            raise FedfeatError(
                f"store {store} has {st.embed_dim}-dimensional features, run {run}'s head takes "
                f"{weights['W'].shape[1]}: another encoder's store; score a store encoded by the run's model"
            )
        want_names = classes or names
        missing = [c for c in want_names if c not in run_names]
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
    ref = method.init_global(ctx)  # the model's parameters on this store: what the saved ones must fit
    if not trained:
        weights = ref
    _check_fit(run, cfg, weights, ref, store)
    reads = _record_state_reads(ctx)
    with torch.no_grad():
        try:
            logits = method.predict(ctx, weights, ctx.test_x).float()
        except (KeyError, RuntimeError, FedfeatError) as e:
            raise FedfeatError(
                f"method {cfg.method}'s saved weights cannot score store {store} on their own ({e}); "
                "fedfeat eval takes linear heads, adapters and prompts"
            ) from None
    # its prediction used state the run kept apart from its weights, unset or fresh here (ccvr: the calibrated
    # head, so the FedAvg head would be scored; fedopt: the clients' local prompts)
    if reads:
        raise FedfeatError(
            f"method {cfg.method} predicts from its training state (ctx.state[{reads[0]!r}]), which fedfeat eval "
            "does not restore from the saved weights: it would score another model than the run's final one; "
            "the run's own test accuracy is in its summary.json"
        )
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
        # the store the run was trained on: the scored one is the run's own when the fingerprints are equal
        "run_store": str(cfg.store),
        "run_store_fingerprint": recorded,
        "own_store": recorded is not None and fp == recorded,
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

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

Output (``out``, default ``RUN/eval-<store name>``): ``eval.json`` (accuracy, per-class accuracy, macro F1, the
confusion matrix's file, the run and store), ``results.npz`` (``class_acc`` [1, K], ``confusion`` [K, K]; as a run's)
and the result in CLIP_benchmark's JSON (``fedfeat.report.clipbench``)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

from fedfeat.errors import FedfeatError


def evaluate_run(
    run: str | Path, store: str | Path, *, out: str | Path | None = None, classes: list[str] | None = None,
    device: str = "cpu",
) -> dict:  # fmt: skip
    """Evaluate run directory ``run``'s trained model on ``store``'s test split; writes ``out`` and returns the
    metrics (``eval.json``'s content)."""
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
    pred = logits.contiguous().argmax(1)
    conf = torch.bincount(y * K + pred, minlength=K * K).view(K, K).cpu().numpy().astype(np.int64)
    present = conf.sum(1) > 0
    scored = present | (conf.sum(0) > 0)
    tp = np.diag(conf).astype(np.float64)
    prec = np.divide(tp, conf.sum(0), out=np.zeros(K), where=conf.sum(0) > 0)
    rec = np.divide(tp, conf.sum(1), out=np.zeros(K), where=present)
    f1 = np.divide(2 * prec * rec, prec + rec, out=np.zeros(K), where=(prec + rec) > 0)
    per_class = [100 * float(r) for r in rec]
    res = {
        "run": str(run),
        "method": cfg.method,
        "store": str(store),
        "classes": classes or names,
        "test_rows": int(len(y)),
        "acc": float((pred == y).double().mean()) * 100 if len(y) else 0.0,
        "per_class_acc": per_class,
        # macro F1 over the classes in the targets or the predictions (scikit-learn's f1_score(average="macro"))
        "macro_f1": 100 * float(f1[scored].mean()) if scored.any() else 0.0,
    }
    dest = Path(out) if out is not None else run / f"eval-{Path(str(store)).stem}"
    dest.mkdir(parents=True, exist_ok=True)
    write_results(dest, [{"round": 0, "test_acc": res["acc"], "per_class_acc": per_class}], conf)
    doc = clipbench.result(st, logits.cpu(), y.cpu())
    res["clip_benchmark"] = clipbench.write(dest, doc).name
    (dest / "eval.json").write_text(json.dumps(res, indent=1))
    res["out"] = str(dest)
    return res

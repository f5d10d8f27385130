"""Comparison tables and figures of runs: ``report`` (one row per run, or per setting over seeds with
``--seeds``), seed groups (mean ± sample std and n), ``--best`` selection, and the seed-band figure.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

import numpy as np

from fedfeat.errors import FedfeatError
from fedfeat.report.load import MEMORY_KEYS, collect_runs, unfinished_runs, worst_client_acc


def report(
    paths: list[Path],
    *,
    fmt: str = "markdown",
    plot: Path | None = None,
    all_runs: bool = False,
    seeds: bool = False,
    best: bool = False,
    warn=None,
    metric: str = "test_acc",
    size: str | None = None,
    kind: str = "curves",
    memory: bool = False,
) -> str:
    """A comparison table of finished runs (markdown or CSV) and, optionally, all their curves in one PNG.

    ``seeds``: one row per group of runs that differ only in ``--seed``: mean ± sample std (n - 1) and n.
    ``best``: per method, partition and store, only the settings with the best mean selection metric -- the
    validation accuracy (``val_acc``) where the runs record one, else the final test accuracy, said loudly in the
    table's first line (selecting on the test split is optimistic).

    A path is a run directory or a parent of run directories; hidden entries (runs being written, temporary
    files) are never read as runs. A run that cannot be read is skipped with a one-line warning (``warn``); the
    report fails only when no run is readable. ``all_runs`` adds the unfinished runs (interrupted or running).

    ``plot``: the figure of the reported runs (``seed_figure``: runs differing only in their seed drawn as one
    mean ± std curve; with ``best``, the selected settings only); ``kind`` curves (``metric`` per round) or clients
    (each client's accuracy, sorted); ``size`` one-column / two-column (print widths). ``best`` with ``fmt="json"``
    is one JSON object ``{"selection": <how the settings were selected>, "selected_on": "val_acc" | "final_acc",
    "groups": [...]}``; in markdown / CSV that sentence is the first line.

    ``memory``: the per-run table also shows each run's measured memory (summary.json's ``peak_rss_bytes``,
    ``rss_bytes_at_end``, ``peak_device_bytes``; see ``fedfeat.runs.train.memory_figures``) in GB, "-" where a run
    has none (made before they were recorded; no CUDA). The JSON output always has them (bytes)."""

    if fmt not in ("markdown", "csv", "json"):
        raise FedfeatError(f"unknown format '{fmt}'; choose markdown, csv or json")
    warn = warn or (lambda msg: print(msg, file=sys.stderr))
    problems: list[str] = []
    found, parents = collect_runs(paths, problems.append)
    runs = [(summary, rows, q) for (summary, rows), q in found]
    unfinished = unfinished_runs(parents) if all_runs else []
    if not runs and not unfinished:  # one line: the first reason stands for all
        why = ""
        if problems:
            why = f" ({problems[0]}" + (f"; and {len(problems) - 1} more" if len(problems) > 1 else "") + ")"
        raise FedfeatError(
            f"no readable finished runs in the given paths{why}; pass run directories or "
            "their parent (`--all` also lists unfinished runs)"
        )
    for msg in problems:
        warn(f"warning: {msg}")
    if not runs:
        return _unfinished_table(unfinished, fmt)
    if plot is not None:
        _check_figure_args(runs, metric, size, kind)
    known: dict = {}  # run directory -> its setting (config.toml read once)
    if best:
        runs, note, on = _best_settings(runs, known)
        if plot is not None:
            seed_figure(runs, plot, metric=metric, size=size, kind=kind, known=known)
        if fmt == "json":  # one valid JSON document: the selection rule is a field
            groups = json.loads(seed_table([s for s, _, _ in runs], fmt, _settings(runs, known)))
            return json.dumps({"selection": note, "selected_on": on, "groups": groups}, indent=1)
        return note + "\n\n" + seed_table([s for s, _, _ in runs], fmt, _settings(runs, known))
    if seeds:
        if plot is not None:
            seed_figure(runs, plot, metric=metric, size=size, kind=kind, known=known)
        return seed_table([s for s, _, _ in runs], fmt, _settings(runs, known))
    if plot is not None:  # before any return: --plot always writes its file
        seed_figure(runs, plot, metric=metric, size=size, kind=kind, known=known)
    if fmt == "json":  # the runs' summaries, plain numbers
        return json.dumps([{**s, "path": str(q)} for s, _, q in runs], indent=1)
    has_lt = any("many_acc" in s for s, _, _ in runs)
    has_pl = any(s.get("pseudo_label_acc") is not None for s, _, _ in runs)
    # "best acc" is the best evaluated round on the test split itself: labelled so; a run with a validation split
    # (--val-split, open vocabulary's query validation) also gets the test accuracy at its best validation round
    cols = ["method", "settings", "partition", "labels", "rounds", "round-0 acc", "final acc",
            "best acc (selected on test)"]  # fmt: skip
    has_val = any(s.get("test_acc_at_best_val") is not None for s, _, _ in runs)
    if has_val:
        cols += ["val acc", "test acc @ best val round"]
    if has_lt:
        cols += ["many", "medium", "few"]
    if has_pl:
        cols += ["pseudo-label acc"]
    ov_keys = ("novel_precision", "novel_recall", "novel_f1", "base_acc", "hm")
    has_ov = any("novel_f1" in s for s, _, _ in runs)
    if has_ov:  # open vocabulary: final acc is the novel accuracy
        cols += ["novel P", "novel R", "novel F1", "base acc", "HM"]
    has_local = any(s.get("local_acc") is not None for s, _, _ in runs)
    if has_local:  # --local-test: the mean of per-client accuracies on local test splits (FedCoPL)
        cols += ["local acc", "worst-10% client acc"]  # the latter from results.npz's client_acc
    cols += ["s/round", "MB up"]
    # --memory: the peak RSS column always, the others where some run has them
    mem_keys = [
        k for k in MEMORY_KEYS if k == "peak_rss_bytes" or any(s.get(k) is not None for s, _, _ in runs)
    ]
    mem_keys = mem_keys if memory else []
    if memory:
        names = {"peak_rss_bytes": "peak RSS (GB)", "rss_bytes_at_end": "RSS at end (GB)",
                 "peak_device_bytes": "peak device (GB)"}  # fmt: skip
        cols += [names[k] for k in mem_keys]
    rows = []
    for s, _m, q in runs:
        defaults = _method_defaults(s["method"])
        changed = {k: v for k, v in s["params"].items() if defaults.get(k, v) != v}
        row = [
            s["method"],
            " ".join(f"{k}={v}" for k, v in changed.items()) or "-",
            s["partition"],
            "yes" if s.get("uses_labels", True) else "no",
            str(s["rounds"]),
            f"{s['initial_acc']:.2f}",
            f"{s['final_acc']:.2f}",
            f"{s['best_acc']:.2f}",
        ]
        if has_val:
            row += [_fmt(s.get("val_acc")), _fmt(s.get("test_acc_at_best_val"))]
        if has_lt:
            row += [_fmt(s.get(k)) for k in ("many_acc", "medium_acc", "few_acc")]
        if has_pl:
            row += [_fmt(s.get("pseudo_label_acc"))]
        if has_ov:
            row += [_fmt(s.get(k)) for k in ov_keys]
        if has_local:
            row += [_fmt(s.get("local_acc")), _fmt(worst_client_acc(q))]
        row += [f"{s['seconds_per_round']:.3f}", f"{s['bytes_up'] / 1e6:.1f}"]
        row += ["-" if s.get(k) is None else f"{s[k] / 1e9:.2f}" for k in mem_keys]
        rows.append(row)
    text = _table(cols, rows, fmt)
    return text + ("\n\n" + _unfinished_table(unfinished, fmt) if unfinished else "")


def _table(cols: list[str], rows: list[list[str]], fmt: str) -> str:
    """Markdown or CSV."""
    if fmt == "csv":
        import csv
        import io

        buf = io.StringIO()
        csv.writer(buf).writerows([cols, *rows])
        return buf.getvalue()
    out = ["| " + " | ".join(cols) + " |", "|" + "|".join("---" for _ in cols) + "|"]
    return "\n".join(out + ["| " + " | ".join(r) + " |" for r in rows])


def _unfinished_table(rows: list[dict], fmt: str) -> str:
    cols = ["unfinished run", "method", "state", "rounds recorded", "checkpoint", "resume with"]
    cells = [
        [r["name"], str(r["method"]), r["state"], f"{r['recorded']}/{r['rounds']}",
         "-" if r["checkpoint"] is None else f"round {r['checkpoint']}", f"fedfeat train --resume {r['path']}"]
        for r in rows
    ]  # fmt: skip
    return _table(cols, cells, fmt)


SEED_METRICS = {"final_acc": "final acc", "best_acc": "best acc (selected on test)", "val_acc": "val acc",
                "test_acc_at_best_val": "test acc @ best val round", "novel_precision": "novel P",
                "novel_recall": "novel R", "novel_f1": "novel F1", "base_acc": "base acc", "hm": "HM",
                "many_acc": "many", "medium_acc": "medium", "few_acc": "few",
                "pseudo_label_acc": "pseudo-label acc", "local_acc": "local acc"}  # fmt: skip


def _settings(runs: list, known: dict | None = None) -> list[dict]:
    """Each run's setting from its directory's config.toml (``fedfeat.report.load.run_settings``); ``known``
    (run directory -> setting) keeps what one report has read, so each config.toml is read once."""
    from fedfeat.report.load import run_settings

    known = {} if known is None else known
    out = []
    for r in runs:  # (summary, rows, run dir); without a dir, the summary's keys
        q = r[2] if len(r) > 2 else None
        if q is None:
            out.append(run_settings(r[0]))
            continue
        if q not in known:
            known[q] = run_settings(r[0], q)
        out.append(known[q])
    return out


def _best_settings(runs: list, known: dict | None = None) -> tuple[list, str, str]:
    """Keep, among the runs that agree on every setting but their hyperparameters and seed (the run specification's
    seed-table settings, ``fedfeat.spec.group_items``, without ``params.*``), the runs of the hyperparameters whose
    mean selection metric is highest."""
    metric = "val_acc" if runs and all(s.get("val_acc") is not None for s, _, _ in runs) else "final_acc"
    by_group: dict[tuple, dict[str, list]] = {}
    for r, items in zip(runs, _settings(runs, known)):
        s = r[0]
        defaults = _method_defaults(s["method"])
        changed = " ".join(f"{k}={v}" for k, v in s["params"].items() if defaults.get(k, v) != v) or "-"
        outer = tuple((k, repr(v)) for k, v in items.items() if not k.startswith("params."))
        by_group.setdefault(outer, {}).setdefault(changed, []).append(r)
    kept = []
    for settings in by_group.values():
        kept += max(settings.values(), key=lambda rs: float(np.mean([r[0][metric] for r in rs])))
    note = (
        "best settings selected on the validation accuracy (val_acc)"
        if metric == "val_acc"
        else "best settings selected on the TEST split's final accuracy (these runs record no validation "
        "accuracy): optimistic, do not report it as a held-out result"
    )
    return kept, note, metric


FIGURE_KINDS = ("curves", "clients")


def _curve_keys(runs) -> list[str]:
    """The per-round numeric values the runs' metrics.jsonl rows record (``--metric``'s choices)."""
    keys: dict = {}
    for r in runs:
        for row in r[1]:
            for k, v in row.items():
                if k != "round" and isinstance(v, (int, float)) and not isinstance(v, bool):
                    keys[k] = None
    skip = ("bytes_up", "bytes_down", "seconds", "train_seconds", "train_loss")
    return [k for k in keys if k not in skip] + [k for k in skip if k in keys]


def _check_figure_args(runs, metric: str, size: str | None, kind: str) -> None:
    """Refuse a bad ``--kind`` / ``--size`` / ``--metric`` before anything is drawn (one line each)."""
    from fedfeat.report.plots import SIZES

    if kind not in FIGURE_KINDS:
        raise FedfeatError(f"unknown --kind '{kind}'; choose {' or '.join(FIGURE_KINDS)}")
    if size is not None and size not in SIZES:
        raise FedfeatError(f"unknown --size '{size}'; choose one-column or two-column")
    if kind == "curves" and not any(row.get(metric) is not None for r in runs for row in r[1]):
        hint = " (final_acc / best_acc are the last / best point of test_acc's curve)" if metric in (
            "final_acc", "best_acc") else ""  # fmt: skip
        raise FedfeatError(
            f"--metric {metric}: no run records it per round{hint}; choose one of "
            f"{', '.join(_curve_keys(runs)) or 'test_acc'}"
        )


_ZS_CACHE: dict = {}


def store_zeroshot(store_path) -> float | None:
    """CLIP zero-shot top-1 accuracy (%) on a store's test split, from its cached features: argmax over classes of
    cos(image, text) with the first prompt template -- ``zeroshot``'s default (``templates="first"``), label -1 rows
    left out. Computed once per store and process (nothing written); None when the store cannot be read or has
    no test split."""
    key = str(store_path)
    if key in _ZS_CACHE:
        return _ZS_CACHE[key]
    from fedfeat.store.featurestore import FeatureStore

    acc = None
    try:
        st = FeatureStore.open(store_path, mode="r")
        if "test" in st.splits:
            y = st.labels("test")
            keep = y >= 0
            x = st.features("test")[keep].astype(np.float32)
            t = st.text_features()[0].astype(np.float32)  # [K, D]: the first template
            x /= np.maximum(np.linalg.norm(x, axis=1, keepdims=True), 1e-12)
            t /= np.maximum(np.linalg.norm(t, axis=1, keepdims=True), 1e-12)
            if keep.any():
                acc = float(np.mean((x @ t.T).argmax(1) == y[keep]) * 100.0)
    except (FedfeatError, OSError, ValueError, KeyError):  # moved / unreadable store: no line
        acc = None
    _ZS_CACHE[key] = acc
    return acc


def _zeroshot_reference(zs, others, metric: str) -> dict | None:
    """``{partition: zero-shot accuracy}`` for the test-accuracy figure: a ``zeroshot`` run's final accuracy where
    the set has one for that partition, else the store's (``store_zeroshot``) when the panel's runs read one store
    and are not open-vocabulary (their test accuracy is on novel classes only)."""
    if metric != "test_acc":
        return None
    ref = {r[0]["partition"]: r[0]["final_acc"] for r in zs}
    stores: dict = {}
    for r in others:
        s = r[0]
        stores.setdefault(s["partition"], set()).add(
            None if "novel_f1" in s or s.get("store") is None else str(s["store"])
        )
    for part, ss in stores.items():
        if part not in ref and len(ss) == 1 and None not in ss:
            v = store_zeroshot(next(iter(ss)))
            if v is not None:
                ref[part] = v
    return ref or None


def seed_figure(
    runs: list[tuple],
    path: Path,
    *,
    metric: str = "test_acc",
    size: str | None = None,
    kind: str = "curves",
    known: dict | None = None,
) -> None:
    """A paper's figure of seed-grouped runs (``runs``: ``(summary, metrics rows[, run dir])``): one panel per
    partition (readable titles), each setting's mean curve of ``metric`` (a per-round value of metrics.jsonl)
    with a ± std band over its seeds (``fedfeat.report.plots.plot_seed_curves``), labelled like the seed table
    (the method and its settings that differ from the method's defaults; defaults unlabelled), one legend for the
    figure, the zero-shot level as a dashed line (``_zeroshot_reference``: the ``zeroshot`` runs, which are not
    drawn as curves, else the store's own zero-shot accuracy); long-tailed runs add rows of panels for many /
    medium / few. ``kind="clients"``: each client's accuracy at the last evaluated round, sorted
    (``results.npz``'s ``client_acc``; run directories needed)."""
    from fedfeat.report.plots import plot_clients, plot_seed_curves

    _check_figure_args(runs, metric, size, kind)
    zs = [r for r in runs if r[0]["method"] == "zeroshot"]
    others = [r for r in runs if r[0]["method"] != "zeroshot"] or zs
    grouped: dict[tuple, list] = {}
    for r in others:
        s = r[0]
        defaults = _method_defaults(s["method"])
        changed = " ".join(f"{k}={v}" for k, v in s["params"].items() if defaults.get(k, v) != v)
        items = tuple((k, repr(v)) for k, v in _settings([r], known)[0].items())
        key = (s["method"] + (f" {changed}" if changed else ""), s["partition"], items)
        grouped.setdefault(key, []).append(r)
    if kind == "clients":
        from fedfeat.report.load import load_results

        groups = []
        for (label, panel, _), rs in grouped.items():
            accs = [load_results(r[2]).get("client_acc") if len(r) > 2 else None for r in rs]
            accs = [a[-1] for a in accs if a is not None and len(a)]
            if accs:
                groups.append({"label": label, "panel": panel, "acc": accs})
        if not groups:
            raise FedfeatError(
                "--kind clients: no run has per-client results (RUN/results.npz client_acc); train with --local-test"
            )
        plot_clients(groups, path, size=size)
        return
    metrics = [metric]
    if metric == "test_acc" and any("many_acc" in r[0] for r in others):
        metrics += ["many_acc", "medium_acc", "few_acc"]
    groups = []
    for (label, panel, _), rs in grouped.items():
        ms = [r[1] for r in rs]
        rounds = sorted(set.intersection(*[{r["round"] for r in m if r.get(metric) is not None} for m in ms]))
        if not rounds:
            continue
        by_round = [{r["round"]: r for r in m} for m in ms]
        runs_of = {k: [[br[r].get(k) for r in rounds] for br in by_round] for k in metrics}
        groups.append({"label": label, "panel": panel, "rounds": rounds,
                       "runs": runs_of[metric] if len(metrics) == 1 else runs_of})  # fmt: skip
    reference = _zeroshot_reference(zs if others is not zs else [], others, metric)
    plot_seed_curves(
        groups, path, reference=reference, metric=metrics[0] if len(metrics) == 1 else metrics, size=size
    )


def seed_groups(summaries: list[dict], settings: list[dict] | None = None) -> list[dict]:
    """Runs grouped by everything but the seed, each with every metric's mean, sample standard deviation (n - 1;
    None for one run) and n. ``settings``: each run's setting (``fedfeat.report.load.run_settings``, from its
    config.toml: every setting the run specification groups by); default: what the summaries hold."""
    from fedfeat.report.load import run_settings

    settings = settings if settings is not None else [run_settings(s) for s in summaries]
    groups: dict[tuple, list[dict]] = {}
    for s, items in zip(summaries, settings):
        defaults = _method_defaults(s["method"])
        changed = " ".join(f"{k}={v}" for k, v in s["params"].items() if defaults.get(k, v) != v) or "-"
        groups.setdefault(tuple((k, repr(v)) for k, v in items.items()), []).append((s, changed))
    metrics = [k for k in SEED_METRICS if any(s.get(k) is not None for s in summaries)]
    out = []
    for members in groups.values():
        ss = [s for s, _ in members]
        s0, changed = members[0]  # what the table shows of the group: its first run's
        g = {"method": s0["method"], "settings": changed, "store": Path(str(s0.get("store", ""))).name,
             "store_fingerprint": s0.get("store_fingerprint"), "partition": s0["partition"], "rounds": s0["rounds"],
             "clients": s0.get("clients"), "participation": s0.get("participation"),
             "n": len(ss), "seeds": [s["seed"] for s in ss], "metrics": {}}  # fmt: skip
        for k in metrics:
            v = np.array([s[k] for s in ss if s.get(k) is not None], dtype=np.float64)
            g["metrics"][k] = (
                {"mean": float(v.mean()), "std": float(v.std(ddof=1)) if len(v) > 1 else None, "n": len(v)}
                if len(v)
                else None
            )
        out.append(g)
    return out


def seed_table(summaries: list[dict], fmt: str = "markdown", settings: list[dict] | None = None) -> str:
    """``seed_groups`` as a table: each metric as mean ± sample standard deviation over the group's seeds, with n
    (markdown, CSV) or as JSON with plain numbers."""
    groups = seed_groups(summaries, settings)
    if fmt == "json":
        return json.dumps(groups, indent=1)
    metrics = [k for k in SEED_METRICS if any(g["metrics"].get(k) for g in groups)]
    cols = ["method", "settings", "store", "partition", "rounds", "n", "seeds"] + [
        SEED_METRICS[k] for k in metrics
    ]
    rows = []
    for g in groups:
        row = [g["method"], g["settings"], g["store"], g["partition"], str(g["rounds"]), str(g["n"]),
               ",".join(map(str, g["seeds"]))]  # fmt: skip
        for k in metrics:
            m = g["metrics"].get(k)
            row.append(
                "-"
                if m is None
                else f"{m['mean']:.2f} ± {m['std']:.2f}"
                if m["n"] > 1
                else f"{m['mean']:.2f}"
            )
        rows.append(row)
    return _table(cols, rows, fmt)


def _fmt(v) -> str:
    return "-" if v is None else f"{v:.2f}"


def _method_defaults(name: str) -> dict:
    from fedfeat.methods import REGISTRY

    cls = REGISTRY.get(name)
    return dataclasses.asdict(cls.Params()) if cls else {}

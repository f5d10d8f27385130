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
from fedfeat.report.load import collect_runs, unfinished_runs


def report(
    paths: list[Path],
    *,
    fmt: str = "markdown",
    plot: Path | None = None,
    all_runs: bool = False,
    seeds: bool = False,
    best: bool = False,
    warn=None,
) -> str:
    """A comparison table of finished runs (markdown or CSV) and, optionally, all their curves in one PNG.

    ``seeds``: one row per group of runs that differ only in ``--seed``: mean ± sample std (n - 1) and n.
    ``best``: per method, partition and store, only the settings with the best mean selection metric -- the
    validation accuracy (``val_acc``) where the runs record one, else the final test accuracy, said loudly in the
    table's first line (selecting on the test split is optimistic).

    A path is a run directory or a parent of run directories; hidden entries (runs being written, temporary
    files) are never read as runs. A run that cannot be read is skipped with a one-line warning (``warn``); the
    report fails only when no run is readable. ``all_runs`` adds the unfinished runs (interrupted or running)."""
    from fedfeat.report.plots import plot_curves

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
    if best:
        runs, note = _best_settings(runs)
        return note + "\n\n" + seed_table([s for s, _, _ in runs], fmt)
    if seeds:
        if plot is not None:
            seed_figure([(s, m) for s, m, _ in runs], plot)
        return seed_table([s for s, _, _ in runs], fmt)
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
        cols += ["local acc"]
    cols += ["s/round", "MB up"]
    rows = []
    for s, _m, _ in runs:
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
            row += [_fmt(s.get("local_acc"))]
        row += [f"{s['seconds_per_round']:.3f}", f"{s['bytes_up'] / 1e6:.1f}"]
        rows.append(row)
    if plot is not None:
        curves = {}
        for (s, m, p), row in zip(runs, rows):
            label = f"{s['method']}" + (f" [{row[1]}]" if row[1] != "-" else "") + f" | {s['partition']}"
            if label in curves:
                label += f" ({Path(p).name[-24:]})"
            m = [r for r in m if r["test_acc"] is not None]
            curves[label] = ([r["round"] for r in m], [r["test_acc"] for r in m])
        plot_curves(curves, plot, title="test accuracy")
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


def _best_settings(runs: list) -> tuple[list, str]:
    """Keep, per (method, partition, store, rounds, clients, participation), the runs of the settings group whose
    mean selection metric is highest."""
    metric = "val_acc" if runs and all(s.get("val_acc") is not None for s, _, _ in runs) else "final_acc"
    by_group: dict[tuple, dict[str, list]] = {}
    for r in runs:
        s = r[0]
        defaults = _method_defaults(s["method"])
        changed = " ".join(f"{k}={v}" for k, v in s["params"].items() if defaults.get(k, v) != v) or "-"
        outer = (s["method"], s["partition"], s.get("store_fingerprint"), s["rounds"], s.get("clients"),
                 s.get("participation"))  # fmt: skip
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
    return kept, note


def seed_figure(runs: list[tuple[dict, list[dict]]], path: Path) -> None:
    """A paper's figure of seed-grouped runs: one panel per partition, each setting's mean curve with a ± std band
    over its seeds (``fedfeat.report.plots.plot_seed_curves``), labelled like the seed table (the method and its settings
    that differ from the method's defaults), the zero-shot level as a dashed line (from the ``zeroshot`` runs, which
    are not drawn as curves); long-tailed runs add rows of panels for many / medium / few."""
    from fedfeat.report.plots import plot_seed_curves

    zs = [(s, m) for s, m in runs if s["method"] == "zeroshot"]
    others = [(s, m) for s, m in runs if s["method"] != "zeroshot"] or zs
    reference = {s["partition"]: s["final_acc"] for s, _ in zs} if zs and others is not zs else None
    metrics = ["test_acc"]
    if any("many_acc" in s for s, _ in others):
        metrics += ["many_acc", "medium_acc", "few_acc"]
    grouped: dict[tuple, list] = {}
    for s, m in others:
        defaults = _method_defaults(s["method"])
        changed = " ".join(f"{k}={v}" for k, v in s["params"].items() if defaults.get(k, v) != v)
        key = (s["method"] + (f" {changed}" if changed else ""), s["partition"], s.get("store_fingerprint"),
               s["rounds"])  # fmt: skip
        grouped.setdefault(key, []).append(m)
    groups = []
    for (label, panel, _, _), ms in grouped.items():
        rounds = sorted(
            set.intersection(*[{r["round"] for r in m if r.get("test_acc") is not None} for m in ms])
        )
        by_round = [{r["round"]: r for r in m} for m in ms]
        runs_of = {k: [[br[r].get(k) for r in rounds] for br in by_round] for k in metrics}
        groups.append({"label": label, "panel": panel, "rounds": rounds,
                       "runs": runs_of["test_acc"] if len(metrics) == 1 else runs_of})  # fmt: skip
    plot_seed_curves(groups, path, reference=reference, metric=metrics[0] if len(metrics) == 1 else metrics)


def seed_groups(summaries: list[dict]) -> list[dict]:
    """Runs grouped by everything but the seed (method, settings, store, partition, rounds, clients,
    participation), each with every metric's mean, sample standard deviation (n - 1; None for one run) and n."""
    groups: dict[tuple, list[dict]] = {}
    for s in summaries:
        defaults = _method_defaults(s["method"])
        changed = " ".join(f"{k}={v}" for k, v in s["params"].items() if defaults.get(k, v) != v) or "-"
        key = (s["method"], changed, s["partition"], s.get("store_fingerprint"), s["rounds"], s.get("clients"),
               s.get("participation"), Path(str(s.get("store", ""))).name)  # fmt: skip
        groups.setdefault(key, []).append(s)
    metrics = [k for k in SEED_METRICS if any(s.get(k) is not None for s in summaries)]
    out = []
    for key, ss in groups.items():
        g = {"method": key[0], "settings": key[1], "store": key[7], "store_fingerprint": key[3],
             "partition": key[2], "rounds": key[4], "clients": key[5], "participation": key[6],
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


def seed_table(summaries: list[dict], fmt: str = "markdown") -> str:
    """``seed_groups`` as a table: each metric as mean ± sample standard deviation over the group's seeds, with n
    (markdown, CSV) or as JSON with plain numbers."""
    groups = seed_groups(summaries)
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

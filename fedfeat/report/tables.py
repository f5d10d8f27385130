"""Comparison tables and figures of runs: ``report`` (one row per run, or per setting over seeds with
``--seeds``), seed groups (mean ± sample std and n), ``--best`` selection, and the seed-band figure.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np

from fedfeat.errors import FedfeatError
from fedfeat.report.load import (
    MEMORY_KEYS,
    SUMMARY_EXTRAS,
    changed_params,
    collect_runs,
    diverged_text,
    unfinished_runs,
    worst_client_acc,
)
from fedfeat.report.plots import DPI

DAGGER = "†"  # marks a diverged run's (or a group with one) final accuracy; a footnote line names it


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
    dpi: int = DPI,
) -> str:
    """A comparison table of finished runs (markdown or CSV) and, optionally, all their curves in one PNG.

    Each run is counted once, however many paths name it: a run is its settings (every setting its config.toml
    groups by, ``fedfeat.spec.group_items``: method, hyperparameters, partition, store fingerprint, ...) and its
    seed, not its directory. ``report DIR DIR`` is ``report DIR``, and the same run made by two launchers into two
    folders is one run: the later copies are dropped, said in one line on stderr (``warn``) naming each dropped
    directory and the one kept (the first in the order given). Copies whose results disagree (another final
    accuracy: other code, another device) are not merged silently: each gets a warning line, and the first is kept.

    A run whose summary.json says it diverged (``"diverged": {"round", "reason"}``, a missing key is a healthy run
    made before the key existed) is marked: in markdown its final accuracy (or its seed group's) carries ``†`` and
    a footnote line "† diverged: NAME at round R (reason)" follows the table; CSV has a ``diverged`` column; JSON a
    ``diverged`` field (null or the summary's object per run; a list of the diverged runs per seed group).

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

    ``memory``: the tables also show the measured memory (summary.json's ``peak_rss_bytes``, ``rss_bytes_at_end``,
    ``peak_device_bytes``; see ``fedfeat.runs.train.memory_figures``) in GB, "-" where a run has none (made before
    they were recorded; no CUDA); with ``seeds`` / ``best`` as mean ± std over the group's runs that have it. The
    JSON output always has them (bytes; per group under ``metrics``).

    ``dpi``: the resolution of a PNG figure (``DPI`` = 200 by default; PDF / SVG are vector). With ``best`` the
    figure's title says on what the settings were selected (the test split, when no run has a validation split).
    The per-run table names each run (``name``, its directory) and its ``seed``."""

    if fmt not in ("markdown", "csv", "json"):
        raise FedfeatError(f"unknown format '{fmt}'; choose markdown, csv or json")
    warn = warn or (lambda msg: print(msg, file=sys.stderr))
    _check_dpi(dpi)
    problems: list[str] = []
    found, parents = collect_runs(paths, problems.append)
    runs = [(summary, rows, q) for (summary, rows), q in found]
    unfinished = unfinished_runs(_distinct_paths(parents)) if all_runs else []
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
    runs = distinct_runs(runs, known, warn)
    fig = dict(metric=metric, size=size, kind=kind, known=known, dpi=dpi)
    if best:
        runs, note, on = _best_settings(runs, known)
        if plot is not None:
            seed_figure(runs, plot, title=_best_title(on), **fig)
        if fmt == "json":  # one valid JSON document: the selection rule is a field
            groups = json.loads(seed_table(_summaries(runs), fmt, _settings(runs, known), memory=memory))
            return json.dumps({"selection": note, "selected_on": on, "groups": groups}, indent=1)
        return note + "\n\n" + seed_table(_summaries(runs), fmt, _settings(runs, known), memory=memory)
    if seeds:
        if plot is not None:
            seed_figure(runs, plot, **fig)
        return seed_table(_summaries(runs), fmt, _settings(runs, known), memory=memory)
    if plot is not None:  # before any return: --plot always writes its file
        seed_figure(runs, plot, **fig)
    # JSON: the runs' summaries, plain numbers; "diverged" null for a run made before the key existed
    if fmt == "json":
        return json.dumps(
            [{**s, "diverged": s.get("diverged"), "path": str(q)} for s, _, q in runs], indent=1
        )
    has_lt = any("many_acc" in s for s, _, _ in runs)
    has_pl = any(s.get("pseudo_label_acc") is not None for s, _, _ in runs)
    # "best acc" is the best evaluated round on the test split itself: labelled so; a run with a validation split
    # (--val-split, open vocabulary's query validation) also gets the test accuracy at its best validation round
    cols = ["method", "settings", "partition", "seed", "labels", "rounds", "round-0 acc", "final acc",
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
    has_dp = any(s.get("dp") for s, _, _ in runs)
    if has_dp:  # --dp: the epsilon the run spent at its delta (summary.json dp; "-": not private)
        cols += ["DP", "epsilon (delta)"]
    cols += ["s/round", "MB up"]
    # --memory: the peak RSS column always, the others where some run has them
    mem_keys = [
        k for k in MEMORY_KEYS if k == "peak_rss_bytes" or any(s.get(k) is not None for s, _, _ in runs)
    ]
    mem_keys = mem_keys if memory else []
    cols += [MEMORY_NAMES[k] for k in mem_keys]
    notes = [diverged_text(s, _run_name(s, q)) for s, _, q in runs]
    if fmt == "csv" and any(notes):  # CSV: a column, never prose under the table
        cols += ["diverged"]
    cols += ["name"]
    rows = []
    for (s, _m, q), note in zip(runs, notes):
        changed = changed_params(s["method"], s["params"])
        row = [
            s["method"],
            " ".join(f"{k}={v}" for k, v in changed.items()) or "-",
            s["partition"],
            "-" if s.get("seed") is None else str(s["seed"]),
            "yes" if s.get("uses_labels", True) else "no",
            str(s["rounds"]),
            f"{s['initial_acc']:.2f}",
            f"{s['final_acc']:.2f}" + (f" {DAGGER}" if note and fmt == "markdown" else ""),
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
            try:
                worst = worst_client_acc(q)
            except FedfeatError as e:  # a damaged results.npz: this run's column only, said on stderr
                warn(f"warning: {e}; its worst-10% client accuracy is left out")
                worst = None
            row += [_fmt(s.get("local_acc")), _fmt(worst)]
        if has_dp:
            d = s.get("dp") or {}
            row += [d.get("mode", "-"), f"{d['epsilon']:.2f} ({d['delta']:g})" if d else "-"]
        row += [f"{s['seconds_per_round']:.3f}", f"{s['bytes_up'] / 1e6:.1f}"]
        row += ["-" if s.get(k) is None else f"{s[k] / 1e9:.2f}" for k in mem_keys]
        if fmt == "csv" and any(notes):
            row += [note or ""]
        row += [_run_name(s, q)]
        rows.append(row)
    text = _table(cols, rows, fmt) + _footnotes([n for n in notes if n], fmt)
    return text + ("\n\n" + _unfinished_table(unfinished, fmt) if unfinished else "")


MEMORY_NAMES = {"peak_rss_bytes": "peak RSS (GB)", "rss_bytes_at_end": "RSS at end (GB)",
                "peak_device_bytes": "peak device (GB)"}  # fmt: skip


def _summaries(runs: list) -> list[dict]:
    """Each run's summary, its directory's name added as ``name`` where the summary has none (older runs)."""
    return [{**r[0], "name": _run_name(r[0], r[2] if len(r) > 2 else None)} for r in runs]


def _run_name(s: dict, q) -> str:
    return str(s.get("name") or (Path(q).name if q is not None else s["method"]))


def _footnotes(notes: list[str], fmt: str) -> str:
    """Markdown: a line "† diverged: NAME at round R (reason)" per diverged run, under the table."""
    if fmt != "markdown" or not notes:
        return ""
    return "\n\n" + "\n".join(f"{DAGGER} diverged: {n}" for n in notes)


def _check_dpi(dpi) -> None:
    # 50..1200: below 50 a figure's text is unreadable; above 1200 a screen-size PNG (18 x 14 in) is > 20k pixels
    # a side (hundreds of MB in memory); 300 is journals' usual raster minimum
    if isinstance(dpi, bool) or not isinstance(dpi, int) or not 50 <= dpi <= 1200:
        raise FedfeatError(f"--dpi must be a whole number from 50 to 1200 (got {dpi!r}); e.g. --dpi 300")


def _distinct_paths(paths: list[Path]) -> list[Path]:
    """``paths`` without repeats (the same folder named twice, or by two spellings), in order."""
    seen, out = set(), []
    for p in paths:
        k = Path(p).resolve()
        if k not in seen:
            seen.add(k)
            out.append(p)
    return out


# the results two copies of one run are compared on: copies that differ in one are not merged silently
_RESULT_KEYS = ("final_acc", "best_acc", "initial_acc", *SUMMARY_EXTRAS)
# what may explain two copies' different results (shown in the warning where the copies differ in it)
_MADE_WITH = (("device", ("device",)), ("fedfeat", ("provenance", "fedfeat")),
              ("git commit", ("provenance", "git_commit")), ("torch", ("env", "torch")))  # fmt: skip


def run_identity(summary: dict, settings: dict) -> tuple | None:
    """What makes a run the same run wherever its directory is: its settings (``run_settings``: every setting the
    run specification groups by, hyperparameters included) and its seed. None when the summary has no seed (a
    run that cannot be told apart: never merged)."""
    if summary.get("seed") is None:
        return None
    return tuple((k, repr(v)) for k, v in settings.items()), repr(summary["seed"])


def distinct_runs(runs: list, known: dict | None = None, warn=None) -> list:
    """``runs`` (``(summary, rows, run dir)``) with each run once (``run_identity``), the first of its copies kept
    in the order given. The dropped copies are named in one ``warn`` line; a copy whose results differ from the
    kept one's (``_RESULT_KEYS``) gets its own warning line instead, saying what differs."""
    warn = warn or (lambda msg: print(msg, file=sys.stderr))
    first: dict = {}
    kept, same, disagree = [], [], []
    for r, items in zip(runs, _settings(runs, known)):
        key = run_identity(r[0], items)
        if key is None or key not in first:
            if key is not None:
                first[key] = r
            kept.append(r)
            continue
        k = first[key]
        diff = _results_differ(k[0], r[0])
        (disagree if diff else same).append((r, k, diff))
    if same:
        shown = [_kept_words(r[2], k[2]) for r, k, _ in same]
        more = f", and {len(shown) - 6} more" if len(shown) > 6 else ""
        warn(
            f"report: {len(same)} run director{'y is a duplicate' if len(same) == 1 else 'ies are duplicates'} "
            f"of runs already counted (same settings and seed): {', '.join(shown[:6])}{more}"
        )
    for r, k, diff in disagree:
        made = [
            f"{what} {_dig(k[0], path) or '-'} vs {_dig(r[0], path) or '-'}"
            for what, path in _MADE_WITH
            if _dig(k[0], path) != _dig(r[0], path)
        ]
        warn(
            f"warning: {k[2]} and {r[2]} are the same run (same settings and seed) but their results disagree "
            f"({diff}{'; made with ' + ', '.join(made) if made else ''}); kept the first, dropped the second: "
            "check which is right and delete the other"
        )
    return kept


def _kept_words(dropped, kept) -> str:
    """``DROPPED (named twice)`` / ``DROPPED (kept the one in FOLDER)`` / ``DROPPED (kept KEPT)``."""
    d, k = Path(dropped), Path(kept)
    if d.resolve() == k.resolve():
        return f"{d} (named twice)"
    return f"{d} (kept the one in {k.parent})" if d.name == k.name else f"{d} (kept {k})"


def _dig(d: dict, path: tuple):
    for p in path:
        d = d.get(p) if isinstance(d, dict) else None
    return d


def _results_differ(a: dict, b: dict) -> str:
    """The first result two copies of a run disagree on, as ``final_acc 31.00 vs 34.00``; "" when they agree."""
    for k in _RESULT_KEYS:
        x, y = a.get(k), b.get(k)
        if x is None and y is None:
            continue
        if x is None or y is None or abs(float(x) - float(y)) > 1e-9:
            show = lambda v: "-" if v is None else f"{v:.2f}"  # noqa: E731
            return f"{k} {show(x)} vs {show(y)}"
    return ""


def _best_title(on: str) -> str:
    """The ``--best`` figure's title: on what the settings were selected."""
    if on == "val_acc":
        return "settings selected on the validation accuracy (val_acc)"
    return "settings selected on the TEST split (no validation split): optimistic, not a held-out result"


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
                "pseudo_label_acc": "pseudo-label acc", "local_acc": "local acc",
                "epsilon": "epsilon (DP)"}  # fmt: skip


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
        changed = " ".join(f"{k}={v}" for k, v in changed_params(s["method"], s["params"]).items()) or "-"
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


FIGURE_KINDS = ("curves", "clients", "privacy")


def _curve_keys(runs) -> list[str]:
    """The per-round numeric values the runs' metrics.jsonl rows record (``--metric``'s choices)."""
    keys: dict = {}
    for r in runs:
        for row in r[1]:
            for k, v in row.items():
                if k != "round" and isinstance(v, (int, float)) and not isinstance(v, bool):
                    keys[k] = None
    skip = ("bytes_up", "bytes_down", "seconds", "train_seconds", "train_loss", "images", "trainable_params")
    return [k for k in keys if k not in skip] + [k for k in skip if k in keys]


def _check_figure_args(runs, metric: str, size: str | None, kind: str) -> None:
    """Refuse a bad ``--kind`` / ``--size`` / ``--metric`` before anything is drawn (one line each)."""
    from fedfeat.report.plots import SIZES

    if kind not in FIGURE_KINDS:
        raise FedfeatError(f"unknown --kind '{kind}'; choose {', '.join(FIGURE_KINDS)}")
    if size is not None and size not in SIZES:
        raise FedfeatError(f"unknown --size '{size}'; choose one-column or two-column")
    if kind == "privacy" and not any(r[0].get("dp") for r in runs):
        raise FedfeatError(
            "--kind privacy: no run is differentially private; train runs with --dp (and --epsilon)"
        )
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


def _zeroshot_reference(zs, others, metrics: list[str]) -> dict | None:
    """``{partition: {metric: zero-shot accuracy}}`` for the accuracy figure's rows (``metrics``: ``test_acc`` and,
    for long-tailed runs, ``many_acc`` / ``medium_acc`` / ``few_acc``): the mean over the set's ``zeroshot`` runs of
    that partition of their final accuracy (``test_acc``) and of their own many / medium / few accuracy (a row
    gets zero-shot's accuracy on that group, never the overall one); where the set has no zeroshot run for a
    partition, the store's (``store_zeroshot``, the ``test_acc`` row only) when the panel's runs read one store
    and are not open-vocabulary (their test accuracy is on novel classes only)."""
    if metrics[0] != "test_acc":
        return None
    of = {"test_acc": "final_acc", "many_acc": "many_acc", "medium_acc": "medium_acc", "few_acc": "few_acc"}
    ref: dict = {}
    for part in dict.fromkeys(r[0]["partition"] for r in zs):
        mine = [r[0] for r in zs if r[0]["partition"] == part]
        for m in metrics:
            vals = [s[of[m]] for s in mine if m in of and s.get(of[m]) is not None]
            if vals:
                ref.setdefault(part, {})[m] = float(np.mean(vals))
    stores: dict = {}
    for r in others:
        s = r[0]
        stores.setdefault(s["partition"], set()).add(
            None if "novel_f1" in s or s.get("store") is None else str(s["store"])
        )
    for part, ss in stores.items():
        if "test_acc" not in ref.get(part, {}) and len(ss) == 1 and None not in ss:
            v = store_zeroshot(next(iter(ss)))
            if v is not None:
                ref.setdefault(part, {})["test_acc"] = v
    return ref or None


def privacy_groups(summaries: list[dict]) -> list[dict]:
    """The privacy-utility figure's data: per (method, DP level, partition) the points ``(epsilon spent, final
    accuracy mean, std, n)``, one per privacy setting (its target epsilon, else its noise multiplier), epsilon and
    accuracy averaged over the setting's seeds, sorted by epsilon; ``plain``: the method's non-private final accuracy
    on that partition (mean over its runs), or None."""
    plain: dict[tuple, list[float]] = {}
    pts: dict[tuple, dict] = {}
    for s in summaries:
        d = s.get("dp")
        if not d:
            plain.setdefault((s["method"], s["partition"]), []).append(s["final_acc"])
            continue
        setting = d.get("target_epsilon") or ("z", d.get("noise_multiplier"), d.get("clip_norm"))
        g = pts.setdefault((s["method"], d["mode"], s["partition"]), {})
        g.setdefault(repr(setting), []).append((s.get("epsilon", d.get("epsilon")), s["final_acc"]))
    out = []
    for (method, mode, part), settings in pts.items():
        points = []
        for vals in settings.values():
            eps, acc = np.array([v[0] for v in vals], float), np.array([v[1] for v in vals], float)
            std = float(acc.std(ddof=1)) if len(acc) > 1 else None
            points.append((float(eps.mean()), float(acc.mean()), std, len(acc)))
        base = plain.get((method, part))
        out.append({"label": f"{method}, {mode}-level DP", "method": method, "panel": part,
                    "points": sorted(points), "plain": float(np.mean(base)) if base else None})  # fmt: skip
    return out


def seed_figure(
    runs: list[tuple],
    path: Path,
    *,
    metric: str = "test_acc",
    size: str | None = None,
    kind: str = "curves",
    known: dict | None = None,
    title: str | None = None,
    dpi: int = DPI,
) -> None:
    """A paper's figure of seed-grouped runs (``runs``: ``(summary, metrics rows[, run dir])``): one panel per
    partition (readable titles), each setting's mean curve of ``metric`` (a per-round value of metrics.jsonl)
    with a ± std band over its seeds (``fedfeat.report.plots.plot_seed_curves``), one legend for the figure, the
    zero-shot level as a dashed line (``_zeroshot_reference``: the ``zeroshot`` runs, which are not drawn as curves,
    else the store's own zero-shot accuracy); long-tailed runs add rows of panels for many / medium / few, each
    with zero-shot's accuracy on that group. ``kind="clients"``: each client's accuracy at the last evaluated
    round, sorted (``results.npz``'s ``client_acc``; run directories needed).

    Labels (``figure_labels``): the method, and every setting in which the method's runs of one panel differ,
    with its value -- the run at a default value too (``fedprox mu=0.01`` beside ``fedprox mu=0.1``). A method
    keeps its colour and marker in every figure (``fedfeat.report.plots.line_style``). A group with a diverged
    run says so in its legend entry. ``title``: the figure's title (``--best``: on what it selected); ``dpi``:
    a PNG's resolution."""
    from fedfeat.report.plots import plot_clients, plot_seed_curves

    _check_figure_args(runs, metric, size, kind)
    zs = [r for r in runs if r[0]["method"] == "zeroshot"]
    others = [r for r in runs if r[0]["method"] != "zeroshot"] or zs
    grouped: dict[tuple, list] = {}
    for r, label in zip(others, figure_labels(others, known)):
        items = tuple((k, repr(v)) for k, v in _settings([r], known)[0].items())
        grouped.setdefault((label, r[0]["partition"], items), []).append(r)
    if kind == "privacy":
        from fedfeat.report.plots import plot_privacy

        plot_privacy(privacy_groups([r[0] for r in others]), path, size=size, dpi=dpi)
        return
    if kind == "clients":
        from fedfeat.report.load import load_results

        def client_acc(r):  # a damaged results.npz leaves that run out of the figure, said on stderr
            try:
                return load_results(r[2]).get("client_acc") if len(r) > 2 else None
            except FedfeatError as e:
                print(f"warning: {e}; the run is left out of the per-client figure", file=sys.stderr)
                return None

        groups = []
        for (label, panel, _), rs in grouped.items():
            accs = [client_acc(r) for r in rs]
            accs = [a[-1] for a in accs if a is not None and len(a)]
            if accs:
                groups.append({"label": label, "method": rs[0][0]["method"], "panel": panel, "acc": accs})
        if not groups:
            raise FedfeatError(
                "--kind clients: no run has per-client results (RUN/results.npz client_acc); train with --local-test"
            )
        plot_clients(groups, path, size=size, dpi=dpi)
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
        groups.append({"label": label, "method": rs[0][0]["method"], "panel": panel, "rounds": rounds,
                       "runs": runs_of[metric] if len(metrics) == 1 else runs_of,
                       "diverged": sum(diverged_text(r[0]) is not None for r in rs)})  # fmt: skip
    reference = _zeroshot_reference(zs if others is not zs else [], others, metrics)
    plot_seed_curves(
        groups,
        path,
        reference=reference,
        metric=metrics[0] if len(metrics) == 1 else metrics,
        size=size,
        title=title,
        dpi=dpi,
    )


def _label_value(k: str, v, s: dict) -> str:
    if k == "store_fingerprint":  # the store's file name reads better than its hash
        return f"store={Path(str(s.get('store') or v)).name}"
    return f"{k.removeprefix('params.')}={v}"


def figure_labels(runs: list, known: dict | None = None) -> list[str]:
    """Each run's legend label: its method, then every setting (``run_settings``: run settings first, then the
    hyperparameters) in which that method's runs in one panel (one partition) differ, with the run's value of
    it, so that every swept setting is named on every curve, its default value included. Settings that differ only
    between panels (the partition's own) are the panels' titles, not labels."""
    settings = _settings(runs, known)
    varying: dict[str, set] = {}  # method -> the setting keys its runs of one panel differ in
    seen: dict[tuple, dict] = {}  # (method, partition) -> key -> values
    for r, items in zip(runs, settings):
        vals = seen.setdefault((r[0]["method"], r[0]["partition"]), {})
        for k, v in items.items():
            vals.setdefault(k, set()).add(repr(v))
    for (method, _), vals in seen.items():
        varying.setdefault(method, set()).update(k for k, vs in vals.items() if len(vs) > 1)
    out = []
    for r, items in zip(runs, settings):
        keys = varying.get(r[0]["method"], set())
        named = [k for k in items if k in keys and not k.startswith("params.")]
        named += [k for k in items if k in keys and k.startswith("params.")]
        out.append(" ".join([r[0]["method"]] + [_label_value(k, items[k], r[0]) for k in named]))
    return out


DP_SHOWN = (
    "dp",
    "epsilon",
    "noise_multiplier",
    "clip_norm",
    "dp_clip",
    "delta",
)  # in a seed group's settings


def seed_groups(summaries: list[dict], settings: list[dict] | None = None) -> list[dict]:
    """Runs grouped by everything but the seed, each with every metric's mean, sample standard deviation (n - 1;
    None for one run) and n (the measured memory in bytes among them, ``MEMORY_KEYS``), and ``diverged``: the
    group's runs whose summary says they diverged (``[{"name", "seed", "round", "reason"}]``; ``[]`` when none).
    ``settings``: each run's setting (``fedfeat.report.load.run_settings``, from its config.toml: every setting the
    run specification groups by); default: what the summaries hold. Count each run once first
    (``distinct_runs``): a run given twice is two members here."""
    from fedfeat.report.load import run_settings

    settings = settings if settings is not None else [run_settings(s) for s in summaries]
    groups: dict[tuple, list[dict]] = {}
    for s, items in zip(summaries, settings):
        changed = " ".join(f"{k}={v}" for k, v in changed_params(s["method"], s["params"]).items())
        private = " ".join(f"{k}={items[k]}" for k in DP_SHOWN if items.get(k) is not None)
        changed = (
            " ".join(x for x in (changed, private) if x) or "-"
        )  # the privacy settings too (seed groups)
        groups.setdefault(tuple((k, repr(v)) for k, v in items.items()), []).append((s, changed))
    metrics = [k for k in (*SEED_METRICS, *MEMORY_KEYS) if any(s.get(k) is not None for s in summaries)]
    out = []
    for members in groups.values():
        ss = [s for s, _ in members]
        s0, changed = members[0]  # what the table shows of the group: its first run's
        g = {"method": s0["method"], "settings": changed, "store": Path(str(s0.get("store", ""))).name,
             "store_fingerprint": s0.get("store_fingerprint"), "partition": s0["partition"], "rounds": s0["rounds"],
             "clients": s0.get("clients"), "participation": s0.get("participation"),
             "n": len(ss), "seeds": [s["seed"] for s in ss], "metrics": {},
             "diverged": [{"name": s.get("name") or s["method"], "seed": s.get("seed"), **s["diverged"]}
                          for s in ss if diverged_text(s) is not None]}  # fmt: skip
        for k in metrics:
            v = np.array([s[k] for s in ss if s.get(k) is not None], dtype=np.float64)
            g["metrics"][k] = (
                {"mean": float(v.mean()), "std": float(v.std(ddof=1)) if len(v) > 1 else None, "n": len(v)}
                if len(v)
                else None
            )
        out.append(g)
    # one order whatever order the directories were read in: method, store, partition, then the method's defaults
    # ("-") before its settings, alphabetically (the run directories' hash suffixes used to decide it)
    out.sort(key=lambda g: (g["method"], g["store"], str(g["partition"]), g["settings"] != "-", g["settings"],
                            str(g["rounds"]), str(g["clients"]), str(g["participation"])))  # fmt: skip
    return out


def seed_table(
    summaries: list[dict], fmt: str = "markdown", settings: list[dict] | None = None, memory: bool = False
) -> str:
    """``seed_groups`` as a table: each metric as mean ± sample standard deviation over the group's seeds, with n
    (markdown, CSV) or as JSON with plain numbers. ``memory``: the memory columns too (GB, mean ± std over the
    group's runs that recorded it; JSON always has them, in bytes). A group with a diverged run: markdown marks its
    final accuracy with † and names the run in a footnote line under the table, CSV has a ``diverged`` column."""
    groups = seed_groups(summaries, settings)
    if fmt == "json":
        return json.dumps(groups, indent=1)
    metrics = [k for k in SEED_METRICS if any(g["metrics"].get(k) for g in groups)]
    mem_keys = [
        k
        for k in MEMORY_KEYS
        if memory and (k == "peak_rss_bytes" or any(g["metrics"].get(k) for g in groups))
    ]
    any_div = any(g["diverged"] for g in groups)
    cols = ["method", "settings", "store", "partition", "rounds", "n", "seeds"] + [
        SEED_METRICS[k] for k in metrics
    ]
    cols += [MEMORY_NAMES[k] for k in mem_keys] + (["diverged"] if any_div and fmt == "csv" else [])
    rows, notes = [], []
    for g in groups:
        row = [g["method"], g["settings"], g["store"], g["partition"], str(g["rounds"]), str(g["n"]),
               ",".join(map(str, g["seeds"]))]  # fmt: skip
        texts = [f"{d['name']} at round {d['round']} ({d['reason']})" for d in g["diverged"]]
        for k in metrics:
            row.append(_mean_std(g["metrics"].get(k)))
            if k == "final_acc" and texts and fmt == "markdown":
                row[-1] += f" {DAGGER}"
        row += [_mean_std(g["metrics"].get(k), 1e9) for k in mem_keys]
        if any_div and fmt == "csv":
            row.append("; ".join(texts))
        if len(texts) == 1:
            notes += texts
        elif texts:  # one line per group: how many of its seeds, at which rounds, the first one's reason
            d = g["diverged"]
            rounds = sorted({x["round"] for x in d})
            at = f"round {rounds[0]}" if len(rounds) == 1 else f"rounds {rounds[0]}-{rounds[-1]}"
            what = g["method"] + ("" if g["settings"] == "-" else f" {g['settings']}")
            notes.append(
                f"{what} on {g['partition']}: {len(d)} of {g['n']} seeds ({', '.join(str(x['seed']) for x in d)}) "
                f"at {at} (seed {d[0]['seed']}: {d[0]['reason']})"
            )
        rows.append(row)
    return _table(cols, rows, fmt) + _footnotes(notes, fmt)


def _mean_std(m: dict | None, unit: float = 1.0) -> str:
    if m is None:
        return "-"
    if m["n"] > 1:
        return f"{m['mean'] / unit:.2f} ± {m['std'] / unit:.2f}"
    return f"{m['mean'] / unit:.2f}"


def _fmt(v) -> str:
    return "-" if v is None else f"{v:.2f}"

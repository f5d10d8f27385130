"""Finished and unfinished runs read back from their directories: ``load_run``, ``load_runs`` (a DataFrame with
pandas), ``unfinished_runs`` (interrupted runs with their rounds, checkpoint and the resume command).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import tomllib

from fedfeat.errors import FedfeatError
from fedfeat.report import rundir
from fedfeat.report.rundir import CHECKPOINT, read_metrics

SUMMARY_EXTRAS = ("many_acc", "medium_acc", "few_acc", "pseudo_label_acc", "novel_precision", "novel_recall",
                  "novel_f1", "base_acc", "hm", "local_acc", "local_acc_std", "val_acc")  # fmt: skip
SUMMARY_KEYS = ("method", "partition", "rounds", "initial_acc", "final_acc", "best_acc", "seconds_per_round",
                "bytes_up", "params")  # fmt: skip


def load_run(path: Path) -> tuple[dict, list[dict]]:
    """``(summary, metrics)`` of a finished run; a ``FedfeatError`` names what is missing or damaged."""
    path = Path(path)
    s = path / "summary.json"
    if not s.is_file():
        raise FedfeatError(f"{path} is not a finished run directory (no summary.json)")
    try:
        summary = json.loads(s.read_text())
    except (OSError, ValueError) as e:
        raise FedfeatError(f"{s} is unreadable ({e}); re-run it, or delete the directory") from None
    if not isinstance(summary, dict) or any(k not in summary for k in SUMMARY_KEYS):
        raise FedfeatError(f"{s} lacks the keys of a fedfeat summary; re-run it, or delete the directory")
    m = path / "metrics.jsonl"
    try:
        metrics = [json.loads(line) for line in m.read_text().splitlines() if line]
    except (OSError, ValueError) as e:
        raise FedfeatError(
            f"{m} is missing or unreadable ({e}); re-run it, or delete the directory"
        ) from None
    if not metrics or not all(isinstance(r, dict) and "round" in r and "test_acc" in r for r in metrics):
        raise FedfeatError(f"{m} holds no per-round rows; re-run it, or delete the directory")
    return summary, metrics


def _looks_like_run(p: Path) -> bool:
    return (
        p.is_dir()
        and not p.name.startswith(".")
        and any((p / f).exists() for f in ("summary.json", "metrics.jsonl", "config.toml"))
    )


def load_runs(*paths, metrics: bool = False, as_frame: bool | None = None, warn=None):
    """Finished runs under ``paths`` (run directories or their parents) as records: each run's ``summary.json``
    flattened (``params`` as ``params.<key>``) plus ``path`` (and its per-round rows under ``metrics`` when asked).
    A pandas DataFrame when pandas is installed (``as_frame=None``) or asked for (``True``), else a list of dicts.

    >>> runs = load_runs("runs/demo")                              # doctest: +SKIP
    >>> runs.groupby(["method", "partition"])["final_acc"].agg(["mean", "std"])   # doctest: +SKIP
    """
    warn = warn or (lambda msg: print(f"warning: {msg}", file=sys.stderr))
    found, _ = collect_runs(paths or ("runs",), warn)
    records = []
    for (summary, rows), path in found:
        rec = {k: v for k, v in summary.items() if k not in ("params", "env", "provenance")}
        rec.update({f"params.{k}": v for k, v in summary.get("params", {}).items()})
        rec["path"] = str(path)
        if metrics:
            rec["metrics"] = rows
        records.append(rec)
    if as_frame is False:
        return records
    try:
        import pandas as pd
    except ImportError:
        if as_frame:
            raise FedfeatError("load_runs(as_frame=True) needs pandas; pip install pandas") from None
        return records
    return pd.DataFrame.from_records(records)


def collect_runs(paths, warn) -> tuple[list, list]:
    """``([((summary, metrics), path), ...], parents)``: readable finished runs; unreadable ones are warned about."""
    found, parents = [], []
    for p in map(Path, paths):
        if not p.exists():
            warn(f"{p} does not exist")
            continue
        if p.is_dir() and not _looks_like_run(p):
            parents.append(p)
            cands = [q for q in sorted(p.iterdir()) if _looks_like_run(q)]
        else:
            cands = [p]
        for q in cands:
            try:
                found.append((load_run(q), q))
            except FedfeatError as e:
                warn(f"skipped {q}: {e}")
    return found, parents


def unfinished_runs(parents: list[Path]) -> list[dict]:
    """Runs being written or interrupted (``OUT/.partial-NAME``): name, method, rounds recorded, checkpoint."""
    from fedfeat.engine import checkpoint

    out = []
    for parent in parents:
        parent = Path(parent)
        if not parent.is_dir():
            continue
        for q in sorted(parent.glob(f"{rundir.PARTIAL}*")):
            name = q.name[len(rundir.PARTIAL) :]
            row = {"name": name, "path": str(parent / name), "method": "?", "rounds": "?", "recorded": 0}
            try:
                run = tomllib.loads((q / "config.toml").read_text()).get("run", {})
                row.update(method=run.get("method", "?"), rounds=run.get("rounds", "?"))
            except (OSError, ValueError):
                pass
            if (q / "metrics.jsonl").is_file():
                row["recorded"] = max(0, len(read_metrics(q / "metrics.jsonl")) - 1)
            ck = q / CHECKPOINT
            try:
                row["checkpoint"] = int(checkpoint.read_meta(ck)["round"]) if ck.is_file() else None
            except FedfeatError:
                row["checkpoint"] = None
            lock = parent / f"{rundir.LOCK}{name}"
            row["state"] = (
                "running"
                if lock.exists() and not rundir.Lock._stale(rundir.Lock(lock, "")._holder())
                else "interrupted"
            )
            out.append(row)
    return out

"""Finished and unfinished runs read back from their directories: ``load_run``, ``load_runs`` (a DataFrame with
pandas), ``unfinished_runs`` (interrupted runs with their rounds, checkpoint and the resume command).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import tomllib

from fedfeat.errors import FedfeatError
from fedfeat.report import rundir
from fedfeat.report.rundir import CHECKPOINT, read_metrics, read_regular

SUMMARY_EXTRAS = ("many_acc", "medium_acc", "few_acc", "pseudo_label_acc", "novel_precision", "novel_recall",
                  "novel_f1", "base_acc", "hm", "local_acc", "local_acc_std", "val_acc")  # fmt: skip
# per-domain figures ({domain name: value}; a store with domains, a combined store's base-to-novel run)
DOMAIN_EXTRAS = ("domain_acc", "domain_novel_acc", "domain_base_acc", "domain_hm", "domain_local_acc")
SUMMARY_KEYS = ("method", "partition", "rounds", "initial_acc", "final_acc", "best_acc", "seconds_per_round",
                "bytes_up", "params")  # fmt: skip

# a run's measured memory in bytes (fedfeat.runs.train.memory_figures): the process's peak RSS so far, its RSS at
# the run's end, and on CUDA the peak of torch's allocated device memory since the run's start
MEMORY_KEYS = ("peak_rss_bytes", "rss_bytes_at_end", "peak_device_bytes")

_NUM = (int, float)
# the type of every summary key that ``report``, ``load_runs`` and ``reproduce`` read: a run whose summary holds
# another type (a hand-edited or damaged file) is skipped with a warning naming the file and the key
SUMMARY_TYPES = {
    "method": (str,), "partition": (str,), "rounds": (int,), "seed": (int,), "initial_acc": _NUM,
    "final_acc": _NUM, "best_acc": _NUM, "seconds_per_round": _NUM, "bytes_up": _NUM, "params": (dict,),
}  # fmt: skip
OPTIONAL_TYPES = {
    "name": (str,), "store": (str,), "store_fingerprint": (str,), "clients": (int,), "participation": _NUM,
    "best_round": (int,), "uses_labels": (bool,), "bytes_down": _NUM, "seconds": _NUM, "engine": (str,),
    "kernel": (str,), "device": (str,), "best_val_acc": _NUM, "best_val_round": (int,),
    "test_acc_at_best_val": _NUM, **{k: _NUM for k in SUMMARY_EXTRAS}, **{k: (int,) for k in MEMORY_KEYS},
    "diverged": (dict,), "weights_sha256": (str,), "seconds_per_image": _NUM, "trainable_params": (int,), "train_seconds": _NUM,
    **{k: (dict,) for k in DOMAIN_EXTRAS},
}  # fmt: skip
TYPE_NAMES = {_NUM: "a number", (int,): "an integer", (str,): "a string", (dict,): "a table (JSON object)",
              (bool,): "true or false"}  # fmt: skip
ROW_NUMBERS = ("test_acc", "train_loss", *SUMMARY_EXTRAS)  # per-round values the report plots or tabulates


def _type_ok(v, types: tuple) -> bool:
    if isinstance(v, bool):
        return bool in types
    return isinstance(v, types)


def _check_summary(s: Path, summary) -> None:
    if not isinstance(summary, dict):
        raise FedfeatError(f"{s} holds a JSON {type(summary).__name__}, not a fedfeat summary (an object)")
    missing = [k for k in SUMMARY_KEYS if k not in summary]
    if missing:
        raise FedfeatError(f"{s} lacks the keys of a fedfeat summary ({', '.join(missing)})")
    for k, types in (*SUMMARY_TYPES.items(), *OPTIONAL_TYPES.items()):
        if k not in summary or (summary[k] is None and k not in SUMMARY_KEYS):
            continue
        if not _type_ok(summary[k], types):
            raise FedfeatError(f"{s}: key {k!r} is {_describe(summary[k])}, expected {TYPE_NAMES[types]}")
    d = summary.get("diverged")
    if d is not None and not (_type_ok(d.get("round"), (int,)) and isinstance(d.get("reason"), str)):
        raise FedfeatError(
            f"{s}: key 'diverged' is {_describe(d)}, expected null or an object with an integer round and a "
            "string reason"
        )


def _describe(v) -> str:
    text = json.dumps(v)
    return f"{type(v).__name__ if v is not None else 'null'} ({text[:40]}{'...' if len(text) > 40 else ''})"


def load_run(path: Path) -> tuple[dict, list[dict]]:
    """``(summary, metrics)`` of a finished run; a ``FedfeatError`` names what is missing or damaged: a file that
    is not a regular file (a FIFO, a socket, a directory: never opened), not JSON, or a key of the wrong type."""
    path = Path(path)
    s = path / "summary.json"
    fix = "re-run it, or delete the directory"
    if not os.path.lexists(s):
        raise FedfeatError(f"{path} is not a finished run directory (no summary.json)")
    try:
        summary = json.loads(read_regular(s))
    except FedfeatError as e:
        raise FedfeatError(f"{e}; {fix}") from None
    except ValueError as e:
        raise FedfeatError(f"{s} is unreadable ({e}); {fix}") from None
    try:
        _check_summary(s, summary)
    except FedfeatError as e:
        raise FedfeatError(f"{e}; {fix}") from None
    m = path / "metrics.jsonl"
    try:
        metrics = [json.loads(line) for line in read_regular(m).splitlines() if line]
    except FedfeatError as e:
        raise FedfeatError(f"{e}; {fix}") from None
    except ValueError as e:
        raise FedfeatError(f"{m} is unreadable ({e}); {fix}") from None
    if not metrics or not all(isinstance(r, dict) and "round" in r and "test_acc" in r for r in metrics):
        raise FedfeatError(f"{m} holds no per-round rows; {fix}")
    for i, r in enumerate(metrics):
        bad = [k for k in ROW_NUMBERS if r.get(k) is not None and not _type_ok(r[k], _NUM)]
        if not _type_ok(r["round"], (int,)) or bad:
            k = bad[0] if bad else "round"
            want = "an integer" if k == "round" else "a number or null"
            raise FedfeatError(f"{m}: row {i + 1}, key {k!r} is {_describe(r[k])}, expected {want}; {fix}")
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
            if not cands:  # runs one or two folders further down are not read: say where they are
                deeper = _runs_below(p)
                if deeper:
                    where = sorted({str(q.parent) for q in deeper})
                    warn(
                        f"no run directly in {p}; {len(deeper)} run(s) are in its subfolders ({', '.join(where[:3])}"
                        + (f", and {len(where) - 3} more" if len(where) > 3 else "")
                        + "): pass those folders (e.g. "
                        + where[0]
                        + ")"
                    )
        else:
            cands = [p]
        for q in cands:
            try:
                found.append((load_run(q), q))
            except FedfeatError as e:
                warn(f"skipped {q}: {e}")
    return found, parents


def _runs_below(p: Path, depth: int = 3, limit: int = 10_000) -> list[Path]:
    """Run directories in the subfolders of ``p`` down to ``depth`` more levels (hidden ones skipped; at most
    ``limit`` folders looked at)."""
    out, level, seen = [], [p], 0
    for _ in range(depth):
        nxt = []
        for d in level:
            try:
                kids = [q for q in sorted(d.iterdir()) if q.is_dir() and not q.name.startswith(".")]
            except OSError:
                continue
            for q in kids:
                seen += 1
                if seen > limit:
                    return out
                (out if _looks_like_run(q) else nxt).append(q)
        if out:
            return out
        level = nxt
    return out


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
                run = tomllib.loads(read_regular(q / "config.toml")).get("run", {})
                row.update(method=str(run.get("method", "?")), rounds=str(run.get("rounds", "?")))
            except (FedfeatError, ValueError, AttributeError):
                pass
            try:
                row["recorded"] = max(0, len(read_metrics(q / "metrics.jsonl")) - 1)
            except FedfeatError:
                pass
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


RESULTS = "results.npz"


def load_results(run_dir) -> dict:
    """A run's per-round per-class / per-client results (``RUN/results.npz``, ``fedfeat.runs.train.write_results``)
    as ``{name: numpy array}``: ``rounds`` [E], ``class_acc`` [E, K] (%), ``client_acc`` [E, n_clients] (%, NaN
    where a client has no local test rows; only with local test splits), ``confusion`` [K, K] (the last evaluated
    round; rows true class, columns predicted). ``{}`` when the run has no such file (runs made before it existed).
    Read without pickle; a damaged file -- not a zip of arrays, or arrays of the wrong type or shape (float
    counts, accuracies outside 0-100, a row count unlike ``rounds``'s: ``_check_results``) -- is one
    ``FedfeatError`` line naming it."""
    import numpy as np

    p = Path(os.fspath(run_dir)) / RESULTS
    if not os.path.lexists(p):
        return {}
    if not p.is_file():  # a FIFO would block, a directory is no file
        raise FedfeatError(f"{p} is not a regular file; the run's per-class results are damaged (rerun it)")
    try:
        with np.load(p, allow_pickle=False) as z:
            out = {k: z[k] for k in z.files}
    except Exception as e:  # zipfile's, zlib's, numpy's and the OS's errors alike: the file is damaged
        problem = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    else:
        problem = _check_results(out)
    if problem:
        raise FedfeatError(f"cannot read {p}: {problem}; the run's per-class results are damaged (rerun it)")
    return out


def _check_results(d: dict) -> str | None:
    """What is wrong with ``results.npz``'s arrays (``write_results``' types and shapes), None when nothing."""
    import numpy as np

    def kind(a, k: str) -> bool:
        return np.issubdtype(a.dtype, np.integer if k == "int" else np.floating)

    for k in ("rounds", "class_acc"):
        if k not in d:
            return f"it has no {k!r} array"
    r = d["rounds"]
    if r.ndim != 1 or not kind(r, "int") or (r < 0).any():
        return f"'rounds' is {r.dtype} {list(r.shape)}, expected the evaluated rounds (non-negative integers [E])"
    for k in ("class_acc", "client_acc"):
        if k not in d:
            continue
        a = d[k]
        if not len(r) and a.size == 0 and kind(a, "float"):  # no evaluated round with per-class rows
            continue
        if a.ndim != 2 or not kind(a, "float") or a.shape[0] != len(r):
            return f"{k!r} is {a.dtype} {list(a.shape)}, expected floats [{len(r)}, n] (one row per evaluated round)"
        if (np.isinf(a) | (a < 0) | (a > 100)).any():  # NaN is an unscored class / client without test rows
            return f"{k!r} holds values outside 0-100 (%)"
    c = d.get("confusion")
    if c is not None:
        K = d["class_acc"].shape[1] if d["class_acc"].ndim == 2 else (c.shape[0] if c.ndim else -1)
        if c.ndim != 2 or not kind(c, "int") or c.shape != (K, K) or (c < 0).any():
            return f"'confusion' is {c.dtype} {list(c.shape)}, expected non-negative integer counts [{K}, K]"
    return None


def worst_client_acc(run_dir, frac: float = 0.1) -> float | None:
    """The mean accuracy of the worst ``frac`` of clients (at least one) at the last evaluated round, from
    ``results.npz``'s ``client_acc`` (clients without local test rows left out); None without per-client results."""
    import numpy as np

    ca = load_results(run_dir).get("client_acc")
    if ca is None or not len(ca):
        return None
    last = np.sort(ca[-1][~np.isnan(ca[-1])])
    if not len(last):
        return None
    return float(last[: max(1, int(np.ceil(frac * len(last))))].mean())


def diverged_text(summary: dict, name: str | None = None) -> str | None:
    """``NAME at round R (reason)`` for a run whose ``summary.json`` says it diverged (``"diverged": {"round",
    "reason"}``); None for a healthy run, and for a run made before the key existed (a missing key is healthy)."""
    d = summary.get("diverged")
    if not isinstance(d, dict):
        return None
    text = f"{name or summary.get('name') or summary.get('method')} at round {d.get('round')} ({d.get('reason')})"
    rec = d.get("recovered")
    if isinstance(rec, dict) and rec.get("test_acc") is not None:
        text += f"; recovered to {rec['test_acc']:.2f}% by round {rec.get('round')}"
    return text


def method_defaults(name: str) -> dict:
    """A registered method's default hyperparameters (``{}`` for a method this installation does not have)."""
    import dataclasses

    from fedfeat.methods import REGISTRY

    cls = REGISTRY.get(name)
    return dataclasses.asdict(cls.Params()) if cls else {}


def changed_params(method: str, params: dict) -> dict:
    """The hyperparameters of a run that differ from its method's defaults (what names a run's setting)."""
    defaults = method_defaults(method)
    return {k: v for k, v in (params or {}).items() if defaults.get(k, v) != v}


def run_settings(summary: dict, path=None) -> dict:
    """What makes the run's setting in a seed table (``fedfeat.spec.group_items``: every setting but the seed, and
    the hyperparameters): from its ``config.toml`` when ``path`` has a readable one (every setting as the run
    resolved it), else from the keys its ``summary.json`` holds (the others at their defaults)."""
    import tomllib

    from fedfeat.spec import FIELDS, group_items

    run, params = None, summary.get("params") or {}
    if path is not None:
        try:
            data = tomllib.loads(read_regular(Path(path) / "config.toml"))
            run, params = data.get("run"), data.get("params", params)
        except (FedfeatError, ValueError, OSError):
            run = None
    if not isinstance(run, dict) or not isinstance(params, dict):
        run, params = {k: v for k, v in summary.items() if k in FIELDS}, summary.get("params") or {}
    return group_items(run, params)

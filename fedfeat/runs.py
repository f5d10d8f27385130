"""Runs: resolve a run's configuration, train, write the run directory, compare runs.

A run directory (``runs/<name>/``) holds:

* ``config.toml``   the resolved configuration; ``fedfeat train --config runs/<name>/config.toml`` replays it;
* ``metrics.jsonl`` one JSON object per round (round 0 = before training): test accuracy, per-class accuracy,
  many/medium/few-shot accuracy, pseudo-label accuracy (label-free methods), mean train loss, bytes up and
  down, seconds, the sampled clients;
* ``summary.json``  final and best accuracy, totals, the environment; written last;
* ``curve.png``     test accuracy vs round;
* ``weights.safetensors``  the final global parameters (safetensors: loading it cannot execute code).

The directory is written under a temporary name and renamed when complete, so a crashed run never looks
finished.
"""

from __future__ import annotations

import dataclasses
import json
import os
import platform
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import tomllib
import torch

from fedfeat.errors import FedfeatError

DEFAULTS = {
    "method": "fst-cbdg",
    "store": "cache/synth-cifar10.zarr",
    "partition": "dirichlet",
    "alpha": None,
    "shards": None,
    "imbalance_factor": None,
    "partition_seed": None,
    "clients": 100,
    "participation": 0.1,
    "rounds": 10,
    "seed": 0,
    "engine": "batched",
    "kernel": "auto",
    "device": "auto",
    "out": "runs",
    "name": None,
    "shot_thresholds": None,
}


@dataclass
class RunConfig:
    method: str
    store: str
    partition: str
    clients: int
    participation: float
    rounds: int
    seed: int
    engine: str
    kernel: str
    device: str
    out: str
    alpha: float | None = None
    shards: int | None = None
    imbalance_factor: float | None = None
    partition_seed: int | None = None
    name: str | None = None
    shot_thresholds: str | None = None  # "many,few" counts, e.g. "1500,200" (CIFAR-10-LT) or "100,20"
    params: dict = field(default_factory=dict)  # method hyperparameters (--set key=value)


def parse_sets(sets: list[str] | None) -> dict:
    out = {}
    for s in sets or []:
        if "=" not in s:
            raise FedfeatError(f"--set expects key=value, got {s!r}")
        k, v = s.split("=", 1)
        out[k.strip()] = v.strip()
    return out


def resolve_config(cli: dict, config_file: Path | None, sets: list[str] | None) -> RunConfig:
    """Defaults <- config file <- explicit flags (``None`` in ``cli`` means "not given")."""
    merged = dict(DEFAULTS)
    params: dict = {}
    if config_file is not None:
        try:
            data = tomllib.loads(Path(config_file).read_text())
        except FileNotFoundError:
            raise FedfeatError(f"config file {config_file} not found") from None
        except tomllib.TOMLDecodeError as e:
            raise FedfeatError(f"config file {config_file} is not valid TOML: {e}") from None
        run = data.get("run", data)
        unknown = set(run) - set(DEFAULTS) - {"method_params", "params"}
        if unknown:
            raise FedfeatError(
                f"config file {config_file}: unknown keys {sorted(unknown)}; valid: {sorted(DEFAULTS)}"
            )
        merged.update({k: v for k, v in run.items() if k in DEFAULTS})
        params.update(data.get("params", {}))
    merged.update({k: v for k, v in cli.items() if v is not None})
    params.update(parse_sets(sets))
    return RunConfig(**merged, params=params)


def _toml_value(v) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    return json.dumps(str(v))


def config_toml(cfg: RunConfig, method_params: dict) -> str:
    """The resolved configuration as TOML (``None`` values are left out: TOML has no null)."""
    lines = ["# fedfeat run configuration; replay with: fedfeat train --config THIS_FILE", "[run]"]
    for k, v in dataclasses.asdict(cfg).items():
        if k == "params" or v is None:
            continue
        lines.append(f"{k} = {_toml_value(v)}")
    lines.append("")
    lines.append("[params]  # every hyperparameter of the method, resolved")
    for k, v in method_params.items():
        if v is not None:
            lines.append(f"{k} = {_toml_value(v)}")
    return "\n".join(lines) + "\n"


def shot_groups(train_counts: np.ndarray, thresholds: str | None) -> dict[str, np.ndarray] | None:
    """Many / medium / few class groups by training-sample count (CLIP2FL's CIFAR-10-LT thresholds:
    many > 1500, few < 200; ImageNet-LT's: "100,20"). ``None`` when no thresholds are set."""
    if not thresholds:
        return None
    try:
        hi, lo = (float(t) for t in thresholds.split(","))
    except ValueError:
        raise FedfeatError(
            f"shot_thresholds must be 'many,few' counts such as 1500,200; got {thresholds!r}"
        ) from None
    c = np.asarray(train_counts)
    return {
        "many": np.flatnonzero(c > hi),
        "medium": np.flatnonzero((c >= lo) & (c <= hi)),
        "few": np.flatnonzero(c < lo),
    }


def group_accuracy(per_class_acc: list[float], test_counts: np.ndarray, groups: dict) -> dict:
    """Accuracy over the test samples of each class group (sample-weighted)."""
    pc = np.asarray(per_class_acc)
    out = {}
    for g, idx in groups.items():
        n = test_counts[idx].sum()
        out[f"{g}_acc"] = float((pc[idx] * test_counts[idx]).sum() / n) if n else None
    return out


def default_run_name(cfg: RunConfig, part_key: str) -> str:
    tag = "".join(f"_{k}={v}" for k, v in sorted(cfg.params.items()))
    return f"{cfg.method}{tag}__{part_key}__r{cfg.rounds}_p{cfg.participation:g}_seed{cfg.seed}".replace(
        "/", "-"
    )


def train(cfg: RunConfig, *, progress: bool = True, log=print) -> Path:
    """Run one configuration end to end and write its run directory. Returns the directory."""
    from safetensors.torch import save_file

    from fedfeat.engine import load_run_data, resolve_device, resolve_kernel, run_federated
    from fedfeat.methods import get_method
    from fedfeat.plots import plot_curves
    from fedfeat.report import store_partition
    from fedfeat.store import FeatureStore

    method = get_method(cfg.method, cfg.params)
    device = resolve_device(cfg.device)
    kernel = resolve_kernel(cfg.kernel, method, cfg.engine, device)  # before anything is written
    if cfg.rounds < 0:
        raise FedfeatError("--rounds must be >= 0")
    store = FeatureStore.open(cfg.store, mode="r+")
    key, part = store_partition(
        store,
        scheme=cfg.partition,
        clients=cfg.clients,
        alpha=cfg.alpha,
        shards=cfg.shards,
        imbalance_factor=cfg.imbalance_factor,
        seed=cfg.partition_seed,
    )
    centralized = getattr(method, "centralized", False)
    data = load_run_data(store, part, device=device, centralized=centralized)
    name = cfg.name or default_run_name(cfg, key)
    out = Path(cfg.out)
    final = out / name
    tmp = out / f".tmp-{name}-{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    (tmp / "config.toml").write_text(config_toml(cfg, dataclasses.asdict(method.p)))
    groups = shot_groups(data.train_counts.cpu().numpy(), cfg.shot_thresholds)
    test_counts = np.bincount(data.test_y.cpu().numpy(), minlength=len(data.class_names))
    mfile = open(tmp / "metrics.jsonl", "w")  # noqa: SIM115 (closed below)
    bar = None
    if progress:
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        bar = Progress(
            TextColumn(f"[bold]{cfg.method}[/bold] {key}"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("acc {task.fields[acc]}"),
            TimeElapsedColumn(),
            transient=False,
        )
        task = bar.add_task("rounds", total=cfg.rounds if method.federated else 0, acc="-")
        bar.start()

    def on_round(row: dict) -> None:
        if groups is not None:
            row.update(group_accuracy(row["per_class_acc"], test_counts, groups))
        mfile.write(json.dumps(row) + "\n")
        mfile.flush()
        if bar is not None:
            bar.update(task, completed=row["round"], acc=f"{row['test_acc']:.2f}%")

    t0 = time.perf_counter()
    try:
        glob, metrics = run_federated(
            method,
            data,
            rounds=cfg.rounds,
            participation=1.0 if centralized else cfg.participation,
            seed=cfg.seed,
            engine=cfg.engine,
            kernel=cfg.kernel,
            device=device,
            on_round=on_round,
        )
    finally:
        mfile.close()
        if bar is not None:
            bar.stop()
    wall = time.perf_counter() - t0
    save_file(
        {k: v.detach().cpu().contiguous() for k, v in glob.items()},
        tmp / "weights.safetensors",
    )
    plot_curves(
        {cfg.method: ([r["round"] for r in metrics], [r["test_acc"] for r in metrics])},
        tmp / "curve.png",
        title=f"{cfg.method} on {Path(cfg.store).name}, {key}",
    )
    accs = [r["test_acc"] for r in metrics]
    last = metrics[-1]
    summary = {
        "name": name,
        "method": cfg.method,
        "uses_labels": method.uses_labels,
        "store": str(cfg.store),
        "partition": key,
        "clients": cfg.clients,
        "participation": cfg.participation,
        "rounds": cfg.rounds,
        "seed": cfg.seed,
        "engine": cfg.engine,
        "kernel": kernel,
        "device": str(device),
        "initial_acc": accs[0],
        "final_acc": accs[-1],
        "best_acc": max(accs),
        "best_round": int(np.argmax(accs)),
        **{k: last[k] for k in ("many_acc", "medium_acc", "few_acc", "pseudo_label_acc") if k in last},
        "bytes_up": int(sum(r["bytes_up"] for r in metrics)),
        "bytes_down": int(sum(r["bytes_down"] for r in metrics)),
        "seconds": wall,  # everything: loading, set-up, kernel compilation on first use, all rounds
        # the median round (training + evaluation): one-time costs (a kernel compiled in round 1) left out
        "seconds_per_round": (
            float(np.median([r["seconds"] for r in metrics[1:]]))
            if len(metrics) > 1
            else wall / max(cfg.rounds, 1)
        ),
        "params": dataclasses.asdict(method.p),
        "env": {
            "torch": torch.__version__,
            "python": platform.python_version(),
            "machine": platform.machine(),
        },
    }
    (tmp / "summary.json").write_text(json.dumps(summary, indent=2))
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)
    log(
        f"run: {final}  (final acc {accs[-1]:.2f}%, best {max(accs):.2f}% at round {summary['best_round']}, {wall:.1f} s)"
    )
    return final


def load_run(path: Path) -> tuple[dict, list[dict]]:
    s = Path(path) / "summary.json"
    if not s.is_file():
        raise FedfeatError(f"{path} is not a finished run directory (no summary.json)")
    metrics = [json.loads(line) for line in (Path(path) / "metrics.jsonl").read_text().splitlines() if line]
    return json.loads(s.read_text()), metrics


def report(paths: list[Path], *, fmt: str = "markdown", plot: Path | None = None) -> str:
    """A comparison table of finished runs (markdown or CSV) and, optionally, all their curves in one PNG."""
    from fedfeat.plots import plot_curves

    if fmt not in ("markdown", "csv"):
        raise FedfeatError(f"unknown format '{fmt}'; choose markdown or csv")
    runs = []
    for p in paths:
        p = Path(p)
        if p.is_dir() and not (p / "summary.json").exists():  # a parent of run dirs
            runs += [load_run(q) + (q,) for q in sorted(p.iterdir()) if (q / "summary.json").is_file()]
        else:
            runs.append(load_run(p) + (p,))
    if not runs:
        raise FedfeatError("no finished runs found in the given paths")
    has_lt = any("many_acc" in s for s, _, _ in runs)
    has_pl = any(s.get("pseudo_label_acc") is not None for s, _, _ in runs)
    cols = ["method", "settings", "partition", "labels", "rounds", "round-0 acc", "final acc", "best acc"]
    if has_lt:
        cols += ["many", "medium", "few"]
    if has_pl:
        cols += ["pseudo-label acc"]
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
        if has_lt:
            row += [_fmt(s.get(k)) for k in ("many_acc", "medium_acc", "few_acc")]
        if has_pl:
            row += [_fmt(s.get("pseudo_label_acc"))]
        row += [f"{s['seconds_per_round']:.3f}", f"{s['bytes_up'] / 1e6:.1f}"]
        rows.append(row)
    if plot is not None:
        curves = {}
        for (s, m, p), row in zip(runs, rows):
            label = f"{s['method']}" + (f" [{row[1]}]" if row[1] != "-" else "") + f" | {s['partition']}"
            if label in curves:
                label += f" ({Path(p).name[-24:]})"
            curves[label] = ([r["round"] for r in m], [r["test_acc"] for r in m])
        plot_curves(curves, plot, title="test accuracy")
    if fmt == "csv":
        import csv
        import io

        buf = io.StringIO()
        w = csv.writer(buf)
        w.writerow(cols)
        w.writerows(rows)
        return buf.getvalue()
    out = ["| " + " | ".join(cols) + " |", "|" + "|".join("---" for _ in cols) + "|"]
    out += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(out)


def _fmt(v) -> str:
    return "-" if v is None else f"{v:.2f}"


def _method_defaults(name: str) -> dict:
    from fedfeat.methods import REGISTRY

    cls = REGISTRY.get(name)
    return dataclasses.asdict(cls.Params()) if cls else {}

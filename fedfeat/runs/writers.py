"""What a run writes besides training: its results (``results.npz``: per-round per-class accuracy and the last
confusion matrix), ``summary.json``'s figures (accuracies, best-on-validation, bytes, seconds, memory), the
many / medium / few class groups of long-tailed runs, the progress bar and the live callbacks' run information.
``fedfeat.runs.train`` calls them around its one loop of rounds."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import platform
from pathlib import Path

import numpy as np
import torch

from fedfeat.errors import FedfeatError
from fedfeat.report.load import DOMAIN_EXTRAS, SUMMARY_EXTRAS
from fedfeat.runs.config import RunConfig, provenance
from fedfeat.runs.threads import current as current_threads


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


def default_thresholds(cfg: RunConfig, data) -> str | None:
    """Long-tailed runs report many / medium / few without ``--shot-thresholds``: CLIP2FL's CIFAR-10-LT groups
    (> 1500, < 200) for 10 classes, the CIFAR-100-LT / ImageNet-LT ones (> 100, < 20) otherwise."""
    if cfg.imbalance_factor is None:
        return None
    return "1500,200" if len(data.class_names) <= 10 else "100,20"


def group_accuracy(per_class_acc: list[float], test_counts: np.ndarray, groups: dict) -> dict:
    """Accuracy over the test samples of each class group (sample-weighted)."""
    pc = np.asarray(per_class_acc)
    out = {}
    for g, idx in groups.items():
        n = test_counts[idx].sum()
        out[f"{g}_acc"] = float((pc[idx] * test_counts[idx]).sum() / n) if n else None
    return out


def capture_predictions(method) -> dict:
    """Keep the confusion matrix of the last evaluated round of ``method``'s run (for ``RUN/results.npz``): the
    engine hands every evaluation's predictions to ``method.round_metrics``; this wraps that hook on the instance
    (the engine is unchanged) and returns the dict it fills with ``confusion`` ``[K, K]`` int64 (rows true class,
    columns predicted; the ``--val-split`` rows left out, as the accuracy does). A checkpoint is never taken after the
    last round, so a resumed run evaluates its last round again and its confusion equals the uninterrupted run's."""
    box: dict = {}
    inner = method.round_metrics

    def round_metrics(ctx, data, glob, ev):
        box["confusion"] = confusion_matrix(ctx, data.test_y, ev.get("pred"))
        return inner(ctx, data, glob, ev)

    method.round_metrics = round_metrics
    return box


def confusion_matrix(ctx, test_y: torch.Tensor, pred) -> np.ndarray | None:
    """``[K, K]`` int64 counts of (true, predicted) over the evaluated test rows; None when ``pred`` is not one
    prediction per row (a method's own evaluation)."""
    if pred is None:
        return None
    y = test_y
    vm = getattr(ctx, "val_mask", None)
    if vm is not None and len(pred) != len(y):  # engine.evaluate scores the --val-split rows apart
        y = y[~vm.to(y.device)]
    if len(pred) != len(y):
        return None
    K = ctx.K
    flat = y.to(torch.int64) * K + pred.to(y.device, torch.int64)
    return torch.bincount(flat, minlength=K * K).view(K, K).cpu().numpy().astype(np.int64)


def write_results(run_dir: Path, metrics: list[dict], confusion: np.ndarray | None) -> None:
    """``RUN/results.npz`` (compressed, no pickle): ``rounds`` [E] the evaluated rounds, ``class_acc`` [E, K] (%),
    ``client_acc`` [E, n_clients] (%, NaN for a client without local test rows; only with local test splits) and
    ``confusion`` [K, K] of the last evaluated round. Built from the metric rows (``per_class_acc``,
    ``client_acc``), so a resumed run, whose rows before the checkpoint come from ``metrics.jsonl``, writes the same
    file as an uninterrupted one."""
    ev = [r for r in metrics if r.get("test_acc") is not None and r.get("per_class_acc") is not None]
    arrays: dict[str, np.ndarray] = {
        "rounds": np.asarray([int(r["round"]) for r in ev], dtype=np.int64),
        "class_acc": np.asarray([r["per_class_acc"] for r in ev], dtype=np.float64),
    }
    if ev and all(r.get("client_acc") is not None for r in ev):
        arrays["client_acc"] = np.asarray(
            [[np.nan if a is None else a for a in r["client_acc"]] for r in ev], dtype=np.float64
        )
    if confusion is not None:
        arrays["confusion"] = np.asarray(confusion, dtype=np.int64)
    tmp = run_dir / ".results.tmp.npz"
    with open(tmp, "wb") as f:
        np.savez_compressed(f, **arrays)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, run_dir / "results.npz")


def _run_info(cfg: RunConfig, method_params: dict, rd, resumed_after: int | None) -> dict:
    """What ``on_run_start`` gets (``fedfeat.runs.callbacks``)."""
    conf = {k: v for k, v in dataclasses.asdict(cfg).items() if k != "params"}
    return {
        "name": rd.name,
        "path": str(rd.final),
        "dir": str(rd.partial),
        "method": cfg.method,
        "rounds": cfg.rounds,
        "config": {**conf, "params": method_params},
        "resumed_after_round": resumed_after,
        "first_round": 0 if not resumed_after else resumed_after + 1,
    }


_STARTED: list = []  # a run of this process has started training (only the first one has a start-up)


def process_age() -> float | None:
    """Seconds since this process started (Linux: ``/proc/self/stat``'s start time against ``/proc/uptime``, to
    the kernel's clock tick), else None. The first run of a process records its age when round 0 (the evaluation
    before training) is written -- the moment training starts -- as ``startup_seconds``: interpreter, imports,
    store, partition, loading, numba's kernels (compiled or loaded from the cache) and round 0's evaluation."""
    try:
        with open("/proc/self/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        with open("/proc/uptime") as f:
            up = float(f.read().split()[0])
        return max(0.0, up - int(fields[19]) / os.sysconf("SC_CLK_TCK"))  # field 22: starttime, in ticks
    except (OSError, ValueError, IndexError, AttributeError):
        return None


@contextlib.contextmanager
def compile_clock(box: list):
    """Add to ``box[0]`` the seconds numba spends compiling inside the block (its ``numba:compile`` events, nested
    compiles counted once; a kernel loaded from numba's disk cache is not a compile). The round in which a kernel
    is compiled keeps it in its own ``seconds`` row (``seconds_per_round``, a median, leaves it out)."""
    import sys

    if "numba" not in sys.modules:
        os.environ.setdefault("NUMBA_THREADING_LAYER", "workqueue")  # as fedfeat.engine.kernels sets it
    from numba.core import event

    timer = event.TimingListener()
    try:
        with event.install_listener("numba:compile", timer):
            yield box
    finally:
        if timer.done:
            box[0] += timer.duration


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _progress_bar(cfg: RunConfig, method, key: str, done: int):
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    bar = Progress(
        TextColumn(f"[bold]{cfg.method}[/bold] {key}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("acc {task.fields[acc]}"),
        TimeElapsedColumn(),
        transient=False,
    )
    task = bar.add_task("rounds", total=cfg.rounds if method.federated else 0, completed=done, acc="-")
    bar.start()
    return bar, task


def _best_on_val(ev: list[dict]) -> dict:
    """Round selection on the validation split (``--val-split``, or an open-vocabulary run's query validation
    part): the evaluated round with the best ``val_acc`` (the first of ties), its ``val_acc`` and the test accuracy
    there (``test_acc_at_best_val``: the held-out figure to report, where ``best_acc`` is selected on test)."""
    vals = [(r["val_acc"], -i) for i, r in enumerate(ev) if r.get("val_acc") is not None]
    if not vals:
        return {}
    v, i = max(vals)
    return {
        "best_val_acc": v,
        "best_val_round": int(ev[-i]["round"]),
        "test_acc_at_best_val": ev[-i]["test_acc"],
    }


def domain_local(partition, metrics: list[dict]) -> dict:
    """``domain_local_acc``: a domain partition's personal accuracy per domain -- the mean of its clients' local
    accuracies (the last evaluated round's ``client_acc``, ``--local-test joint``) by the clients' domains; with one
    client per domain, each domain's client (FedOTP's and FedCLIP's per-domain personal columns). {} otherwise."""
    owners = (getattr(partition, "params", None) or {}).get("client_domains")
    rows = [r for r in metrics if isinstance(r.get("client_acc"), list)]
    if not owners or not rows or len(rows[-1]["client_acc"]) != len(owners):
        return {}
    per: dict[str, list[float]] = {}
    for name, acc in zip(owners, rows[-1]["client_acc"]):
        if acc is not None:
            per.setdefault(name, []).append(float(acc))
    return {"domain_local_acc": {n: float(np.mean(v)) for n, v in per.items()}}


def _efficiency(metrics: list[dict]) -> dict:
    """Fed-MP Table 3's two figures, as a run measures them:

    * ``seconds_per_image``: seconds of training per training image processed -- the rounds' ``train_seconds`` (local
      updates, aggregation, server step; no evaluation) over their ``images`` (each sampled client's samples x local
      epochs), the first round left out where there are others (one-time costs: a kernel compiled, caches filled). On
      cached features the encoder's forward pass is not in it: ``fedfeat encode`` paid it once.
    * ``trainable_params``: the parameters one client trains (``fedfeat.engine.context.trainable_params``).
    * ``train_seconds``: the rounds' training seconds summed (local updates, aggregation, server step; a stacked run's
      share of its stack's), the cross-family table's compute column.

    Absent from runs whose rounds do not record them (made before they existed, or without training rounds)."""
    rows = [r for r in metrics if "images" in r]  # the training rounds (round 0 has none)
    out = {}
    if rows:  # the run's training seconds, every round (a stacked run's: its share of the stack's)
        out["train_seconds"] = float(sum(r.get("train_seconds", 0.0) for r in rows))
        timed = rows[1:] if len(rows) > 1 else rows
        images = sum(r["images"] for r in timed)
        if images:  # (the training-free methods process no image in local training)
            out["seconds_per_image"] = float(sum(r["train_seconds"] for r in timed) / images)
    n = [r["trainable_params"] for r in rows if "trainable_params" in r]
    if n:
        out["trainable_params"] = int(max(n))
    return out


def _summary(cfg, method, method_params, kernel, device, key, name, metrics, wall, store) -> dict:
    ev = [r for r in metrics if r["test_acc"] is not None]  # --eval-every: the evaluated rounds
    accs = [r["test_acc"] for r in ev]
    last = metrics[-1]
    return {
        "name": name,
        "method": cfg.method,
        "uses_labels": method.uses_labels,
        "store": str(cfg.store),
        "store_fingerprint": store.attrs.get("fingerprint_hash"),
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
        "best_acc": max(accs),  # selected on the test split (optimistic): best_val_* select on validation
        "best_round": int(ev[int(np.argmax(accs))]["round"]),
        **_best_on_val(ev),
        **{k: last[k] for k in SUMMARY_EXTRAS if k in last},
        **{k: last[k] for k in DOMAIN_EXTRAS if isinstance(last.get(k), dict)},
        "bytes_up": int(sum(r["bytes_up"] for r in metrics)),
        "bytes_down": int(sum(r["bytes_down"] for r in metrics)),
        "seconds": wall,  # this process: loading, set-up, its rounds (numba's compiling: compile_seconds)
        # the median round (training + evaluation): one-time costs (a kernel compiled in round 1) left out
        "seconds_per_round": (
            float(np.median([r["seconds"] for r in metrics[1:]]))
            if len(metrics) > 1
            else wall / max(cfg.rounds, 1)
        ),
        **_efficiency(metrics),
        "params": method_params,
        "env": {
            "torch": torch.__version__,
            "python": platform.python_version(),
            "machine": platform.machine(),
            "threads": current_threads(),  # torch's CPU threads and why (fedfeat.runs.threads)
        },
        "provenance": provenance(method),  # a plugin method: its module, package and version
        **_privacy(cfg, metrics),
    }


def _privacy(cfg, metrics) -> dict:
    """summary.json's ``dp``: the level, the epsilon spent at delta (the accountant's, after the last round), the
    noise multiplier used (calibrated to a target epsilon when one was given) and the clipping."""
    if getattr(cfg, "dp", None) is None:
        return {}
    from fedfeat.engine.privacy import from_config

    dp = from_config(cfg)
    rows = [r for r in metrics if "epsilon" in r]
    last = rows[-1] if rows else {}
    return {
        "epsilon": last.get("epsilon", 0.0),  # flat, for report's columns and seed tables (dp.epsilon)
        "dp": {
            "mode": dp.mode,
            "epsilon": last.get("epsilon", 0.0),
            "delta": dp.delta,
            "target_epsilon": dp.epsilon,
            "noise_multiplier": last.get("dp_noise_multiplier", dp.noise_multiplier),
            "clip_norm": dp.clip_norm,
            "clip": dp.clip,
            "final_clip_norm": last.get("dp_clip", dp.clip_norm),
            "accountant": dp.accountant,
        }
    }


def reset_device_peak(device) -> None:
    """Start a run's ``peak_device_bytes`` afresh (``torch.cuda.reset_peak_memory_stats``); nothing off CUDA."""
    if torch.device(device).type == "cuda" and torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats(device)


def memory_figures(device) -> dict:
    """A run's measured memory, for summary.json (bytes):

    * ``peak_rss_bytes``: the process's peak resident set size so far (``getrusage(RUSAGE_SELF).ru_maxrss``: KiB
      on Linux, bytes on macOS). The process's high-water mark, not the run's: in a sweep it is the peak of all
      the runs made so far in that process (a stacked run: its whole stack's).
    * ``rss_bytes_at_end``: the resident set size when the run ends (``/proc/self/statm``; absent where there is
      none), what the process still holds -- read before the peak, so ``peak_rss_bytes >= rss_bytes_at_end``.
    * ``peak_device_bytes``: on CUDA only, ``torch.cuda.max_memory_allocated`` since the run's start (reset by
      ``train``; a stacked run: since its stack's start). Tensors torch allocated, not the caching allocator's
      reserve nor the CUDA context.
    """
    import sys

    out = {}
    try:
        with open("/proc/self/statm") as f:
            out["rss_bytes_at_end"] = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        pass
    try:
        import resource

        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        out["peak_rss_bytes"] = int(peak if sys.platform == "darwin" else peak * 1024)
    except (ImportError, OSError):  # no resource module (Windows)
        pass
    if (
        "peak_rss_bytes" in out and "rss_bytes_at_end" in out
    ):  # page rounding: the peak is never below the end
        out["peak_rss_bytes"] = max(out["peak_rss_bytes"], out["rss_bytes_at_end"])
    if torch.device(device).type == "cuda" and torch.cuda.is_available():
        out["peak_device_bytes"] = int(torch.cuda.max_memory_allocated(device))
    return out


# ------------------------------------------------------------------------------------------------ the run's loop


@dataclasses.dataclass(frozen=True)
class StackShare:
    """A run's share of a stacked program (``fedfeat.runs.train.train_stacked``), written as its own run."""

    weights: dict  # the final global parameters
    rows: list  # its metric rows, round 0 first
    seconds: float  # its share of the stack's time
    runs: int  # how many runs the program made
    confusion: np.ndarray | None = None  # the last evaluated round's confusion matrix


class RowWriter:
    """One thing a run does with each metric row, in the order of ``Rows.writers`` (module docstring)."""

    def row(self, row: dict) -> None:  # pragma: no cover - the interface
        raise NotImplementedError

    def close(self) -> None:
        pass


class ClassGroups(RowWriter):
    """Many / medium / few-shot accuracy added to each evaluated row (long-tailed runs, ``--shot-thresholds``)."""

    def __init__(self, groups: dict | None, test_counts: np.ndarray):
        self.groups, self.test_counts = groups, test_counts

    def row(self, row: dict) -> None:
        if self.groups is not None and "per_class_acc" in row:
            row.update(group_accuracy(row["per_class_acc"], self.test_counts, self.groups))


class MetricsFile(RowWriter):
    """``metrics.jsonl``: one line a round, flushed; ``text`` is what it holds (a checkpoint's digest covers it)."""

    def __init__(self, path: Path, kept: str | None = None):
        self.path = path
        self.written: list[str] = []
        if kept is not None:  # a resumed run: the rows up to its checkpoint, written afresh
            self.written.append(kept)
            tmp = path.with_name(".metrics.jsonl.tmp")
            tmp.write_text(kept)
            os.replace(tmp, path)
        self.file = open(path, "a")  # noqa: SIM115 (closed by close)

    def row(self, row: dict) -> None:
        self.written.append(json.dumps(row) + "\n")
        self.file.write(self.written[-1])
        self.file.flush()

    def sync(self) -> None:
        os.fsync(self.file.fileno())

    @property
    def text(self) -> str:
        return "".join(self.written)

    def close(self) -> None:
        self.file.close()


class Live(RowWriter):
    """The live loggers and plugins (``fedfeat.runs.callbacks``), after the row is on disk."""

    def __init__(self, cbs):
        self.cbs = cbs

    def row(self, row: dict) -> None:
        self.cbs.round_end(dict(row))


class ProgressBar(RowWriter):
    def __init__(self, cfg: RunConfig, method, key: str, done: int):
        self.bar, self.task = _progress_bar(cfg, method, key, done)

    def row(self, row: dict) -> None:
        acc = "-" if row["test_acc"] is None else f"{row['test_acc']:.2f}%"
        self.bar.update(self.task, completed=row["round"], acc=acc)

    def close(self) -> None:
        self.bar.stop()


class Startup(RowWriter):
    """The process's age when its first run produced its first row (``summary.json``'s ``startup_seconds``)."""

    def __init__(self, first: bool):
        self.first, self.seconds = first, None

    def row(self, row: dict) -> None:
        if self.first and self.seconds is None and not _STARTED:
            _STARTED.append(True)
            self.seconds = process_age()


class Interrupts(RowWriter):
    """Fault-injection points for the tests, and a Ctrl-C that numba's compiler swallowed, after each row."""

    def row(self, row: dict) -> None:
        from fedfeat.report import rundir

        rundir.fault_point(f"after-round-{row['round']}")
        rundir.check_interrupt()


class Rows:
    """The writers a run's rows go through, in order; ``Rows(...)(row)`` is the engine's ``on_round``."""

    def __init__(self, writers: list[RowWriter]):
        self.writers = [w for w in writers if w is not None]

    def __call__(self, row: dict) -> None:
        for w in self.writers:
            w.row(row)

    def close(self) -> None:
        for w in self.writers:
            w.close()


def write_outputs(
    rd_dir: Path, cfg: RunConfig, method, key: str, glob: dict, metrics: list[dict], confusion
) -> str | None:
    """What a finished run leaves besides its summary: ``weights.safetensors`` (a method that trains), ``curve.png``
    and ``results.npz``. Returns the sha256 of the weights file as written (``summary.json``'s ``weights_sha256``,
    checked wherever the weights are read: ``fedfeat.runs.run.read_weights``), None when none were written."""
    from safetensors.torch import save_file

    from fedfeat.report.plots import plot_curves, run_title
    from fedfeat.runs.run import WEIGHTS, weights_digest

    trained = method.federated or method.centralized  # zeroshot: its head is the store's text features
    digest = None
    if trained:
        save_file({k: v.detach().cpu().contiguous() for k, v in glob.items()}, rd_dir / WEIGHTS)
        digest = weights_digest(rd_dir / WEIGHTS)  # the bytes as they are on disk: what a reader hashes
    ev_rows = [r for r in metrics if r["test_acc"] is not None]
    plot_curves(
        {cfg.method: ([r["round"] for r in ev_rows], [r["test_acc"] for r in ev_rows])},
        rd_dir / "curve.png",
        title=run_title(cfg.method, dataclasses.asdict(method.p), cfg.store, key, cfg.seed),  # in words
    )
    write_results(rd_dir, metrics, confusion)
    return digest

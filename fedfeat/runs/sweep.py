"""Sweeps: a grid of runs in one process (``fedfeat sweep``, ``fedfeat.runs.sweep``).

Every grid point is an ordinary run directory (its own ``config.toml``, metrics, weights, name), made by the same
``fedfeat.runs.train.train`` as ``fedfeat train``. What a sweep adds is one process for all of them: the interpreter,
torch, the compiled CPU kernels, each store, each partition and each store's loaded features are made once and
shared (``Session``), so a grid of short runs costs its rounds, not 3-4 s of start-up per run. Finished runs
are skipped (a sweep can be re-run after an interruption and only does what is missing), unless ``overwrite``.

**After a kill** (SIGKILL, a lost machine, a job's time limit) the same command finishes the grid, as an
uninterrupted one would have written it (``tests/test_sweep_resume.py``): a run the kill left unfinished
(``OUT/.partial-NAME``) is resumed from its checkpoint (``fedfeat train --resume``'s checks; a run made alone
checkpoints every 10 rounds, ``CHECKPOINT_EVERY``), started again when it has none (a stacked run's share, fewer
than 10 rounds made), published when it had written its summary; the dead process's lock is taken over, a live
one's is refused (that run fails, the others are made); an unfinished run of other settings under the name is
refused, never replaced (``fedfeat.report.rundir.take_unfinished``). ``FEDFEAT_FAULT=sweep-next@K`` kills a sweep
before its K-th run or stack (tests).

The grid -- value lists over run settings and hyperparameters, times *cells* of settings that vary together --
is read, checked, bounded and expanded by ``fedfeat.runs.grid`` (its docstring has the file format); points that
would share a run directory but are different runs are refused before anything runs (``same_runs``).

**Stacking** (default; ``fedfeat sweep --no-stack`` turns it off): the pending runs of a stackable method
(``Method.stacks``, ``fedfeat methods``: the linear heads and their baselines, FST-CBDG, CReFF / CLIP2FL, CCVR, FedDF,
FedBE; the others say why not, ``Method.no_stack_reason``) that agree on every run setting the run specification
does not declare ``per_run`` (``fedfeat.spec.stack_key``: only seed, participation, name and output directory
may differ) and on the hyperparameters that shape the data (``Method.stack_shape``) are made as one batched program along a run axis (``fedfeat.runs.stack``): their seeds,
participation and hyperparameters may differ. Each still gets its own ordinary run directory with what the same
run made alone gives (``tests/test_stack.py``: bit for bit with the fused CPU kernels, <= 1e-5 with the torch
program); its ``summary.json`` says ``stacked_runs`` (its ``seconds`` are its share of the stack's). Other runs
are made one after another in the shared process (BENCHMARKS.md, "Stacked runs", gives what each saves).
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import NamedTuple

from fedfeat.errors import FedfeatError
from fedfeat.runs.grid import (  # the grid: read, checked, bounded, expanded (re-exported: fedfeat.runs.sweep.*)
    MAX_DEPTH,
    MAX_POINTS,
    applicable_points,
    check_grid,
    configs,
    count_points,
    expand,
    parse_values,
    read_grid,
)
from fedfeat.runs.session import active, session, signatures


def plan(points: list[tuple[dict, dict]]) -> None:
    """Inside a ``session()`` that makes several ``run_sweep`` calls (``reproduce``): count all their points at
    once, so an entry that a later call reads is kept across the earlier ones (``Session.expect``)."""
    s = active()
    if s is None:
        return
    s.expect(configs(points))
    s.planned = True


# runs per stacked program (memory: R x the virtual clients' heads, FST-CBDG's soft labels, banks)
STACK_MAX = 16


def _differ(a, b, most: int = 3) -> str:
    """The settings in which two resolved configs differ, e.g. ``seed 0 / 1``."""
    import dataclasses

    keys = [
        f.name for f in dataclasses.fields(a) if f.name != "name" and getattr(a, f.name) != getattr(b, f.name)
    ]
    text = ", ".join(f"{k} {getattr(a, k)!r} / {getattr(b, k)!r}" for k in keys[:most])
    return text + (f" and {len(keys) - most} more" if len(keys) > most else "")


def same_runs(cfgs: list, names: list[Path]) -> dict[int, int]:
    """Points that are one run -> the first one's index: the same run directory, and settings that differ only in
    what the run ignores (``zeroshot`` over partitions: it draws none), made once. Before anything runs, one line
    for two points that would be one run directory but are different runs (a ``name`` given to points of several
    seeds: the second would be skipped as the first), naming both and the fix, and for an exact duplicate."""
    import dataclasses

    from fedfeat.runs.train import run_name

    seen: dict[Path, int] = {}
    same: dict[int, int] = {}
    for i, path in enumerate(names):
        j = seen.setdefault(path, i)
        if j == i:
            continue
        a, b = cfgs[j], cfgs[i]
        if a == b:
            raise FedfeatError(
                f"grid points {j + 1} and {i + 1} are the same run ({path.name}); remove the duplicate"
            )
        if (a.name is None and b.name is None) or run_name(dataclasses.replace(a, name=None)) == run_name(
            dataclasses.replace(b, name=None)
        ):
            same[i] = j  # one run (the name stands for the same settings)
            continue
        raise FedfeatError(
            f"grid points {j + 1} and {i + 1} are different runs ({_differ(a, b)}) with one run name, {path.name}; "
            "drop name from the points (each run's default name stands for its settings) or give each point a "
            "name of its own"
        )
    return same


def _unfinished(path: Path) -> str:
    """What a sweep run again finds of a killed run at ``path`` (``OUT/NAME``): its ``.partial-NAME`` and what
    will be done with it (``fedfeat.report.rundir.take_unfinished`` decides under the run's lock)."""
    from fedfeat.report import rundir

    part = path.parent / f"{rundir.PARTIAL}{path.name}"
    if not part.is_dir() or part.is_symlink():
        return ""
    if (part / "summary.json").is_file():
        return ": finished before an interruption, published"
    if (part / rundir.CHECKPOINT).is_file():
        return ": interrupted, resumed from its checkpoint"
    return ": interrupted before a checkpoint, started again"


class Failure(NamedTuple):
    """A grid point whose run failed: its index in the points, its run name, the error's one line."""

    index: int
    name: str
    error: str


def one_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    if isinstance(e, FedfeatError):
        return text[0] if text else ""
    return f"{type(e).__name__}: {' '.join(text)}"


class SweepFailed(FedfeatError):
    """Raised at the end of ``run_sweep`` (without a ``failures`` list) when runs failed; the others are written."""

    def __init__(self, failures: list[Failure]):
        self.failures = list(failures)
        f = failures[0]
        more = f" (and {len(failures) - 1} more)" if len(failures) > 1 else ""
        super().__init__(f"run {f.name} failed: {f.error}{more}; the other runs are written")


class Display:
    """One progress line for long jobs (``sweep``, ``reproduce``): runs done / total, failures, ETA -- a ``rich``
    progress line on stderr; nothing when ``quiet``. ``advance`` counts runs (skipped finished ones too)."""

    def __init__(self, total: int, *, label: str = "runs", quiet: bool = False):
        self.total, self.done, self.failed, self.quiet, self.label = total, 0, 0, quiet, label
        self._bar = self._task = None

    def start(self) -> None:
        """Show the line (``run_sweep`` calls it once its points are checked: a refused sweep prints no progress)."""
        if self._bar is not None or self.quiet or self.total <= 0:
            return
        label, total = self.label, self.total
        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

        self._bar = Progress(
            TextColumn(f"[bold]{label}[/bold]"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("failed {task.fields[failed]}"),
            TextColumn("ETA"),
            TimeRemainingColumn(),
            console=Console(stderr=True),
            transient=False,
        )
        self._task = self._bar.add_task(label, total=total, failed=0)
        self._bar.start()

    def advance(self, n: int = 1, failed: int = 0) -> None:
        self.start()
        self.done += n
        self.failed += failed
        if self._bar is not None:
            self._bar.update(self._task, completed=self.done, failed=self.failed)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.stop()
            self._bar = None

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def failure_lines(failures: list[Failure]) -> list[str]:
    """The closing report of failed runs: a header and one line per run with its one-line error."""
    if not failures:
        return []
    return [f"{len(failures)} run(s) failed:"] + [f"  {f.name}: {f.error}" for f in failures]


def run_sweep(
    points: list[tuple[dict, dict]],
    *,
    overwrite: bool = False,
    progress: bool = True,
    log=print,
    stack: bool = True,
    failures: list | None = None,
    display: Display | None = None,
) -> list[Path]:
    """Make every point's run (skipping finished ones unless ``overwrite``); returns the run directories in the
    points' order. One process, one ``Session``; with ``stack``, runs that read the same data in one program
    (module docstring).

    A run that fails does not stop the others. With a ``failures`` list, each failure is appended to it as a
    ``Failure`` and its place in the result is None; without one, ``SweepFailed`` (a ``FedfeatError`` naming the
    first) is raised once every other run is written. ``display`` (a ``Display``) is advanced per run."""
    from fedfeat.report import rundir
    from fedfeat.runs.threads import refresh as refresh_threads
    from fedfeat.runs.train import run_name, stack_group, train_stacked
    from fedfeat.runs.train import train as run_train

    said: set = set()

    def once(msg: str) -> None:
        if msg not in said:
            said.add(msg)
            log(msg)

    display = display or Display(0, quiet=True)
    paths: list[Path] = []
    outer = active()
    with contextlib.nullcontext(outer) if outer is not None else session() as s:
        cfgs = configs(points, once)
        if not s.planned:  # memory follows the largest cell: entries dropped after their last run (Session)
            s.expect(cfgs)
        from fedfeat.store.urls import local_path

        for c in cfgs:  # run directories are local: a URL --out is refused before any store is opened
            local_path(c.out, "--out", "a local directory for run directories")
        names = [run_name(c) for c in cfgs]
        same = same_runs(cfgs, names)  # points whose settings differ only in what the run ignores: made once
        display.start()
        done: dict[int, Path] = {}
        pending = []
        for i, path in enumerate(names):
            if i in same:
                log(f"[{i + 1}/{len(cfgs)}] {path.name}: the same run as point {same[i] + 1}")
                s.done([cfgs[i]])
                display.advance()
                continue
            if (
                (path / "summary.json").is_file() and not path.is_symlink() and not overwrite
            ):  # a link: train refuses
                log(f"[{i + 1}/{len(cfgs)}] {path.name}: finished already, skipped")
                s.done([cfgs[i]])
                done[i] = path
                display.advance()
            else:
                pending.append(i)
        groups: dict = {}
        # a run a kill left with a checkpoint is resumed from it, alone (a stack starts from round 0)
        resumable = {i for i in pending if not overwrite and _unfinished(names[i]).endswith("checkpoint")}
        for i in pending:
            g = stack_group(cfgs[i]) if stack and i not in resumable else None
            groups.setdefault(("one", i) if g is None else g, []).append(i)
        # runs that read the same data run one after another (stable: each cell's groups at its first group's
        # place), so a cell's data is dropped before the next is loaded; every run's result is its own (the order
        # of independent runs changes no run directory or metric)
        # -- and the cells of one store one after another (stores in their first point's order), so that one
        # store's memo of whole splits is held at a time (``Session.loaded``)
        first: dict = {}
        for members in groups.values():
            sig = signatures(cfgs[members[0]])
            first.setdefault(sig["stores"], len(first))
            first.setdefault(sig["data"], len(first))

        def place(kv) -> tuple[int, int]:
            sig = signatures(cfgs[kv[1][0]])
            return first[sig["stores"]], first[sig["data"]]

        groups = dict(sorted(groups.items(), key=place))
        failed: list[Failure] = []

        def fail(i: int, e: BaseException) -> None:
            failed.append(Failure(i, names[i].name, one_line(e)))
            log(f"  {names[i].name}: failed: {failed[-1].error}")
            display.advance(failed=1)

        for members in groups.values():
            for c0 in range(0, len(members), STACK_MAX):
                chunk = members[c0 : c0 + STACK_MAX]
                refresh_threads()  # the thread policy again (every 10 s at most): other jobs may have started
                rundir.fault_point("sweep-next")  # tests: a kill between runs (FEDFEAT_FAULT=sweep-next@K)
                if len(chunk) == 1:
                    i = chunk[0]
                    what = "" if overwrite else _unfinished(names[i])
                    log(f"[{i + 1}/{len(cfgs)}] {names[i].name}{what}")
                    try:  # a run a kill left unfinished: resumed from its checkpoint, else started again
                        done[i] = run_train(cfgs[i], overwrite=overwrite, progress=progress, log=lambda *a: None,
                                            unfinished="finish")  # fmt: skip
                    except Exception as e:  # noqa: BLE001 -- recorded, reported at the end; Ctrl-C still stops
                        fail(i, e)
                        continue
                    finally:
                        s.done([cfgs[i]])  # what no later run reads is dropped now
                    display.advance()
                    continue
                log(
                    f"[{', '.join(str(i + 1) for i in chunk)}/{len(cfgs)}] {len(chunk)} runs stacked in one program"
                )
                try:
                    res = train_stacked([cfgs[i] for i in chunk], overwrite=overwrite, log=lambda *a: None,
                                        unfinished="finish")  # fmt: skip
                except Exception as e:  # noqa: BLE001 -- the whole stack failed: each of its runs is recorded
                    res = [e] * len(chunk)
                finally:
                    s.done([cfgs[i] for i in chunk])  # the stack shared one copy: dropped after the stack
                for i, r in zip(chunk, res):
                    if isinstance(r, BaseException):
                        fail(i, r)
                    else:
                        done[i] = r
                        display.advance()
        failed.sort(key=lambda f: f.index)
        if failed and failures is None:  # the others are written; the sweep's error names the first
            raise SweepFailed(failed)
        if failures is not None:
            failures.extend(failed)
        paths = [done.get(same.get(i, i)) for i in range(len(cfgs))]
        del s
    return paths


__all__ = [
    "MAX_DEPTH",
    "MAX_POINTS",
    "Display",
    "Failure",
    "SweepFailed",
    "applicable_points",
    "check_grid",
    "configs",
    "count_points",
    "expand",
    "failure_lines",
    "parse_values",
    "plan",
    "read_grid",
    "run_sweep",
    "same_runs",
]

"""Sweeps: a grid of runs in one process (``fedfeat sweep``, ``fedfeat.runs.sweep``).

Every grid point is an ordinary run directory (its own ``config.toml``, metrics, weights, name), made by the same
``fedfeat.runs.train.train`` as ``fedfeat train``. What a sweep adds is one process for all of them: the interpreter,
torch, the compiled CPU kernels, each store, each partition and each store's loaded features are made once and
shared (``Session``), so a grid of short runs costs its rounds, not 3-4 s of start-up per run. Finished runs
are skipped (a sweep can be re-run after an interruption and only does what is missing), unless ``overwrite``.

A grid is the cartesian product of value lists over run settings (``method``, ``seed``, ``alpha``, ...) and
method hyperparameters (``params``), times an optional list of *cells* -- settings that vary together, e.g.
partitions with their own parameters::

    # grid.toml
    [fixed]
    store = "cache/synth-cifar10.zarr"
    rounds = 10
    [grid]
    method = ["fedavg", "fst-cbdg"]
    seed = [0, 1, 2, 3, 4]
    [grid.params]
    sigma = [0.5, 1.0]            # a method without this hyperparameter skips the key (named in the log)
    [[cells]]
    partition = "shard"
    shards = 2
    [[cells]]
    partition = "dirichlet"
    alpha = 0.1

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
import itertools
import os
from pathlib import Path
from typing import NamedTuple

from fedfeat.errors import FedfeatError
from fedfeat.runs.session import active, session, signatures


def _as_list(key: str, v) -> list:
    if isinstance(v, list):
        if not v:
            raise FedfeatError(f"grid value list for {key} is empty; give at least one value")
        return v
    return [v]


def expand(grid: dict | None = None, params: dict | None = None, cells: list[dict] | None = None,
           fixed: dict | None = None, fixed_params: dict | None = None, *, log=None) -> list[tuple[dict, dict]]:  # fmt: skip
    """The grid's points as ``(settings, params)`` pairs, in a deterministic order: cells outermost, then the
    grid's keys in the order given, then its params.

    ``cells`` is a list of tables (settings that vary together; a cell's ``params`` table adds hyperparameters), or
    a dict of such lists (``[[cells.methods]]``, ``[[cells.partitions]]``), which are crossed. Every key and value
    is type-checked first (``check_grid``): a wrong one is a one-line ``FedfeatError``.

    A hyperparameter that a point's method lacks drops out of that point (``--method fedavg,fedprox --set
    mu=0.01,0.1``: fedprox twice, fedavg once), said once per method in ``log``; points that become equal are kept
    once, at the first one's place (``applicable_points``)."""
    return applicable_points(_expand(grid, params, cells, fixed, fixed_params), log=log)


def applicable_points(points: list[tuple[dict, dict]], log=None) -> list[tuple[dict, dict]]:
    """Each point with only the hyperparameters its method has (``_applicable``), points that thereby become
    equal kept once (the first); each (method, dropped keys) said once in ``log``."""
    from fedfeat.runs.config import DEFAULTS

    said: set = set()

    def once(msg: str) -> None:
        if log is not None and msg not in said:
            said.add(msg)
            log(msg)

    out, seen = [], set()
    for settings, params in points:
        ps = _applicable(settings.get("method", DEFAULTS["method"]), params, once)
        key = (repr(sorted(settings.items())), repr(sorted(ps.items())))
        if key not in seen:
            seen.add(key)
            out.append((settings, ps))
    return out


def _expand(grid, params, cells, fixed, fixed_params) -> list[tuple[dict, dict]]:
    check_grid(grid, params, cells, fixed, fixed_params, where="sweep grid")
    grid, params = dict(grid or {}), dict(params or {})
    axes = list(cells.values()) if isinstance(cells, dict) else [cells or [{}]]
    combos = []
    for parts in itertools.product(*axes):
        merged: dict = {}
        for cell in parts:
            if not isinstance(cell, dict):
                raise FedfeatError(
                    'each [[cells]] entry must be a table of settings, e.g. partition = "shard"'
                )
            cp = {**merged.get("params", {}), **cell.get("params", {})}
            merged = {**merged, **cell, "params": cp}
        combos.append(merged)
    keys, pkeys = list(grid), list(params)
    out = []
    for cell in combos:
        cell = dict(cell)
        cell_params = cell.pop("params", {})
        for vals in itertools.product(*(_as_list(k, grid[k]) for k in keys)):
            for pvals in itertools.product(*(_as_list(k, params[k]) for k in pkeys)):
                settings = {**(fixed or {}), **cell, **dict(zip(keys, vals))}
                out.append((settings, {**(fixed_params or {}), **cell_params, **dict(zip(pkeys, pvals))}))
    return out


def parse_values(key: str, text: str, typ=str) -> list:
    """``"0,1,2"`` or a range ``"0-4"`` (integers only) -> typed values; a one-line error names a bad one."""
    text = text.strip()
    flag = "--" + key.replace("_", "-")  # the option as typed
    if typ is int and "-" in text and "," not in text and not text.startswith("-"):
        a, _, b = text.partition("-")
        try:
            lo, hi = int(a), int(b)
        except ValueError:
            raise FedfeatError(f"{flag} {text!r}: a range is two integers, e.g. 0-4") from None
        if hi < lo:
            raise FedfeatError(f"{flag} {text!r}: the range is empty (write low-high, e.g. 0-4)")
        return list(range(lo, hi + 1))
    out = []
    for v in (x.strip() for x in text.split(",")):
        if not v:
            raise FedfeatError(f"{flag} {text!r} has an empty value; separate values with single commas")
        try:
            out.append(typ(v))
        except ValueError:
            raise FedfeatError(f"{flag}: {v!r} is not a {typ.__name__}") from None
    return out


_GRID_EXAMPLE = (
    "pass a grid TOML file: [fixed] settings, [grid] value lists, [[cells]] tables (fedfeat/runs/sweep.py)"
)
TABLES = ("fixed", "grid", "cells")


def read_grid(path: str | os.PathLike) -> dict:
    """A grid TOML file (module docstring) -> ``expand``'s keyword arguments. Every table, key and value is
    type-checked (``check_grid``): a wrong one is one line naming the file, the table, the key and the type."""
    from fedfeat.runs.config import read_toml, short, toml_kind

    p = Path(path)
    where = f"grid file {p}"
    data = read_toml(p, "grid file", _GRID_EXAMPLE)
    unknown = set(data) - set(TABLES)
    if unknown:
        raise FedfeatError(f"{where}: unknown tables {sorted(unknown)}; use [fixed], [grid], [[cells]]")
    for t in ("fixed", "grid"):
        if not isinstance(data.get(t, {}), dict):
            v = data[t]
            raise FedfeatError(
                f"{where}: {t} = {short(v)} is {toml_kind(v)}, but [{t}] is a table of settings "
                f"(e.g. [{t}] then {'seed = [0, 1]' if t == 'grid' else 'rounds = 10'})"
            )
    fixed, grid = dict(data.get("fixed", {})), dict(data.get("grid", {}))
    for t, tbl in (("fixed", fixed), ("grid", grid)):
        if not isinstance(tbl.get("params", {}), dict):
            v = tbl["params"]
            raise FedfeatError(
                f"{where} [{t}]: params = {short(v)} is {toml_kind(v)}, but [{t}.params] is a table of "
                "hyperparameters (e.g. [{t}.params] then lr = 0.01)".replace("{t}", t)
            )
    kw = {
        "grid": {k: v for k, v in grid.items() if k != "params"},
        "params": grid.get("params", {}),
        "cells": data.get("cells"),
        "fixed": {k: v for k, v in fixed.items() if k != "params"},
        "fixed_params": fixed.get("params", {}),
    }
    check_grid(**kw, where=where)
    return kw


def _settings(tbl: dict, where: str, axis: bool) -> None:
    """Run settings: known keys, each value of its type (``axis``: a value or a non-empty list of values)."""
    from fedfeat.runs.config import DEFAULTS, TYPES, check_setting, key_text, short
    from fedfeat.spec import SWEEP_FIXED, SWEEPABLE

    for k, v in tbl.items():
        if k not in DEFAULTS:
            raise FedfeatError(
                f"{where}: unknown key {key_text(k)}; valid: {', '.join(sorted(DEFAULTS))} (and a params table)"
            )
        if k not in SWEEPABLE and not (k in SWEEP_FIXED and not axis):
            if k in SWEEP_FIXED:
                raise FedfeatError(
                    f"{where}: {key_text(k)} takes one value for the whole sweep; put it in [fixed]"
                )
            raise FedfeatError(
                f"{where}: {key_text(k)} is the sweep's to set (each run's name, a replayed store's fingerprint); "
                "drop it"
            )
        typ = TYPES.get(k, str)
        if axis and isinstance(v, str) and typ is not str:
            try:
                vals = parse_values(k, v, typ)
            except FedfeatError:
                vals = None
            eg = short(vals, 60) if vals else "[1, 2]" if typ is int else "[0.1, 0.5]"
            raise FedfeatError(
                f"{where}: {k} = {short(v)} is a string, but {k} takes a list of "
                f"{'integers' if typ is int else 'numbers'} (e.g. {k} = {eg})"
            )
        if isinstance(v, list) and axis:
            if not v:
                raise FedfeatError(f"{where}: {k} = [] is empty; give at least one value (e.g. {k} = [...])")
            for i, x in enumerate(v):
                check_setting(k, x, where, shown=f"{k}[{i}]")
        elif isinstance(v, list) and v and not all(isinstance(x, dict) for x in v):
            raise FedfeatError(
                f"{where}: {k} = {short(v)} is an array, but {k} takes one value here; a list of values to "
                "sweep belongs in [grid]"
            )
        else:
            check_setting(k, v, where)


def _params(tbl, where: str, axis: bool, methods, label: str = "params") -> None:
    """Hyperparameters: a table of scalars (``axis``: or non-empty lists of scalars), typed as each of
    ``methods`` that has the key wants."""
    from fedfeat.runs.config import check_method_params, check_param_value, key_text, short, toml_kind

    if not isinstance(tbl, dict):
        raise FedfeatError(
            f"{where}: params = {short(tbl)} is {toml_kind(tbl)}, but params is a table of hyperparameters "
            "(e.g. params = { lr = 0.01 })"
        )
    for k, v in tbl.items():
        if not isinstance(k, str) or not k:
            raise FedfeatError(f"{where}: params has an empty key; name each hyperparameter")
        vals = v if axis and isinstance(v, list) else [v]
        if not vals:
            raise FedfeatError(f"{where}: params {key_text(k)} = [] is empty; give at least one value")
        for x in vals:
            check_param_value(k, x, f"{where} {label}".strip())
            check_method_params(methods, {k: x}, f"{where} {label}".strip())


def check_grid(grid=None, params=None, cells=None, fixed=None, fixed_params=None, *, where: str) -> None:
    """``expand``'s arguments, checked: tables where tables belong, known setting names with values of their
    types (``[grid]``: a value or a non-empty list), hyperparameters as scalars of the types their methods want,
    ``cells`` a non-empty list of tables or a table of such lists. One line naming ``where``, the table, the key
    and the type expected."""
    from fedfeat.runs.config import DEFAULTS, key_text, short, toml_kind

    def table(v, name: str) -> dict:
        if v is None:
            return {}
        if not isinstance(v, dict):
            raise FedfeatError(f"{where}: {name} = {short(v)} is {toml_kind(v)}, but {name} is a table")
        return v

    grid, params = table(grid, "[grid]"), table(params, "[grid.params]")
    fixed, fixed_params = table(fixed, "[fixed]"), table(fixed_params, "[fixed.params]")
    _settings(fixed, f"{where} [fixed]", axis=False)
    _settings(grid, f"{where} [grid]", axis=True)

    axes: list[tuple[str, list]] = []
    if isinstance(cells, dict):
        if not cells:
            raise FedfeatError(f"{where}: [cells] is an empty table; give [[cells.NAME]] tables or drop it")
        for name, v in cells.items():
            name = key_text(name)
            if not isinstance(v, list):
                raise FedfeatError(
                    f"{where}: cells.{name} = {short(v)} is {toml_kind(v)}, but cells.{name} takes an array of "
                    f"tables ([[cells.{name}]] entries)"
                )
            axes.append((f"[[cells.{name}]]", v))
    elif cells is not None:
        if not isinstance(cells, list):
            raise FedfeatError(
                f"{where}: cells = {short(cells)} is {toml_kind(cells)}, but cells takes an array of tables "
                '([[cells]] entries, e.g. [[cells]] then partition = "shard")'
            )
        axes.append(("[[cells]]", cells))
    cell_methods = []
    for name, entries in axes:
        if not entries:
            raise FedfeatError(f"{where}: {name} has no entries; give at least one table or drop it")
        for i, cell in enumerate(entries):
            if not isinstance(cell, dict):
                raise FedfeatError(
                    f"{where}: {name} entry {i + 1} = {short(cell)} is {toml_kind(cell)}, but each entry is a "
                    'table of settings (e.g. partition = "shard")'
                )
            _settings(
                {k: v for k, v in cell.items() if k != "params"}, f"{where} {name} entry {i + 1}", False
            )
            cell_methods.append(cell.get("method"))

    def listed(v) -> list:
        return v if isinstance(v, list) else [v]

    methods = [*listed(grid.get("method", [])), *([fixed["method"]] if "method" in fixed else [])]
    methods = list(dict.fromkeys([*methods, *(m for m in cell_methods if m is not None)]))
    methods = methods or [DEFAULTS["method"]]
    _params(params, f"{where} [grid.params]", True, methods, label="")
    _params(fixed_params, f"{where} [fixed.params]", False, methods, label="")
    for name, entries in axes:
        for i, cell in enumerate(entries):
            if "params" in cell:
                own = [cell["method"]] if "method" in cell else methods
                _params(cell["params"], f"{where} {name} entry {i + 1}", False, own)


def _applicable(method: str, params: dict, log) -> dict:
    """The params that ``method`` has (a grid over one method's hyperparameter leaves the others alone)."""
    import dataclasses

    from fedfeat.methods import REGISTRY

    cls = REGISTRY.get(method)
    if cls is None:
        return params  # get_method names the unknown method
    names = {f.name for f in dataclasses.fields(cls.Params)}
    dropped = sorted(k for k in params if k.replace("-", "_") not in names)
    if dropped:
        log(f"{method}: no hyperparameter {', '.join(dropped)}; those grid keys are skipped for it")
    return {k: v for k, v in params.items() if k.replace("-", "_") in names}


def configs(points: list[tuple[dict, dict]], log=None) -> list:
    """The points' resolved ``RunConfig``s (each with only the hyperparameters its method has), as ``run_sweep``
    runs them."""
    from fedfeat.runs.config import DEFAULTS, resolve_config

    out = []
    for settings, params in points:
        ps = _applicable(settings.get("method", DEFAULTS["method"]), params, log or (lambda *a: None))
        out.append(resolve_config(settings, None, [f"{k}={v}" for k, v in ps.items()]))
    return out


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
        display.start()
        seen: dict[Path, int] = {}
        same: dict[int, int] = {}  # points whose settings differ only in what the run ignores: made once
        for i, path in enumerate(names):
            if path in seen and cfgs[i] != cfgs[seen[path]]:  # zeroshot over partitions (it draws none)
                same[i] = seen[path]
            elif path in seen:
                raise FedfeatError(
                    f"grid points {seen[path] + 1} and {i + 1} are the same run ({path.name}); remove the duplicate"
                )
            seen[path] = i
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
        for i in pending:
            g = stack_group(cfgs[i]) if stack else None
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
                if len(chunk) == 1:
                    i = chunk[0]
                    log(f"[{i + 1}/{len(cfgs)}] {names[i].name}")
                    try:
                        done[i] = run_train(
                            cfgs[i], overwrite=overwrite, progress=progress, log=lambda *a: None
                        )
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
                    res = train_stacked([cfgs[i] for i in chunk], overwrite=overwrite, log=lambda *a: None)
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
    "Display",
    "Failure",
    "SweepFailed",
    "applicable_points",
    "check_grid",
    "expand",
    "failure_lines",
    "parse_values",
    "plan",
    "read_grid",
    "run_sweep",
]

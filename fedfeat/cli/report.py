"""``fedfeat report`` (compare finished runs) and ``fedfeat methods`` (the registered methods): parse, call one
library function."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer


def methods() -> None:
    """List the registered methods, whether they read labels, what they run on, their kernels, the differential
    privacy levels they have (--dp client / sample), defaults."""
    from rich.console import Console
    from rich.table import Table

    from fedfeat.methods import method_table

    t = Table(title="methods", show_lines=True)
    for c in ("name", "labels", "runs on", "kernels", "--dp", "what", "defaults (--set key=value)"):
        t.add_column(c, overflow="fold")
    for r in method_table():
        d = " ".join(f"{k}={v}" for k, v in r["defaults"].items())
        t.add_row(r["name"], r["labels"], r["runs_on"], r["kernels"], r["dp"], r["summary"], d)
    Console(width=160).print(t)


def report(
    runs: list[Path] = typer.Argument(..., help="Run directories (or parents of run directories)."),
    fmt: str = typer.Option("markdown", "--format", help="markdown, csv or json (plain numbers)."),
    plot: Optional[Path] = typer.Option(
        None,
        help="Draw the runs into this figure (.pdf, .svg or .png; TrueType fonts): one panel per partition, "
        "one mean ± std curve per setting over its seeds, the zero-shot level dashed (on long-tailed runs' many / "
        "medium / few rows, zero-shot's own accuracy on that group). A method has the same colour and marker in "
        "every figure; every setting a method's runs differ in is named in each legend label, its default value "
        "too; curves that coincide stay visible (each later one thinner, markers at other rounds). With --best "
        "the title says what the settings were selected on.",
    ),
    dpi: int = typer.Option(
        200,  # fedfeat.report.plots.DPI (its reason there; not imported: the CLI starts without numpy)
        "--dpi",
        help="--plot: a PNG's resolution (50-1200; 200 is sharp in a printed draft, journals ask 300 for raster "
        "line art). PDF and SVG are vector.",
    ),
    kind: str = typer.Option(
        "curves",
        help="--plot's figure: curves (--metric per round), clients (each client's accuracy, sorted) or privacy "
        "(final accuracy against the epsilon spent, per method and DP level, mean ± std over seeds; the method's "
        "non-private accuracy dotted).",
    ),
    metric: str = typer.Option(
        "test_acc",
        help="--plot curves: the per-round value of metrics.jsonl to draw (test_acc, local_acc, ...).",
    ),
    size: Optional[str] = typer.Option(
        None,
        help="--plot for print: one-column (3.3 in wide) or two-column (7 in), fonts sized to match.",
    ),
    all_runs: bool = typer.Option(
        False, "--all", help="Also list unfinished runs (interrupted or running) and how to resume them."
    ),
    seeds: bool = typer.Option(
        False,
        "--seeds",
        help="One row per group of runs that differ only in --seed: mean ± std (sample, n - 1) and n.",
    ),
    best: bool = typer.Option(
        False,
        "--best",
        help="Per method and partition, only the settings with the best mean: on val_acc where runs record a "
        "validation accuracy, else on the test split's final accuracy (the table says which).",
    ),
    memory: bool = typer.Option(
        False,
        "--memory",
        help="The tables also show the measured memory in GB (with --seeds / --best: mean ± std over the "
        "group's runs): the process's peak RSS so far, its RSS at the end, on CUDA its peak device memory "
        "(summary.json: peak_rss_bytes, rss_bytes_at_end, peak_device_bytes; --format json always has them).",
    ),
) -> None:
    """Compare finished runs: a table (markdown/CSV) and one plot with all curves.

    Each run is counted once however many paths name it: a run is its settings and seed (config.toml), not its
    folder, so `report DIR DIR` = `report DIR`, and copies of a run (the same run made by two launchers) are
    dropped, named on stderr; copies whose results disagree are each warned about, and the first is kept. The
    per-run table names each run and its seed. A run whose summary.json says it diverged is marked † with a
    footnote naming it, its round and the reason (CSV: a diverged column; JSON: a diverged field). Unreadable runs
    are skipped with a warning; the exit status is non-zero only when none is readable."""
    from fedfeat.report.tables import report as make_report
    from fedfeat.store.urls import local_path

    for r in runs:  # run directories are local: a URL is refused, never read as a folder named 'memory:'
        local_path(r, "report", "local run directories")
    if plot is not None:
        plot = local_path(plot, "--plot", "a local file")
    warn = lambda msg: typer.echo(msg, err=True)  # noqa: E731
    typer.echo(
        make_report(
            runs,
            fmt=fmt,
            plot=plot,
            all_runs=all_runs,
            seeds=seeds,
            best=best,
            warn=warn,
            metric=metric,
            size=size,
            kind=kind,
            memory=memory,
            dpi=dpi,
        )  # fmt: skip
    )
    if plot is not None:  # csv / json: on stderr, stdout stays one parseable document
        typer.echo(f"plot: {plot}", err=fmt != "markdown")


def register(app: typer.Typer) -> None:
    app.command()(methods)
    app.command()(report)

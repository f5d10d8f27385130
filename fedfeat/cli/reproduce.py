"""``fedfeat reproduce``: a paper's table, its grid x seeds in one process (``fedfeat.runs.reproduce``)."""

from __future__ import annotations

from typing import Optional

import typer

from fedfeat.cli.options import apply_threads, threads_option
from fedfeat.errors import FedfeatError


def reproduce(
    name: Optional[str] = typer.Argument(
        None,
        help="The table (see --list): fst-cbdg-table1 .. 4, clip2fl-table1, fed-mp-table1(-f1), fedcopl-table1.",
    ),
    list_: bool = typer.Option(
        False, "--list", help="List the tables (name, title, rows, setting; with NAME: that one) and exit."
    ),
    store_root: str = typer.Option(
        "cache",
        help="Where the encoded stores are: ROOT/<dataset>/<backbone>-*.zarr (a folder, or a store URL such "
        "as s3://bucket/cache; --synthetic builds its stand-ins in a local folder).",
    ),
    synthetic: bool = typer.Option(
        False,
        "--synthetic",
        help="Build synthetic stand-in stores (the numbers then say nothing about data; the title says so).",
    ),
    seeds: int = typer.Option(5, help="Seeds per cell (0 .. N-1)."),
    rounds: Optional[int] = typer.Option(None, help="Override the paper's round count (the header says so)."),
    out: Optional[str] = typer.Option(None, help="Parent of the runs, local. Default runs/reproduce-NAME."),
    fmt: str = typer.Option(
        "markdown",
        "--format",
        help="markdown, csv or json. Every number of ours says where it comes from: json cells carry synthetic, "
        "source ('synthetic stand-in' or 'encoded store'), stand_in and store; csv rows end with a source column "
        "and the header's prose is '#' comment lines (pandas: comment='#').",
    ),
    overwrite: bool = typer.Option(False, "--overwrite", help="Redo finished runs (default: reuse them)."),
    quiet: bool = typer.Option(False, "--quiet", help="No per-run lines and no progress line."),
    threads: str = threads_option(),
    ctx: typer.Context = None,  # given by typer: --threads holds for the command
) -> None:
    """Run a paper's table (its grid x seeds, in one process) and print it in the paper's layout, ours
    (mean ± std) beside the paper's numbers, under a header with the setting."""
    from fedfeat.runs.reproduce import TABLES, list_tables
    from fedfeat.runs.reproduce import reproduce as run_table

    if list_:
        if fmt not in ("markdown", "csv", "json"):
            raise FedfeatError(f"unknown format '{fmt}'; choose markdown, csv or json")
        typer.echo(list_tables(fmt, name))  # NAME: that table only; an unknown one names the known ones
        return
    if name is None:
        raise FedfeatError(f"name a table (fedfeat reproduce --list): {', '.join(TABLES)}")
    from fedfeat.runs.sweep import failure_lines

    apply_threads(ctx, threads)  # before the runs touch torch (fedfeat.runs.threads)

    log = (lambda *a: None) if quiet else (lambda m: typer.echo(m, err=True))
    failures: list = []
    typer.echo(
        run_table(
            name,
            store_root=store_root,
            synthetic=synthetic,
            seeds=seeds,
            rounds=rounds,
            out=out,
            fmt=fmt,
            overwrite=overwrite,
            log=log,
            progress=not quiet,
            failures=failures,
        )  # fmt: skip
    )
    # the table counts the runs that were made; the failed ones are listed and the command fails
    if failures:
        for line in failure_lines(failures):
            typer.echo(line, err=True)
        raise typer.Exit(1)


def register(app: typer.Typer) -> None:
    app.command()(reproduce)

"""CLI commands of stage 2: ``train``, ``methods``, ``report``."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from fedfeat.errors import FedfeatError


def _loggers(names, log_dir) -> list:
    """``--logger`` (repeatable) and ``--log-dir``: the live loggers (``fedfeat.integrations.loggers``)."""
    if not names:
        if log_dir is not None:
            raise FedfeatError(
                "--log-dir is where --logger writes; add --logger tensorboard or --logger wandb"
            )
        return []
    from fedfeat.integrations.loggers import make_loggers

    return make_loggers(names, log_dir)


def register(app: typer.Typer) -> None:
    @app.command()
    def train(
        method: Optional[str] = typer.Option(
            None, help="Method name (see `fedfeat methods`). Default fst-cbdg."
        ),
        store: Optional[str] = typer.Option(
            None,
            help="Feature store: a path or an fsspec URL (file://, memory://, s3:// with s3fs, gs:// with gcsfs). "
            "Default cache/synth-cifar10.zarr.",
        ),
        partition: Optional[str] = typer.Option(
            None, help="Partition scheme, as `fedfeat partition --scheme`. Default dirichlet."
        ),
        alpha: Optional[float] = typer.Option(
            None, help="Dirichlet alpha (default 0.1; 0.5 for dirichlet-equal)."
        ),
        shards: Optional[int] = typer.Option(
            None, help="Shards per client for --partition shard (default 2)."
        ),
        imbalance_factor: Optional[float] = typer.Option(
            None, help="Long-tail the training split first (e.g. 100), as in CLIP2FL."
        ),
        partition_seed: Optional[int] = typer.Option(
            None,
            help="Partition seed (default FedNTD's 19940817; CLIP2FL's 7 for dirichlet-equal/longtail; FedCoPL's 2 for dirichlet-joint).",
        ),
        min_size: Optional[int] = typer.Option(
            None,
            help="--partition dirichlet: redraw until every client holds >= N samples (default FedNTD's 10; 0 "
            "accepts the first draw).",
        ),
        preset: Optional[str] = typer.Option(
            None,
            help="A Fed-MP dataset preset (caltech101, food101, flowers102, ucf101, fgvc-aircraft, stanford-cars): "
            "disjoint-classes, 10 shots, 10 clients, all clients, 2 rounds and the reference code's partition seed "
            "for that dataset; flags override it (README, open vocabulary).",
        ),
        shots: Optional[int] = typer.Option(
            None, help="Samples per client class for --partition disjoint-classes (Fed-MP; default 10)."
        ),
        local_val: Optional[str] = typer.Option(
            None,
            help="Open vocabulary: each client's train/validation split: paper (2 of 10 shots per class, default), "
            "code (Fed-MP's 80/20 permutation) or none.",
        ),
        class_order: Optional[str] = typer.Option(
            None,
            help="disjoint-classes' class order: preset (default with --preset: the store's classes matched by name "
            "to the preset's list and drawn in the reference code's order) or store (the store's class ids).",
        ),
        query_val: Optional[str] = typer.Option(
            None,
            help="Open vocabulary: the novel-class query set: paper (20 % validation / 80 % test, default) or code "
            "(all test).",
        ),
        pretrained: Optional[str] = typer.Option(
            None,
            help="Prompt-learning methods: the checkpoint the store was encoded with (checked by sha256), when it "
            "is no longer where `fedfeat encode` read it; or the open_clip tag's file.",
        ),
        local_test: Optional[str] = typer.Option(
            None,
            help="none (default); proportional: split the test set among the clients in proportion to their "
            "training class counts; joint: the test split drawn with --partition dirichlet-joint (FedCoPL). Reports "
            "local_acc, the mean of per-client accuracies (FedCoPL's metric).",
        ),
        val_split: Optional[float] = typer.Option(
            None,
            help="Hold out this fraction of each test class as a validation set (a fixed seed: the same split "
            "for every --seed): val_acc is measured on it, test metrics leave it out, and `report --best` selects on "
            "it. Open-vocabulary runs validate on the query set's 20 % (--query-val paper) instead. Default: none.",
        ),
        clients: Optional[int] = typer.Option(None, help="Number of clients. Default 100."),
        participation: Optional[float] = typer.Option(
            None, help="Fraction of clients per round; max(1, int(p * clients)) are sampled. Default 0.1."
        ),
        rounds: Optional[int] = typer.Option(None, help="Communication rounds. Default 10."),
        eval_every: Optional[int] = typer.Option(
            None,
            help="Evaluate on the test split at round 0, every N-th round and the last (best acc is over those "
            "rounds). Default 1.",
        ),
        seed: Optional[int] = typer.Option(
            None, help="Run seed (client sampling, shuffles, synthetic draws)."
        ),
        engine: Optional[str] = typer.Option(
            None,
            help="batched (all sampled clients at once) or loop (one client after another). Default batched.",
        ),
        kernel: Optional[str] = typer.Option(
            None,
            help="auto (fused CPU kernel where a method has one, on CPU with the batched engine; else torch), "
            "fused or torch (the batched tensor program). Default auto.",
        ),
        device: Optional[str] = typer.Option(None, help="auto, cpu or cuda. Default auto."),
        set_: Optional[list[str]] = typer.Option(
            None,
            "--set",
            help="Method hyperparameter key=value (repeatable); unknown keys list the valid ones.",
        ),
        config: Optional[Path] = typer.Option(
            None, help="A run's config.toml to replay (flags override it)."
        ),
        out: Optional[str] = typer.Option(
            None, help="Parent directory of run directories, local (a URL is refused). Default runs/."
        ),
        name: Optional[str] = typer.Option(
            None,
            help="Run directory name, one path component (default: method__store__partition__seedS__hash, the "
            "hash standing for every other non-default setting).",
        ),
        overwrite: bool = typer.Option(
            False,
            "--overwrite",
            help="Replace a finished (or unfinished) run of the same name; the old run stays until the new one "
            "is complete, then the two are swapped atomically.",
        ),
        resume: Optional[Path] = typer.Option(
            None,
            help="Continue the interrupted run RUN_DIR (OUT/NAME) from its last checkpoint, with its own config; "
            "ends equal to an uninterrupted run.",
            metavar="RUN_DIR",
        ),
        checkpoint_every: Optional[int] = typer.Option(
            None,
            help="Checkpoint every N rounds for --resume (0: never). Default 10 (<= 5 % of the rounds' time at the "
            "CIFAR-10 shape, BENCHMARKS.md).",
        ),
        save_partition: bool = typer.Option(
            False,
            "--save-partition",
            help="Also save a newly computed partition into the store (needs a writable store); by default the "
            "store is only read and the partition is kept in the run directory.",
        ),
        shot_thresholds: Optional[str] = typer.Option(
            None, help="'many,few' training counts for many/medium/few accuracy, e.g. 1500,200 (CIFAR-10-LT)."
        ),
        quiet: bool = typer.Option(False, "--quiet", help="No progress bar."),
        logger: Optional[list[str]] = typer.Option(
            None,
            "--logger",
            help="Live logging (repeatable): tensorboard (event files in RUN/tb; pip install fedfeat[tensorboard]), "
            "wandb (an offline W&B run in RUN/wandb; pip install fedfeat[wandb]) or a fedfeat.callbacks plugin.",
        ),
        log_dir: Optional[Path] = typer.Option(
            None, help="Where --logger writes instead of the run directory (DIR/NAME for tensorboard)."
        ),
    ) -> None:
        """Train a method federatedly on a store's cached features; writes a run directory."""
        from fedfeat.runs.config import resolve_config
        from fedfeat.runs.train import train as run_train

        cli = {
            "method": method,
            "store": str(store) if store else None,
            "partition": partition,
            "alpha": alpha,
            "shards": shards,
            "imbalance_factor": imbalance_factor,
            "partition_seed": partition_seed,
            "min_size": min_size,
            "clients": clients,
            "shots": shots,
            "preset": preset,
            "local_val": local_val,
            "query_val": query_val,
            "class_order": class_order,
            "participation": participation,
            "rounds": rounds,
            "seed": seed,
            "engine": engine,
            "kernel": kernel,
            "device": device,
            "out": str(out) if out else None,
            "name": name,
            "shot_thresholds": shot_thresholds,
            "pretrained": pretrained,
            "local_test": local_test,
            "val_split": val_split,
            "eval_every": eval_every,
        }
        opts = dict(
            overwrite=overwrite,
            checkpoint_every=checkpoint_every,
            save_partition=save_partition,
            progress=not quiet,
            log=typer.echo,
            callbacks=_loggers(logger, log_dir),
        )
        if resume is not None:
            extra = [f"--{k.replace('_', '-')}" for k, v in cli.items() if v is not None]
            extra += ["--config"] * (config is not None) + ["--set"] * bool(set_)
            if extra:
                raise FedfeatError(
                    f"--resume continues a run with its own config; drop {', '.join(extra)} (or start a new run)"
                )
            run_train(None, resume=resume, **opts)
            return
        run_train(resolve_config(cli, config, set_), **opts)

    @app.command()
    def methods() -> None:
        """List the registered methods, whether they read labels, what they run on, their kernels, defaults."""
        from rich.console import Console
        from rich.table import Table

        from fedfeat.methods import method_table

        t = Table(title="methods", show_lines=True)
        for c in ("name", "labels", "runs on", "kernels", "what", "defaults (--set key=value)"):
            t.add_column(c, overflow="fold")
        for r in method_table():
            d = " ".join(f"{k}={v}" for k, v in r["defaults"].items())
            t.add_row(r["name"], r["labels"], r["runs_on"], r["kernels"], r["summary"], d)
        Console(width=160).print(t)

    @app.command()
    def report(
        runs: list[Path] = typer.Argument(..., help="Run directories (or parents of run directories)."),
        fmt: str = typer.Option("markdown", "--format", help="markdown, csv or json (plain numbers)."),
        plot: Optional[Path] = typer.Option(
            None,
            help="Draw the runs into this figure (.pdf, .svg or .png; TrueType fonts): one panel per partition, "
            "one mean ± std curve per setting over its seeds, the zero-shot level dashed.",
        ),
        kind: str = typer.Option(
            "curves",
            help="--plot's figure: curves (--metric per round) or clients (each client's accuracy, sorted).",
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
            help="The per-run table also shows each run's measured memory in GB: its process's peak RSS so far, "
            "its RSS at the end, on CUDA its peak device memory (summary.json: peak_rss_bytes, rss_bytes_at_end, "
            "peak_device_bytes; --format json always has them).",
        ),
    ) -> None:
        """Compare finished runs: a table (markdown/CSV) and one plot with all curves.

        Unreadable runs are skipped with a warning; the exit status is non-zero only when none is readable."""
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
            )  # fmt: skip
        )
        if plot is not None:  # csv / json: on stderr, stdout stays one parseable document
            typer.echo(f"plot: {plot}", err=fmt != "markdown")

    @app.command()
    def sweep(
        grid: Optional[Path] = typer.Option(
            None, help="A grid TOML file: [fixed] settings, [grid] value lists, [[cells]] (README, Sweeps)."
        ),
        method: Optional[str] = typer.Option(None, help="Methods, comma-separated (e.g. fedavg,fst-cbdg)."),
        store: Optional[str] = typer.Option(None, help="Stores, comma-separated."),
        partition: Optional[str] = typer.Option(None, help="Partition schemes, comma-separated."),
        alpha: Optional[str] = typer.Option(None, help="Dirichlet alphas, comma-separated."),
        shards: Optional[str] = typer.Option(None, help="Shards per client, comma-separated."),
        min_size: Optional[str] = typer.Option(
            None, help="--partition dirichlet's minimum client sizes, comma-separated (default 10)."
        ),
        clients: Optional[str] = typer.Option(None, help="Client counts, comma-separated."),
        participation: Optional[str] = typer.Option(None, help="Participations, comma-separated."),
        rounds: Optional[str] = typer.Option(None, help="Round counts, comma-separated."),
        seed: Optional[str] = typer.Option(None, help="Seeds, comma-separated or a range: 0,1,2 or 0-4."),
        engine: Optional[str] = typer.Option(None, help="batched and/or loop."),
        kernel: Optional[str] = typer.Option(None, help="auto, fused, torch."),
        device: Optional[str] = typer.Option(None, help="auto, cpu or cuda."),
        set_: Optional[list[str]] = typer.Option(
            None, "--set", help="Hyperparameter key=v1,v2 (repeatable): every value is a grid axis."
        ),
        out: Optional[str] = typer.Option(None, help="Parent directory of the runs, local. Default runs/."),
        overwrite: bool = typer.Option(False, "--overwrite", help="Redo finished runs (default: skip them)."),
        fmt: str = typer.Option("markdown", "--format", help="The closing table: markdown, csv or json."),
        quiet: bool = typer.Option(False, "--quiet", help="No per-run lines and no progress line."),
        stack: bool = typer.Option(
            True,
            "--stack/--no-stack",
            help="Make runs of fedavg / fedprox / fedntd / fst-cbdg that read the same data as one batched program along a "
            "run axis (seeds and hyperparameters may differ; each run equals the same run made alone).",
        ),
        launcher: str = typer.Option(
            "local",
            help="local (this process), slurm (Slurm jobs through submitit: pip install fedfeat[slurm]) or ray (Ray "
            "tasks: pip install fedfeat[ray]); every launcher writes the same run directories.",
        ),
        jobs: int = typer.Option(
            4, help="slurm / ray: how many jobs (tasks) the pending runs are split into."
        ),
        slurm_partition: Optional[str] = typer.Option(None, help="slurm: the Slurm partition of the jobs."),
        slurm_time: int = typer.Option(60, help="slurm: each job's time limit in minutes."),
        slurm_cluster: Optional[str] = typer.Option(
            None,
            help="slurm: submitit's cluster: slurm (default where sbatch exists), local (subprocesses here) or debug.",
        ),
        ray_address: Optional[str] = typer.Option(
            None,
            help="ray: a running cluster's address (auto: the one ray start made); default: Ray started here.",
        ),
    ) -> None:
        """Run a grid of runs in one process (stores, partitions and features loaded once; runs that read the same
        data stacked into one program); every point is an ordinary run directory; finished runs are skipped. Ends
        with mean ± std over seeds per setting."""
        from fedfeat.report.tables import report
        from fedfeat.runs import sweep as sw
        from fedfeat.runs.config import TYPES

        kw = sw.read_grid(grid) if grid is not None else {"grid": {}, "params": {}, "fixed": {}}
        flags = {"method": method, "store": store, "partition": partition, "alpha": alpha, "shards": shards,
                 "min_size": min_size, "clients": clients, "participation": participation, "rounds": rounds, "seed": seed,
                 "engine": engine, "kernel": kernel, "device": device}  # fmt: skip
        for k, v in flags.items():
            if v is not None:
                kw["grid"][k] = sw.parse_values(k, v, TYPES.get(k, str))
        for s in set_ or []:
            if "=" not in s:
                raise FedfeatError(f"--set expects key=value[,value...], got {s!r}; e.g. --set sigma=0.5,1,2")
            k, v = s.split("=", 1)
            kw["params"][k.strip()] = sw.parse_values(k.strip(), v, str)
        if out is not None:
            kw["fixed"]["out"] = str(out)
        from fedfeat.runs.launch import launch

        log = (lambda *a: None) if quiet else typer.echo
        points = sw.expand(**kw, log=log)
        failures: list = []
        with sw.Display(len(points), label="sweep", quiet=quiet) as display:
            paths = launch(points, launcher=launcher, jobs=jobs, overwrite=overwrite, stack=stack, log=log,
                           display=display, failures=failures, slurm_partition=slurm_partition,
                           slurm_time=slurm_time, slurm_cluster=slurm_cluster, ray_address=ray_address)  # fmt: skip
        made = list(dict.fromkeys(p for p in paths if p is not None))  # a run two points share: once
        if made:
            typer.echo(report(made, fmt=fmt, seeds=True, warn=lambda m: typer.echo(m, err=True)))
        if failures:  # the others are written and reported; the command fails
            for line in sw.failure_lines(failures):
                typer.echo(line, err=True)
            raise typer.Exit(1)

    @app.command()
    def reproduce(
        name: Optional[str] = typer.Argument(
            None,
            help="The table (see --list): fst-cbdg-table1 .. 4, clip2fl-table1, fed-mp-table1(-f1), fedcopl-table1.",
        ),
        list_: bool = typer.Option(
            False, "--list", help="List the tables (name, title, rows, setting) and exit."
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
        rounds: Optional[int] = typer.Option(
            None, help="Override the paper's round count (the header says so)."
        ),
        out: Optional[str] = typer.Option(
            None, help="Parent of the runs, local. Default runs/reproduce-NAME."
        ),
        fmt: str = typer.Option("markdown", "--format", help="markdown, csv or json."),
        overwrite: bool = typer.Option(
            False, "--overwrite", help="Redo finished runs (default: reuse them)."
        ),
        quiet: bool = typer.Option(False, "--quiet", help="No per-run lines and no progress line."),
    ) -> None:
        """Run a paper's table (its grid x seeds, in one process) and print it in the paper's layout, ours
        (mean ± std) beside the paper's numbers, under a header with the setting."""
        from fedfeat.runs.reproduce import TABLES, list_tables
        from fedfeat.runs.reproduce import reproduce as run_table

        if list_:
            if fmt not in ("markdown", "csv", "json"):
                raise FedfeatError(f"unknown format '{fmt}'; choose markdown, csv or json")
            typer.echo(list_tables(fmt))
            return
        if name is None:
            raise FedfeatError(f"name a table (fedfeat reproduce --list): {', '.join(TABLES)}")
        from fedfeat.runs.sweep import failure_lines

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

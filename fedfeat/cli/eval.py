"""``fedfeat eval RUN --store STORE``: a saved run's model on another store (``fedfeat.runs.evaluate``).

The main app (``fedfeat/cli/app.py``) calls ``register(app)``; a ``FedfeatError`` becomes one line, exit status 2."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Optional

import typer


def register(app: typer.Typer) -> None:
    """Add the ``eval`` command to ``app``."""

    @app.command("eval")
    def eval_cmd(
        run: Annotated[
            Path, typer.Argument(help="A finished run directory (config.toml, weights.safetensors).")
        ],
        store: Annotated[
            Optional[str],
            typer.Option(
                help="The store whose test split is scored (default: the run's own store, at the path its "
                "config.toml records; it must still have the fingerprint the run recorded).",
                show_default=False,
            ),
        ] = None,
        store_fingerprint: Annotated[
            Optional[str],
            typer.Option(
                "--store-fingerprint",
                help="The fingerprint hash the scored store must have (fedfeat info prints it). Default: the "
                "run's recorded one when the store is the run's own path, none for another --store. Give the "
                "other store's fingerprint to score a store that replaced the run's at its path.",
                show_default=False,
            ),
        ] = None,
        out: Annotated[
            Optional[Path],
            typer.Option(
                help="Output directory (default: RUN/eval-<store's folder>-<store name>-<fingerprint, 8 hex>, one "
                "per store). Another evaluation there is replaced only with --overwrite.",
                show_default=False,
            ),
        ] = None,
        classes: Annotated[
            Optional[str],
            typer.Option(
                help="Comma-separated class names to score (base -> novel), default all.", show_default=False
            ),
        ] = None,
        format: Annotated[str, typer.Option("--format", help="markdown or json.")] = "markdown",
        device: Annotated[str, typer.Option(help="auto, cpu or cuda (cuda:N).")] = "cpu",
        overwrite: Annotated[
            bool,
            typer.Option(
                "--overwrite",
                help="Replace another evaluation (other run, store or --classes) in the output.",
            ),
        ] = False,
    ) -> None:
        """Evaluate a saved head, adapter or prompt on another store: accuracy, per-class accuracy, mean class
        accuracy, macro F1, the confusion matrix (results.npz) and CLIP_benchmark's JSON, written into --out
        (eval.json last). A class with no test row (outside --classes, or none in the store) is unscored: null in
        per_class_acc (NaN in results.npz), left out of mean_class_acc, counted in unscored_classes. The run's
        own store (no --store, or its recorded path) must have the fingerprint the run recorded; the weights
        must match the digest summary.json records; --out is never the run directory or another run."""
        from fedfeat.errors import FedfeatError
        from fedfeat.runs.evaluate import evaluate_run

        if format not in ("markdown", "json"):
            raise FedfeatError(f"unknown format '{format}'; choose markdown or json")
        cl = [c.strip() for c in classes.split(",") if c.strip()] if classes else None
        res = evaluate_run(
            run,
            store,
            out=out,
            classes=cl,
            device=device,
            overwrite=overwrite,
            store_fingerprint=store_fingerprint,
        )
        if format == "json":
            typer.echo(json.dumps(res, indent=1))
            return
        typer.echo("| method | store | classes | test rows | acc | mean class acc | macro F1 |\n"
                   "|---|---|---|---|---|---|---|")  # fmt: skip
        typer.echo(f"| {res['method']} | {res['store']} | {res['scored_classes']} scored of {len(res['per_class_acc'])} | "
                   f"{res['test_rows']} | {res['acc']:.2f} | {res['mean_class_acc']:.2f} | {res['macro_f1']:.2f} |")  # fmt: skip
        if res["unscored_classes"]:
            typer.echo(f"{res['unscored_classes']} class(es) have no test row here and are unscored (null in "
                       "eval.json's per_class_acc, left out of the means)")  # fmt: skip
        typer.echo(f"written: {res['out']}")

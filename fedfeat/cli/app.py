"""The ``fedfeat`` command line. It only parses flags and calls one library function per command.

Errors a user can cause (``FedfeatError``) print as one line, ``error: ...``, with exit status 2. Ctrl-C
(SIGINT) ends any command with one line and exit status 130, SIGTERM with 143 -- also when a library swallowed
the ``KeyboardInterrupt`` (numba's first compile of the fused kernels: ``fedfeat.report.rundir.interrupt_latch``);
what the command was writing is left unfinished (a hidden ``.partial-`` run, a store without its complete flag).
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer
from typer.core import TyperGroup

from fedfeat.cli import encode as cli_encode
from fedfeat.cli import eval as cli_eval
from fedfeat.cli import partition as cli_partition
from fedfeat.cli import report as cli_report
from fedfeat.cli import reproduce as cli_reproduce
from fedfeat.cli import sweep as cli_sweep
from fedfeat.cli import train as cli_train
from fedfeat.errors import FedfeatError


class _Group(TyperGroup):
    """Prints a ``FedfeatError`` from any subcommand as one line and exits with status 2."""

    def invoke(self, ctx):
        from fedfeat.report.rundir import Interrupted, interrupt_latch, interrupted

        try:
            with interrupt_latch():  # Ctrl-C ends every command with 130, even one a library swallowed
                rv = super().invoke(ctx)
                if isinstance(interrupted(), KeyboardInterrupt):
                    raise KeyboardInterrupt
                if isinstance(interrupted(), Interrupted):
                    raise Interrupted(15)
                return rv
        except FedfeatError as e:
            typer.echo(f"error: {e}", err=True)
            raise typer.Exit(2) from None
        except KeyboardInterrupt:
            typer.echo("error: interrupted (Ctrl-C)", err=True)
            raise typer.Exit(130) from None
        except Interrupted:
            typer.echo("error: terminated (SIGTERM)", err=True)
            raise typer.Exit(143) from None
        except OSError as e:  # the environment, not fedfeat: a full disk, a read-only filesystem, permissions
            where = f" ({e.filename})" if e.filename else ""
            typer.echo(
                f"error: {e.strerror or e}{where}; free space, or choose a writable location and run again",
                err=True,
            )
            raise typer.Exit(2) from None


app = typer.Typer(
    cls=_Group,
    name="fedfeat",
    help="Federated learning on cached frozen-CLIP features: encode once, train every method fast.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)


@app.command()
def synth(
    out: str = typer.Option(
        "cache/synth-cifar10.zarr",
        "--out",
        help="Store directory to write, or an fsspec URL (memory://, s3:// with s3fs, gs:// with gcsfs): written "
        "locally in a temporary folder, then copied there (its root metadata last).",
    ),
    preset: str = typer.Option(
        "cifar10-rn50",
        help="Named parameter set: cifar10-rn50 (CIFAR-10 under RN50) or caltech101-vitl14 (Fed-MP's Caltech101 "
        "under ViT-L/14@336: 102 classes, D = 768); the flags below override its fields.",
    ),
    classes: Optional[int] = typer.Option(None, help="Number of classes K (preset: 10)."),
    dim: Optional[int] = typer.Option(
        None, help="Embedding dimension D (RN50: 1024, ViT-B: 512, ViT-L: 768)."
    ),
    train_per_class: Optional[int] = typer.Option(None, help="Training samples per class (preset: 5000)."),
    test_per_class: Optional[int] = typer.Option(None, help="Test samples per class (preset: 1000)."),
    templates: Optional[int] = typer.Option(
        None, help="Prompt templates, text embeddings per class (preset: 18)."
    ),
    seed: int = typer.Option(0, help="Generator seed: the same seed gives the same store, byte for byte."),
    stats: bool = typer.Option(True, help="Measure zero-shot / linear-probe / cosine statistics (~10 s)."),
    force: bool = typer.Option(False, "--force", help="Replace an existing store at --out."),
) -> None:
    """Write a synthetic CLIP-like store (default: CIFAR-10 shape under RN50) with the real layout."""
    import dataclasses

    from fedfeat.store.synth import PRESETS, write_synthetic_store

    if preset not in PRESETS:
        raise FedfeatError(f"unknown synth preset '{preset}'; choose one of: {', '.join(PRESETS)}")
    given = dict(
        classes=classes,
        dim=dim,
        train_per_class=train_per_class,
        test_per_class=test_per_class,
        templates=templates,
    )
    p = dataclasses.replace(PRESETS[preset], seed=seed, **{k: v for k, v in given.items() if v is not None})
    from fedfeat.store.urls import is_url, store_location

    store_location(out, write="--out")  # a URL pathlib collapsed, or a chained URL: one line, nothing written
    if not is_url(out):
        write_synthetic_store(store_location(out), p, force=force, stats=stats, log=typer.echo)
        typer.echo(f"store: {out}")
        return
    import shutil
    import tempfile

    from fedfeat.store.featurestore import FeatureStore, copy_store
    from fedfeat.store.urls import is_store

    url = store_location(out)
    tmp = Path(tempfile.mkdtemp(prefix="fedfeat-synth-"))
    try:
        local = write_synthetic_store(tmp / "store.zarr", p, stats=stats, log=typer.echo)
        if is_store(url) and not force:
            there = FeatureStore.open(url, allow_incomplete=True)
            if not there.complete or there.attrs.get("fingerprint_hash") != local.attrs["fingerprint_hash"]:
                raise FedfeatError(
                    f"{url} holds a different or incomplete store; pass --force to replace it, or choose --out"
                )
            typer.echo(f"{url}: a synthetic store with these parameters exists; nothing to do")
        else:
            copy_store(tmp / "store.zarr", url, overwrite=force, log=typer.echo)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    typer.echo(f"store: {url}")


@app.command()
def info(
    store: str = typer.Argument(
        ...,
        help="Store directory (made by `fedfeat synth` or `fedfeat encode`) or an fsspec URL (file://, memory://, "
        "s3:// with s3fs, gs:// with gcsfs).",
    ),
    as_json: bool = typer.Option(False, "--json", help="Print the attributes as JSON instead of a table."),
    verify: bool = typer.Option(
        False,
        "--verify",
        help="Check every chunk, the labels and the text features against their checksums and for "
        "NaN/inf first; a damaged store exits with status 2 and one line naming split, chunk and rows.",
    ),
) -> None:
    """Print a store's attributes, sizes and partitions (incomplete stores are shown, marked as such).

    Read-only: works on stores on read-only filesystems and writes nothing."""
    from fedfeat.report.stores import print_store_info

    print_store_info(store, as_json=as_json, verify=verify)


@app.command()
def models(
    all_tags: bool = typer.Option(
        False,
        "--all",
        help="Also list the pretrained tags whose weights are not here (they need a download).",
    ),
    local_only: bool = typer.Option(
        False, "--local", help="Only architectures with weights here (and the hf-hub / local-dir models)."
    ),
    local_dir: Optional[list[Path]] = typer.Option(
        None,
        "--dir",
        help="Also list local-dir: model folders (open_clip_config.json + weights) in DIR (repeatable).",
    ),
    cache_dir: Optional[Path] = typer.Option(
        None, help="The weights cache to look in (default: the Hugging Face cache, and ~/.cache/clip)."
    ),
    as_json: bool = typer.Option(False, "--json", help="Print JSON instead of tables."),
) -> None:
    """List open_clip architectures and the weights found locally (no network): pretrained tags in the caches,
    hf-hub:ORG/REPO models in the Hugging Face cache, local-dir: folders -- each usable as `encode --backbone`."""
    import json

    from rich.console import Console
    from rich.table import Table

    from fedfeat.encoders.openclip import list_models

    found = list_models(all_tags=all_tags, cache_dir=cache_dir, local_dirs=local_dir or ())
    if local_only:
        found["architectures"] = [a for a in found["architectures"] if a["local"]]
    if as_json:
        typer.echo(json.dumps(found, indent=2))
        return
    con = Console(width=160, highlight=False)
    t = Table(
        title="open_clip architectures (--backbone NAME, --pretrained TAG)",
        title_justify="left",
        min_width=60,
    )
    t.add_column("architecture", no_wrap=True)
    t.add_column("D", justify="right")
    t.add_column("weights here (tags)", overflow="fold")
    if all_tags:
        t.add_column("other tags (need a download)", overflow="fold")
    for a in found["architectures"]:
        row = [a["name"], str(a["embed_dim"] or "?"), ", ".join(x["tag"] for x in a["local"]) or "-"]
        if all_tags:
            row.append(", ".join(a["not_local"]) or "-")
        t.add_row(*row)
    con.print(t)
    n_local = sum(bool(a["local"]) for a in found["architectures"])
    con.print(f"{len(found['architectures'])} architectures, {n_local} with weights here")
    extra = found["hf_hub"] + found["local_dir"]
    if extra:
        h = Table(title="models with their own config (--backbone NAME)", title_justify="left")
        h.add_column("backbone", overflow="fold")
        h.add_column("weights", overflow="fold")
        for m in extra:
            h.add_row(m["name"], m["weights"] or "[red]missing[/red] (pass --pretrained FILE)")
        con.print(h)
    else:
        con.print(f"no hf-hub models in the Hugging Face cache ({found['hf_hub_cache']})")


@app.command("compile")
def compile_(
    quiet: bool = typer.Option(False, "--quiet", help="Print nothing but errors."),
) -> None:
    """Compile the fused CPU kernels now (numba, ~25 s once per machine) instead of in the first run.

    ``make install`` runs it. The machine code is cached on disk (next to fedfeat's source when that folder is
    writable, else numba's per-user cache; NUMBA_CACHE_DIR overrides), so every later run starts at once; a new
    machine, numba version or kernel source compiles again. Running it twice is harmless (the second loads the
    cache)."""
    from fedfeat.runs.compile import compile_kernels

    res = compile_kernels(log=(lambda s: None) if quiet else (lambda s: typer.echo(s, err=True)))
    if not quiet:
        sigs = ", ".join(f"{k.lstrip('_')} {v}" for k, v in res["signatures"].items())
        how = (
            f"compiled in {res['compile_seconds']:.1f} s"
            if res["compile_seconds"]
            else "all loaded from the cache"
        )
        typer.echo(
            f"fused kernels ready ({sigs} signatures; {how}; {res['seconds']:.1f} s in all); cache: {res['cache']}"
        )


# commands that live in their own modules (keeps this file a thin parser)
for _cmd in (cli_partition, cli_train, cli_report, cli_sweep, cli_reproduce, cli_encode, cli_eval):
    _cmd.register(app)


def main(argv: list[str] | None = None) -> None:
    """Entry point of the ``fedfeat`` console script."""
    app(args=argv, prog_name="fedfeat")


if __name__ == "__main__":
    main()

"""``fedfeat models`` (open_clip architectures and local weights) and ``fedfeat compile`` (the fused CPU kernels)."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer


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


def register(app: typer.Typer) -> None:
    app.command()(models)
    app.command("compile")(compile_)

"""``fedfeat synth`` (a synthetic store), ``fedfeat info`` (a store's attributes, sizes and partitions) and ``fedfeat
combine`` (several stores of one encoder as one, each a domain)."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from fedfeat.errors import FedfeatError


def synth(
    out: str = typer.Option(
        "cache/synth-cifar10.zarr",
        "--out",
        help="Store directory to write, or an fsspec URL (memory://, s3:// with s3fs, gs:// with gcsfs): written "
        "locally in a temporary folder, then copied there (its root metadata last).",
    ),
    preset: str = typer.Option(
        "cifar10-rn50",
        help="Named parameter set: cifar10-rn50 (CIFAR-10 under RN50), caltech101-vitl14 (Fed-MP's Caltech101 "
        "under ViT-L/14@336: 102 classes, D = 768), or a domain-shift stand-in under ViT-B/32 (D = 512, rows "
        "per domain): pacs-vitb32, officehome-vitb32, office-caltech10-vitb32, domainnet-vitb32; the flags "
        "below override its fields.",
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
    domains: Optional[int] = typer.Option(
        None,
        help="Domains N (feature-shift federations: clients = domains): each domain has the per-class counts "
        "above, its own offset of the image cloud and a harder or easier class signal; every row's domain is "
        "recorded. 0: no domains (as cifar10-rn50 and caltech101-vitl14). A count other than the preset's drops "
        "the preset's domain names and per-domain signal factors.",
    ),
    domain_shift: Optional[float] = typer.Option(
        None, help="Weight of each domain's own image-cloud offset (default 0.3; needs --domains)."
    ),
    seed: int = typer.Option(0, help="Generator seed: the same seed gives the same store, byte for byte."),
    stats: bool = typer.Option(True, help="Measure zero-shot / linear-probe / cosine statistics (~10 s)."),
    force: bool = typer.Option(False, "--force", help="Replace an existing store at --out."),
) -> None:
    """Write a synthetic CLIP-like store (default: CIFAR-10 shape under RN50) with the real layout."""
    import dataclasses

    from fedfeat.store.synth import DOMAIN_FIELDS, PRESETS, SynthParams, write_synthetic_store

    if preset not in PRESETS:
        raise FedfeatError(f"unknown synth preset '{preset}'; choose one of: {', '.join(PRESETS)}")
    given = dict(
        classes=classes,
        dim=dim,
        train_per_class=train_per_class,
        test_per_class=test_per_class,
        templates=templates,
        domains=domains,
        domain_shift=domain_shift,
    )
    base = PRESETS[preset]
    if (
        domains is not None and domains != base.domains
    ):  # the preset's per-domain fields fit its own count only
        dflt = SynthParams()
        base = dataclasses.replace(base, **{k: getattr(dflt, k) for k in DOMAIN_FIELDS})
    p = dataclasses.replace(base, seed=seed, **{k: v for k, v in given.items() if v is not None})
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


def combine(
    out: str = typer.Argument(..., metavar="OUT", help="Combined store directory to write (a local path)."),
    stores: list[str] = typer.Argument(
        ...,
        metavar="STORE",
        help="Two or more complete stores of one encoder (same backbone, weights and templates), each a domain of "
        "the combined store: their classes concatenated, each row's domain its store.",
    ),
    name: Optional[list[str]] = typer.Option(
        None,
        "--name",
        metavar="NAME",
        help="The domain name of each store, in their order (repeat: --name cifar10 --name pets). Default: each "
        "store's dataset, else its folder name.",
    ),
    overwrite: bool = typer.Option(
        False, "--overwrite", "--force", help="Replace a different store at OUT (an identical one is kept)."
    ),
) -> None:
    """Combine stores of one encoder into one store whose domains are the source datasets (a federation across
    datasets, FedTPG's setting: train with --partition domain, one client per dataset). Pixels are not combined."""
    from fedfeat.store.combine import combine_stores

    combine_stores(out, stores, name or None, overwrite=overwrite, log=typer.echo)
    typer.echo(f"store: {out}")


def register(app: typer.Typer) -> None:
    app.command()(synth)
    app.command()(info)
    app.command()(combine)

"""Image data as published: readers and class prompts. The bottom of the data flow.

Owns the ``ImageDataset`` interface and its readers (CIFAR "python version" pickles through a restricted unpickler,
ImageFolder trees, ``path label`` list files, CoOp split files and multi-domain layouts with each row's domain
(``fedfeat.data.domains``), ``hf:`` Hugging Face datasets and ``wds:`` webdataset shards), class
names as the datasets spell them, content fingerprints of the files read, and the prompt templates.

May import: ``fedfeat.errors`` only. Nothing here knows of CLIP, stores or training.
"""

from __future__ import annotations

import os
from pathlib import Path

from fedfeat.data.base import ImageDataset
from fedfeat.errors import FedfeatError

__all__ = ["ImageDataset", "open_dataset"]

OPTIONS = {"image_column": str, "label_column": str, "classnames": (str, os.PathLike),  # hf: and wds: only
           "domains": (str, list, tuple)}  # multi-domain readers (``fedfeat.data.domains``): a subset  # fmt: skip


def open_dataset(name: str, root: str | Path, options: dict | None = None) -> ImageDataset:
    """Open dataset format ``name`` at ``root`` (the layouts: ``fedfeat.data.files``' docstring).

    ``hf:NAME[:CONFIG]`` and ``wds:PATTERN`` (``fedfeat.data.hf``) resolve relative names against ``root``
    and take ``options``: ``image_column``, ``label_column``, ``classnames`` (a class-name file). The
    multi-domain readers (``domainnet``, ``domainfolder`` and its presets: ``fedfeat.data.domains``) take
    ``domains``: a subset of their domains (a list, or names separated by commas).

    Example::

        >>> ds = open_dataset("imagefolder", "data/pets")   # data/pets/{train,test}/<class>/*.jpg
        >>> ds.labels("test").dtype
        dtype('int64')
    """
    if options is not None and not isinstance(options, dict):
        raise FedfeatError(f"open_dataset options must be a dict, got {type(options).__name__}")
    opts = {k: v for k, v in (options or {}).items() if v is not None}
    for k, v in opts.items():  # wrong names or types: one line, not a TypeError from deep inside a reader
        if k not in OPTIONS:
            raise FedfeatError(f"unknown dataset option {k!r}; known: {', '.join(OPTIONS)}")
        if not isinstance(v, OPTIONS[k]):
            want = {"classnames": "a path (str or os.PathLike)", "domains": "domain names (a list or 'a,b')"}
            raise FedfeatError(f"dataset option {k} = {v!r} must be {want.get(k, 'a column name (str)')}")
    from fedfeat.data.files import DATASETS

    if "domains" in opts:  # the multi-domain readers' option
        takes = [n for n, c in DATASETS.items() if "domains" in c.options]
        if DATASETS.get(name) is None or "domains" not in DATASETS[name].options:
            raise FedfeatError(f"--domains applies to {', '.join(takes)} only, not to '{name}'; drop it")
    if name.startswith(("hf:", "wds:")):
        return _open_external(name, Path(root).expanduser(), **opts)
    ours = {k: v for k, v in opts.items() if k in getattr(DATASETS.get(name), "options", ())}
    if len(ours) < len(opts):
        flag = "--" + next(k for k in opts if k not in ours).replace("_", "-")
        raise FedfeatError(f"{flag} applies to hf: and wds: datasets only, not to '{name}'; drop it")

    if name not in DATASETS:
        raise FedfeatError(
            f"unknown dataset '{name}'; known: {', '.join(DATASETS)}, hf:NAME[:CONFIG], wds:PATTERN"
        )
    root = Path(root).expanduser()
    if not root.exists():
        raise FedfeatError(f"dataset root {root} does not exist; expected {DATASETS[name].layout}")
    return DATASETS[name](root, **ours)


def _open_external(
    spec: str,
    root: Path,
    image_column: str | None = None,
    label_column: str | None = None,
    classnames: str | Path | None = None,
) -> ImageDataset:
    """``hf:NAME[:CONFIG]`` or ``wds:PATTERN`` (relative names against ``root``) as an ``ImageDataset``."""
    names = Path(classnames).expanduser() if classnames is not None else None
    if names is not None and not names.is_file():
        raise FedfeatError(f"--classnames {names} not found; give a text file with one class name per line")
    kind, _, rest = spec.partition(":")
    if kind == "hf":
        from fedfeat.data.hf import HFDataset

        return HFDataset(rest, root, image_column, label_column, names)
    from fedfeat.data.wds import WebDataset

    return WebDataset(rest, root, image_column, label_column, names)

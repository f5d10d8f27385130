"""Image data as published: readers and class prompts. The bottom of the data flow.

Owns the ``ImageDataset`` interface and its readers (CIFAR "python version" pickles through a restricted unpickler,
ImageFolder trees, ``path label`` list files, ``hf:`` Hugging Face datasets and ``wds:`` webdataset shards), class
names as the datasets spell them, content fingerprints of the files read, and the prompt templates.

May import: ``fedfeat.errors`` only. Nothing here knows of CLIP, stores or training.
"""

from __future__ import annotations

import os
from pathlib import Path

from fedfeat.data.base import ImageDataset
from fedfeat.errors import FedfeatError

__all__ = ["ImageDataset", "open_dataset"]

OPTIONS = {"image_column": str, "label_column": str, "classnames": (str, os.PathLike)}  # hf: and wds: only


def open_dataset(name: str, root: str | Path, options: dict | None = None) -> ImageDataset:
    """Open dataset format ``name`` at ``root`` (the layouts: ``fedfeat.data.files``' docstring).

    ``hf:NAME[:CONFIG]`` and ``wds:PATTERN`` (``fedfeat.data.hf``) resolve relative names against ``root``
    and take ``options``: ``image_column``, ``label_column``, ``classnames`` (a class-name file).

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
            want = "a path (str or os.PathLike)" if k == "classnames" else "a column name (str)"
            raise FedfeatError(f"dataset option {k} = {v!r} must be {want}")
    if name.startswith(("hf:", "wds:")):
        return _open_external(name, Path(root).expanduser(), **opts)
    if opts:
        flag = "--" + next(iter(opts)).replace("_", "-")
        raise FedfeatError(f"{flag} applies to hf: and wds: datasets only, not to '{name}'; drop it")
    from fedfeat.data.files import DATASETS

    if name not in DATASETS:
        raise FedfeatError(
            f"unknown dataset '{name}'; known: {', '.join(DATASETS)}, hf:NAME[:CONFIG], wds:PATTERN"
        )
    root = Path(root).expanduser()
    if not root.exists():
        raise FedfeatError(f"dataset root {root} does not exist; expected {DATASETS[name].layout}")
    return DATASETS[name](root)


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

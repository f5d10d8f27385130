"""Hugging Face ``datasets`` and webdataset tar shards as fedfeat image datasets (``hf:`` and ``wds:``).

``fedfeat.data.files.open_dataset`` sends ``hf:...`` and ``wds:...`` here. Both readers are ``ImageDataset``\\ s with
random access by row, so ``encode``'s units of work (row-range chunks), crash-safe resume, fingerprint and
refresh rules apply unchanged. Both need the optional extra: ``pip install 'fedfeat[hf]'``.

``hf:NAME[:CONFIG]``
    ``NAME`` is a directory written by ``Dataset.save_to_disk`` / ``DatasetDict.save_to_disk`` (relative names
    resolve against ``--root``), read with ``datasets.load_from_disk``; otherwise a dataset in the local
    ``datasets`` cache (``HF_DATASETS_CACHE``), read with ``datasets.load_dataset(NAME, CONFIG)`` in offline mode
    (never a download). Image column: the one ``Image`` feature (else ``image`` / ``img``; or ``--image-column``);
    label column: the one ``ClassLabel`` feature (else ``label`` / ``fine_label``; or ``--label-column``); class
    names: the ``ClassLabel``'s names (or ``--classnames FILE``). Images are the stored bytes (or the file at the
    stored path), decoded with PIL. Fingerprint: the Arrow files (and any image files referenced by path).

``wds:PATTERN``
    webdataset tar shards: a brace pattern (``data/train-{000000..000001}.tar``), one ``.tar``, a folder of
    ``.tar`` shards, or a folder whose ``<split>/`` subfolders hold shards (CLIP_benchmark's ``wds_*`` layout:
    ``ROOT/{train,test}/{0..N-1}.tar`` listed by ``<split>/nshards.txt``, ``ROOT/classnames.txt``). Samples are
    grouped as webdataset groups tar members (``base_plus_ext``: ``s0000001.jpg`` + ``s0000001.cls``); the image
    is the first of ``webp``, ``png``, ``jpg``, ``jpeg`` present (CLIP_benchmark's order; or ``--image-column
    KEY``), the label the integer in ``cls`` (or ``--label-column KEY``). Class names: ``--classnames FILE``,
    else ``classnames.txt`` beside the shards or one folder up. Shards must be uncompressed tar files: each is
    indexed once (member offsets, cached in ``~/.cache/fedfeat/wds-index``), then images are read by offset.

Splits: the dataset's own names (a pattern's split is its shards' folder name, else the shards' leading word,
else ``train``); when there is no ``test`` split, ``validation`` (or ``valid``, ``val``) is stored as ``test``,
the split ``fedfeat train`` evaluates on. An ``hf:`` split whose labels are all ``-1`` (unlabelled, such as
ImageNet's test split) is left out.
"""

from __future__ import annotations

import hashlib
import importlib
import io
import os
import re
import tarfile
import time
from contextlib import contextmanager
from pathlib import Path

import numpy as np
from PIL import Image

from fedfeat.data.base import (
    _RACY_NS,
    ImageDataset,
    UnreadableImage,
    _size,
    _split_key,
    clean_class_name,
    hash_cache_dir,
)
from fedfeat.data.files import read_class_names
from fedfeat.errors import FedfeatError

EXTRA = "pip install 'fedfeat[hf]'"
KNOWN_SPLITS = ("train", "val", "valid", "validation", "test")
EVAL_ALIASES = ("validation", "valid", "val")  # stored as "test" when the dataset has no test split
WDS_IMAGE_KEYS = ("webp", "png", "jpg", "jpeg")  # CLIP_benchmark's to_tuple order: the first present wins
WDS_LABEL_KEY = "cls"
NAME_FILES = ("classnames.txt", "class_names.txt")
_INDEX_VERSION = 1


def _require(module: str, what: str):
    try:
        return importlib.import_module(module)
    except ImportError:
        raise FedfeatError(f"{what} need the '{module}' package: {EXTRA}") from None


def _decode(data: bytes, where: str) -> Image.Image:
    """Image bytes -> RGB ``PIL.Image`` exactly as the file readers decode a file."""
    try:
        with Image.open(io.BytesIO(data)) as img:
            img.load()
            return img.convert("RGB")
    except (OSError, ValueError, SyntaxError, Image.DecompressionBombError) as e:
        raise UnreadableImage(where, f"{type(e).__name__}: {e}") from None


def _split_map(names: list[str]) -> dict[str, str]:
    """fedfeat split -> the source's split: the source's names, ``validation`` (``valid``, ``val``) as
    ``test`` when there is no ``test``; ordered train, val..., test, others."""
    out = {n: n for n in names}
    if "test" not in out:
        alias = next((a for a in EVAL_ALIASES if a in out), None)
        if alias is not None:
            out["test"] = out.pop(alias)
    return dict(sorted(out.items(), key=lambda kv: _split_key(kv[0])))


def _resolve(name: str, root: Path) -> Path:
    p = Path(name).expanduser()
    return p if p.is_absolute() else root / p


def _rel(path: Path, root: Path) -> str:
    """``path`` relative to ``root`` when under it, else absolute (as a POSIX string)."""
    try:
        return path.resolve().relative_to(root.resolve()).as_posix()
    except ValueError:
        return str(path.resolve())


def _check_labels(y: np.ndarray, k: int, where: str, fix: str) -> None:
    if len(y) and (y.min() < 0 or y.max() >= k):
        bad = int(y[(y < 0) | (y >= k)][0])
        raise FedfeatError(f"{where} has label {bad} outside 0..{k - 1} ({k} class names); {fix}")


def open_external(
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
        return HFDataset(rest, root, image_column, label_column, names)
    return WebDataset(rest, root, image_column, label_column, names)


def default_store_name(spec: str, root: str | Path) -> str:
    """The store folder name ``encode`` uses: ``hf:uoft-cs/cifar10:plain`` -> ``cifar10-plain``; a saved
    directory or a ``wds:`` folder -> its name (the folder above ``train/``/``test/`` shard folders)."""
    root = Path(root).expanduser()
    kind, _, rest = spec.partition(":")
    if kind == "hf":
        name, _, config = rest.partition(":")
        p = _resolve(name, root)
        base = (p.resolve().name if p.is_dir() else name.rstrip("/").split("/")[-1]) or "hf"
        return f"{base}-{config}" if config else base
    p = _resolve(rest, root)
    try:
        braceexpand = importlib.import_module("braceexpand").braceexpand
        paths = [Path(x) for x in braceexpand(str(p))]
    except ImportError:
        paths = [p]
    d = p if len(paths) == 1 and p.is_dir() else Path(os.path.commonpath([str(x.parent) for x in paths]))
    d = d.resolve()
    if d.name in KNOWN_SPLITS and not any((d / s).is_dir() for s in KNOWN_SPLITS):
        d = d.parent
    return d.name or "wds"


# ---------------------------------------------------------------------------------------- Hugging Face
@contextmanager
def _offline(datasets_mod):
    """``datasets`` and ``huggingface_hub`` in offline mode for the duration: the cache or nothing."""
    import huggingface_hub.constants as hub

    cfg = datasets_mod.config
    saved = (cfg.HF_HUB_OFFLINE, getattr(cfg, "HF_DATASETS_OFFLINE", None), hub.HF_HUB_OFFLINE)
    cfg.HF_HUB_OFFLINE = True
    if saved[1] is not None:
        cfg.HF_DATASETS_OFFLINE = True
    hub.HF_HUB_OFFLINE = True
    try:
        yield
    finally:
        cfg.HF_HUB_OFFLINE = saved[0]
        if saved[1] is not None:
            cfg.HF_DATASETS_OFFLINE = saved[1]
        hub.HF_HUB_OFFLINE = saved[2]


def _arrow_rows(path: str) -> int:
    import pyarrow as pa

    with pa.memory_map(path) as src:
        try:
            return pa.ipc.open_stream(src).read_all().num_rows
        except pa.ArrowInvalid:
            src.seek(0)
            return pa.ipc.open_file(src).read_all().num_rows


class HFDataset(ImageDataset):
    """A Hugging Face ``datasets`` dataset saved to disk or in the local cache (see the module docstring)."""

    format = "hf"
    layout = (
        "hf:NAME[:CONFIG]: a directory written by Dataset.save_to_disk / DatasetDict.save_to_disk, or a "
        "dataset in the local datasets cache (HF_DATASETS_CACHE), with an Image column and a ClassLabel column"
    )

    def __init__(
        self,
        spec: str,
        root: Path,
        image_column: str | None = None,
        label_column: str | None = None,
        classnames: Path | None = None,
    ):
        dsm = _require("datasets", "hf: datasets")
        name, _, config = spec.partition(":")
        if not name:
            raise FedfeatError(
                "hf: needs a dataset: --dataset hf:NAME[:CONFIG] (a saved directory or a cached name)"
            )
        self.label = f"hf:{spec}"
        loaded, saved_dir = self._load(dsm, name, config or None, root)
        if isinstance(loaded, dsm.Dataset):
            loaded = {str(loaded.split or "train"): loaded}
        parts = {str(k): v for k, v in dict(loaded).items()}
        if not parts:
            raise FedfeatError(f"{self.label} has no splits; expected {self.layout}")
        files = sorted({f["filename"] for d in parts.values() for f in d.cache_files})
        if not files:
            raise FedfeatError(
                f"{self.label} is not backed by Arrow files on disk; save it with save_to_disk"
            )
        base = saved_dir or Path(os.path.commonpath([str(Path(f).parent) for f in files]))
        super().__init__(base)

        feats = next(iter(parts.values())).features
        self.image_column = self._image_column(dsm, feats, image_column)
        self.label_column, label_names = self._label_column(dsm, feats, label_column)
        if classnames is not None:
            names = read_class_names(classnames)
            if label_names is not None and len(names) != len(label_names):
                raise FedfeatError(
                    f"--classnames {classnames} has {len(names)} names but {self.label}'s ClassLabel "
                    f"'{self.label_column}' has {len(label_names)}; give a file with one name per class"
                )
            self.class_names = names
        elif label_names is None:
            raise FedfeatError(
                f"{self.label}: column '{self.label_column}' is not a ClassLabel, so it has no class names; "
                "give them with --classnames FILE (one per line, in label order)"
            )
        else:
            self.class_names = [clean_class_name(n) for n in label_names]

        import pyarrow.compute as pc

        self.split_sources: dict[str, str] = {}
        self._images: dict = {}  # split -> Dataset of the image column, undecoded ({"bytes", "path"} rows)
        self._parts: dict = {}  # split -> the source Dataset
        self._external: dict[str, list[tuple[int, str]]] = {}  # split -> (row, image file) for path-only rows
        self.dropped_splits: list[str] = []  # empty or unlabelled source splits
        labelled: dict[str, np.ndarray] = {}  # source split -> labels
        for src, d in parts.items():
            for col in (self.image_column, self.label_column):
                if col not in d.column_names:
                    raise FedfeatError(
                        f"{self.label}: split '{src}' has no column '{col}'; columns: "
                        f"{', '.join(d.column_names)}"
                    )
            y = np.zeros(0, dtype=np.int64)
            if len(d):
                col = d.with_format("arrow")[self.label_column]
                y = pc.fill_null(col, -1).to_numpy(zero_copy_only=False).astype(np.int64)
            if not len(y) or (y == -1).all():  # empty, or unlabelled (ImageNet's test): nothing to learn from
                self.dropped_splits.append(src)
                continue
            if (y == -1).any():
                raise FedfeatError(
                    f"{self.label}: split '{src}' has {int((y == -1).sum())} of {len(y)} rows without a label "
                    f"in '{self.label_column}'; filter them out and save_to_disk, or choose --label-column"
                )
            _check_labels(
                y,
                len(self.class_names),
                f"{self.label} split '{src}'",
                "choose --label-column or --classnames to match",
            )
            labelled[src] = y
        for split, src in _split_map(list(labelled)).items():
            d = parts[src]
            images = d.with_format("arrow")[self.image_column]
            no_bytes = pc.is_null(pc.struct_field(images, "bytes")).to_numpy(zero_copy_only=False)
            if no_bytes.any():  # images stored as file paths: read (and fingerprint) those files
                paths = pc.struct_field(images, "path").to_pylist()
                self._external[split] = [(int(i), paths[i]) for i in np.flatnonzero(no_bytes)]
            self.split_sources[split] = src
            self._parts[split] = d
            self._images[split] = (  # python rows whatever format the dataset was saved with
                d.select_columns([self.image_column])
                .cast_column(self.image_column, dsm.Image(decode=False))
                .with_format(None)
            )
            self._labels[split] = labelled[src]
        if not self._labels:
            raise FedfeatError(
                f"{self.label} has no labelled rows in any split ({', '.join(parts)}); expected {self.layout}"
            )
        self._file_names = {f: _rel(Path(f), self.root) for f in files}

    # ------------------------------------------------------------------ loading
    def _load(self, dsm, name: str, config: str | None, root: Path):
        p = _resolve(name, root)
        if p.is_dir() and ((p / "dataset_dict.json").is_file() or (p / "state.json").is_file()):
            if config:
                raise FedfeatError(
                    f"hf: {p} is a saved dataset directory and takes no :CONFIG ('{config}'); drop it"
                )
            try:
                return dsm.load_from_disk(str(p)), p
            except Exception as e:  # noqa: BLE001 - a corrupt directory: one line naming it
                raise FedfeatError(
                    f"hf: cannot load the saved dataset {p} ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}); "
                    "save it again with save_to_disk"
                ) from None
        if p.is_dir() or name.startswith((".", "/", "~")):
            raise FedfeatError(
                f"hf: {p} is not a directory written by save_to_disk (no dataset_dict.json or state.json); "
                f"expected {self.layout}"
            )
        cache = dsm.config.HF_DATASETS_CACHE
        try:
            with _offline(dsm):
                return dsm.load_dataset(name, config), None
        except Exception as e:  # noqa: BLE001 - not cached (or a broken cache): one line, never a download
            why = (str(e).splitlines() or [""])[0]
            raise FedfeatError(
                f"hf: dataset '{name}'{f' config {config!r}' if config else ''} is not in the local datasets cache "
                f"{cache} ({type(e).__name__}: {why}); fedfeat never downloads: fetch it once with "
                f"`python -c \"import datasets; datasets.load_dataset('{name}'{f', {config!r}' if config else ''})\"`, "
                "or save_to_disk it and pass hf:DIR"
            ) from None

    def _image_column(self, dsm, feats, chosen: str | None) -> str:
        if chosen is not None:
            if chosen not in feats:
                raise FedfeatError(f"{self.label} has no column '{chosen}'; columns: {', '.join(feats)}")
            if not isinstance(feats[chosen], dsm.Image):
                raise FedfeatError(
                    f"{self.label}: column '{chosen}' is {type(feats[chosen]).__name__}, not an Image feature; "
                    "cast it with cast_column(..., datasets.Image()) and save_to_disk, or choose another --image-column"
                )
            return chosen
        cols = [c for c, f in feats.items() if isinstance(f, dsm.Image)]
        if len(cols) > 1:
            cols = [c for c in ("image", "img") if c in cols] or cols
        if len(cols) != 1:
            what = f"{len(cols)} Image columns ({', '.join(cols)})" if cols else "no Image column"
            raise FedfeatError(
                f"{self.label} has {what}; name the image column with --image-column (columns: {', '.join(feats)})"
            )
        return cols[0]

    def _label_column(self, dsm, feats, chosen: str | None) -> tuple[str, list[str] | None]:
        if chosen is not None:
            if chosen not in feats:
                raise FedfeatError(f"{self.label} has no column '{chosen}'; columns: {', '.join(feats)}")
            f = feats[chosen]
            if isinstance(f, dsm.ClassLabel):
                return chosen, list(f.names)
            if not (isinstance(f, dsm.Value) and "int" in str(f.dtype)):
                raise FedfeatError(
                    f"{self.label}: column '{chosen}' is not a ClassLabel or integer column; choose another "
                    "--label-column"
                )
            return chosen, None
        cols = [c for c, f in feats.items() if isinstance(f, dsm.ClassLabel)]
        if len(cols) > 1:
            cols = [c for c in ("label", "fine_label") if c in cols][:1] or cols
        if len(cols) != 1:
            what = f"{len(cols)} ClassLabel columns ({', '.join(cols)})" if cols else "no ClassLabel column"
            raise FedfeatError(
                f"{self.label} has {what}; name the label column with --label-column "
                f"(and give class names with --classnames FILE if it is not a ClassLabel; columns: {', '.join(feats)})"
            )
        return cols[0], list(feats[cols[0]].names)

    # ------------------------------------------------------------------ ImageDataset
    def load_image(self, split: str, i: int) -> Image.Image:
        rec = self._images[split][int(i)][self.image_column] or {}
        data = rec.get("bytes")
        if data is None:
            path = rec.get("path")
            if not path:
                raise UnreadableImage(self.describe(split, i), "the row has neither image bytes nor a path")
            try:
                data = Path(path).read_bytes()
            except OSError as e:
                raise UnreadableImage(
                    f"{path} ({self.describe(split, i)})", f"{type(e).__name__}: {e}"
                ) from None
        return _decode(data, self.describe(split, i))

    def item_name(self, split: str, i: int) -> str:
        return f"{self.split_sources[split]}[{int(i)}]"

    def describe(self, split: str, i: int) -> str:
        return f"row {int(i)} of split '{self.split_sources[split]}' of {self.label}"

    def files(self) -> list[tuple[str, int]]:
        out = {name: _size(Path(f)) for f, name in self._file_names.items() if self._used(f)}
        for rows in self._external.values():
            for _, p in rows:
                out[_rel(Path(p), self.root)] = _size(Path(p))
        return sorted(out.items())

    def _used(self, filename: str) -> bool:
        return any(filename == f["filename"] for d in self._parts.values() for f in d.cache_files)

    def fingerprint(self) -> dict:
        fp = super().fingerprint()
        fp["source"] = {
            "image_column": self.image_column,
            "label_column": self.label_column,
            "splits": dict(self.split_sources),
            "left_out": list(self.dropped_splits),
        }
        return fp

    def rows_of_files(self, names: set[str]) -> tuple[dict[str, np.ndarray], set[str]]:
        rows: dict[str, list[np.ndarray]] = {}
        used: set[str] = set()
        for split, d in self._parts.items():
            n, start, spans = len(d), 0, []
            for f in (c["filename"] for c in d.cache_files):
                k = _arrow_rows(f)
                spans.append((self._file_names.get(f, f), start, start + k))
                start += k
            exact = start == n and getattr(d, "_indices", None) is None
            for name, a, b in spans:
                if name in names:
                    used.add(name)
                    rows.setdefault(split, []).append(np.arange(a, b) if exact else np.arange(n))
            for i, p in self._external.get(split, []):
                name = _rel(Path(p), self.root)
                if name in names:
                    used.add(name)
                    rows.setdefault(split, []).append(np.asarray([i]))
        out = {s: np.unique(np.concatenate(r)).astype(np.int64) for s, r in rows.items()}
        return out, set(names) - used


# ---------------------------------------------------------------------------------------- webdataset
def _natural(p: Path) -> list:
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", p.name)]


def _dir_shards(d: Path) -> list[Path]:
    """A folder's shards: ``{0..N-1}.tar`` when it has CLIP_benchmark's ``nshards.txt``, else its ``*.tar`` in
    natural order (``2.tar`` before ``10.tar``)."""
    nfile = d / "nshards.txt"
    if nfile.is_file():
        try:
            n = int(nfile.read_text().strip())
        except (OSError, ValueError) as e:
            raise FedfeatError(f"wds: {nfile} does not hold a shard count ({e}); fix or delete it") from None
        shards = [d / f"{i}.tar" for i in range(n)]
        missing = [s for s in shards if not s.is_file()]
        if missing:
            raise FedfeatError(
                f"wds: {missing[0]} not found ({nfile} says {n} shards); copy the missing shards"
            )
        return shards
    return sorted(
        (d / e.name for e in os.scandir(d) if e.is_file() and e.name.endswith(".tar")), key=_natural
    )


def _shard_split(p: Path) -> str:
    if p.parent.name in KNOWN_SPLITS:
        return p.parent.name
    m = re.match(r"[A-Za-z]+", p.name)
    word = m.group(0).lower() if m else ""
    return word if word in KNOWN_SPLITS else "train"


class WebDataset(ImageDataset):
    """webdataset tar shards (see the module docstring); rows in shard order, then tar order."""

    format = "wds"
    layout = (
        "wds:PATTERN: uncompressed tar shards given by a brace pattern (data/train-{000000..000001}.tar), a folder "
        "of .tar shards, or a folder with <split>/ subfolders of shards (CLIP_benchmark: ROOT/train/{0..N-1}.tar, "
        "ROOT/test/..., <split>/nshards.txt, ROOT/classnames.txt); samples <key>.jpg|png|webp|jpeg + <key>.cls, "
        "class names in classnames.txt beside the shards (or one folder up) or --classnames FILE"
    )

    def __init__(
        self,
        spec: str,
        root: Path,
        image_column: str | None = None,
        label_column: str | None = None,
        classnames: Path | None = None,
    ):
        _require("webdataset", "wds: shards")
        self.label = f"wds:{spec}"
        if not spec:
            raise FedfeatError(
                "wds: needs shards: --dataset wds:PATTERN (e.g. wds:data/train-{000000..000001}.tar)"
            )
        by_split, base = self._shards(spec, root)
        super().__init__(base)
        self.image_keys = (image_column.lower(),) if image_column else WDS_IMAGE_KEYS
        self.label_key = (label_column or WDS_LABEL_KEY).lower()

        name_file = classnames
        if name_file is None:
            shard_dirs = list(dict.fromkeys(p.parent for ps in by_split.values() for p in ps))
            for d in [*shard_dirs, base, base.parent]:
                name_file = next((d / n for n in NAME_FILES if (d / n).is_file()), None)
                if name_file is not None:
                    break
        if name_file is None:
            raise FedfeatError(
                f"{self.label}: no classnames.txt beside the shards ({base}) or one folder up; give the class "
                "names with --classnames FILE (one per line, in label order)"
            )
        self.class_names = read_class_names(name_file)
        self._names_file = name_file

        self._shard_paths: list[Path] = []
        self._rows: dict[str, np.ndarray] = {}  # split -> [N, 3] int64: shard index, offset, size
        self._keys: dict[str, list[str]] = {}  # split -> "<key>.<ext>" of each row's image member
        self.split_sources: dict[str, str] = {}
        for split, src in _split_map(list(by_split)).items():
            self.split_sources[split] = src
            rows, keys, labels = [], [], []
            for path in by_split[src]:
                si = len(self._shard_paths)
                self._shard_paths.append(path)
                idx = self._index(path)
                if not len(idx["offset"]):
                    continue
                rows.append(np.stack([np.full(len(idx["offset"]), si), idx["offset"], idx["size"]], axis=1))
                keys += [
                    f"{k}.{self.image_keys[e]}" for k, e in zip(idx["key"].tolist(), idx["ext"].tolist())
                ]
                y = idx["label"]
                _check_labels(
                    y,
                    len(self.class_names),
                    f"wds: shard {path}",
                    f"fix the shard's '{self.label_key}' entries or the class names ({name_file})",
                )
                labels.append(y)
            if not rows:
                raise FedfeatError(
                    f"wds: the shards of split '{src}' hold no samples; expected {self.layout}"
                )
            self._rows[split] = np.concatenate(rows).astype(np.int64)
            self._keys[split] = keys
            self._labels[split] = np.concatenate(labels).astype(np.int64)
        self._shard_names = [_rel(p, self.root) for p in self._shard_paths]
        self._fds: dict[int, int] = {}

    # ------------------------------------------------------------------ shards and index
    def _shards(self, spec: str, root: Path) -> tuple[dict[str, list[Path]], Path]:
        p = _resolve(spec, root)
        if "{" not in spec and p.is_dir():
            direct = _dir_shards(p)
            if direct:
                return {p.name if p.name in KNOWN_SPLITS else "train": direct}, p
            subs = {
                e.name: _dir_shards(p / e.name)
                for e in sorted(os.scandir(p), key=lambda e: e.name)
                if e.is_dir() and not e.name.startswith(".")
            }
            subs = {k: v for k, v in subs.items() if v}
            if not subs:
                raise FedfeatError(f"wds: no .tar shards in {p} or its subfolders; expected {self.layout}")
            return subs, p
        from braceexpand import braceexpand

        expanded = [Path(x) for x in braceexpand(str(p))]
        missing = [x for x in expanded if not x.is_file()]
        if missing:
            raise FedfeatError(
                f"wds: shard {missing[0]} not found ({len(missing)} of {len(expanded)} missing); check the "
                "pattern (quote it, 'wds:dir/{0..9}.tar', so that the shell leaves the braces to fedfeat)"
            )
        if len({x.resolve() for x in expanded}) != len(expanded):
            raise FedfeatError(f"wds: the pattern {spec} names a shard twice; list each shard once")
        by_split: dict[str, list[Path]] = {}
        for x in expanded:
            by_split.setdefault(_shard_split(x), []).append(x)
        return by_split, Path(os.path.commonpath([str(x.parent) for x in expanded]))

    def _index(self, path: Path) -> dict[str, np.ndarray]:
        """The shard's samples (``key``, image ``ext`` index, member ``offset`` and ``size``, ``label``), read
        from the index cache when the shard's size and mtime are unchanged, else built and cached."""
        st = path.stat()
        ident = f"{_INDEX_VERSION}\t{path.resolve()}\t{','.join(self.image_keys)}\t{self.label_key}"
        cache = hash_cache_dir() / "wds-index" / (hashlib.sha256(ident.encode()).hexdigest()[:24] + ".npz")
        stamp = np.asarray([st.st_size, st.st_mtime_ns], dtype=np.int64)
        try:
            with np.load(cache, allow_pickle=False) as z:
                if np.array_equal(z["stamp"], stamp):
                    return {k: z[k] for k in ("key", "ext", "offset", "size", "label")}
        except (OSError, ValueError, KeyError):
            pass
        idx = self._build_index(path)
        if time.time_ns() - st.st_mtime_ns > _RACY_NS:
            try:
                cache.parent.mkdir(parents=True, exist_ok=True)
                tmp = cache.with_name(f".{cache.stem}.{os.getpid()}.tmp.npz")
                np.savez(tmp, stamp=stamp, **idx)
                os.replace(tmp, cache)
            except OSError:
                pass  # a read-only home: index again next time
        return idx

    def _build_index(self, path: Path) -> dict[str, np.ndarray]:
        from webdataset.tariterators import base_plus_ext, meta_prefix, meta_suffix

        groups: list[tuple[str, dict[str, tuple[int, int]]]] = []
        try:
            with tarfile.open(path, "r:") as tf:
                for ti in tf:
                    name = ti.name
                    if not ti.isreg() or name is None:
                        continue
                    if "/" not in name and name.startswith(meta_prefix) and name.endswith(meta_suffix):
                        continue
                    if re.match(r"__[^/]*__($|/)", name):  # webdataset's skip_meta
                        continue
                    key, ext = base_plus_ext(name)
                    if key is None:
                        continue
                    ext = ext.lower()
                    if not groups or groups[-1][0] != key:
                        groups.append((key, {}))
                    if ext in groups[-1][1]:
                        raise FedfeatError(
                            f"wds: {path} has '{name}' twice in sample '{key}'; rewrite the shard"
                        )
                    groups[-1][1][ext] = (ti.offset_data, ti.size)
                    tf.members = []  # keep memory flat on big shards
        except (tarfile.TarError, OSError, EOFError) as e:
            raise FedfeatError(
                f"wds: {path} is not a readable uncompressed tar file ({type(e).__name__}: {e}); random access "
                "needs plain .tar shards (decompress .tar.gz ones)"
            ) from None
        n = len(groups)
        out = {
            "key": np.asarray([k for k, _ in groups], dtype=np.str_) if n else np.zeros(0, dtype="<U1"),
            "ext": np.zeros(n, dtype=np.int8),
            "offset": np.zeros(n, dtype=np.int64),
            "size": np.zeros(n, dtype=np.int64),
            "label": np.zeros(n, dtype=np.int64),
        }
        with open(path, "rb") as f:
            fd = f.fileno()
            for j, (key, members) in enumerate(groups):
                e = next((k for k, ext in enumerate(self.image_keys) if ext in members), None)
                if e is None or self.label_key not in members:
                    what = (
                        f"no image ({'/'.join(self.image_keys)})" if e is None else f"no '{self.label_key}'"
                    )
                    raise FedfeatError(
                        f"wds: sample '{key}' in {path} has {what} (it has: {', '.join(members)}); every sample "
                        "needs an image and a label (--image-column / --label-column name other keys)"
                    )
                off, size = members[self.label_key]
                raw = os.pread(fd, size, off)
                try:
                    out["label"][j] = int(raw.decode("utf-8").strip())
                except (UnicodeDecodeError, ValueError):
                    raise FedfeatError(
                        f"wds: sample '{key}' in {path}: '{self.label_key}' is {raw[:20]!r}, not an integer label; "
                        "fix the shard or name the label key with --label-column"
                    ) from None
                out["ext"][j] = e
                out["offset"][j], out["size"][j] = members[self.image_keys[e]]
        return out

    # ------------------------------------------------------------------ ImageDataset
    def _fd(self, si: int) -> int:
        fd = self._fds.get(si)
        if fd is None:
            if len(self._fds) >= 64:  # rows are read shard by shard: a few open files suffice
                self.close()
            fd = self._fds[si] = os.open(self._shard_paths[si], os.O_RDONLY)
        return fd

    def close(self) -> None:
        fds, self._fds = self._fds, {}
        for fd in fds.values():
            try:
                os.close(fd)
            except OSError:
                pass

    def __getstate__(self):  # DataLoader workers under spawn: reopen files there
        state = dict(self.__dict__)
        state["_fds"] = {}
        return state

    def __del__(self):
        try:
            self.close()
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass

    def load_image(self, split: str, i: int) -> Image.Image:
        si, off, size = (int(v) for v in self._rows[split][int(i)])
        try:
            data = os.pread(self._fd(si), size, off)
        except OSError as e:
            raise UnreadableImage(self.describe(split, i), f"{type(e).__name__}: {e}") from None
        if len(data) != size:
            raise UnreadableImage(self.describe(split, i), f"the shard ends {size - len(data)} bytes early")
        return _decode(data, self.describe(split, i))

    def item_name(self, split: str, i: int) -> str:
        return f"{self._shard_names[int(self._rows[split][int(i), 0])]}[{self._keys[split][int(i)]}]"

    def files(self) -> list[tuple[str, int]]:
        out = {name: _size(p) for name, p in zip(self._shard_names, self._shard_paths)}
        names_rel = _rel(self._names_file, self.root)
        if not Path(names_rel).is_absolute():  # a names file outside the root: its names are fingerprinted
            out[names_rel] = _size(self._names_file)
        return sorted(out.items())

    def fingerprint(self) -> dict:
        fp = super().fingerprint()
        fp["source"] = {
            "image_keys": list(self.image_keys),
            "label_key": self.label_key,
            "splits": dict(self.split_sources),
        }
        return fp

    def rows_of_files(self, names: set[str]) -> tuple[dict[str, np.ndarray], set[str]]:
        hit = {k for k, n in enumerate(self._shard_names) if n in names}
        rows = {
            s: np.flatnonzero(np.isin(r[:, 0], list(hit))).astype(np.int64) for s, r in self._rows.items()
        }
        used = {self._shard_names[k] for k in hit}
        return {s: r for s, r in rows.items() if len(r)}, set(names) - used

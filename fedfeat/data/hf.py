"""``hf:NAME[:CONFIG]``: a Hugging Face ``datasets`` dataset (saved with ``save_to_disk``, or in the local cache,
read offline) as an ``ImageDataset`` (the layouts and rules: ``fedfeat.data.external``).
"""

from __future__ import annotations

import os
from contextlib import contextmanager
from pathlib import Path

import numpy as np
from PIL import Image

from fedfeat.data.base import (
    ImageDataset,
    UnreadableImage,
    _size,
    clean_class_name,
)
from fedfeat.data.external import _check_labels, _decode, _rel, _require, _resolve, _split_map
from fedfeat.data.files import read_class_names
from fedfeat.errors import FedfeatError


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

        import pyarrow as pa
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
                try:  # uint8 .. int64 labels (a plain int column): int64 first, so that a null can be -1
                    col = col.cast(pa.int64())
                except (pa.ArrowInvalid, pa.ArrowNotImplementedError) as e:
                    raise FedfeatError(
                        f"{self.label}: split '{src}' column '{self.label_column}' holds labels that are not "
                        f"64-bit integers ({str(e).splitlines()[0] if str(e) else type(e).__name__}); choose "
                        "--label-column"
                    ) from None
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
                f"{self.label} split '{src}' column '{self.label_column}'",
                "choose --label-column or --classnames to match",
                names_file=classnames,
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
            if not self._int_column(dsm, f):
                raise FedfeatError(
                    f"{self.label}: column '{chosen}' is not a ClassLabel or integer column; choose another "
                    "--label-column"
                )
            return chosen, None
        cols = [c for c, f in feats.items() if isinstance(f, dsm.ClassLabel)]
        if len(cols) > 1:
            cols = [c for c in ("label", "fine_label") if c in cols][:1] or cols
        if not cols:  # no ClassLabel: a plain int `label` (then `fine_label`), names from --classnames
            plain = [c for c in ("label", "fine_label") if c in feats and self._int_column(dsm, feats[c])]
            if plain:
                return plain[0], None
        if len(cols) != 1:
            what = f"{len(cols)} ClassLabel columns ({', '.join(cols)})" if cols else "no ClassLabel column"
            raise FedfeatError(
                f"{self.label} has {what}; name the label column with --label-column "
                f"(and give class names with --classnames FILE if it is not a ClassLabel; columns: {', '.join(feats)})"
            )
        return cols[0], list(feats[cols[0]].names)

    @staticmethod
    def _int_column(dsm, f) -> bool:
        """A plain integer column (``Value("int64")``, ``int32``, ``uint8``, ...): labels that index class names."""
        return isinstance(f, dsm.Value) and "int" in str(f.dtype)

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

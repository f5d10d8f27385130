"""Every attribute a store records, checked against the arrays it describes (``FeatureStore.attribute_problems``:
``open`` runs the metadata-only part, ``fedfeat info --verify`` all of it), and a stored partition against its split.
Apart from the store class so that ``featurestore.py`` stays the format's reads and writes."""

from __future__ import annotations

import math

import numpy as np
import zarr

from fedfeat.errors import FedfeatError  # noqa: F401
from fedfeat.store.format import FORMAT_VERSION, fingerprint_hash, longtail_counts
from fedfeat.store.format import short as _short


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _is_str_list(v, nonempty: bool = True) -> bool:
    return isinstance(v, list) and (bool(v) or not nonempty) and all(isinstance(x, str) for x in v)


class AttrCheck:
    """``FeatureStore.attribute_problems``: every attribute the writer (``create``, ``encode``, ``synth``) records,
    against the arrays it describes. One problem per line: ``attribute NAME = VALUE, but WHAT THE ARRAYS SAY``
    (or ``attribute NAME = VALUE is not WHAT IT MUST BE``)."""

    # the dtypes format version 2 writes: name (split arrays under <split>/) -> dtype
    DTYPES = {
        "features": "float16", "labels": "int64", "labels_crc": "uint64", "done": "uint64",
        "pixels": "uint8", "pixels_crc": "uint64", "domains": "int16", "domains_crc": "uint64",
    }  # fmt: skip

    def __init__(self, st):
        self.st, self.a, self.out = st, st._attrs, []
        self.seen: dict = {}  # what the arrays hold: T, K, D of text/features, D of the feature arrays

    def lie(self, name: str, value, says: str) -> None:
        self.out.append(f"attribute {name} = {_short(value)}, but {says}")

    def junk(self, name: str, value, want: str) -> None:
        self.out.append(f"attribute {name} = {_short(value)} is not {want}")

    def array(self, name: str):
        """The zarr array ``name`` (its metadata only), or None with a problem recorded."""
        try:
            arr = self.st._g[name]
        except Exception:
            self.out.append(f"array {name} is missing or unreadable")
            return None
        if not isinstance(arr, zarr.Array):
            self.out.append(f"{name} is a group, not an array")
            return None
        return arr

    def dtype(self, name: str, arr, want: str) -> None:
        if str(arr.dtype) != want:
            self.out.append(
                f"array {name} has dtype {arr.dtype}, but format version {FORMAT_VERSION} stores {want}"
            )

    def run(self, deep: bool) -> list[str]:
        a = self.a
        for k in ("backbone", "pretrained"):
            if not isinstance(a.get(k), str) or not a.get(k):
                self.junk(k, a.get(k), "a non-empty string")
        D = a.get("embed_dim")
        if not _is_int(D) or D < 1:
            self.junk("embed_dim", D, "a positive integer")
            D = None
        ls = a.get("logit_scale")
        if not _is_num(ls) or ls <= 0:
            self.junk(
                "logit_scale", ls, "a finite number > 0 (the model's exp(logit_scale), e.g. 100.0 for CLIP)"
            )
        names = a.get("class_names")
        K = len(names) if _is_str_list(names) else None
        if K is None:
            self.junk("class_names", names, "a non-empty list of strings")
        tmpl = a.get("templates")
        T = len(tmpl) if _is_str_list(tmpl) else None
        if T is None:
            self.junk("templates", tmpl, "a non-empty list of strings")
        for k in ("preprocessing", "fingerprint"):
            if not isinstance(a.get(k), dict):
                self.junk(k, a.get(k), "a dict")
        splits = a.get("splits")
        if not (isinstance(splits, dict) and splits and all(_is_int(n) and n >= 1 for n in splits.values())):
            self.junk("splits", splits, "a dict of split name -> number of rows (>= 1)")
            splits = {}
        cr = a.get("chunk_rows")
        if not _is_int(cr) or cr < 1:
            self.junk("chunk_rows", cr, "a positive integer")
            cr = None
        for k in ("complete", "finite"):
            if k in a and not isinstance(a[k], bool):
                self.junk(k, a[k], "true or false")
        if "fingerprint_hash" in a and not isinstance(a["fingerprint_hash"], str):
            self.junk("fingerprint_hash", a["fingerprint_hash"], "a string")
        px = self.pixel_spec()
        doms = a.get("domain_names")
        if doms is not None and not _is_str_list(doms):
            self.junk("domain_names", doms, "a non-empty list of strings (one per domain)")
        for split, n in splits.items():
            self.split_arrays(split, n, D, cr, px)
        self.text_arrays(T, K, D)
        self.extras(D)
        if deep:
            self.deep(splits, K, T, D)
        return self.out

    def pixel_spec(self):
        """``(H, W)`` of a valid ``pixels`` attribute; None without one (or with a bad one, recorded)."""
        if "pixels" not in self.a:
            return None
        spec = self.a["pixels"]
        ok = isinstance(spec, dict)
        size, mean, std = (spec.get(k) if ok else None for k in ("size", "mean", "std"))
        if not (
            ok and isinstance(size, list) and len(size) == 2 and all(_is_int(v) and v >= 1 for v in size)
        ):
            self.junk("pixels.size", size, "[H, W] of positive integers")
            return None
        if not (isinstance(mean, list) and len(mean) == 3 and all(_is_num(v) for v in mean)):
            self.junk("pixels.mean", mean, "3 finite numbers (one per RGB channel)")
        if not (isinstance(std, list) and len(std) == 3 and all(_is_num(v) and v > 0 for v in std)):
            self.junk("pixels.std", std, "3 finite numbers > 0 (one per RGB channel)")
        return tuple(size)

    def split_arrays(self, split: str, n: int, D, cr, px) -> None:
        st = self.st
        if split not in st._g:
            self.lie("splits", {split: n}, f"the store has no group {split}")
            return
        f = self.array(f"{split}/features")
        if f is not None:
            self.dtype(f"{split}/features", f, "float16")
            if f.ndim != 2:
                self.out.append(f"array {split}/features has shape {list(f.shape)}, not [N, D]")
            else:
                self.seen.setdefault("D", f.shape[1])
                if f.shape[0] != n:
                    self.lie(f"splits.{split}", n, f"{split}/features has {f.shape[0]} rows")
                if D is not None and f.shape[1] != D:
                    self.lie("embed_dim", D, f"{split}/features has D = {f.shape[1]}")
                if cr is not None and f.shape[0] == n and f.chunks[0] != min(cr, n):
                    self.lie("chunk_rows", cr, f"{split}/features is chunked by {f.chunks[0]} rows")
        n_chunks = math.ceil(n / cr) if cr is not None else None
        want = {"labels": (n,), "labels_crc": (1,), "done": (n_chunks,)}
        if px is not None and "pixels" not in st._g[split]:
            self.lie("pixels", self.a["pixels"], f"split {split} has no pixels array")
        elif px is not None:
            want |= {"pixels": (n, 3, *px), "pixels_crc": (n_chunks,)}
        elif "pixels" in st._g[split] or "pixels_crc" in st._g[split]:
            self.out.append(f"array {split}/pixels exists, but the store has no attribute pixels")
        if "domain_names" in self.a and "domains" not in st._g[split]:
            self.lie("domain_names", self.a["domain_names"], f"split {split} has no domains array")
        elif "domain_names" in self.a:
            want |= {"domains": (n,), "domains_crc": (1,)}
        elif "domains" in st._g[split] or "domains_crc" in st._g[split]:
            self.out.append(f"array {split}/domains exists, but the store has no attribute domain_names")
        for name, shape in want.items():
            arr = self.array(f"{split}/{name}")
            if arr is None:
                continue
            self.dtype(f"{split}/{name}", arr, self.DTYPES[name])
            have = tuple(arr.shape)
            if None in shape or have == shape:
                continue
            if name in ("labels", "domains"):
                self.lie(f"splits.{split}", n, f"{split}/{name} has {have[0] if have else 0} rows")
            elif name in ("done", "pixels_crc"):
                says = f"{split}/{name} has {list(have)} entries (one per chunk of {n} rows: {n_chunks} expected)"
                self.lie("chunk_rows", cr, says)
            elif name == "pixels":
                if have[:1] != (n,):
                    self.lie(f"splits.{split}", n, f"{split}/pixels has {have[0] if have else 0} rows")
                if have[1:] != (3, *px):
                    self.lie(
                        "pixels.size", list(px), f"{split}/pixels holds images of shape {list(have[1:])}"
                    )
            else:
                self.out.append(f"array {split}/{name} has shape {list(have)}, not {list(shape)}")

    def text_arrays(self, T, K, D) -> None:
        t = self.array("text/features")
        if t is not None:
            self.dtype("text/features", t, "float16")
            if t.ndim != 3:
                self.out.append(f"array text/features has shape {list(t.shape)}, not [T, K, D]")
            else:
                self.seen.update(T=t.shape[0], K=t.shape[1], D=t.shape[2])
                if T is not None and t.shape[0] != T:
                    self.lie("templates", _Said(f"{T} templates"), f"text/features holds {t.shape[0]}")
                if K is not None and t.shape[1] != K:
                    self.lie("class_names", _Said(f"{K} classes"), f"text/features holds {t.shape[1]}")
                if D is not None and t.shape[2] != D:
                    self.lie("embed_dim", D, f"text/features has D = {t.shape[2]}")
        d = self.array("text/done")
        if d is not None:
            self.dtype("text/done", d, "uint64")
            if tuple(d.shape) != (1,):
                self.out.append(f"array text/done has shape {list(d.shape)}, not [1]")

    def extras(self, D) -> None:
        """What ``encode`` and ``synth`` add (types; the backbone config's embed_dim)."""
        a = self.a
        for k in ("dataset", "precision", "created_at", "weights_file"):  # null where not known
            if a.get(k) is not None and not isinstance(a[k], str):
                self.junk(k, a[k], "a string or null")
        for k in ("backbone_config", "synth_params", "synthetic_stats", "skipped"):
            if a.get(k) is not None and not isinstance(a[k], dict):
                self.junk(k, a[k], "a dict or null")
        cfg = a.get("backbone_config")
        if isinstance(cfg, dict) and D is not None and "embed_dim" in cfg and cfg["embed_dim"] != D:
            self.lie(
                "backbone_config.embed_dim", cfg["embed_dim"], f"the store's arrays and embed_dim are D = {D}"
            )

    def deep(self, splits: dict, K, T, D) -> None:
        st, a = self.st, self.a
        skipped = a.get("skipped")
        for split in splits:
            if self.out and f"{split}/labels" in " ".join(self.out):
                continue  # its labels array is already named
            try:
                lab = np.asarray(st._g[f"{split}/labels"][:])
            except Exception:
                continue  # a labels chunk that does not decode: the checksum pass names it
            if K is not None:
                bad = np.flatnonzero((lab < -1) | (lab >= K))
                if len(bad):
                    r = int(bad[0])
                    says = f"{split}/labels holds label {int(lab[r])} at row {r} (class ids are 0..{K - 1}, -1 marks a"
                    self.lie("class_names", _Said(f"{K} classes"), says + " skipped image)")
            doms = a.get("domain_names")
            if _is_str_list(doms) and "domains" in st._g[split]:
                try:
                    dom = np.asarray(st._g[f"{split}/domains"][:])
                except Exception:
                    dom = np.zeros(0, dtype=np.int16)  # the checksum pass names it
                bad = np.flatnonzero((dom < 0) | (dom >= len(doms)))
                if len(bad):
                    r = int(bad[0])
                    says = (
                        f"{split}/domains holds domain {int(dom[r])} at row {r} (ids are 0..{len(doms) - 1})"
                    )
                    self.lie("domain_names", _Said(f"{len(doms)} domains"), says)
            if isinstance(skipped, dict):
                names = skipped.get(split, [])
                marked = int((lab == -1).sum())
                if not isinstance(names, list) or len(names) != marked:
                    shown = _Said(f"{len(names)} images") if isinstance(names, list) else names
                    self.lie(f"skipped.{split}", shown, f"{split}/labels marks {marked} rows -1 (skipped)")
        self.fingerprint(splits, K, T, D)
        try:
            keys = st.partition_keys()
        except FedfeatError as e:
            self.out.append(str(e))
            keys = []
        for key in keys:
            try:
                pa = dict(st._g[f"partitions/{key}"].attrs)
                order = np.asarray(st._g[f"partitions/{key}/order"][:])
                offsets = np.asarray(st._g[f"partitions/{key}/offsets"][:])
            except Exception:
                self.out.append(f"partition {key}: its arrays are missing or unreadable")
                continue
            self.out += partition_problems(st, key, pa, order, offsets)

    def fingerprint(self, splits: dict, K, T, D) -> None:
        a = self.a
        fp = a.get("fingerprint")
        if not isinstance(fp, dict):
            return
        h = fingerprint_hash(fp)
        if "fingerprint_hash" in a and a["fingerprint_hash"] != h:
            self.lie("fingerprint_hash", a["fingerprint_hash"], f"the fingerprint attribute hashes to {h}")
        if "format_version" in fp and fp["format_version"] != a.get("format_version"):
            says = f"the store is format version {a.get('format_version')}"
            self.lie("fingerprint.format_version", fp["format_version"], says)
        if isinstance(fp.get("templates"), list) and fp["templates"] != a.get("templates"):  # encode's list
            shown = _Said(f"{_count(fp['templates'])} templates")
            self.lie(
                "fingerprint.templates", shown, f"attribute templates and text/features hold {T} other ones"
            )
        bb = fp.get("backbone")
        if isinstance(bb, dict) and "name" in bb and bb["name"] != a.get("backbone"):
            self.lie("fingerprint.backbone.name", bb["name"], f"attribute backbone is {a.get('backbone')!r}")
        if "precision" in fp and "precision" in a and fp["precision"] != a["precision"]:
            self.lie("fingerprint.precision", fp["precision"], f"attribute precision is {a['precision']!r}")
        if fp.get("pixels") is True and "pixels" not in a:
            self.lie("fingerprint.pixels", True, "the store has no attribute pixels (no pixel arrays)")
        pp = fp.get("preprocessing")
        if isinstance(pp, dict) and isinstance(a.get("preprocessing"), dict):
            for k, v in pp.items():
                if a["preprocessing"].get(k) != v:
                    says = f"attribute preprocessing.{k} is {_short(a['preprocessing'].get(k))}"
                    self.lie(f"fingerprint.preprocessing.{k}", v, says)
        ds = fp.get("dataset")
        if isinstance(ds, dict):
            if "splits" in ds and splits and ds["splits"] != splits:
                self.lie(
                    "fingerprint.dataset.splits",
                    ds["splits"],
                    f"attribute splits and the arrays say {splits}",
                )
            if "n_classes" in ds and K is not None and ds["n_classes"] != K:
                self.lie(
                    "fingerprint.dataset.n_classes",
                    ds["n_classes"],
                    f"class_names and text/features hold {K}",
                )
            if "class_names" in ds and ds["class_names"] != a.get("class_names"):
                shown = _Said(f"{_count(ds['class_names'])} names")
                self.lie("fingerprint.dataset.class_names", shown, "attribute class_names holds other ones")
        if fp.get("generator") == "fedfeat.store.synth":  # against what the arrays hold
            self.synthetic(fp, splits, self.seen.get("K", K), self.seen.get("T", T), self.seen.get("D", D))

    def synthetic(self, fp: dict, splits: dict, K, T, D) -> None:
        """A synthetic store's generator parameters against its shapes."""
        checks = (("classes", K, "text/features holds"), ("dim", D, "the arrays have D ="),
                  ("templates", T, "text/features holds"))  # fmt: skip
        for key, have, what in checks:
            if key in fp and have is not None and fp[key] != have:
                self.lie(f"fingerprint.{key}", fp[key], f"{what} {have}")
        for split, per in (("train", "train_per_class"), ("test", "test_per_class")):
            if split in splits and _is_int(fp.get(per)) and _is_int(fp.get("classes")):
                want = fp[per] * fp["classes"]
                says = f"fingerprint's {per} x classes = {fp[per]} x {fp['classes']} = {want}"
                if split == "train" and fp.get("train_min"):  # a long tail (SynthParams.train_min)
                    if _is_int(fp["train_min"]):
                        want = int(longtail_counts(fp["classes"], fp[per], fp["train_min"]).sum())
                    says = f"fingerprint's long tail ({fp[per]} .. {fp['train_min']} per class) = {want}"
                if (
                    _is_int(fp.get("domains")) and fp["domains"] > 0
                ):  # each domain its rows (SynthParams.domains)
                    want *= fp["domains"]
                    says = f"{fp['domains']} domains x ({says}) = {want}"
                if splits[split] != want:
                    self.lie(f"splits.{split}", splits[split], says)
        sp = self.a.get("synth_params")
        if isinstance(sp, dict):  # train_min 0 (balanced) is recorded by its absence (SynthParams.train_min)
            sp = {k: v for k, v in sp.items() if not (k == "train_min" and not v)}
            if not sp.get("domains"):  # likewise no domains: SynthParams.domain* recorded by their absence
                sp = {k: v for k, v in sp.items() if not k.startswith("domain")}
        if isinstance(sp, dict) and sp != {k: v for k, v in fp.items() if k != "generator"}:
            diff = sorted(k for k in set(sp) | set(fp) - {"generator"} if sp.get(k) != fp.get(k))
            have = ", ".join(f"{k}: {sp.get(k)!r}" for k in diff[:3])
            says = ", ".join(f"{k}: {fp.get(k)!r}" for k in diff[:3])
            self.lie("synth_params", _Said(f"{{{have}}}"), f"the fingerprint says {{{says}}}")


def _count(v) -> str:
    return str(len(v)) if isinstance(v, list) else _short(v)


class _Said(str):
    """A value described in words (``3 classes``): shown as is, without quotes."""

    def __repr__(self) -> str:
        return str(self)


def partition_problems(st, key: str, attrs: dict, order: np.ndarray, offsets: np.ndarray) -> list[str]:
    """A stored partition's attributes and arrays against its split (one line each)."""
    out = []
    split, splits = attrs.get("split"), st._attrs.get("splits")
    splits = splits if isinstance(splits, dict) else {}
    if not isinstance(split, str) or split not in splits:
        return [
            f"partition {key}: attribute split = {_short(split)}, but the store has splits {list(splits)}"
        ]
    n = splits[split]
    if not _is_int(n):
        return []  # the splits attribute itself is named
    order, offsets = np.asarray(order), np.asarray(offsets)
    for name, arr in (("order", order), ("offsets", offsets)):
        if arr.ndim != 1 or arr.dtype.kind not in "iu":
            what = f"shape {list(arr.shape)} and dtype {arr.dtype}"
            out.append(f"partition {key}: array {name} has {what}, not a 1-D integer array")
    if out:
        return out
    if len(offsets) < 1 or offsets[0] != 0 or offsets[-1] != len(order) or np.any(np.diff(offsets) < 0):
        run = f"{_short(offsets[:4].tolist())}...{_short(offsets[-1:].tolist())}"
        out.append(
            f"partition {key}: offsets must rise from 0 to len(order) = {len(order)}, but they run {run}"
        )
    if len(order) and (order.min() < 0 or order.max() >= n):
        r = int(order.max()) if order.max() >= n else int(order.min())
        out.append(f"partition {key}: order holds row {r}, but split {split} has {n} rows (0..{n - 1})")
    elif len(np.unique(order)) != len(order):
        out.append(f"partition {key}: order holds a row twice (clients' rows must be disjoint)")
    params = attrs.get("params")
    if not isinstance(params, dict):
        out.append(f"partition {key}: attribute params = {_short(params)} is not a dict")
        return out
    if "clients" in params and params["clients"] != len(offsets) - 1:
        says = f"offsets describe {len(offsets) - 1} clients"
        out.append(f"partition {key}: attribute params.clients = {_short(params['clients'])}, but {says}")
    if _is_int(params.get("n_samples")) and params["n_samples"] > n:
        says = f"split {split} has {n} rows"
        out.append(f"partition {key}: attribute params.n_samples = {params['n_samples']}, but {says}")
    if not isinstance(attrs.get("scheme"), str):
        out.append(f"partition {key}: attribute scheme = {_short(attrs.get('scheme'))} is not a string")
    return out


# ---------------------------------------------------------------------------------------- copying


__all__ = ["AttrCheck", "partition_problems"]

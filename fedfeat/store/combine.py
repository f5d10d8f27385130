"""A federation across several stores (FedTPG's cross-dataset setting: each client holds the classes of one dataset),
as one combined store: ``combine_stores(out, [store_a, store_b, ...])`` (``fedfeat combine OUT A B ...``).

Every source must be a complete store of the same encoder: the same attributes ``backbone``, ``pretrained``,
``embed_dim``, ``logit_scale`` and ``templates``, and the same fingerprint entries for the encoder (``backbone`` --
the config's sha256 --, ``weights``, ``preprocessing``, ``precision``, ``encoder_version``); anything else is a
one-line ``FedfeatError`` naming the two stores and what differs. They must also have the same splits.

The combined store (a normal store, ``FeatureStore.open`` reads it; ``verify`` checks it):

* ``class_names``: the sources' class names, concatenated in source order; source ``s``'s class ``k`` is class
  ``k + (classes of the sources before s)``; ``text/features`` ``[T, K_total, D]`` likewise (each source's own);
* every split: the sources' rows concatenated in source order (features copied chunk by chunk, each source chunk
  verified against its checksum as it is read; never a whole split in memory), labels offset as the classes
  (``-1``, a row ``encode --skip-bad`` skipped, stays ``-1``; the ``skipped`` file lists are concatenated);
* each row's domain (``FeatureStore.domains``) = its source's index, ``domain_names`` = ``names``; by default each
  source's dataset: its ``dataset`` attribute (``encode --dataset``), for the generic readers (imagefolder, listfile,
  coop, domainfolder, hf:, wds:) the store's parent folder (``encode`` writes ``cache/<name>/<backbone>-<weights>.zarr``
  named after the data's folder), for a synthetic store its folder name without ``.zarr``; where those repeat, the
  stores' folder names, else their parent folders' names. The ``domain`` partition scheme then makes clients =
  source datasets;
* attribute ``domain_classes``: per domain, its source's class ids in the combined store (the per-dataset
  vocabulary: evaluation restricts each domain's test rows to its own classes);
* attribute ``combined_from``: per source ``{path, fingerprint_hash, classes, rows: {split: rows}}``;
* attribute ``dataset`` = ``"combined"``; ``backbone``, ``pretrained``, ``preprocessing``, ``precision``,
  ``backbone_config`` and ``weights_file`` are the first source's, so ``fedfeat.encoders.live.load_live_text``
  rebuilds the text encoder of a combined store exactly as of a source store (its fingerprint check then runs on
  the combined class list);
* fingerprint: the first source's with its dataset part replaced by ``{"combined": [each source's fingerprint
  hash], "names": names}`` (the encoder entries kept; a synthetic source's generator parameters, which describe
  its dataset, are dropped: ``{"generator": "fedfeat.store.combine", "dataset": {...}}``).

Not combined: pixels (a source's ``--pixels`` arrays are ignored; the combined store keeps none, so live image
methods cannot run on it) and stored partitions (make them on the combined store). Sources that record domains
themselves (PACS, DomainNet ...) are refused: nested domains are not supported.

Crash safety as ``fedfeat.store.synth.write_synthetic_store``: the store is written in a temporary sibling directory
(``.<name>.tmp-<pid>``) and renamed into place once complete; a failure leaves nothing at ``out`` that reads as a
store. A complete store at ``out`` combined from the same sources (the same fingerprint hashes, in the same order,
with the same names) is kept as is; a different one is replaced only with ``overwrite``. ``out`` is a local path.

Example::

    >>> st = combine_stores("cache/c10+pets.zarr", ["cache/cifar10/ViT-B-32-openai.zarr",
    ...                     "cache/oxford_pets/ViT-B-32-openai.zarr"])                      # doctest: +SKIP
    >>> st.domain_names, st.attrs["domain_classes"][1][:2]                                  # doctest: +SKIP
    (['cifar10', 'oxford_pets'], [10, 11])
"""

from __future__ import annotations

import datetime
import os
from pathlib import Path

import numpy as np

from fedfeat.errors import FedfeatError
from fedfeat.store.featurestore import (
    FeatureStore,
    existing_store,
    half_created,
    publish,
)
from fedfeat.store.format import short as _short
from fedfeat.store.urls import local_path

GENERATOR = "fedfeat.store.combine"
# attributes every source must share (the encoder), and the fingerprint entries that describe the encoder
SAME_ATTRS = ("backbone", "pretrained", "embed_dim", "logit_scale", "templates")
SAME_FINGERPRINT = ("backbone", "weights", "preprocessing", "precision", "encoder_version", "format_version")
# attributes of the first source that describe the encoder, copied so that the live text encoder is rebuilt
ENCODER_ATTRS = ("precision", "backbone_config", "weights_file")
# readers whose stores encode names after the data's folder (cache/<folder>/<backbone>-<weights>.zarr)
GENERIC_READERS = ("imagefolder", "listfile", "coop", "domainfolder")
FIX = "re-encode them with the same --backbone, --pretrained and --templates (and --precision)"


def _shown(v) -> str:
    if isinstance(v, list) and len(v) > 3:
        return f"{len(v)} items starting {_short(v[:2], 50)}"
    if isinstance(v, dict):
        return _short(v, 70)
    return _short(v, 50)


def _check_same_encoder(a: FeatureStore, b: FeatureStore) -> None:
    """One line naming the two stores and what differs, unless ``b`` was made by ``a``'s encoder."""
    aa, ba = a.attrs, b.attrs
    fa, fb = a.fingerprint, b.fingerprint
    diffs = [(k, aa.get(k), ba.get(k)) for k in SAME_ATTRS if aa.get(k) != ba.get(k)]
    diffs += [(f"fingerprint {k}", fa.get(k), fb.get(k)) for k in SAME_FINGERPRINT if fa.get(k) != fb.get(k)]
    if diffs:
        k, va, vb = diffs[0]
        more = f" (and {', '.join(d[0] for d in diffs[1:])})" if len(diffs) > 1 else ""
        raise FedfeatError(
            f"cannot combine {a.path} and {b.path}: not the same encoder, {k} is {_shown(va)} vs {_shown(vb)}{more}; "
            f"combine stores of one encoder only: {FIX}"
        )


def _open_source(src) -> FeatureStore:
    st = FeatureStore.open(src)  # complete and consistent, or a one-line error
    if st.domain_names is not None:
        raise FedfeatError(
            f"cannot combine store {st.path}: it records domains of its own ({', '.join(st.domain_names[:4])}"
            f"{' ...' if len(st.domain_names) > 4 else ''}) and nested domains are not supported; combine "
            "single-domain stores (encode one domain with --domains NAME)"
        )
    return st


def _default_names(stores: list[FeatureStore]) -> list[str]:
    """Each source's dataset name (module docstring), else the stores' folder names, else their parent folders'."""

    def stem(s) -> str:
        n = os.fspath(s.path).rstrip("/").rsplit("/", 1)[-1]
        return n[: -len(".zarr")] if n.endswith(".zarr") else n

    def parent(s) -> str:
        p = os.fspath(s.path.resolve() if isinstance(s.path, Path) else s.path).rstrip("/")
        return p.rsplit("/", 2)[-2] if p.count("/") >= 2 else ""

    def dataset(s) -> str:
        ds = str(s.attrs.get("dataset") or "")
        if ds in GENERIC_READERS or ds.startswith(
            ("hf:", "wds:")
        ):  # encode's cache/<name>/<backbone>-<w>.zarr
            return parent(s)
        return ds if ds not in ("", "synthetic", "combined") else stem(s)

    tries = [[dataset(s) for s in stores], [stem(s) for s in stores], [parent(s) for s in stores]]
    for names in tries:
        if all(names) and len(set(names)) == len(names):
            return names
    raise FedfeatError(
        f"cannot name the combined stores' domains: their datasets and folder names repeat ({', '.join(tries[0])}); "
        "name each with --name (names=[...])"
    )


def _check_names(names, n: int) -> list[str]:
    if not (isinstance(names, (list, tuple)) and all(isinstance(x, str) and x.strip() for x in names)):
        raise FedfeatError(f"names must be a list of non-empty strings, one per store, got {_short(names)}")
    names = [x.strip() for x in names]
    if len(names) != n:
        raise FedfeatError(f"{len(names)} name(s) for {n} stores; give one --name per store, in their order")
    dup = sorted({x for x in names if names.count(x) > 1})
    if dup:
        raise FedfeatError(
            f"names must be distinct, {', '.join(map(repr, dup))} repeats; give each store its own"
        )
    return names


def combined_fingerprint(first: dict, hashes: list[str], names: list[str]) -> dict:
    """The first source's fingerprint with its dataset part replaced (module docstring)."""
    part = {"combined": list(hashes), "names": list(names)}
    if "dataset" in first:  # an encoded store: keep the encoder entries
        fp = {k: v for k, v in first.items() if k != "pixels"}  # pixels are not combined
        fp["dataset"] = part
        return fp
    return {"generator": GENERATOR, "dataset": part}  # a synthetic store: its parameters are its dataset


def _replaceable(path: Path) -> bool:
    """An empty directory, or one left by a process killed inside ``FeatureStore.create``."""
    if not path.is_dir() or path.is_symlink():
        return False
    if not (path / "zarr.json").is_file():
        return not any(path.iterdir())
    return half_created(path, {"train", "test", "val"})


class _ChunkReader:
    """Rows ``[a, b)`` of one source split, read one verified source chunk at a time (the last one kept)."""

    def __init__(self, st: FeatureStore, split: str):
        self.st, self.split, self.i, self.block = st, split, -1, None

    def rows(self, a: int, b: int) -> np.ndarray:
        st, cr, out = self.st, self.st.chunk_rows, []
        while a < b:
            i = a // cr
            if i != self.i:
                sl = st.chunk_slice(self.split, i)
                self.block, self.i = st.features_rows(self.split, np.arange(sl.start, sl.stop)), i  # verified
            stop = min(b, (i + 1) * cr)
            out.append(self.block[a - i * cr : stop - i * cr])
            a = stop
        return np.concatenate(out) if len(out) != 1 else out[0]


def _write(tmp: Path, srcs: list[FeatureStore], names: list[str], fingerprint: dict, chunk_rows, log) -> None:
    first = srcs[0]
    K = [s.n_classes for s in srcs]
    offs = np.concatenate([[0], np.cumsum(K)]).astype(np.int64)  # class id offsets
    splits = first.splits
    labels, domains = {}, {}
    for split in splits:
        labs, doms = [], []
        for d, s in enumerate(srcs):
            lab = s.labels(split).astype(np.int64)
            labs.append(np.where(lab >= 0, lab + offs[d], -1))
            doms.append(np.full(len(lab), d, dtype=np.int16))
        labels[split], domains[split] = np.concatenate(labs), np.concatenate(doms)
    extra = {
        "dataset": "combined",
        **{k: first.attrs[k] for k in ENCODER_ATTRS if k in first.attrs},
        "domain_classes": [list(range(int(offs[d]), int(offs[d + 1]))) for d in range(len(srcs))],
        "combined_from": [
            {
                "path": str(s.path.resolve() if isinstance(s.path, Path) else s.path),
                "fingerprint_hash": s.attrs.get("fingerprint_hash"),
                "classes": s.n_classes,
                "rows": {sp: s.n(sp) for sp in splits},
            }
            for s in srcs
        ],  # fmt: skip
        "created_at": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }
    if any(isinstance(s.attrs.get("skipped"), dict) for s in srcs):  # encode --skip-bad's lists, in row order
        extra["skipped"] = {
            sp: [f"{n}/{f}" for n, s in zip(names, srcs) for f in (s.attrs.get("skipped") or {}).get(sp, [])]
            for sp in splits
        }
    files = {f"{n}/{f}": v for n, s in zip(names, srcs) for f, v in s.sources().items()}
    st = FeatureStore.create(
        tmp,
        backbone=first.attrs["backbone"],
        pretrained=first.attrs["pretrained"],
        embed_dim=first.embed_dim,
        logit_scale=first.logit_scale,
        class_names=[c for s in srcs for c in s.class_names],
        templates=first.templates,
        preprocessing=first.attrs["preprocessing"],
        fingerprint=fingerprint,
        labels=labels,
        chunk_rows=chunk_rows or first.chunk_rows,
        extra_attrs=extra,
        sources=files,
        domains=domains,
        domain_names=names,
    )
    for split in splits:
        ends = np.cumsum([0] + [s.n(split) for s in srcs])  # source d holds combined rows ends[d]:ends[d + 1]
        readers = [_ChunkReader(s, split) for s in srcs]
        for i in range(st.n_chunks(split)):
            sl = st.chunk_slice(split, i)
            parts = []
            for d, r in enumerate(readers):
                a, b = max(sl.start, ends[d]), min(sl.stop, ends[d + 1])
                if a < b:
                    parts.append(r.rows(int(a - ends[d]), int(b - ends[d])))
            st.write_chunk(split, i, np.concatenate(parts) if len(parts) > 1 else parts[0])
        log(f"{split}: {st.n(split)} rows from {len(srcs)} stores")
    st.write_text(np.concatenate([s.text_features() for s in srcs], axis=1))
    st.mark_complete()


def combine_stores(
    out,
    stores: list,
    names: list[str] | None = None,
    *,
    overwrite: bool = False,
    chunk_rows: int | None = None,
    log=print,
) -> FeatureStore:
    """Combine the complete stores ``stores`` (paths or store URLs) of one encoder into one store at ``out`` (a
    local path), each source a domain named by ``names`` (module docstring). ``chunk_rows``: rows per feature
    chunk of the combined store (default: the first source's). Returns the combined store, opened read-only."""
    if not isinstance(overwrite, bool):
        raise FedfeatError(f"overwrite must be True or False, got {_short(overwrite)}")
    if isinstance(stores, (str, os.PathLike)) or not isinstance(stores, (list, tuple)):
        raise FedfeatError(f"stores must be a list of store paths, got {_short(stores)}")
    if len(stores) < 2:
        raise FedfeatError(f"combining needs at least two stores, got {len(stores)}")
    if chunk_rows is not None and (
        not isinstance(chunk_rows, int) or isinstance(chunk_rows, bool) or chunk_rows < 1
    ):
        raise FedfeatError(f"chunk_rows must be a positive integer, got {_short(chunk_rows)}")
    out = local_path(out, "OUT", "a local store directory")
    srcs = [_open_source(s) for s in stores]
    for s in srcs[1:]:
        _check_same_encoder(srcs[0], s)
    want = set(srcs[0].splits)
    for s in srcs[1:]:
        if set(s.splits) != want:
            a, b = (srcs[0], s) if want - set(s.splits) else (s, srcs[0])
            miss = sorted(set(a.splits) - set(b.splits))
            raise FedfeatError(
                f"cannot combine {srcs[0].path} and {s.path}: store {b.path} has no split {', '.join(miss)} (store "
                f"{a.path} has); combine stores with the same splits"
            )
    names = _check_names(names, len(srcs)) if names is not None else _default_names(srcs)
    o = out.resolve()
    for s in srcs:
        if isinstance(s.path, Path):
            p = s.path.resolve()
            if p == o or o.is_relative_to(p) or p.is_relative_to(o):
                raise FedfeatError(f"OUT {out} and store {s.path}: one holds the other; choose another OUT")
    fingerprint = combined_fingerprint(
        srcs[0].fingerprint, [s.attrs.get("fingerprint_hash") for s in srcs], names
    )
    st = existing_store(out, fingerprint, overwrite, "--overwrite", "another OUT", _replaceable)
    if st is not None:
        log(f"{out}: a complete store combined from these stores exists; nothing to do")
        return st
    log(f"combining {len(srcs)} stores into {out}: " + ", ".join(f"{n} ({s.n_classes} classes)" for n, s in
                                                                  zip(names, srcs)))  # fmt: skip
    publish(
        out,
        lambda tmp: _write(tmp, srcs, names, fingerprint, chunk_rows, log),
        "writing the combined store",
        "free space or choose another OUT",
    )
    return FeatureStore.open(out)


__all__ = ["combine_stores", "combined_fingerprint"]

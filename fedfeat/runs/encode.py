"""Stage 1: images and class prompts through a frozen open_clip model into a feature store.

(At ~600 lines: the crash-safe, resumable chunk loop and its torchrun sharding keep each other's invariants.)

``encode`` reads a dataset from disk (``fedfeat.data.files``), builds the model (``fedfeat.encoders.openclip``) and
fills a ``FeatureStore`` at ``OUT/<dataset>/<backbone>-<weights>.zarr``:

- image features of every split, unnormalised, float16, written one whole chunk at a time and recorded as
  done; class-prompt features ``[T, K, D]`` for every template; the model's ``exp(logit_scale)``;
- **resumable**: a run killed at any point and started again only encodes the chunks not yet done, and ends
  with the same bytes as an uninterrupted run (a chunk is always encoded in the same batches, starting at
  the chunk's first row, whatever else runs in the process); the ``complete`` flag is set last;
- **fingerprinted**: a complete store with the same fingerprint (dataset files' names, sizes and contents --
  blake2b of the bytes, cached by (path, size, mtime_ns) in ``~/.cache/fedfeat`` so unchanged files are not read
  again --, class names, backbone config, weights tag or file hash, preprocessing, templates, precision,
  format version) is left alone. When only the contents of image files changed (same names, splits, classes
  and settings; e.g. an image fixed after "cannot read image ..."), only the chunks those files feed are
  encoded again, complete store or not: the result equals a fresh build. Any other difference needs
  ``force`` (which always rebuilds); an unfinished store with the same fingerprint is resumed. ``force``
  never deletes a directory that is not a fedfeat store;
- **locked**: one encode per store. Rank 0 takes ``STORE.lock`` (``fedfeat.store.lock.StoreLock``: pid, host, start
  time) before deciding anything and holds it for the job; a second encode (``--force`` included) is refused
  naming the holder; a lock left by a dead process on this host is taken over with a message;
- **distributed**: under ``torchrun`` (or with ``distributed=True``), rank ``r`` encodes the pending chunks
  ``r, r + world, ...``; rank 0 creates the store before a barrier and, after a second barrier, records
  skipped images, then sets the complete flag. gloo on CPU, NCCL on GPUs. Ranks never share a chunk.

Flags are validated before anything is created. Unreadable images fail with their path, or with ``skip_bad``
get an all-zero feature row; so do images whose model output is not finite (NaN/inf, or beyond float16's range:
never written as a normal row). When the store is finished those rows get label -1 and their names are listed
in the ``skipped`` attribute. A filesystem error (full disk, read-only or forbidden location) is a one-line
``FedfeatError``; the store stays incomplete and the same command resumes it.

Example::

    >>> path = encode("cifar10", "~/data/cifar-10-batches-py", "RN50", out="cache")   # pretrained="openai"
    >>> str(path)
    'cache/cifar10/RN50-openai.zarr'
"""

from __future__ import annotations

import datetime
import os
import re
import time
from functools import partial
from pathlib import Path

import numpy as np
import torch

from fedfeat.data import open_dataset
from fedfeat.data.base import ImageDataset, UnreadableImage
from fedfeat.data.templates import fill, resolve_templates
from fedfeat.encoders import backbones
from fedfeat.encoders import openclip as clipcompat
from fedfeat.encoders.weights import resolve_weights
from fedfeat.engine.distributed import Dist, init_dist
from fedfeat.errors import FedfeatError
from fedfeat.store.featurestore import FORMAT_VERSION, FeatureStore, fingerprint_hash
from fedfeat.store.lock import StoreLock
from fedfeat.store.urls import group_meta, is_store, storage_error, store_exists, store_location

ENCODER_VERSION = 1  # bump when the encoding procedure changes what lands in a store
TEXT_BATCH = 256  # prompts per text forward (fixed, so text features never depend on --batch-size)
_SLEEP_ENV = "FEDFEAT_TEST_CHUNK_SLEEP"  # seconds to pause after each chunk: lets crash tests kill mid-run


# ---------------------------------------------------------------------------------------- naming
def _safe(s: str) -> str:
    return re.sub(r"[^A-Za-z0-9._+-]+", "_", s).strip("._") or "x"


def store_path(out: str | Path, dataset: str, backbone: str, weights: str) -> Path | str:
    """Where ``encode`` puts a store: ``OUT/<dataset>/<backbone>-<weights>.zarr`` (names sanitised). ``OUT`` may be
    an fsspec URL (``s3://bucket/cache``, ``memory://cache``): the store's URL is returned as a string.

    Example::

        >>> store_path("cache", "cifar10", "ViT-B-32", "openai")
        PosixPath('cache/cifar10/ViT-B-32-openai.zarr')
    """
    label = Path(weights).stem if Path(weights).suffix in backbones.CHECKPOINT_SUFFIXES else weights
    base = store_location(out, write="--out")  # a local Path (file:// URLs too) or a URL string
    name = f"{_safe(dataset)}/{_safe(backbone)}-{_safe(label)}.zarr"
    return base / name if isinstance(base, Path) else f"{base}/{name}"


def _dataset_name(dataset: str, root: Path, name: str | None) -> str:
    if name:
        return name
    if dataset.startswith(("hf:", "wds:")):  # the dataset's or the shards' folder name
        from fedfeat.data.external import default_store_name

        return default_store_name(dataset, root)
    if dataset in ("imagefolder", "listfile", "coop", "domainfolder"):  # generic: named after the data's folder
        return root.expanduser().resolve().name or dataset
    return dataset


def _with_domains(name: str, options: dict | None) -> str:
    """``domainnet`` read with ``domains=["clipart", "sketch"]`` -> ``domainnet-clipart+sketch``: a subset of the
    domains is another store, not a rebuild of the full one."""
    doms = (options or {}).get("domains")
    if not doms:
        return name
    items = [doms] if isinstance(doms, str) else list(doms)
    return name + "-" + "+".join(d.strip() for x in items for d in str(x).split(",") if d.strip())


# ---------------------------------------------------------------------------------------- data loading
class _Pixels:
    """PIL image -> ``[3, H, W]`` uint8 after the model's geometric transform (``encode --pixels``)."""

    def __init__(self, geometric):
        self.geometric = geometric

    def __call__(self, img) -> torch.Tensor:
        return torch.from_numpy(np.array(self.geometric(img), dtype=np.uint8, copy=True)).permute(2, 0, 1)


class _Rows(torch.utils.data.Dataset):
    """Map-style dataset over ``(split, row)`` keys -> ``(image [3, H, W] or None, error message)``."""

    def __init__(self, ds: ImageDataset, transform):
        self.ds = ds
        self.transform = transform

    def __getitem__(self, key):
        split, i = key
        try:
            return self.transform(self.ds.load_image(split, i)), ""
        except UnreadableImage as e:
            return None, str(e)


def _collate(items, size: tuple[int, int], dtype=torch.float32):
    """Stack images (zeros for unreadable ones) -> ``([B, 3, H, W], [B] error messages)``."""
    imgs = [x if x is not None else torch.zeros(3, *size, dtype=dtype) for x, _ in items]
    return torch.stack(imgs), [e for _, e in items]


def _batches(st: FeatureStore, chunks: list[tuple[str, int]], batch_size: int) -> list[list[tuple[str, int]]]:
    """Batches of ``(split, row)``: each chunk cut at the same boundaries, whichever chunks run together."""
    out = []
    for split, i in chunks:
        sl = st.chunk_slice(split, i)
        for s in range(sl.start, sl.stop, batch_size):
            out.append([(split, r) for r in range(s, min(s + batch_size, sl.stop))])
    return out


# ---------------------------------------------------------------------------------------- progress
def _progress(enabled: bool, console):
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        ProgressColumn,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
    )
    from rich.text import Text

    class _Rate(ProgressColumn):
        def render(self, task):
            return Text(f"{task.speed:.1f} img/s" if task.speed else "- img/s")

    return Progress(
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        _Rate(),
        TimeElapsedColumn(),
        TimeRemainingColumn(),
        console=console,
        disable=not enabled,
        transient=False,
    )


# ---------------------------------------------------------------------------------------- store decisions
def _diff_keys(a: dict, b: dict) -> list[str]:
    return sorted(k for k in set(a) | set(b) if a.get(k) != b.get(k))


def _half_created(path: Path) -> bool:
    """A directory left by a run killed inside ``FeatureStore.create`` (a zarr group without our attrs)."""
    doc = group_meta(path)  # local or at a store URL
    if doc is None:
        return False
    return doc.get("node_type") == "group" and "format_version" not in doc.get("attributes", {})


def _changed_chunks(st: FeatureStore, fingerprint: dict, ds: ImageDataset):
    """When a store differs from ``fingerprint`` only in the contents of image files (same names, splits,
    classes and settings): ``({split: [chunk indices fed by changed files]}, changed names)``; else
    ``(None, changed names or [])``. Re-encoding those chunks gives the store a fresh build would."""
    old, new = st.fingerprint, fingerprint
    if _diff_keys(old, new) != ["dataset"]:
        return None, []
    if _diff_keys(old["dataset"], new["dataset"]) != ["files"]:
        return None, []
    was, now = st.sources(), _sources(ds)
    changed = sorted(k for k in set(was) | set(now) if was.get(k) != now.get(k))
    if not changed or not was:
        return None, changed
    rows, other = ds.rows_of_files(set(changed))
    if other:  # list files, class-name files, metadata: labels or names may differ
        return None, changed
    chunks = {s: sorted({int(r) // st.chunk_rows for r in rs}) for s, rs in rows.items()}
    return chunks, changed


def _sources(ds: ImageDataset) -> dict:
    return {name: [size, digest] for name, size, digest in ds.file_digests()}


def _decide(path: Path, fingerprint: dict, force: bool, ds: ImageDataset) -> tuple[str, dict]:
    """``("create" | "recreate" | "resume" | "done" | "refresh", chunks to re-encode)`` for the store at
    ``path`` (rank 0 only, holding the store's lock)."""
    if not store_exists(path):
        return "create", {}
    if not is_store(path):
        if _half_created(path):
            return "recreate", {}
        raise FedfeatError(  # never delete what fedfeat did not write, even with --force
            f"{path} exists and is not a fedfeat store; move it away, or choose another --out/--name"
        )
    if force:
        return "recreate", {}
    st = FeatureStore.open(path, mode="r", allow_incomplete=True)
    if st.attrs.get("fingerprint_hash") == fingerprint_hash(fingerprint):
        return ("done" if st.complete else "resume"), {}
    chunks, changed = _changed_chunks(st, fingerprint, ds)
    if chunks is not None:
        return "refresh", {"chunks": chunks, "changed": changed}
    what = ", ".join(_diff_keys(st.fingerprint, fingerprint)) or "contents"
    if changed:
        shown = ", ".join(changed[:3]) + (f" and {len(changed) - 3} more" if len(changed) > 3 else "")
        what += f"; changed files: {shown}"
    state = "a complete" if st.complete else "an unfinished"
    raise FedfeatError(
        f"{path} holds {state} store made with different settings ({what} differ); "
        "pass --force to rebuild it, or --out/--name for another location"
    )


def _read_only_and_done(path: Path, fingerprint: dict, force: bool) -> bool:
    """True for a complete, matching store in a directory this process cannot write (a read-only mount):
    nothing to do, and no lock to take (none could be written)."""
    if force or isinstance(path, str) or not is_store(path) or os.access(path.parent, os.W_OK):
        return False
    st = FeatureStore.open(path, mode="r", allow_incomplete=True)
    return st.complete and st.attrs.get("fingerprint_hash") == fingerprint_hash(fingerprint)


# ---------------------------------------------------------------------------------------- main entry
def encode(
    dataset: str,
    root: str | Path,
    backbone: str,
    pretrained: str | None = None,
    *,
    templates: str | list[str] | None = None,
    out: str | Path = "cache",
    name: str | None = None,
    batch_size: int = 64,
    workers: int | None = None,
    device: str = "auto",
    precision: str = "fp32",
    force: bool = False,
    skip_bad: bool = False,
    chunk_rows: int | None = None,
    distributed: bool | None = None,
    cache_dir: str | Path | None = None,
    probe_timeout: float = 5.0,
    autocast: bool = False,
    pixels: bool = False,
    feed: str = "pil",
    dataset_options: dict | None = None,
    console=None,
    stats: dict | None = None,
) -> Path:
    """Encode dataset ``dataset`` at ``root`` with open_clip ``backbone`` / ``pretrained`` into a feature
    store and return its path (``OUT/<dataset>/<backbone>-<weights>.zarr``).

    ``templates``: a set name (``single``, ``cifar``, ``imagenet``), a template file, a template with ``{}``,
    or a list of those (concatenated, duplicates dropped). ``workers``: DataLoader processes (default 0 on
    CPU, where decoding is ~1% of the model's time, and up to 8 per GPU). ``chunk_rows``: rows per feature
    chunk of a new store (default: 1 MiB chunks). ``distributed``: None = follow torchrun's environment.
    ``autocast``: run bf16/fp16 by autocast instead of casting the weights (see ``bench/bench_encode.py``).
    ``pixels``: also keep every image as the model's uint8 input after its resize and centre crop (``[N, 3, H,
    W]``, chunked and checksummed like the features; the features are computed from exactly those pixels,
    normalised on the device) for the methods that re-encode images (``fedfeat.store.featurestore.FeatureStore.pixels``).
    ``feed``: ``pil`` (the model's own PIL transform, per image, in the loader) or ``device`` (decoded images resized,
    cropped and normalised in batches on ``device`` by ``fedfeat.encoders.feed.DeviceFeed``, Pillow's arithmetic
    reproduced exactly; recorded in the fingerprint).
    ``dataset_options``: ``image_column``, ``label_column``, ``classnames`` for ``hf:`` / ``wds:`` datasets;
    ``domains`` (a subset of the domains) for the multi-domain readers. Each row's domain, where the reader has
    ``domain_names``, is recorded in the store (``FeatureStore.domains``).
    ``stats``: a dict to receive this rank's timings (``images``, ``image_seconds`` for reading, decoding,
    preprocessing, encoding and writing the chunks, ``model_seconds``, ``text_seconds``, ``total_seconds``).

    Example::

        >>> encode("cifar100", "data/cifar-100-python", "ViT-B/32", templates="cifar", precision="bf16")
        PosixPath('cache/cifar100/ViT-B-32-openai.zarr')
    """
    from rich.console import Console

    t_start = time.perf_counter()
    stats = {} if stats is None else stats
    if batch_size < 1:
        raise FedfeatError(f"--batch-size must be >= 1, got {batch_size}")
    if chunk_rows is not None and chunk_rows < 1:
        raise FedfeatError(f"--chunk-rows must be >= 1, got {chunk_rows}")
    if workers is not None and workers < 0:
        raise FedfeatError(f"--workers must be >= 0, got {workers}")
    if not probe_timeout > 0:
        raise FedfeatError(f"the network probe timeout must be > 0 seconds, got {probe_timeout}")
    if precision not in clipcompat.PRECISIONS:
        raise FedfeatError(f"unknown precision '{precision}'; use one of {', '.join(clipcompat.PRECISIONS)}")
    if feed not in ("pil", "device"):
        raise FedfeatError(f"unknown --feed '{feed}'; use pil (the default) or device")
    dist_ctx, dev = init_dist(distributed, device)
    console = console or Console(stderr=True)

    def say_all(msg: str) -> None:
        console.print(msg, markup=False, highlight=False, soft_wrap=True)

    def say(msg: str) -> None:  # rank 0 speaks for the job
        if dist_ctx.rank == 0:
            say_all(msg)

    path: Path | None = None
    lock: StoreLock | None = None
    try:
        clipcompat.check_precision(precision, dev)
        root = Path(root).expanduser()
        ds = open_dataset(dataset, root, dataset_options)
        specs = [templates] if templates is None or isinstance(templates, str) else list(templates)
        tmpl = list(dict.fromkeys(t for s in (specs or [None]) for t in resolve_templates(s)))
        bb = backbones.resolve_backbone(backbone)
        weights = resolve_weights(bb, pretrained, cache_dir=cache_dir, probe_timeout=probe_timeout)
        pp = clipcompat.preprocess_config(bb, weights)
        # rank 0 reads (hashes) the dataset files; the others take its fingerprint
        ds_fp = dist_ctx.broadcast(ds.fingerprint() if dist_ctx.rank == 0 else None)
        fingerprint = {
            "format_version": FORMAT_VERSION,
            "encoder_version": ENCODER_VERSION,
            "dataset": ds_fp,
            "backbone": {"name": bb.name, "config_sha256": bb.config_sha256},
            "weights": weights.fingerprint(),
            "preprocessing": pp,
            "templates": tmpl,
            "precision": precision,
            **({"pixels": True} if pixels else {}),
            **({"feed": feed} if feed != "pil" else {}),  # default stores keep their fingerprint
        }
        store_name = name or _with_domains(_dataset_name(dataset, root, None), dataset_options)
        path = store_path(out, store_name, bb.name, weights.label)

        decision = None
        if dist_ctx.rank == 0:  # rank 0 holds the store's lock for the whole job
            try:
                if _read_only_and_done(path, fingerprint, force):  # a finished store on a read-only mount
                    decision = ("ok", "done", {})
                else:
                    lock = StoreLock(path, log=say).acquire()
                    decision = ("ok", *_decide(path, fingerprint, force, ds))
            except FedfeatError as e:
                decision = ("error", str(e))
        decision = dist_ctx.broadcast(decision)
        if decision[0] == "error":
            raise FedfeatError(decision[1])
        action, refresh = decision[1], decision[2]
        if action == "done":
            say(
                f"{path} is complete and matches (fingerprint {fingerprint_hash(fingerprint)}); nothing to do"
            )
            return path

        t = time.perf_counter()
        clip = clipcompat.load_model(
            bb, weights, device=dev, precision=precision, autocast=autocast, cache_dir=cache_dir
        )
        stats["model_seconds"] = time.perf_counter() - t
        device_feed = None
        if feed == "device":  # refuses a transform it cannot reproduce, before the store is created
            from fedfeat.encoders.feed import DeviceFeed

            device_feed = DeviceFeed.from_transform(clip.transform, clip.device)
        if dist_ctx.rank == 0 and action in ("create", "recreate"):
            say(f"creating {path} ({bb.name}, weights {weights.label}, {len(tmpl)} template(s), {precision})")
            labels = {s: ds.labels(s) for s in ds.split_names}
            FeatureStore.create(
                path,
                backbone=bb.name,
                pretrained=weights.label,
                embed_dim=bb.embed_dim,
                logit_scale=clip.logit_scale,
                class_names=ds.class_names,
                templates=tmpl,
                preprocessing={**pp, "transform": clipcompat.transform_description(clip.transform)},
                fingerprint=fingerprint,
                labels=labels,
                chunk_rows=chunk_rows,
                extra_attrs={
                    "dataset": dataset,
                    "precision": precision,
                    # what `fedfeat.encoders.live` needs to rebuild the text encoder (the fingerprint keeps only hashes)
                    "backbone_config": bb.config,
                    "weights_file": str(weights.file) if weights.kind == "file" else None,
                    "created_at": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                },
                sources=_sources(ds),
                overwrite=action == "recreate",
                pixels=_pixel_spec(clip) if pixels else None,
                domain_names=ds.domain_names,
                domains={s: ds.domains(s) for s in ds.split_names} if ds.domain_names is not None else None,
            )
        elif dist_ctx.rank == 0 and action == "refresh":
            # done entries cleared first, fingerprint last: a run killed in between redoes the same steps
            st = FeatureStore.open(path, mode="r+", allow_incomplete=True)
            n = sum(len(c) for c in refresh["chunks"].values())
            names = refresh["changed"]
            say(
                f"{path}: {len(names)} dataset file(s) changed since it was encoded ({', '.join(names[:3])}"
                f"{', ...' if len(names) > 3 else ''}); re-encoding the {n} chunk(s) they feed"
            )
            for split, chunks in refresh["chunks"].items():
                st.clear_chunks(split, chunks)
            st.set_sources(_sources(ds))
            st.update_attrs(fingerprint=fingerprint, fingerprint_hash=fingerprint_hash(fingerprint))
        dist_ctx.barrier()
        st = FeatureStore.open(path, mode="r+", allow_incomplete=True)
        if st.attrs.get("fingerprint_hash") != fingerprint_hash(fingerprint):
            raise FedfeatError(
                f"{path} changed while this run started (another `fedfeat encode` with other settings "
                "writing the same store?); run one encode per store"
            )
        if action in ("resume", "refresh") and dist_ctx.rank == 0:
            todo = {k: v for k, v in st.missing().items() if v}
            say(f"resuming {path}: pending chunks {todo}")

        # One list of pending chunks for all ranks, read before anyone writes (rank 0's view, broadcast).
        pending = None
        if dist_ctx.rank == 0:
            pending = [(s, int(i)) for s in st.splits for i in np.flatnonzero(~st.done_chunks(s))]
        pending = dist_ctx.broadcast(pending)
        mine = pending[dist_ctx.rank :: dist_ctx.world]

        # Text embeddings: one rank (the last, which gets the fewest image chunks).
        t = time.perf_counter()
        if dist_ctx.rank == dist_ctx.world - 1 and not st.text_done():
            prompts = [fill(t, c) for t in tmpl for c in ds.class_names]
            say_all(f"encoding {len(prompts)} class prompts ({len(tmpl)} templates x {len(ds.class_names)})")
            text = clip.encode_texts(prompts, batch_size=TEXT_BATCH)  # [T * K, D]
            st.write_text(text.reshape(len(tmpl), len(ds.class_names), bb.embed_dim).numpy())

        stats["text_seconds"] = time.perf_counter() - t
        rank_tag = f"[rank {dist_ctx.rank}/{dist_ctx.world}] " if dist_ctx.active else ""
        stats["images"], stats["image_seconds"] = _encode_chunks(
            st,
            ds,
            clip,
            mine,
            batch_size,
            _workers(workers, dev, dist_ctx),
            skip_bad,
            progress=dist_ctx.rank == 0 and console.is_terminal,
            console=console,
            say=say_all if dist_ctx.active else say,
            rank_tag=rank_tag,
            device_feed=device_feed,
        )

        dist_ctx.barrier()
        if dist_ctx.rank == 0:
            skipped = _finish(st, ds)
            if skipped:
                say(
                    f"skipped {sum(len(v) for v in skipped.values())} unreadable image(s): label -1, "
                    "listed in the store's 'skipped' attribute"
                )
            from fedfeat.report.rundir import check_interrupt

            check_interrupt()  # a Ctrl-C that something swallowed: the store stays incomplete (resumable)
            st.mark_complete()
            say(
                f"{path} complete: {', '.join(f'{s} {st.n(s)}' for s in st.splits)} images, "
                f"{len(tmpl)} x {len(ds.class_names)} prompts, D={bb.embed_dim}"
            )
        dist_ctx.barrier()
        stats["total_seconds"] = time.perf_counter() - t_start
        return path
    except (
        OSError
    ) as e:  # a full disk, a read-only or forbidden location: one line; the store stays resumable
        raise storage_error(
            e,
            path if path is not None else out,
            "encoding",
            "free space or fix the location, then re-run the same command (finished chunks are kept), "
            "or choose another --out",
        ) from None
    finally:
        if lock is not None:
            lock.release()
        dist_ctx.close()


def _pixel_spec(clip) -> dict:
    _, mean, std = clipcompat.split_transform(clip.transform)
    return {"size": list(clip.input_size), "mean": mean, "std": std}


def _workers(workers: int | None, dev: torch.device, dist_ctx: Dist) -> int:
    if workers is not None:  # validated by encode() before anything is created
        return workers
    if dev.type == "cpu":
        return 0
    per_rank = max(
        1, (os.cpu_count() or 1) // max(1, int(os.environ.get("LOCAL_WORLD_SIZE", dist_ctx.world)))
    )
    return min(8, per_rank)


def _encode_chunks(
    st,
    ds,
    clip,
    chunks,
    batch_size,
    workers,
    skip_bad,
    *,
    progress,
    console,
    say,
    rank_tag="",
    device_feed=None,
) -> tuple[int, float]:
    """Encode ``chunks`` (list of ``(split, chunk index)``), writing each one whole; -> (images, seconds)."""
    if not chunks:
        if rank_tag:
            say(f"{rank_tag}no chunks to encode")
        return 0, 0.0
    batches = _batches(st, chunks, batch_size)
    px_spec = st.attrs.get("pixels")
    if (
        px_spec is not None
    ):  # uint8 model inputs from the loader; normalised on the device, stored as they are
        geometric, _, _ = clipcompat.split_transform(clip.transform)
        transform, dtype = _Pixels(geometric), torch.uint8
    else:
        transform, dtype = clip.transform, torch.float32
    rows, collate = _Rows(ds, transform), partial(_collate, size=clip.input_size, dtype=dtype)
    if device_feed is not None:  # decoded uint8 images of any size; resized etc. on the device
        from fedfeat.encoders.feed import RawRows, collate_raw

        rows, collate = RawRows(ds, jpeg=device_feed.decodes_jpeg), collate_raw
    loader = torch.utils.data.DataLoader(
        rows,
        batch_sampler=batches,
        num_workers=workers,
        collate_fn=collate,
        pin_memory=clip.device.type == "cuda",
    )
    sleep = float(os.environ.get(_SLEEP_ENV, "0") or 0)
    total = sum(len(b) for b in batches)
    chunk_iter = iter(chunks)
    split, ci = next(chunk_iter)
    sl = st.chunk_slice(split, ci)
    buf = np.zeros((sl.stop - sl.start, st.embed_dim), dtype=np.float32)  # [rows, D] of the current chunk
    pbuf = _pixel_buffer(st, sl)  # [rows, 3, H, W] uint8 of the current chunk, or None
    filled = 0
    t0 = time.perf_counter()
    with _progress(progress, console) as bar:
        task = bar.add_task("encode", total=total)
        for keys, (images, errors) in zip(batches, loader):  # images  # [B, 3, H, W]
            if device_feed is not None:  # uint8 [B, 3, H, W] on the device, as the PIL transform makes them
                images, errors = device_feed.pixels(images, errors)
            bad = [k for k, e in enumerate(errors) if e]
            if bad and not skip_bad:
                raise FedfeatError(errors[bad[0]])
            if pbuf is not None:
                from fedfeat.store.featurestore import normalize_pixels

                pbuf[filled : filled + len(images)] = images.cpu().numpy()
                images = normalize_pixels(images.to(clip.device), px_spec["mean"], px_spec["std"])
            elif device_feed is not None:
                images = device_feed.normalize(images)
            feats = clip.encode_images(images).numpy()  # [B, D] float32
            with np.errstate(over="ignore"):  # what the store keeps: float16 (overflow -> inf)
                finite = np.isfinite(feats.astype(np.float16)).all(axis=1)
            nonfinite = [k for k in np.flatnonzero(~finite) if k not in bad]
            if nonfinite and not skip_bad:
                raise FedfeatError(
                    f"the model's features of image {ds.describe(*keys[nonfinite[0]])} are not finite (NaN or "
                    "inf, or beyond float16's range); check the weights and --precision, or pass --skip-bad to "
                    "skip such images (their rows get label -1)"
                )
            bad += [int(k) for k in nonfinite]
            if bad:  # an all-zero row marks a skipped image (label -1 when the store completes)
                feats[bad] = 0.0
            buf[filled : filled + len(feats)] = feats
            filled += len(feats)
            bar.advance(task, len(feats))
            if filled == len(buf):
                st.write_chunk(split, ci, buf) if pbuf is None else st.write_chunk(split, ci, buf, pbuf)
                if sleep:
                    time.sleep(sleep)
                nxt = next(chunk_iter, None)
                if nxt is not None:
                    split, ci = nxt
                    sl = st.chunk_slice(split, ci)
                    buf = np.zeros((sl.stop - sl.start, st.embed_dim), dtype=np.float32)
                    pbuf = _pixel_buffer(st, sl)
                    filled = 0
    dt = time.perf_counter() - t0
    if not progress or rank_tag:
        say(
            f"{rank_tag}encoded {total} images ({len(chunks)} chunks) in {dt:.1f} s "
            f"({total / max(dt, 1e-9):.1f} img/s)"
        )
    return total, dt


def _pixel_buffer(st: FeatureStore, sl: slice) -> np.ndarray | None:
    spec = st.attrs.get("pixels")
    if spec is None:
        return None
    return np.zeros((sl.stop - sl.start, 3, *spec["size"]), dtype=np.uint8)


def _finish(st: FeatureStore, ds: ImageDataset) -> dict[str, list[str]]:
    """Label the all-zero rows (unreadable images skipped by any rank) -1 and list them; idempotent."""
    skipped: dict[str, list[str]] = {}
    for split in st.splits:
        feats = st.features(split)  # [N, D] float16
        bad = np.flatnonzero(~feats.any(axis=1))
        labels = ds.labels(split).copy()  # from the data: a re-encoded (fixed) image gets its label back
        labels[bad] = -1
        if not np.array_equal(labels, st.labels(split)):
            st.set_labels(split, slice(0, len(labels)), labels)
        if len(bad):
            skipped[split] = [ds.item_name(split, int(i)) for i in bad]
    st.update_attrs(skipped=skipped)
    return skipped

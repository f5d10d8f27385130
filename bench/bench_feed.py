"""Preprocessing benchmark (``encode --feed``): images per second per core of the PIL path (open_clip's eval
transform per image) and of the device feed run on the CPU (``fedfeat.encoders.feed.DeviceFeed``, one torch thread),
measured apart from the model, and how many cores of PIL preprocessing a GPU's forward pass would need.

    python bench/bench_feed.py            # writes bench/results/feed.md (~1 min)

Cases: (a) CIFAR: 32 x 32 uint8 arrays -> 224 px (bicubic upscale, ToTensor, Normalize); (b) JPEG: 500 x 375 files
(quality 90, generated into a temporary folder) read, decoded and resized (shortest side 224, centre crop). The PIL
path is one process, one thread; the device feed decodes with PIL too (as it does on a CPU) and resizes whole
batches of 64 with torch (``torch.set_num_threads(1)``). Each figure is the median of ``--repeats`` interleaved
runs. The GPU forward rates are published figures (timm's benchmark, bf16, one workstation GPU), not measured here.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_engine import machine, write_table  # noqa: E402

from fedfeat.encoders.feed import DeviceFeed  # noqa: E402
from fedfeat.encoders.openclip import import_open_clip  # noqa: E402

GPU_FORWARD = {"CLIP-RN50": 9532, "ViT-B/32": 17992, "ViT-B/16": 5030, "ViT-L/14": 1191}  # img/s, timm bf16
BATCH = 64


def _transform():
    import_open_clip()
    from open_clip.transform import PreprocessCfg, image_transform_v2

    return image_transform_v2(PreprocessCfg(), is_train=False)  # 224 px, bicubic, CLIP mean/std


def _rate(fn, n: int) -> float:
    t = time.perf_counter()
    fn()
    return n / (time.perf_counter() - t)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cifar", type=int, default=256, help="CIFAR-sized images per run")
    ap.add_argument("--jpegs", type=int, default=128, help="500 x 375 JPEG files per run")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "feed.md"))
    args = ap.parse_args()
    torch.set_num_threads(1)
    from PIL import Image

    transform = _transform()
    feed = DeviceFeed.from_transform(transform, "cpu")
    rng = np.random.default_rng(0)
    cifar = [rng.integers(0, 256, (32, 32, 3), dtype=np.uint8) for _ in range(args.cifar)]
    tmp = Path(tempfile.mkdtemp(prefix="bench-feed-"))
    paths = []
    base = rng.integers(0, 256, (375 // 25, 500 // 25, 3), dtype=np.uint8)  # smooth content, photo-like sizes
    for i in range(args.jpegs):
        img = Image.fromarray(np.roll(base, i, axis=1)).resize((500, 375), Image.BICUBIC)
        noisy = np.clip(np.asarray(img, dtype=np.int16) + rng.integers(-8, 9, (375, 500, 3)), 0, 255)
        p = tmp / f"{i:04d}.jpg"
        Image.fromarray(noisy.astype(np.uint8)).save(p, format="JPEG", quality=90)
        paths.append(p)

    def pil_cifar():
        torch.stack([transform(Image.fromarray(x)) for x in cifar])

    def feed_cifar():
        for s in range(0, len(cifar), BATCH):
            feed([("rgb", torch.from_numpy(x)) for x in cifar[s : s + BATCH]])

    def pil_jpeg():
        for p in paths:
            with Image.open(p) as im:
                im.load()
                transform(im.convert("RGB"))

    def decode(p):
        with Image.open(p) as im:
            im.load()
            return torch.from_numpy(np.array(im.convert("RGB"), dtype=np.uint8))

    def feed_jpeg():
        for s in range(0, len(paths), BATCH):
            feed([("rgb", decode(p)) for p in paths[s : s + BATCH]])

    def decode_only():
        for p in paths:
            decode(p)

    cases = {
        "pil_cifar": (pil_cifar, len(cifar)),
        "feed_cifar": (feed_cifar, len(cifar)),
        "pil_jpeg": (pil_jpeg, len(paths)),
        "feed_jpeg": (feed_jpeg, len(paths)),
        "decode": (decode_only, len(paths)),
    }
    for fn, n in cases.values():  # warm-up (coefficient caches, allocator)
        fn() if n < 64 else None
    feed_cifar(), feed_jpeg()
    rates: dict[str, list[float]] = {k: [] for k in cases}
    for _ in range(args.repeats):
        for k, (fn, n) in cases.items():
            rates[k].append(_rate(fn, n))
    med = {k: statistics.median(v) for k, v in rates.items()}
    for p in paths:
        p.unlink()
    tmp.rmdir()

    lines = [
        "## Preprocessing: the PIL path and the device feed, per core",
        "",
        f"Machine: {machine()}. Command: `python bench/bench_feed.py` (one process; torch threads = 1): images per "
        f"second of preprocessing alone, no model; median of {args.repeats} interleaved runs. CIFAR: {args.cifar} "
        f"32 x 32 uint8 arrays -> 224 px. JPEG: {args.jpegs} files of 500 x 375 (quality 90) read, decoded (PIL), "
        "resized (shortest side 224, bicubic), centre-cropped, normalised. The device feed (`encode --feed device`) "
        f"is run here on the CPU, in batches of {BATCH}, with Pillow's arithmetic reproduced exactly (its outputs "
        "equal the PIL path's bit for bit).",
        "",
        "| case | PIL path img/s/core | device feed on CPU img/s/core | feed / PIL |",
        "|---|---|---|---|",
        f"| (a) CIFAR 32 px -> 224 | {med['pil_cifar']:,.0f} | {med['feed_cifar']:,.0f} | "
        f"{med['feed_cifar'] / med['pil_cifar']:.2f}x |",
        f"| (b) JPEG 500 x 375 -> 224 (decode + resize) | {med['pil_jpeg']:,.0f} | {med['feed_jpeg']:,.0f} | "
        f"{med['feed_jpeg'] / med['pil_jpeg']:.2f}x |",
        f"| (b') JPEG decode alone (PIL, both paths) | {med['decode']:,.0f} | | |",
        "",
        "Cores of PIL preprocessing one GPU's forward pass would need (published forward rates: timm, bf16, one "
        "workstation GPU; not measured here):",
        "",
        "| model | GPU forward img/s | cores of PIL path, CIFAR | cores of PIL path, JPEG | cores of PIL decode alone "
        "(device resize), JPEG |",
        "|---|---|---|---|---|",
    ]
    for name, r in GPU_FORWARD.items():
        lines.append(
            f"| {name} | {r:,} | {r / med['pil_cifar']:.1f} | {r / med['pil_jpeg']:.1f} | {r / med['decode']:.1f} |"
        )
    lines += [
        "",
        "On a CPU the device feed is no faster than PIL (it is meant for the GPU; its GPU speed is not measured here: this "
        "machine has none). With `--feed device` on CUDA the "
        "resize leaves the loader's cores, which then only decode (last column); JPEG files are decoded on the GPU "
        "(nvJPEG) when torchvision's compiled decoder is there.",
        "",
    ]
    write_table(Path(args.out), lines)


if __name__ == "__main__":
    main()

"""Stand-in stores that prompt methods can run on: ``fedfeat reproduce --synthetic`` for the rows that need a live
encoder (PromptFL, FedTPG, pFedPrompt, FedOPT, FedCoPL).

A feature stand-in (``fedfeat synth``) has no encoder, so a prompt row could only be ``n/a`` on it. A *live stand-in*
is a real store made by the real ``fedfeat encode`` path (``--pixels``): synthetic 32-px images -- per class a
random 4 x 4 colour pattern upsampled, each image that pattern shifted by up to 4 px plus Gaussian noise (seeded) --
written as an ImageFolder tree and encoded by a tiny open_clip ViT (2 layers, width 64, patch 8, embedding dim
32) with random weights (seeded) saved as a safetensors checkpoint beside the store. Its config and checkpoint are
recorded by the store as for any backbone, so the prompt methods rebuild its text tower (and FedCoPL / FedOPT its
image tower) through the ordinary loading path.

What it is for: the grid's prompt rows *run* anywhere (a CPU, CI) and exercise their whole path. What it is not:
a random tiny CLIP knows no words and no images, so its numbers (zero-shot near chance) say nothing about any
method on real data -- the table's title says so. Sizes: the dataset's class count, at most ``LIVE_TRAIN`` train
and ``LIVE_TEST`` test images per class (fewer than the feature stand-in: these images are re-encoded every step);
of a domain shape (``domains``), that many per class in each domain, read as DomainNet's layout so that the store
records each row's domain (``--partition domain``).
"""

from __future__ import annotations

import io
import json
from pathlib import Path

import numpy as np

STANDIN_NAME = "fedfeat-standin-vit"
STANDIN_CFG = {
    "embed_dim": 32,
    "vision_cfg": {
        "image_size": 32,
        "layers": 2,
        "width": 64,
        "head_width": 32,
        "patch_size": 8,
        "mlp_ratio": 2,
    },
    "text_cfg": {
        "context_length": 77,
        "vocab_size": 49408,
        "width": 64,
        "heads": 2,
        "layers": 2,
        "mlp_ratio": 2,
    },
}
LIVE_TRAIN = 30  # train images per class, at most (FedCoPL: 10 clients >= 10 each at Dirichlet 0.1)
LIVE_TEST = 12  # test images per class, at most
TEMPLATE = "a photo of a {}."


def standin_model(folder: Path) -> tuple[Path, Path]:
    """The tiny model's config (``<name>.json``, as ``--backbone FILE`` takes it) and random weights (seed 0),
    written once under ``folder``."""
    import torch
    from safetensors.torch import save_file

    from fedfeat.encoders.openclip import import_open_clip

    folder.mkdir(parents=True, exist_ok=True)
    cfg, weights = folder / f"{STANDIN_NAME}.json", folder / f"{STANDIN_NAME}.safetensors"
    if not weights.is_file():
        cfg.write_text(json.dumps(STANDIN_CFG))
        oc = import_open_clip()
        oc.add_model_config(cfg)
        torch.manual_seed(0)
        import logging

        quiet = logging.getLogger().level
        logging.getLogger().setLevel(
            logging.ERROR
        )  # open_clip's "no pretrained weights": random ones are the point
        try:
            model = oc.create_model(STANDIN_NAME)
        finally:
            logging.getLogger().setLevel(quiet)
        tmp = weights.with_name(weights.name + ".tmp")
        save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(tmp))
        tmp.replace(weights)  # a crash leaves no half-written checkpoint under the final name
    return cfg, weights


def standin_images(folder: Path, classes: int, train: int, test: int, seed: int = 0) -> Path:
    """An ImageFolder tree ``folder/{train,test}/classNNN/i.png`` of class-patterned 32-px images (module
    docstring); written once (a ``.complete`` marker last)."""
    from PIL import Image

    done = folder / ".complete"
    if done.is_file():
        return folder
    rs = np.random.RandomState(seed)
    protos = rs.uniform(0, 255, size=(classes, 4, 4, 3))
    for split, n in (("train", train), ("test", test)):
        for c in range(classes):
            d = folder / split / f"class{c:03d}"
            d.mkdir(parents=True, exist_ok=True)
            base = np.kron(protos[c], np.ones((8, 8, 1)))  # [32, 32, 3]
            for i in range(n):
                img = np.roll(base, tuple(rs.randint(-4, 5, size=2)), axis=(0, 1)) + rs.normal(
                    0, 40, base.shape
                )
                Image.fromarray(np.clip(img, 0, 255).astype(np.uint8)).save(d / f"{i:04d}.png")
    done.write_text("ok\n")
    return folder


def standin_domain_images(
    folder: Path, classes: int, train: int, test: int, domains: list[str], seed: int = 0
) -> Path:
    """A DomainNet-layout tree (``fedfeat.data.domains`` ``domainnet``: ``folder/<domain>/classNNN/<split>_i.png`` and
    list files ``<domain>_{train,test}.txt``) of ``standin_images``' class patterns, one style per domain: a domain's
    images are its class pattern blended with a random colour field of its own (weight 0.4), so that the domains
    share their classes and differ in appearance, a feature shift. Written once (a ``.complete`` marker last)."""
    from PIL import Image

    done = folder / ".complete"
    if done.is_file():
        return folder
    rs = np.random.RandomState(seed)
    protos = rs.uniform(0, 255, size=(classes, 4, 4, 3))
    styles = rs.uniform(0, 255, size=(len(domains), 2, 2, 3))
    for d, dom in enumerate(domains):
        style = np.kron(styles[d], np.ones((16, 16, 1)))  # [32, 32, 3]
        for split, n in (("train", train), ("test", test)):
            lines = []
            for c in range(classes):
                rel = Path(dom) / f"class{c:03d}"
                (folder / rel).mkdir(parents=True, exist_ok=True)
                base = 0.6 * np.kron(protos[c], np.ones((8, 8, 1))) + 0.4 * style
                for i in range(n):
                    img = np.roll(base, tuple(rs.randint(-4, 5, size=2)), axis=(0, 1)) + rs.normal(
                        0, 40, base.shape
                    )
                    Image.fromarray(np.clip(img, 0, 255).astype(np.uint8)).save(
                        folder / rel / f"{split}_{i:04d}.png"
                    )
                    lines.append(f"{(rel / f'{split}_{i:04d}.png').as_posix()} {c}")
            (folder / f"{dom}_{split}.txt").write_text("\n".join(lines) + "\n")
    done.write_text("ok\n")
    return folder


def _domain_names(shape: dict) -> list[str]:
    """A domain shape's domain names (``domain_names``, else ``domain 0``, ...), as the DomainNet reader orders them
    (alphabetically: the published DomainNet, Office-Caltech10 and PACS names already are)."""
    n = int(shape.get("domains", 0) or 0)
    names = [x.strip() for x in str(shape.get("domain_names", "")).split(",") if x.strip()]
    return sorted(names or [f"domain{d}" for d in range(n)])


def live_standin(root: Path, dataset: str, shape: dict, log=print) -> Path:
    """The live stand-in store of ``dataset`` under ``root`` (``root/live-standin/...``), built on first use: the
    shape's class count, ``min(train_per_class, LIVE_TRAIN)`` / ``min(test_per_class, LIVE_TEST)`` images per class."""
    from fedfeat.runs.encode import encode
    from fedfeat.store.urls import is_store

    base = Path(root) / "live-standin"
    out = base / "stores"
    path = out / dataset / f"{STANDIN_NAME}-{STANDIN_NAME}.zarr"
    if is_store(path):
        return path
    train = min(int(shape.get("train_per_class", LIVE_TRAIN)), LIVE_TRAIN)
    test = min(int(shape.get("test_per_class", LIVE_TEST)), LIVE_TEST)
    log(
        f"building the live stand-in of {dataset} ({shape['classes']} classes x {train} + {test} synthetic 32-px "
        "images, encoded with --pixels by a tiny random CLIP: prompt rows run on it; its numbers say nothing about "
        "real data)"
    )
    cfg, weights = standin_model(base)
    fmt = "imagefolder"
    if shape.get("domains"):  # a domain shape: every domain has the classes, in a style of its own
        fmt = "domainnet"
        images = standin_domain_images(
            base / "images" / dataset, int(shape["classes"]), train, test, _domain_names(shape)
        )
    else:
        images = standin_images(base / "images" / dataset, int(shape["classes"]), train, test)
    from rich.console import Console

    got = encode(
        fmt, images, str(cfg), str(weights), templates=TEMPLATE, out=out, name=dataset,
        batch_size=256, device="cpu", pixels=True, console=Console(file=io.StringIO()),
    )  # fmt: skip
    return Path(got)


__all__ = [
    "LIVE_TEST",
    "LIVE_TRAIN",
    "live_standin",
    "standin_domain_images",
    "standin_images",
    "standin_model",
]

"""The ``fedfeat encode`` command: parses flags and calls ``fedfeat.runs.encode.encode`` — nothing else.

The main app (``fedfeat/cli/app.py``) calls ``register(app)``; it prints a ``FedfeatError`` as one line and exits
with status 2, so this module catches nothing.
"""

import os
from pathlib import Path
from typing import Annotated, Optional

import typer

_ADV = "Advanced"


def register(app: typer.Typer) -> None:
    """Add the ``encode`` command to ``app``."""

    @app.command("encode")
    def encode_cmd(
        dataset: Annotated[
            str,
            typer.Option(
                help="Dataset format: cifar10, cifar100, cinic10, imagefolder, listfile, coop (CoOp split_zhou_*.json), "
                "domainnet, domainfolder (<domain>/<class>/<image>, FedCLIP's split; presets pacs, officehome, vlcs, "
                "office-caltech10), hf:NAME[:CONFIG] (a "
                "Hugging Face dataset saved with save_to_disk, or in the local datasets cache) or wds:PATTERN "
                "(webdataset tar shards, e.g. wds:data/train-{000000..000001}.tar or a folder with train/, test/).",
                show_default=False,
            ),
        ],
        backbone: Annotated[
            str,
            typer.Option(
                help="open_clip architecture (RN50, ViT-B-32; OpenAI spellings like ViT-B/32 work), a path to an "
                "open_clip JSON model config, local-dir:PATH (open_clip_config.json + weights) or hf-hub:ORG/REPO "
                "(from the Hugging Face cache). `fedfeat models` lists what is here.",
                show_default=False,
            ),
        ],
        root: Annotated[
            Optional[Path],
            typer.Option(
                help="Dataset folder on disk, e.g. ~/data/cifar-10-batches-py (never downloaded). For hf: and "
                "wds: optional: relative names and patterns resolve against it (default: the current folder).",
                show_default=False,
            ),
        ] = None,
        pretrained: Annotated[
            Optional[str],
            typer.Option(
                help="open_clip pretrained tag (default: openai for OpenAI architectures) or a local "
                "checkpoint file (.pt/.bin/.safetensors, loaded with weights_only=True). OpenAI weights "
                "from a file need the -quickgelu backbone, e.g. ViT-B-32-quickgelu.",
                show_default=False,
            ),
        ] = None,
        templates: Annotated[
            Optional[list[str]],
            typer.Option(
                help="Prompt templates: single ('a photo of a {}.'), cifar (CLIP_benchmark's 18), imagenet "
                "(CLIP's 80), a file with one template per line, or a template with {}. Repeat to combine.",
                show_default=False,
            ),
        ] = None,
        out: Annotated[
            str,
            typer.Option(
                help="Cache folder or fsspec URL (s3://bucket/cache with s3fs, gs:// with gcsfs, memory://); the "
                "store lands at OUT/<dataset>/<backbone>-<weights>.zarr."
            ),
        ] = "cache",
        batch_size: Annotated[int, typer.Option(help="Images per forward pass.")] = 64,
        workers: Annotated[
            Optional[int],
            typer.Option(
                help="DataLoader worker processes (default: 0 on CPU, up to 8 per GPU).", show_default=False
            ),
        ] = None,
        device: Annotated[
            str, typer.Option(help="auto, cpu or cuda (cuda:N); under torchrun each rank uses its local GPU.")
        ] = "auto",
        precision: Annotated[
            str,
            typer.Option(
                help="fp32, bf16 (weights cast to bf16, LayerNorm in fp32; on CPU needs AVX-512/AMX) "
                "or fp16 (CUDA only)."
            ),
        ] = "fp32",
        force: Annotated[
            bool,
            typer.Option(
                "--force",
                help="Rebuild the store even if it exists (needed when its settings differ). Respects the "
                "store's lock; never replaces a directory that is not a fedfeat store.",
            ),
        ] = False,
        pixels: Annotated[
            bool,
            typer.Option(
                "--pixels",
                help="Also store every image as the model's uint8 input after its resize and centre crop (3 x H x "
                "W bytes per image: 150 KB at 224 px, 7.5 GB for CIFAR-10's 50,000) for methods that re-encode "
                "images (visual prompts); features are computed from exactly those pixels.",
            ),
        ] = False,
        feed: Annotated[
            str,
            typer.Option(
                help="How images reach the model: pil (the model's own transform with PIL, per image, in the "
                "loader: the default) or device (decoded images resized, centre-cropped and normalised in batches "
                "on --device, Pillow's bicubic arithmetic reproduced exactly; on CUDA, JPEG files decoded on the "
                "GPU). On CPU its model inputs measured bit-identical to pil's (features equal, tolerance 0); pil "
                "stays the default until the GPU path (nvJPEG decode) is shown equal too. Recorded in the store's "
                "fingerprint.",
            ),
        ] = "pil",
        skip_bad: Annotated[
            bool,
            typer.Option(
                "--skip-bad",
                help="Skip unreadable images instead of failing: zero features, label -1, listed in "
                "the store's 'skipped' attribute.",
            ),
        ] = False,
        distributed: Annotated[
            bool,
            typer.Option(
                "--distributed",
                help="Split chunks across torchrun ranks (automatic when WORLD_SIZE > 1): "
                "torchrun --nproc-per-node N -m fedfeat encode ...",
            ),
        ] = False,
        image_column: Annotated[
            Optional[str],
            typer.Option(
                help="hf: the image column (default: the one Image feature); wds: the image key (default: the "
                "first of webp, png, jpg, jpeg).",
                show_default=False,
            ),
        ] = None,
        label_column: Annotated[
            Optional[str],
            typer.Option(
                help="hf: the label column (default: the one ClassLabel feature); wds: the label key (default: cls).",
                show_default=False,
            ),
        ] = None,
        classnames: Annotated[
            Optional[Path],
            typer.Option(
                help="hf:/wds: a class-name file, one name per line in label order (default: the ClassLabel's "
                "names; for wds: classnames.txt beside the shards).",
                show_default=False,
            ),
        ] = None,
        domains: Annotated[
            Optional[list[str]],
            typer.Option(
                help="domainnet, domainfolder, pacs, officehome, vlcs, office-caltech10: encode only these domains "
                "(names separated by commas, or repeat the flag); the store is named <dataset>-<d1>+<d2>. Default: "
                "every domain.",
                show_default=False,
            ),
        ] = None,
        name: Annotated[
            Optional[str],
            typer.Option(
                help="Store folder name under OUT (default: the dataset, or the root folder's name for "
                "imagefolder/listfile).",
                show_default=False,
                rich_help_panel=_ADV,
            ),
        ] = None,
        chunk_rows: Annotated[
            Optional[int],
            typer.Option(
                help="Rows per feature chunk of a new store (default: 1 MiB chunks).",
                show_default=False,
                rich_help_panel=_ADV,
            ),
        ] = None,
        cache_dir: Annotated[
            Optional[Path],
            typer.Option(
                help="Where open_clip caches downloaded weights (default: the Hugging Face cache).",
                show_default=False,
                rich_help_panel=_ADV,
            ),
        ] = None,
    ) -> None:
        """Encode a dataset through a frozen open_clip model into a resumable feature store."""
        from fedfeat.runs.encode import encode

        if root is None:
            if not dataset.startswith(("hf:", "wds:")):
                from fedfeat.errors import FedfeatError

                raise FedfeatError(
                    f"--root is required for --dataset {dataset}: the dataset folder on disk, "
                    "e.g. --root ~/data/cifar-10-batches-py"
                )
            root = Path(".")
        path = encode(
            dataset,
            root,
            backbone,
            pretrained,
            templates=templates or None,
            out=out,
            name=name,
            batch_size=batch_size,
            workers=workers,
            device=device,
            precision=precision,
            force=force,
            skip_bad=skip_bad,
            pixels=pixels,
            feed=feed,
            chunk_rows=chunk_rows,
            distributed=True if distributed else None,
            cache_dir=cache_dir,
            dataset_options={
                "image_column": image_column,
                "label_column": label_column,
                "classnames": classnames,
                "domains": domains or None,
            },
        )
        if int(os.environ.get("RANK", "0")) == 0:
            typer.echo(str(path))

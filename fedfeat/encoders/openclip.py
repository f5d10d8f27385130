"""open_clip without surprises: import it on a CPU torch, resolve backbones and weights, never hang offline.

Three things happen here and nowhere else:

1. **The torchvision remedy.** The registry's torchvision wheel is built against CUDA torch; on the CPU
   torch its compiled ``_C`` library fails to load silently and ``import torchvision`` (so
   ``import open_clip``) dies with ``operator torchvision::nms does not exist``. ``apply_torchvision_remedy``
   runs before the first import: it tries ``torch.ops.load_library`` on torchvision's ``_C`` and, only if
   that fails, defines the ``nms`` / ``qnms`` schemas in a ``torch.library.Library("torchvision", "DEF")``
   kept alive in this module. Transforms, models and open_clip then import; torchvision's compiled ops (nms,
   roi_align, ``torchvision.io`` decoding) raise a clear error, which is why datasets decode with PIL.
   Where the compiled library loads, nothing is changed. ``import_open_clip()`` applies the remedy and
   returns the module; always import open_clip through it.

2. **Backbones.** ``resolve_backbone`` takes an open_clip architecture name (``RN50``, ``ViT-B-32``), an
   OpenAI spelling (``ViT-B/32``), or a path to an open_clip-style JSON model config (``{"embed_dim",
   "vision_cfg", "text_cfg"}``, or an ``open_clip_config.json`` with ``model_cfg`` / ``preprocess_cfg``),
   registered with ``open_clip.add_model_config`` under the file's stem. open_clip's schemas work too:
   ``local-dir:PATH`` (a folder with ``open_clip_config.json`` and its weights, ``open_clip_model.safetensors`` or
   ``open_clip_pytorch_model.bin``) and ``hf-hub:org/repo`` (the same two files of a Hugging Face repo, read from
   the local Hugging Face cache; downloaded only under the rules of 3. below). Their config is registered under the
   folder's / repo's name and their weights are the default ``--pretrained`` (a checkpoint file: its name and
   sha256 are fingerprinted, plus the repo id for ``hf-hub:``, so the live encoder is rebuilt from the cache).

3. **Weights, offline-safe.** ``resolve_weights`` takes an open_clip pretrained tag (``openai`` is the
   default for architectures that have it) or a local checkpoint file (``.pt`` / ``.pth`` / ``.bin`` /
   ``.safetensors``, loaded by open_clip with ``weights_only=True``). For a tag it never lets open_clip
   touch the network when it does not have to:

   - it looks for the tag's file in the local caches first (the Hugging Face cache via
     ``huggingface_hub.try_to_load_from_cache``, and ``~/.cache/clip`` for URL-only tags) and, if found,
     loads that file directly (with the tag's QuickGELU and preprocessing settings), so a cached tag works
     with no network at all;
   - otherwise, if ``HF_HUB_OFFLINE`` (or ``TRANSFORMERS_OFFLINE``) is set it fails at once; if not, it
     probes the download host — one TCP connection and TLS handshake (or a TCP connection to the configured
     HTTPS proxy) in a daemon thread, bounded by ``probe_timeout`` seconds (5 by default, DNS included) —
     and only if that answers is open_clip allowed to download;
   - a failure is a ``FedfeatError`` naming the architecture and tag, the file to fetch, and
     ``--pretrained /path/to/checkpoint``.

   OpenAI weights used with a tag get QuickGELU automatically (open_clip 3.x itself only warns about the
   mismatch). OpenAI weights loaded **from a file** need the ``-quickgelu`` architecture name
   (``--backbone ViT-B-32-quickgelu --pretrained open_clip_model.safetensors``): the activation has no
   parameters, so a checkpoint cannot tell which one it was trained with.

Example::

    >>> bb = resolve_backbone("ViT-B/32")
    >>> bb.name, bb.embed_dim
    ('ViT-B-32', 512)
    >>> w = resolve_weights(bb, "/ckpt/vit_b32_openai.safetensors")
    >>> clip = load_model(bb, w, device="cpu", precision="fp32")
    >>> clip.encode_images(torch.zeros(2, 3, 224, 224)).shape
    torch.Size([2, 512])
"""

from __future__ import annotations

import contextlib
import json
import pickle
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from fedfeat.encoders.backbones import (
    HF_CONFIG_NAME,
    HF_HUB_PREFIX,
    LOCAL_DIR_PREFIX,
    Backbone,
    dir_checkpoint,
    hf_hub_cache_dir,
    hub_cached_file,
    hub_cached_weights,
)
from fedfeat.encoders.remedy import apply_torchvision_remedy, import_open_clip  # noqa: F401  (open_clip's entry)
from fedfeat.encoders.weights import Weights, find_cached_weights
from fedfeat.errors import FedfeatError

PRECISIONS = ("fp32", "bf16", "fp16")


# ---------------------------------------------------------------------------------------- what is here
def hub_models(cache_dir: str | Path | None = None) -> list[dict]:
    """open_clip models in the local Hugging Face cache (repos whose ``main`` snapshot has ``open_clip_config.json``):
    ``[{"name": "hf-hub:org/repo", "config": path, "weights": path or None}]``, by name. Reads the disk only."""
    root = hf_hub_cache_dir(cache_dir)
    out = []
    try:
        entries = sorted(p.name for p in root.iterdir() if p.is_dir() and p.name.startswith("models--"))
    except OSError:  # no cache yet
        return []
    for entry in entries:
        repo_id = entry[len("models--") :].replace("--", "/")
        cfg = hub_cached_file(repo_id, HF_CONFIG_NAME, root)
        if cfg is not None:
            w = hub_cached_weights(repo_id, root)
            out.append(
                {"name": f"{HF_HUB_PREFIX}{repo_id}", "config": str(cfg), "weights": str(w) if w else None}
            )
    return out


def local_dir_models(folders) -> list[dict]:
    """``local-dir:`` model folders among ``folders`` and their sub-folders (one level): ``[{"name":
    "local-dir:/abs/folder", "config": path, "weights": path or None}]``."""
    out, seen = [], set()
    for f in folders:
        f = Path(f).expanduser().absolute()
        cands = [f] + (sorted(p for p in f.iterdir() if p.is_dir()) if f.is_dir() else [])
        for d in cands:
            if (d / HF_CONFIG_NAME).is_file() and d not in seen:
                seen.add(d)
                w = dir_checkpoint(d)
                out.append(
                    {
                        "name": f"{LOCAL_DIR_PREFIX}{d}",
                        "config": str(d / HF_CONFIG_NAME),
                        "weights": str(w) if w else None,
                    }  # fmt: skip
                )
    return out


def list_models(*, all_tags: bool = False, cache_dir: str | Path | None = None, local_dirs=()) -> dict:
    """What ``--backbone`` / ``--pretrained`` can be here, without any network: every open_clip architecture with
    its pretrained tags whose weights are in a local cache (``find_cached_weights``: the Hugging Face cache, or
    ``~/.cache/clip`` for URL-only tags) and, with ``all_tags``, the tags that would need a download; ``hf-hub:``
    models in the Hugging Face cache; ``local-dir:`` folders among ``local_dirs``.

    Example::

        >>> m = list_models()
        >>> [a["name"] for a in m["architectures"] if a["local"]]   # doctest: +SKIP
        ['RN50']
    """
    oc = import_open_clip()
    archs = []
    for name in oc.list_models():
        local, other = [], []
        for tag in oc.list_pretrained_tags_by_model(name):
            f = find_cached_weights(oc.get_pretrained_cfg(name, tag), cache_dir)
            if f is not None:
                local.append({"tag": tag, "file": str(f)})
            else:
                other.append(tag)
        cfg = oc.get_model_config(name) or {}
        row: dict[str, Any] = {"name": name, "embed_dim": cfg.get("embed_dim"), "local": local}
        if all_tags:
            row["not_local"] = other
        archs.append(row)
    return {
        "architectures": archs,
        "hf_hub": hub_models(cache_dir),
        "local_dir": local_dir_models(local_dirs),
        "hf_hub_cache": str(hf_hub_cache_dir(cache_dir)),
    }


# ---------------------------------------------------------------------------------------- devices, precision
def devices_here() -> str:
    """The devices torch can use on this machine, in words: ``cpu``, then ``cuda:0`` .. ``cuda:N-1`` when CUDA is
    available, and ``mps`` (which fedfeat does not run on) when torch has it."""
    out = ["cpu"]
    if torch.cuda.is_available():
        n = torch.cuda.device_count()
        out.append("cuda:0" if n == 1 else f"cuda:0 .. cuda:{n - 1}")
    mps = getattr(torch.backends, "mps", None)
    if mps is not None and mps.is_available():
        out.append("mps (fedfeat does not run on it)")
    return ", ".join(out)


def resolve_device(device: str = "auto", local_rank: int | None = None) -> torch.device:
    """``auto`` -> ``cuda`` when available, else ``cpu``; ``cuda`` under torchrun -> ``cuda:<local rank>``.
    Anything else -- a device fedfeat does not run on (``tpu``, ``mps``), CUDA where torch has none, a GPU index
    past the last -- is one ``FedfeatError`` line naming the device and the ones this machine has."""
    device = str(device)
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device != "cpu" and device != "cuda" and not (device.startswith("cuda:") and device[5:].isdigit()):
        raise FedfeatError(
            f"unknown device {device!r}: fedfeat runs on auto, cpu, cuda or cuda:N (this machine has "
            f"{devices_here()}); e.g. --device auto"
        )
    if device == "cpu":
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise FedfeatError(
            f"--device {device}, but torch sees no CUDA device (this machine has {devices_here()}); use --device cpu "
            "or auto"
        )
    dev = torch.device(device)
    if dev.index is not None and dev.index >= torch.cuda.device_count():
        raise FedfeatError(
            f"--device {device}: there is no such GPU (this machine has {devices_here()}); use --device cuda or "
            "one of those"
        )
    if dev.index is None and local_rank is not None:
        dev = torch.device("cuda", local_rank)
    return dev


def cpu_has_fast_bf16() -> bool:
    """Whether oneDNN has native bf16 kernels on this CPU (AVX-512 or AMX). Without them (AVX2-only CPUs)
    bf16 matmuls fall back to ~1 GFLOP/s, over 100x slower than fp32 (measured on an AVX2 EPYC)."""
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return False


def check_precision(precision: str, device: torch.device) -> None:
    """Refuse precisions the device cannot run well: fp16 on CPU (~1 GFLOP/s), bf16 on a CPU without native
    bf16 kernels (~1 GFLOP/s), bf16 on a GPU without bf16."""
    if precision not in PRECISIONS:
        raise FedfeatError(f"unknown precision '{precision}'; use one of {', '.join(PRECISIONS)}")
    if precision == "fp16" and device.type != "cuda":
        raise FedfeatError(
            "--precision fp16 needs a CUDA device (fp16 on CPU runs at ~1 GFLOP/s); use bf16 or fp32"
        )
    if precision == "bf16" and device.type == "cpu" and not cpu_has_fast_bf16():
        raise FedfeatError(
            "--precision bf16: this CPU has no native bf16 kernels (needs AVX-512 or AMX), so bf16 would run "
            "~100x slower than fp32; use --precision fp32"
        )
    if precision == "bf16" and device.type == "cuda" and not torch.cuda.is_bf16_supported():
        raise FedfeatError("this GPU has no bf16 support; use --precision fp16 or fp32")


# ---------------------------------------------------------------------------------------- the model
def preprocess_config(backbone: Backbone, weights: Weights) -> dict:
    """The eval transform's settings, as open_clip derives them (defaults < config file < tag; size from the
    vision config) — JSON-ready, computed without building the model."""
    import_open_clip()
    from open_clip.transform import PreprocessCfg, merge_preprocess_dict

    pp = merge_preprocess_dict(PreprocessCfg(), backbone.preprocess)
    pp = merge_preprocess_dict(pp, weights.preprocess)
    pp["size"] = backbone.config.get("vision_cfg", {}).get("image_size", pp["size"])
    return json.loads(json.dumps(pp))  # tuples -> lists


@dataclass
class ClipModel:
    """A frozen open_clip model on a device with its eval transform and tokenizer."""

    model: torch.nn.Module
    transform: Callable  # PIL image -> [3, H, W] float32
    tokenizer: Callable  # list[str] -> [N, L] int64
    device: torch.device
    precision: str
    autocast: bool  # bf16/fp16 by autocast (fp32 weights) instead of casting the weights
    embed_dim: int
    preprocess: dict

    @property
    def logit_scale(self) -> float:
        """``exp(logit_scale)``, e.g. 100.0 for CLIP."""
        return float(self.model.logit_scale.detach().float().exp().item())

    @property
    def input_size(self) -> tuple[int, int]:
        s = self.preprocess["size"]
        return (s, s) if isinstance(s, int) else (int(s[0]), int(s[1]))

    def _ctx(self):
        if self.autocast and self.precision != "fp32":
            dtype = torch.bfloat16 if self.precision == "bf16" else torch.float16
            return torch.autocast(self.device.type, dtype=dtype)
        return contextlib.nullcontext()

    def _input_dtype(self) -> torch.dtype:
        if self.autocast or self.precision == "fp32":
            return torch.float32
        return torch.bfloat16 if self.precision == "bf16" else torch.float16

    def encode_images(self, images: torch.Tensor) -> torch.Tensor:
        """``images  # [B, 3, H, W]`` (transformed) -> unnormalised ``[B, D]`` float32 on the CPU."""
        x = images.to(self.device, dtype=self._input_dtype(), non_blocking=True)
        with torch.inference_mode(), self._ctx():
            feats = self.model.encode_image(x)  # [B, D]
        return feats.float().cpu()

    def encode_texts(self, prompts: list[str], batch_size: int = 256) -> torch.Tensor:
        """``prompts`` -> unnormalised ``[N, D]`` float32 on the CPU, in fixed batches of ``batch_size``."""
        out = []
        with torch.inference_mode(), self._ctx():
            for s in range(0, len(prompts), batch_size):
                tokens = self.tokenizer(prompts[s : s + batch_size]).to(self.device)  # [b, L]
                out.append(self.model.encode_text(tokens).float().cpu())  # [b, D]
        return torch.cat(out) if out else torch.zeros(0, self.embed_dim)


def load_model(
    backbone: Backbone,
    weights: Weights,
    *,
    device: str | torch.device = "cpu",
    precision: str = "fp32",
    autocast: bool = False,
    cache_dir: str | Path | None = None,
) -> ClipModel:
    """Build ``backbone`` with ``weights`` in eval mode, frozen, on ``device``.

    ``precision`` bf16/fp16 casts the weights the way open_clip (and OpenAI) do — convolutions, linear
    layers and attention in low precision, LayerNorm in fp32 — unless ``autocast`` is set, which keeps fp32
    weights and runs the forward under ``torch.autocast``.
    """
    oc = import_open_clip()
    device = torch.device(device)
    check_precision(precision, device)
    pp = preprocess_config(backbone, weights)
    kwargs = dict(
        precision="fp32" if autocast else precision,
        device=device,
        force_quick_gelu=weights.quick_gelu,
        force_preprocess_cfg=pp,
        pretrained_image=False,
        pretrained_text=False,
        cache_dir=None if cache_dir is None else str(cache_dir),
        weights_only=True,
    )
    pretrained = str(weights.file) if weights.file is not None else weights.label
    try:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)  # the random init is overwritten, but keep even that deterministic
            model = oc.create_model(backbone.name, pretrained=pretrained, require_pretrained=True, **kwargs)
    except FedfeatError:
        raise
    except Exception as e:  # open_clip reports bad checkpoints and failed downloads as many exception types
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        if isinstance(e, pickle.UnpicklingError):  # torch's text would advise weights_only=False: never
            if (
                "global" in str(e).lower()
            ):  # the weights-only unpickler met a class or function: not plain tensors
                raise FedfeatError(
                    f"refused to load checkpoint {weights.file}: it holds objects other than tensors, which a "
                    "weights-only load does not accept (they could run code); get the weights from a trusted "
                    "source, preferably as .safetensors, and pass that file to --pretrained"
                ) from None
            raise FedfeatError(
                f"cannot read checkpoint {weights.file}: it is damaged or not a torch checkpoint; re-download it or "
                "pass another file to --pretrained"
            ) from None
        if weights.kind == "file":
            raise FedfeatError(
                f"cannot load checkpoint {weights.file} into {backbone.name} ({type(e).__name__}: {first}); "
                "check that --backbone matches the checkpoint (OpenAI weights need the -quickgelu name)"
            ) from None
        raise FedfeatError(
            f"cannot get the weights for {backbone.name} pretrained '{weights.label}' ({first}); "
            "pass --pretrained /path/to/checkpoint"
        ) from None
    model.eval().requires_grad_(False)
    from open_clip.transform import PreprocessCfg, image_transform_v2

    transform = image_transform_v2(PreprocessCfg(**model.visual.preprocess_cfg), is_train=False)
    return ClipModel(
        model=model,
        transform=transform,
        tokenizer=oc.get_tokenizer(backbone.name),
        device=device,
        precision=precision,
        autocast=autocast,
        embed_dim=backbone.embed_dim,
        preprocess=pp,
    )


def split_transform(transform: Callable) -> tuple[Callable, list[float], list[float]]:
    """``(geometric, mean, std)`` of an open_clip eval transform ``Compose([..., ToTensor, Normalize])``: the PIL ->
    PIL part (resize, centre crop, RGB) whose uint8 output ``encode --pixels`` stores, and the normalisation that
    ``fedfeat.store.featurestore.normalize_pixels`` applies later with the same arithmetic."""
    from torchvision.transforms import Compose, Normalize, ToTensor

    ts = list(getattr(transform, "transforms", []) or [])
    if len(ts) < 2 or not isinstance(ts[-2], ToTensor) or not isinstance(ts[-1], Normalize):
        raise FedfeatError(
            "--pixels needs the model's eval transform to end in ToTensor + Normalize (open_clip's own); this "
            f"model's is {transform_description(transform)}"
        )
    return Compose(ts[:-2]), [float(v) for v in ts[-1].mean], [float(v) for v in ts[-1].std]


def transform_description(transform: Callable) -> str:
    """``repr`` of a transform without memory addresses (stable across processes)."""
    return re.sub(r" at 0x[0-9a-fA-F]+", "", repr(transform))

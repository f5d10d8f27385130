"""Weights: what a ``--pretrained`` names (an open_clip tag found in a local cache, or a checkpoint file), its
sha256, and the offline-safe rules for tags (``resolve_weights``; the rules in ``fedfeat.encoders.openclip``).
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlparse

from fedfeat.encoders.backbones import (
    CHECKPOINT_SUFFIXES,
    DIR_CHECKPOINTS,
    HF_CONFIG_NAME,
    HF_HUB_PREFIX,
    HF_SAFE_WEIGHTS_NAME,
    HF_WEIGHTS_NAME,
    Backbone,
    _hub_fetch,
    _offline_env,
    network_reachable,
)
from fedfeat.encoders.remedy import import_open_clip
from fedfeat.errors import FedfeatError


# ---------------------------------------------------------------------------------------- weights
@dataclass(frozen=True)
class Weights:
    """Resolved ``--pretrained``: a tag (maybe found in a local cache) or a checkpoint file."""

    kind: str  # "tag" or "file"
    label: str  # the tag, or the checkpoint's file name (store path and attrs)
    file: Path | None = None  # checkpoint to load; None: open_clip downloads the tag
    sha256: str | None = None  # of a user-given checkpoint file
    quick_gelu: bool = False  # the tag was trained with QuickGELU
    preprocess: dict = field(default_factory=dict)  # the tag's mean/std/interpolation/resize_mode
    source: str = ""  # hf-hub id or URL of a tag; the path of a file
    hub: str | None = None  # "hf-hub:org/repo" whose default weights these are (``--backbone hf-hub:...``)

    def fingerprint(self) -> dict:
        if self.kind == "file":
            return {"file": self.label, "sha256": self.sha256, **({"hf_hub": self.hub} if self.hub else {})}
        return {"tag": self.label, "source": self.source}


def sha256_file(path: Path, block: int = 1 << 23) -> str:
    """Hex sha256 of a file, read in 8 MiB blocks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(block):
            h.update(chunk)
    return h.hexdigest()


def _hf_candidates(hf_hub: str) -> tuple[str, list[str]]:
    model_id, filename = os.path.split(hf_hub)
    if not filename:
        return model_id, [HF_SAFE_WEIGHTS_NAME, HF_WEIGHTS_NAME]
    alts = [filename[:-4] + ".safetensors"] if filename.endswith((".bin", ".pth")) else []
    return model_id, alts + [filename]


def find_cached_weights(cfg: dict, cache_dir: str | Path | None = None) -> Path | None:
    """The local copy of a pretrained tag's checkpoint (Hugging Face cache, or ``~/.cache/clip`` for URL-only
    tags), or ``None``. Looks only at the disk."""
    if cfg.get("file") and Path(cfg["file"]).is_file():
        return Path(cfg["file"])
    if cfg.get("hf_hub"):
        try:
            from huggingface_hub import try_to_load_from_cache
        except ImportError:
            return None
        model_id, names = _hf_candidates(cfg["hf_hub"])
        for fn in names:
            hit = try_to_load_from_cache(
                model_id, fn, cache_dir=None if cache_dir is None else str(cache_dir)
            )
            if isinstance(hit, str) and Path(hit).is_file():
                return Path(hit)
        return None
    if cfg.get("url"):
        base = Path(cache_dir) if cache_dir else Path("~/.cache/clip").expanduser()
        p = base / os.path.basename(urlparse(cfg["url"]).path)
        return p if p.is_file() else None
    return None


def _download_hint(cfg: dict) -> tuple[str, str]:
    """(host to probe, what to download by hand) for a tag's config."""
    if cfg.get("hf_hub"):
        from huggingface_hub import constants

        model_id, names = _hf_candidates(cfg["hf_hub"])
        endpoint = constants.ENDPOINT
        return urlparse(
            endpoint
        ).hostname or "huggingface.co", f"{endpoint}/{model_id}/resolve/main/{names[0]}"
    url = cfg.get("url", "")
    return urlparse(url).hostname or "", url


def resolve_weights(
    backbone: Backbone,
    pretrained: str | None = None,
    *,
    cache_dir: str | Path | None = None,
    probe_timeout: float = 5.0,
) -> Weights:
    """Resolve ``--pretrained`` for ``backbone`` without downloading anything.

    A tag found in a local cache resolves to that file; a tag that is not cached resolves only if its download
    host answers within ``probe_timeout`` seconds (and ``HF_HUB_OFFLINE`` is unset); otherwise this raises a
    ``FedfeatError`` telling the user to pass ``--pretrained /path/to/checkpoint``.

    Example::

        >>> resolve_weights(resolve_backbone("RN50")).label      # "openai" is the default for OpenAI archs
        'openai'
    """
    oc = import_open_clip()
    if pretrained is None and backbone.source is not None:  # local-dir: / hf-hub: carry their own weights
        return _schema_weights(backbone, cache_dir, probe_timeout)
    tags = oc.list_pretrained_tags_by_model(backbone.name)
    if pretrained is None:
        if "openai" not in tags:
            known = ", ".join(tags) if tags else "none"
            raise FedfeatError(
                f"--pretrained is required for {backbone.name}: give an open_clip tag (known: {known}) "
                "or a checkpoint file path"
            )
        pretrained = "openai"
    path = Path(pretrained).expanduser()
    if path.is_file():
        file = path.resolve()
        if file.suffix != path.suffix:  # a link to a hub cache's blob: the suffix picks open_clip's loader
            file = path.absolute()
        return Weights(kind="file", label=path.name, file=file, sha256=sha256_file(path), source=str(path))
    cfg = oc.get_pretrained_cfg(backbone.name, pretrained)
    if not cfg:
        if os.sep in pretrained or "/" in pretrained or pretrained.endswith(CHECKPOINT_SUFFIXES):
            raise FedfeatError(
                f"checkpoint file {pretrained} not found; pass an existing file or an open_clip tag"
            )
        known = ", ".join(tags) if tags else "none"
        raise FedfeatError(
            f"unknown pretrained tag '{pretrained}' for {backbone.name} (known tags: {known}); "
            "pass a known tag or --pretrained /path/to/checkpoint"
        )
    tag = pretrained.lower().replace("-", "_")
    pp_keys = ("mean", "std", "interpolation", "resize_mode", "fill_color")
    preprocess = {k: cfg[k] for k in pp_keys if cfg.get(k) is not None}
    source = f"hf-hub:{cfg['hf_hub']}" if cfg.get("hf_hub") else cfg.get("url", "")
    common = dict(
        kind="tag", label=tag, quick_gelu=bool(cfg.get("quick_gelu")), preprocess=preprocess, source=source
    )
    cached = find_cached_weights(cfg, cache_dir)
    if cached is not None:
        return Weights(file=cached, **common)
    host, what = _download_hint(cfg)
    if _offline_env():
        reason = "HF_HUB_OFFLINE is set"
    else:
        ok, reason = (
            network_reachable(host, 443, timeout=probe_timeout) if host else (False, "no download source")
        )
        if ok:
            return Weights(file=None, **common)
    qg = (
        f" (OpenAI weights: use --backbone {backbone.name}-quickgelu with that file)"
        if cfg.get("quick_gelu") and not backbone.name.endswith("-quickgelu")
        else ""
    )
    raise FedfeatError(
        f"no local copy of the weights for {backbone.name} pretrained '{pretrained}' and no way to download "
        f"them ({reason}); fetch {what} on a machine with network and "
        f"pass --pretrained /path/to/checkpoint{qg}"
    )


def _schema_weights(backbone: Backbone, cache_dir, probe_timeout: float) -> Weights:
    """The default weights of a ``local-dir:`` / ``hf-hub:`` backbone: the checkpoint beside its config."""
    f = backbone.weights_file
    hub = backbone.source if backbone.source.startswith(HF_HUB_PREFIX) else None
    if f is None and hub is not None:
        repo_id = hub[len(HF_HUB_PREFIX) :]
        f = _hub_fetch(
            repo_id, [HF_SAFE_WEIGHTS_NAME, HF_WEIGHTS_NAME], cache_dir, probe_timeout, "the weights"
        )
    if f is None:
        raise FedfeatError(
            f"no weights beside {backbone.source}'s {HF_CONFIG_NAME} (looked for {', '.join(DIR_CHECKPOINTS[:3])}); "
            "put the checkpoint in that folder or pass --pretrained /path/to/checkpoint"
        )
    f = Path(f).absolute()  # not resolved: a hub cache's blob has no suffix, and the suffix picks the loader
    return Weights(kind="file", label=f.name, file=f, sha256=sha256_file(f), source=str(f), hub=hub)

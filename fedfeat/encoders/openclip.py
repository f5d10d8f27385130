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
import difflib
import hashlib
import importlib.util
import json
import os
import pickle
import re
import socket
import sys
import tempfile
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any
from urllib.parse import urlparse

import torch

from fedfeat.errors import FedfeatError

_TV_LIBRARY = None  # the stub torchvision operator library; must stay alive for the process
_REMEDY: str | None = None  # "native" | "stub" | "imported" | "absent", once applied
CHECKPOINT_SUFFIXES = (".pt", ".pth", ".bin", ".safetensors", ".ckpt", ".npz")
HF_SAFE_WEIGHTS_NAME = "open_clip_model.safetensors"  # open_clip.constants, without importing open_clip
HF_WEIGHTS_NAME = "open_clip_pytorch_model.bin"
PRECISIONS = ("fp32", "bf16", "fp16")


# ---------------------------------------------------------------------------------------- torchvision remedy
def _tv_op_exists() -> bool:
    try:
        return hasattr(torch.ops.torchvision, "nms")
    except (RuntimeError, AttributeError):
        return False


def apply_torchvision_remedy() -> str:
    """Make ``import torchvision`` work on a CPU torch with a torchvision wheel built for CUDA (idempotent).

    Returns what was done: ``"native"`` (torchvision's compiled ops loaded, nothing changed), ``"stub"``
    (the ``nms`` / ``qnms`` schemas were defined so torchvision's Python side imports), ``"imported"``
    (torchvision was already imported; too late to change anything) or ``"absent"`` (no torchvision).
    """
    global _REMEDY, _TV_LIBRARY
    if _REMEDY is not None:
        return _REMEDY
    if "torchvision" in sys.modules:
        _REMEDY = "imported"
        return _REMEDY
    spec = importlib.util.find_spec("torchvision")
    if spec is None or not spec.submodule_search_locations:
        _REMEDY = "absent"
        return _REMEDY
    if _tv_op_exists():
        _REMEDY = "native"
        return _REMEDY
    pkg = Path(next(iter(spec.submodule_search_locations)))
    for lib in sorted(pkg.glob("_C*.so")) + sorted(pkg.glob("_C*.pyd")):
        try:
            torch.ops.load_library(str(lib))
        except (OSError, RuntimeError):
            continue
        if _tv_op_exists():
            _REMEDY = "native"
            return _REMEDY
    # The compiled library does not load: give torchvision's fake-kernel registrations their operators.
    _TV_LIBRARY = torch.library.Library("torchvision", "DEF")
    for op in ("nms", "qnms"):
        _TV_LIBRARY.define(f"{op}(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
    _REMEDY = "stub"
    return _REMEDY


def import_open_clip() -> ModuleType:
    """``import open_clip`` after the torchvision remedy; use this instead of a bare import."""
    apply_torchvision_remedy()
    import open_clip

    return open_clip


# ---------------------------------------------------------------------------------------- backbones
def _sha256_json(obj: Any) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


@dataclass(frozen=True)
class Backbone:
    """A resolved open_clip architecture."""

    name: str  # registered open_clip architecture name, e.g. "ViT-B-32"
    config: dict  # the model config (embed_dim, vision_cfg, text_cfg, ...)
    config_file: str | None = None  # the JSON file it came from, if any
    preprocess: dict = field(default_factory=dict)  # preprocess_cfg of an open_clip_config.json, else {}
    source: str | None = None  # "hf-hub:org/repo" or "local-dir:/abs/folder" it came from, if any
    weights_file: Path | None = None  # the checkpoint found beside that config (the default --pretrained)

    @property
    def embed_dim(self) -> int:
        return int(self.config["embed_dim"])

    @property
    def config_sha256(self) -> str:
        return _sha256_json(self.config)


def _looks_like_path(spec: str) -> bool:
    return spec.endswith(".json") or Path(spec).expanduser().is_file()


def resolve_backbone(
    spec: str, *, cache_dir: str | Path | None = None, probe_timeout: float = 5.0
) -> Backbone:
    """Resolve ``--backbone``: an open_clip name (``RN50``), OpenAI spelling (``ViT-B/32``), JSON config,
    ``local-dir:PATH`` or ``hf-hub:org/repo`` (``cache_dir``: the Hugging Face cache to look in, default the usual).

    Example::

        >>> resolve_backbone("RN50").embed_dim
        1024
        >>> resolve_backbone("configs/tiny-vit.json").name   # registered under the file's stem
        'tiny-vit'
        >>> resolve_backbone("hf-hub:laion/CLIP-ViT-B-32-laion2B-s34B-b79K").weights_file.name  # doctest: +SKIP
        'open_clip_model.safetensors'
    """
    oc = import_open_clip()
    if spec.startswith(LOCAL_DIR_PREFIX):
        return _backbone_from_dir(oc, spec)
    if spec.startswith(HF_HUB_PREFIX):
        return _backbone_from_hub(oc, spec, cache_dir, probe_timeout)
    if _looks_like_path(spec):
        return _backbone_from_file(oc, Path(spec).expanduser())
    name = spec.replace("/", "-")
    if name not in oc.list_models():
        close = difflib.get_close_matches(name, oc.list_models(), n=5, cutoff=0.6)
        hint = f"close matches: {', '.join(close)}" if close else "see open_clip.list_models()"
        raise FedfeatError(
            f"unknown backbone '{spec}' ({hint}); "
            "pass an open_clip architecture name or a path to a JSON model config"
        )
    return Backbone(name=name, config=oc.get_model_config(name))


def _backbone_from_file(oc: ModuleType, path: Path, name: str | None = None) -> Backbone:
    if not path.is_file():
        raise FedfeatError(
            f"backbone config {path} not found; pass an open_clip architecture name or a JSON file"
        )
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise FedfeatError(
            f"cannot read backbone config {path} ({e}); expected an open_clip JSON model config"
        ) from None
    preprocess: dict = {}
    fixed = name is not None
    name = name or path.stem
    if isinstance(data, dict) and "model_cfg" in data:  # open_clip_config.json (Hugging Face layout)
        preprocess = dict(data.get("preprocess_cfg") or {})
        data = data["model_cfg"]
        if name == "open_clip_config" and not fixed:
            name = path.parent.name
    if not isinstance(data, dict) or not all(k in data for k in ("embed_dim", "vision_cfg", "text_cfg")):
        raise FedfeatError(
            f"{path} is not an open_clip model config: it needs 'embed_dim', 'vision_cfg' and 'text_cfg' "
            "(see open_clip/model_configs/RN50.json)"
        )
    if fixed and name in oc.list_models() and oc.get_model_config(name) != data:
        name = f"{name}-{_sha256_json(data)[:8]}"  # never replace another architecture of that name
    if path.name != f"{name}.json" or preprocess:
        # add_model_config registers files by stem and wants the bare config: write one under the right name.
        tmp = Path(tempfile.mkdtemp(prefix="fedfeat-cfg-")) / f"{name}.json"
        tmp.write_text(json.dumps(data))
        oc.add_model_config(tmp)
    else:
        oc.add_model_config(path)
    return Backbone(name=name, config=oc.get_model_config(name), config_file=str(path), preprocess=preprocess)


HF_HUB_PREFIX = "hf-hub:"  # open_clip's schemas (open_clip.factory), without importing open_clip
LOCAL_DIR_PREFIX = "local-dir:"
HF_CONFIG_NAME = "open_clip_config.json"
# checkpoint names in a model folder, preferred first (open_clip.factory._find_checkpoint_in_dir's order)
DIR_CHECKPOINTS = (
    HF_SAFE_WEIGHTS_NAME, "open_clip_pytorch_model.safetensors", HF_WEIGHTS_NAME, "open_clip_pytorch_model.pth",
    "model.safetensors", "pytorch_model.bin", "pytorch_model.pth", "model.pth",
)  # fmt: skip
_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def _safe_name(s: str) -> str:
    return re.sub(r"[^A-Za-z0-9._+-]+", "_", s).strip("._") or "model"


def dir_checkpoint(folder: Path) -> Path | None:
    """The weights file of a model folder (``local-dir:`` or a hub snapshot), as open_clip picks it."""
    for n in DIR_CHECKPOINTS:
        if (folder / n).is_file():
            return folder / n
    found = sorted(
        p for p in folder.iterdir() if p.suffix in (".safetensors", ".bin", ".pth") and p.is_file()
    )
    return found[0] if len(found) == 1 else None


def _backbone_from_dir(oc: ModuleType, spec: str) -> Backbone:
    raw = spec[len(LOCAL_DIR_PREFIX) :]
    folder = Path(raw).expanduser()
    if not raw or not folder.is_dir():
        raise FedfeatError(
            f"--backbone {spec}: no folder {folder}; local-dir:PATH names a folder holding {HF_CONFIG_NAME} and its "
            f"weights ({HF_SAFE_WEIGHTS_NAME} or {HF_WEIGHTS_NAME})"
        )
    cfg = folder / HF_CONFIG_NAME
    if not cfg.is_file():
        raise FedfeatError(
            f"--backbone {spec}: {cfg} not found; a local-dir model folder holds {HF_CONFIG_NAME} (model_cfg, "
            f"preprocess_cfg) beside its weights, as open_clip's push_to_hf_hub writes them"
        )
    folder = folder.absolute()
    bb = _backbone_from_file(oc, cfg, name=_safe_name(folder.resolve().name))
    return Backbone(
        name=bb.name,
        config=bb.config,
        config_file=str(cfg.absolute()),
        preprocess=bb.preprocess,
        source=f"{LOCAL_DIR_PREFIX}{folder}",
        weights_file=dir_checkpoint(folder),
    )


def hf_hub_cache_dir(cache_dir: str | Path | None = None) -> Path:
    """The Hugging Face hub cache looked in: ``cache_dir``, else ``HF_HUB_CACHE`` / ``HF_HOME/hub`` as resolved by
    huggingface_hub."""
    if cache_dir is not None:
        return Path(cache_dir).expanduser()
    from huggingface_hub import constants

    return Path(constants.HF_HUB_CACHE).expanduser()


def hub_cached_file(repo_id: str, filename: str, cache_dir: str | Path | None = None) -> Path | None:
    """The local copy of ``filename`` of hub repo ``repo_id`` (its ``main`` revision) or None; never the network."""
    try:
        from huggingface_hub import try_to_load_from_cache
    except ImportError:
        return None
    try:
        hit = try_to_load_from_cache(repo_id, filename, cache_dir=str(hf_hub_cache_dir(cache_dir)))
    except ValueError:  # an invalid repo id
        return None
    return Path(hit) if isinstance(hit, str) and Path(hit).is_file() else None


def hub_cached_weights(repo_id: str, cache_dir: str | Path | None = None) -> Path | None:
    """The cached weights of hub repo ``repo_id`` (safetensors first, as open_clip), or None."""
    for fn in (HF_SAFE_WEIGHTS_NAME, HF_WEIGHTS_NAME):
        hit = hub_cached_file(repo_id, fn, cache_dir)
        if hit is not None:
            return hit
    return None


def _hub_fetch(repo_id: str, files: list[str], cache_dir, probe_timeout: float, what: str) -> Path:
    """Download the first of ``files`` that the repo has, under ``resolve_weights``' offline rules (``HF_HUB_OFFLINE``
    fails at once; otherwise only when the hub answers within ``probe_timeout`` s); a failure is one line."""
    from huggingface_hub import constants

    endpoint = constants.ENDPOINT
    hint = (
        f"get it on a machine with network (`hf download {repo_id} {HF_CONFIG_NAME} {HF_SAFE_WEIGHTS_NAME}` into "
        f"the Hugging Face cache {hf_hub_cache_dir(cache_dir)}, copied here), or download the folder and pass "
        f"--backbone {LOCAL_DIR_PREFIX}PATH"
    )
    if _offline_env():
        raise FedfeatError(
            f"{what} of {HF_HUB_PREFIX}{repo_id} is not in the local Hugging Face cache and HF_HUB_OFFLINE is set; "
            + hint
        )
    ok, reason = network_reachable(
        urlparse(endpoint).hostname or "huggingface.co", 443, timeout=probe_timeout
    )
    if not ok:
        raise FedfeatError(
            f"{what} of {HF_HUB_PREFIX}{repo_id} is not in the local Hugging Face cache and cannot be downloaded "
            f"({reason}); " + hint
        )
    from huggingface_hub import hf_hub_download

    last = ""
    for fn in files:
        try:
            return Path(hf_hub_download(repo_id, fn, cache_dir=None if cache_dir is None else str(cache_dir)))
        except Exception as e:  # missing file, missing repo, HTTP errors: try the next name, then report
            last = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
    raise FedfeatError(f"cannot download {what} of {HF_HUB_PREFIX}{repo_id} ({last}); " + hint)


def _backbone_from_hub(oc: ModuleType, spec: str, cache_dir, probe_timeout: float) -> Backbone:
    repo_id = spec[len(HF_HUB_PREFIX) :].strip("/")
    if not _REPO_ID.match(repo_id):
        raise FedfeatError(
            f"--backbone {spec}: expected hf-hub:ORG/REPO (a Hugging Face model repo with {HF_CONFIG_NAME}), "
            "e.g. hf-hub:laion/CLIP-ViT-B-32-laion2B-s34B-b79K"
        )
    cfg = hub_cached_file(repo_id, HF_CONFIG_NAME, cache_dir)
    if cfg is None:
        cfg = _hub_fetch(repo_id, [HF_CONFIG_NAME], cache_dir, probe_timeout, HF_CONFIG_NAME)
    bb = _backbone_from_file(oc, cfg, name=_safe_name(repo_id.split("/")[-1]))
    return Backbone(
        name=bb.name,
        config=bb.config,
        config_file=str(cfg),
        preprocess=bb.preprocess,
        source=f"{HF_HUB_PREFIX}{repo_id}",
        weights_file=hub_cached_weights(repo_id, cache_dir),
    )


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


def _offline_env() -> bool:
    return any(
        os.environ.get(k, "").strip().upper() in ("1", "ON", "YES", "TRUE")
        for k in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")
    )


def _proxy_for(scheme: str = "https") -> tuple[str, int] | None:
    for key in (f"{scheme}_proxy", f"{scheme.upper()}_PROXY", "all_proxy", "ALL_PROXY"):
        url = os.environ.get(key)
        if url:
            u = urlparse(url if "://" in url else f"http://{url}")
            if u.hostname:
                return u.hostname, u.port or 8080
    return None


def network_reachable(host: str, port: int = 443, timeout: float = 5.0) -> tuple[bool, str]:
    """Can ``host`` be downloaded from? One TCP connection plus a TLS handshake (or, when an HTTPS proxy is
    configured, one TCP connection to the proxy), bounded by ``timeout`` seconds including DNS: the probe runs
    in a daemon thread, so a stuck resolver or a firewall that swallows packets cannot hold the caller.
    Returns ``(ok, reason)``. The TLS handshake matters: some sandboxes accept every TCP connection and then
    never answer, which is exactly where a download would hang.

    Example::

        >>> network_reachable("huggingface.co", timeout=2.0)  # doctest: +SKIP
        (True, '')
    """
    import ssl

    result: list[tuple[bool, str]] = []
    proxy = _proxy_for("https")

    def probe() -> None:
        try:
            if proxy is not None:
                with socket.create_connection(proxy, timeout=timeout):
                    result.append((True, ""))
                return
            cafile = os.environ.get("REQUESTS_CA_BUNDLE") or os.environ.get("CURL_CA_BUNDLE") or None
            ctx = ssl.create_default_context(cafile=cafile)
            with socket.create_connection((host, port), timeout=timeout) as sock:
                with ctx.wrap_socket(sock, server_hostname=host):
                    result.append((True, ""))
        except (OSError, ValueError) as e:
            where = f"proxy {proxy[0]}:{proxy[1]}" if proxy else f"{host}:{port}"
            result.append((False, f"cannot reach {where} ({getattr(e, 'strerror', None) or e})"))

    t = threading.Thread(target=probe, daemon=True, name="fedfeat-net-probe")
    t.start()
    t.join(timeout)
    if result:
        return result[0]
    where = f"proxy {proxy[0]}:{proxy[1]}" if proxy else f"{host}:{port}"
    return False, f"no answer from {where} within {timeout:g} s"


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
def resolve_device(device: str = "auto", local_rank: int | None = None) -> torch.device:
    """``auto`` -> ``cuda`` when available, else ``cpu``; ``cuda`` under torchrun -> ``cuda:<local rank>``."""
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        dev = torch.device(device)
    except RuntimeError:
        raise FedfeatError(f"unknown device '{device}'; use auto, cpu, cuda or cuda:N") from None
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise FedfeatError("--device cuda but torch sees no CUDA GPU; use --device cpu (or auto)")
        if dev.index is None and local_rank is not None:
            dev = torch.device("cuda", local_rank)
    elif dev.type != "cpu":
        raise FedfeatError(f"device '{device}' is not supported; use auto, cpu or cuda")
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

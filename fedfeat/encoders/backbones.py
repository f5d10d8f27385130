"""Backbones: which open_clip architecture (and, for ``local-dir:`` / ``hf-hub:``, which config and weights files)
a ``--backbone`` names, and where those files come from: a folder, the local Hugging Face cache, or -- only when a
probe says the network answers -- a download (``network_reachable``: never hang offline).
"""

from __future__ import annotations

import difflib
import hashlib
import json
import os
import re
import socket
import tempfile
import threading
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any
from urllib.parse import urlparse

from fedfeat.encoders.remedy import import_open_clip
from fedfeat.errors import FedfeatError

CHECKPOINT_SUFFIXES = (".pt", ".pth", ".bin", ".safetensors", ".ckpt", ".npz")
HF_SAFE_WEIGHTS_NAME = "open_clip_model.safetensors"  # open_clip.constants, without importing open_clip
HF_WEIGHTS_NAME = "open_clip_pytorch_model.bin"


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

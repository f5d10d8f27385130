"""The live text encoder of a store: the frozen open_clip model a store was encoded with, rebuilt for methods that
train prompts (their class embeddings change every step, so the text tower runs inside the round).

A store records its backbone (``attrs["backbone"]``, the full model config in ``attrs["backbone_config"]`` since
this module exists, and the config's sha256 in its fingerprint) and its weights (an open_clip tag, or a checkpoint
file's name, sha256 and -- since this module exists -- path; for ``--backbone hf-hub:ORG/REPO`` also the repo, so the
file is found in this machine's Hugging Face cache when the recorded path is not there; ``local-dir:`` stores
record the folder's checkpoint path). ``load_live_text`` rebuilds the same architecture
with the same weights under ``encode``'s offline rules (a tag must be in the local cache, or its host reachable
with ``HF_HUB_OFFLINE`` unset; a file must exist and have the recorded sha256; ``pretrained`` overrides where the
file is looked for), frozen, in eval mode, on the run's device, in float32.

Loading it is a fingerprint check: the text features the rebuilt tower gives for the store's own templates and
class names (through ``fedfeat.encoders.prompt``'s path, the one the prompt learner uses) must equal the stored ones
(cosine >= 0.999 for every prompt checked), or the run refuses with a one-line error.
"""

from __future__ import annotations

import json
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from fedfeat.encoders import backbones, weights
from fedfeat.encoders.prompt import PromptLearner, TextTower
from fedfeat.errors import FedfeatError

MIN_COSINE = 0.999
CHECK_PROMPTS = (
    1024  # at most this many stored prompts are re-encoded by the check (all of the first template)
)


@dataclass
class LiveText:
    """A store's frozen text tower, ready for ``fedfeat.encoders.prompt.PromptLearner``."""

    tower: TextTower
    model: torch.nn.Module
    backbone: str
    weights: str
    min_cosine: float  # what the fingerprint check measured

    def learner(self, class_names: list[str], n_ctx: int, **kw) -> PromptLearner:
        return PromptLearner(self.tower, class_names, n_ctx, **kw)


def _backbone(oc, st):
    """The store's architecture: its recorded config (registered under its name), else open_clip's registry entry
    of that name, checked against the fingerprint's config hash."""
    name = st.attrs.get("backbone")
    fp = (st.fingerprint or {}).get("backbone") or {}
    if name in (None, "synthetic") or not fp:
        raise FedfeatError(
            f"store {st.path} has no encoder to rebuild (backbone: {name or 'none'}; a `fedfeat synth` store?); "
            "prompt-learning methods need a store made by `fedfeat encode`"
        )
    cfg = st.attrs.get("backbone_config")
    if cfg is not None:
        tmp = Path(tempfile.mkdtemp(prefix="fedfeat-cfg-")) / f"{name}.json"
        tmp.write_text(json.dumps(cfg))
        oc.add_model_config(tmp)
        bb = backbones.Backbone(name=name, config=oc.get_model_config(name))
    elif name in oc.list_models():
        bb = backbones.Backbone(name=name, config=oc.get_model_config(name))
    else:
        raise FedfeatError(
            f"store {st.path} was encoded with backbone '{name}', a config file this store does not record (made "
            "before fedfeat recorded it); re-encode it with `fedfeat encode` to use prompt-learning methods"
        )
    if bb.config_sha256 != fp.get("config_sha256"):
        raise FedfeatError(
            f"backbone '{name}' here is not the architecture store {st.path} was encoded with (config sha256 "
            f"{bb.config_sha256[:12]} vs {str(fp.get('config_sha256'))[:12]}); use the open_clip version the store "
            "was made with, or re-encode it"
        )
    return bb


def _weights(bb, st, pretrained: str | None, cache_dir):
    """The store's weights under ``encode``'s offline rules (``weights.resolve_weights``)."""

    wfp = (st.fingerprint or {}).get("weights") or {}
    if "tag" in wfp:
        w = weights.resolve_weights(bb, pretrained or wfp["tag"], cache_dir=cache_dir)
        if pretrained and w.kind == "file" and w.label != wfp["tag"]:  # a tag's file, passed by hand
            w = weights.Weights(kind="file", label=wfp["tag"], file=w.file, sha256=w.sha256, source=w.source)
        return w
    want, label = wfp.get("sha256"), wfp.get("file", "?")
    where = pretrained or st.attrs.get("weights_file")
    hub = wfp.get("hf_hub")  # --backbone hf-hub:ORG/REPO: the repo's file in the local HF cache
    if not pretrained and hub and (where is None or not Path(where).expanduser().is_file()):
        repo_id = hub[len(backbones.HF_HUB_PREFIX) :]
        where = backbones.hub_cached_file(repo_id, label, cache_dir) or backbones._hub_fetch(
            repo_id, [label], cache_dir, 5.0, f"the weights ({label}) store {st.path} was encoded with"
        )
    if where is None or not Path(where).expanduser().is_file():
        seen = f" (not found at {where})" if where else ""
        raise FedfeatError(
            f"no local copy of the weights for {bb.name} checkpoint '{label}'{seen}, which store {st.path} was "
            "encoded with; pass --pretrained /path/to/checkpoint"
        )
    w = weights.resolve_weights(bb, str(where), cache_dir=cache_dir)
    if want and w.sha256 != want:
        raise FedfeatError(
            f"checkpoint {where} is not the one store {st.path} was encoded with (sha256 {str(w.sha256)[:12]} vs "
            f"{want[:12]}); pass --pretrained with the store's checkpoint '{label}'"
        )
    return w


def load_live_text(
    store,
    *,
    device: str | torch.device = "cpu",
    pretrained: str | None = None,
    cache_dir: str | Path | None = None,
    min_cosine: float = MIN_COSINE,
) -> LiveText:
    """Rebuild ``store``'s text encoder (frozen, eval, float32, on ``device``) and check it against the store."""
    from fedfeat.encoders import openclip as clipcompat

    oc = clipcompat.import_open_clip()
    bb = _backbone(oc, store)
    w = _weights(bb, store, pretrained, cache_dir)
    clip = clipcompat.load_model(bb, w, device=device, precision="fp32", cache_dir=cache_dir)
    tower = TextTower.of(clip.model, clip.tokenizer)
    cos = fingerprint_check(tower, store, min_cosine)
    return LiveText(tower=tower, model=clip.model, backbone=bb.name, weights=w.label, min_cosine=cos)


def fingerprint_check(tower: TextTower, store, min_cosine: float = MIN_COSINE) -> float:
    """Re-encode the store's prompts (every class under the first template, then others up to ``CHECK_PROMPTS``)
    through ``tower`` via ``PromptLearner`` with no context; the smallest cosine to the stored features must be
    ``>= min_cosine``. Returns it."""
    stored = store.text_features()  # [T, K, D]
    names, templates = store.class_names, store.templates
    K = len(names)
    worst, where = 1.0, ""
    budget = max(CHECK_PROMPTS, K)
    for t, template in enumerate(templates):
        if budget <= 0:
            break
        take = min(K, budget)
        budget -= take
        pl = PromptLearner(tower, names[:take], 0, template=template)
        with torch.no_grad():
            got = pl.features(torch.zeros(1, 0, tower.width, dtype=tower.dtype, device=tower.device))[0]
        want = torch.from_numpy(np.asarray(stored[t, :take], dtype=np.float32)).to(got.device)
        cos = torch.nn.functional.cosine_similarity(got.float(), want, dim=-1)
        i = int(cos.argmin())
        if float(cos[i]) < worst:
            worst, where = float(cos[i]), f"{template!r} for class {names[i]!r}"
    if not worst >= min_cosine:
        raise FedfeatError(
            f"the rebuilt text encoder does not reproduce store {store.path}: cosine {worst:.4f} < {min_cosine} at "
            f"{where}; the weights or the open_clip version differ from the encode -- pass the store's own "
            "checkpoint with --pretrained, or re-encode the store"
        )
    return worst


__all__ = ["LiveText", "load_live_text", "fingerprint_check"]


def _count_params(oc, config: dict) -> int:
    """Parameters of open_clip's model for ``config`` (both towers), built on the meta device: no memory, no
    weights, no download."""
    from open_clip.model import CLIP, CustomTextCLIP

    cls = (
        CustomTextCLIP if config.get("custom_text") or "hf_model_name" in config.get("text_cfg", {}) else CLIP
    )
    cfg = {k: v for k, v in config.items() if k != "custom_text"}
    with torch.device("meta"):
        model = cls(**cfg)
    return int(sum(p.numel() for p in model.parameters()))


def encoder_params(store) -> int:
    """Parameters of the frozen CLIP ``store`` was encoded with (its recorded architecture, ``_backbone``), e.g.
    427,944,193 for ViT-L-14-336: the denominator of a method's share of trainable parameters."""
    from fedfeat.encoders.remedy import import_open_clip

    oc = import_open_clip()
    return _count_params(oc, _backbone(oc, store).config)


def backbone_params(name: str) -> int | None:
    """Parameters of open_clip's registered architecture ``name`` (None where it is not registered here)."""
    from fedfeat.encoders.remedy import import_open_clip

    oc = import_open_clip()
    name = name.removesuffix("-quickgelu") if name not in oc.list_models() else name
    if name not in oc.list_models():
        return None
    return _count_params(oc, oc.get_model_config(name))

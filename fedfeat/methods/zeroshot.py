"""CLIP zero-shot classification (CLIP-ZS): argmax over classes of image . text, no training.

Base-to-novel (``--base-novel``, CoOp's protocol, FedTPG's tables): the run's vocabularies are the protocol's (the
first ceil(K/2) classes of each dataset base, the rest novel), so ``test_acc`` is zero-shot accuracy of the novel
test images over the novel classes, ``base_acc`` that of the base images over the base classes, ``hm`` their harmonic
mean, and on a combined store ``domain_novel_acc`` / ``domain_base_acc`` / ``domain_hm`` the same per dataset (the
engine's open-vocabulary evaluation through ``Method.predict_classes``: argmax over the restricted columns). Such a
run draws its partition, as a ``disjoint-classes`` one does (``fedfeat.runs.train.uses_partition``), since the
vocabularies come with it; the method still trains nothing and reads none of the clients' rows.

A run also writes its result in CLIP_benchmark's JSON schema (``fedfeat.report.clipbench``, from the logits of
``benchmark_logits``): top-1, top-5 accuracy and
mean per-class recall on the store's test split, in a file named as CLIP_benchmark names its outputs
(``{dataset}_{pretrained}_{model}_{language}_{task}.json``), which ``clip_benchmark build`` merges with its own.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace
from typing import Literal

import torch
import torch.nn.functional as F

from fedfeat.methods.base import Method, register


@dataclass(frozen=True)
class ZeroShotParams:
    templates: Literal["first", "ensemble"] = (
        "first"  # FST-CBDG: "a photo of a {}."; ensemble: CLIP's averaging (CLIP_benchmark's classifier)
    )
    normalize: bool = True  # cosine similarity (CLIP)
    batch_size: int = 1  # unused (no local training)
    local_epochs: int = 1  # unused
    # the "dataset" of the CLIP_benchmark JSON (e.g. cifar10, as CLIP_benchmark's --dataset); default: the store's
    benchmark_dataset: str | None = None


@register
class ZeroShot(Method):
    """CLIP-ZS: predict argmax_k cos(image, text_k); reads no training data at all."""

    name = "zeroshot"
    Params = ZeroShotParams
    uses_labels = False
    federated = False
    # no training data read: --partition settings are ignored (fedfeat.runs.train), except where the evaluation
    # depends on them (disjoint-classes, --base-novel: the base / novel vocabularies; --local-test; long tails)
    needs_partition = False
    no_stack_reason = "no training: a run is one evaluation, nothing per round to share"

    def init_global(self, ctx):
        return {"W": ctx.text.clone(), "b": torch.zeros(ctx.K, device=ctx.device)}

    def predict(self, ctx, glob, x):
        return ctx.clip_logit_scale * (x @ glob["W"].T)

    @torch.no_grad()
    def benchmark_logits(self, *, data, glob, store) -> tuple[torch.Tensor, torch.Tensor, str | None]:
        """``(logits  # [N, K], labels  # [N], dataset name or None)`` for the run's CLIP_benchmark JSON, which the
        run writes (``fedfeat.report.clipbench``).

        The logits are this method's ``predict`` on the store's whole test split (label -1 rows left out), over all
        classes: the run's own test set, except for an open-vocabulary partition, whose test set is the query set
        of novel classes."""
        x, y = data.test_x.to(data.dtype), data.test_y  # held as stored (float16): upcast
        if data.open_vocab is not None:  # test_x is the novel-class query set: read the whole split instead
            split = "test" if "test" in store.splits else "train"
            labels = store.labels(split)
            keep = labels >= 0
            x = torch.from_numpy(store.features(split)[keep]).to(device=x.device, dtype=x.dtype)
            y = torch.from_numpy(labels[keep]).to(x.device)
        if self.p.normalize:
            x = F.normalize(x, dim=-1)
        logits = self.predict(SimpleNamespace(clip_logit_scale=data.clip_logit_scale), glob, x)  # [N, K]
        return logits, y, self.p.benchmark_dataset
